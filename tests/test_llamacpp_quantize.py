"""Files quantized by llama.cpp's own quantizer (`v4parity quantize`, the `llamacpp_quantized` fixture): they load
in v4parity's GGUF contract, `inspect` shows their type mix and which engines read it, and `capture llamacpp`
runs on the ones whose types the engines read."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner
from gguf.constants import GGMLQuantizationType as Q
from requires import require

from parity import api
from parity.cli import cli
from parity.contract.errors import ParityError
from parity.gguf.inventory import type_mix
from parity.gguf.report import inspect_model
from parity.gguf.weights import Weights

llama_cpp = require("llama_cpp")

# llama.cpp file type -> the ggml types the tiny model's tensors get from llama.cpp's quantizer (measured;
# F32 stays for the 1-D / small tensors, I32 for the hash tables)
MIXES = {
    "F16": {"F32", "F16", "I32"},
    "BF16": {"F32", "BF16", "I32"},
    "Q8_0": {"F32", "Q8_0", "I32"},
    "MXFP4_MOE": {"F32", "Q8_0", "MXFP4", "I32"},
    "Q4_K_M": {"F32", "Q4_K", "Q5_0", "Q6_K", "I32"},
    "Q2_K": {"F32", "Q2_K", "Q3_K", "Q4_0", "Q6_K", "I32"},
    "Q3_K_M": {"F32", "Q3_K", "Q4_0", "Q4_K", "Q6_K", "I32"},
    "Q5_K_M": {"F32", "Q5_K", "Q5_1", "Q6_K", "I32"},
    "Q6_K": {"F32", "Q6_K", "Q8_0", "I32"},
    "IQ4_XS": {"F32", "IQ4_XS", "IQ4_NL", "Q6_K", "I32"},
}
# the routed experts' gate/up type llama.cpp picks for each file type on the tiny model (measured)
EXPERT_GATE = {"F16": Q.F16, "BF16": Q.BF16, "Q8_0": Q.Q8_0, "MXFP4_MOE": Q.MXFP4, "Q4_K_M": Q.Q4_K,
               "Q2_K": Q.Q2_K, "Q3_K_M": Q.Q3_K, "Q5_K_M": Q.Q5_K, "Q6_K": Q.Q6_K, "IQ4_XS": Q.IQ4_XS}
# tensors whose type differs from the release's (parity/gguf/inventory.py: the file's layout, not a contract
# problem): F16/BF16 none; Q8_0/MXFP4_MOE 19, all Q8_0 where the release uses F16: output_hc_fn + 6 x hc_attn_fn
# + 6 x hc_ffn_fn + 4 attn_compressor_ape + 2 indexer_compressor_ape
DIFFERS = {"F16": 0, "BF16": 0, "Q8_0": 19, "MXFP4_MOE": 19}
READ_BY_ENGINES = ("F16", "BF16", "Q8_0", "MXFP4_MOE")   # types the reference and torch engines dequantize today
NEEDS_IMATRIX = ("IQ2_XXS", "IQ2_XS", "IQ1_S")
TOKENS = "0,5,7,9,11,13,15,17"


def run(*args: object, ok: bool = True):
    r = CliRunner().invoke(cli, [str(a) for a in args])
    if ok:
        assert r.exit_code == 0, r.output
    return r


@pytest.mark.parametrize("file_type", sorted(MIXES))
def test_quantized_file_loads_in_the_contract(llamacpp_quantized, tiny_f32, file_type):
    path = llamacpp_quantized(file_type)
    w, ref = Weights(path), Weights(tiny_f32)
    assert w.config.to_dict() == ref.config.to_dict()          # the metadata contract reads it unchanged
    assert sorted(w.names) == sorted(ref.names)                 # same tensors, same shapes
    assert all(w.info(n).shape == ref.info(n).shape for n in w.names)
    mix = {r["type"] for r in type_mix(w.tensor_infos())}
    assert mix == MIXES[file_type]
    assert sum(r["bytes"] for r in type_mix(w.tensor_infos())) == sum(w.info(n).nbytes for n in w.names)
    assert {Q(w.info(f"blk.{l}.ffn_gate_exps.weight").ggml_type) for l in range(6)} == {EXPERT_GATE[file_type]}


@pytest.mark.parametrize("file_type", sorted(MIXES))
def test_inspect_shows_type_mix_engines_and_problems(llamacpp_quantized, file_type):
    path = llamacpp_quantized(file_type)
    r = run("inspect", "-m", path, "--json", ok=False)
    report = json.loads(r.output)
    assert {row["type"] for row in report["type_mix"]} == MIXES[file_type]
    assert sum(row["count"] for row in report["type_mix"]) == len(report["tensors"])
    engines = {e["engine"]: e for e in report["engines"]}
    assert set(engines) == {"reference", "torch", "llamacpp"}
    assert engines["llamacpp"]["available"] and engines["llamacpp"]["runs"]   # ggml knows every type it wrote
    for name in ("reference", "torch"):
        e = engines[name]
        assert e["available"] and set(e["reads"]) == MIXES[file_type]
        if file_type in READ_BY_ENGINES:
            assert e["runs"], e
    v = report["validation"]
    assert v["problems"] == [] and r.exit_code == 0   # llama.cpp's own choices are no contract problem
    if file_type in DIFFERS:
        assert len(v["differs"]) == DIFFERS[file_type], v["differs"]
        assert all(next(t for t in report["tensors"] if t["name"] == n)["type"] == "Q8_0" for n in v["differs"])
    assert (v["layout"] is None) == (not v["differs"])
    text = run("inspect", "-m", path, ok=False).output
    assert "type mix" in text and all(t in text for t in MIXES[file_type]) and "validation: OK" in text
    assert max(len(line) for line in text.splitlines()) <= 100


def test_inspect_f32_every_engine_reads_it(tiny_f32):
    report = inspect_model(str(tiny_f32))
    assert [(r["type"], r["count"], r["bytes"]) for r in report["type_mix"]] == [("F32", 175, 48_679_140),
                                                                                  ("I32", 3, 10_440)]
    assert {e["engine"]: e["runs"] for e in report["engines"]} == {"reference": True, "torch": True,
                                                                    "llamacpp": True}


def test_engine_support_asks_the_engines(monkeypatch):
    from parity.contract.errors import TensorError
    from parity.gguf import support

    class Declares:
        @staticmethod
        def readable_types() -> frozenset[int]:
            return frozenset({int(Q.F32), int(Q.Q6_K)})

    class Dequantizes:   # reads F32 only, through its dequantizer
        @staticmethod
        def dequantizer(raw, ggml_type, shape, device):
            if ggml_type != Q.F32:
                raise TensorError(f"no dequantizer for {Q(ggml_type).name}")
            return lambda: np.zeros(shape, np.float32)

    class Neither:
        pass

    def missing():
        raise ImportError("No module named 'llama_cpp'")

    classes = {"declares": Declares, "dequantizes": Dequantizes, "neither": Neither}
    monkeypatch.setattr(support, "engine_class", lambda name: classes[name] if name in classes else missing())
    types = [Q.F32, Q.Q6_K, Q.I32]
    got = {e["engine"]: e for e in support.support(types, ["declares", "dequantizes", "neither", "gone"])}
    assert got["declares"]["reads"] == {"F32": True, "Q6_K": True, "I32": False}
    assert got["declares"]["how"] == "declared" and not got["declares"]["runs"]
    assert got["dequantizes"]["reads"] == {"F32": True, "Q6_K": False, "I32": True}   # I32: an integer table
    assert got["dequantizes"]["how"] == "dequantizer probe" and not got["dequantizes"]["runs"]
    assert not got["neither"]["available"] and "no dequantizer" in got["neither"]["error"]
    assert not got["gone"]["available"] and "llama_cpp" in got["gone"]["error"]


def test_engine_lines_name_what_is_missing(llamacpp_quantized):
    from parity.gguf.report import engine_line

    report = inspect_model(str(llamacpp_quantized("Q6_K")))
    for e in report["engines"]:
        assert e["runs"] == all(e["reads"].values())
        line = engine_line(e)
        assert ("reads every type" in line) if e["runs"] else ("does not read Q6_K" in line)


@pytest.mark.parametrize("file_type", READ_BY_ENGINES)
def test_capture_llamacpp_runs_on_the_quantized_file(llamacpp_quantized, file_type, tmp_path):
    path = llamacpp_quantized(file_type)
    cap = tmp_path / "cap.npz"
    r = run("capture", "llamacpp", "-m", path, "--tokens", TOKENS, "--decode", 2, "--engine-arg", "lcp_threads=1",
            "-o", cap)
    assert "10 tokens (8 prompt + 2 decode)" in r.output
    with np.load(cap) as z:
        logits = z["result_output"]
        assert logits.shape[0] == 10 and np.isfinite(logits).all()
    run("import", "llama.cpp", cap, "--model", path, "-o", tmp_path / "lcp.trace")
    t = api.load_trace(tmp_path / "lcp.trace")
    assert t.header.tokens[:8] == [int(x) for x in TOKENS.split(",")] and len(t.header.tokens) == 10


def test_quantize_cli_json_and_text(tiny_f32, tmp_path):
    out = tmp_path / "q8.gguf"
    r = run("quantize", "-m", tiny_f32, "--type", "Q8_0", "--threads", 2, "-o", out, "--json")
    info = json.loads(r.output)
    assert info["path"] == str(out) and info["file_type"] == "Q8_0" and info["bytes"] == out.stat().st_size
    assert {row["type"] for row in info["type_mix"]} == MIXES["Q8_0"]
    assert info["problems"] == list(inspect_model(str(out))["validation"]["problems"])
    r = run("quantize", "-m", tiny_f32, "--type", "Q8_0", "-o", tmp_path / "q8b.gguf")
    lines = r.output.splitlines()
    assert lines[0].startswith(f"wrote {tmp_path / 'q8b.gguf'}") and "llama.cpp Q8_0" in lines[0]
    assert lines[1].split() == ["Q8_0", "103", "tensors", "12,911,840", "bytes"]
    assert lines[-1] == "contract: OK"
    # llama.cpp's quantizer is deterministic: the same file twice
    assert (tmp_path / "q8b.gguf").read_bytes() == out.read_bytes()


def test_quantize_unknown_type_lists_the_valid_ones(tiny_f32, tmp_path):
    r = run("quantize", "-m", tiny_f32, "--type", "Q4_K_X", "-o", tmp_path / "x.gguf", ok=False)
    assert r.exit_code == 2 and "unknown --type 'Q4_K_X'" in r.output
    assert all(t in r.output for t in ("Q4_K_M", "MXFP4_MOE", "IQ4_XS", "BF16"))
    r = run("quantize", "-m", tiny_f32, "--type", "nope", "-o", tmp_path / "x.gguf", "--json", ok=False)
    assert r.exit_code == 2 and "valid: " in json.loads(r.output)["error"]
    r = run("quantize", "-m", tiny_f32, "-o", tmp_path / "x.gguf", ok=False)   # --type missing
    assert r.exit_code == 2 and "--type" in r.output
    assert not (tmp_path / "x.gguf").exists()


def test_quantize_help_has_an_example():
    out = run("quantize", "--help").output
    assert "Example: v4parity synth" in out and "--type Q4_K_M" in out


@pytest.mark.parametrize("file_type", NEEDS_IMATRIX)
def test_types_that_need_an_importance_matrix_are_refused(tiny_f32, tmp_path, file_type):
    with pytest.raises(ParityError, match="requires an imatrix") as e:
        api.quantize_llamacpp(tiny_f32, tmp_path / "x.gguf", file_type)
    assert "offending tensor: output_hc_fn.weight" in str(e.value)
    assert not (tmp_path / "x.gguf").exists()


def test_quantize_refuses_its_input_as_output(tiny_f32):
    with pytest.raises(ParityError, match="is the input file"):
        api.quantize_llamacpp(tiny_f32, tiny_f32, "Q8_0")
