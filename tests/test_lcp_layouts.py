"""`synth --quant lcp-FTYPE` (parity/gguf/lcp_layouts.py): every tensor in the type llama.cpp's own quantizer
writes at that file type, checked against files written by llama.cpp's quantizer (llama-cpp-python's
`llama_model_quantize`); such files run in the reference; `inspect` reports llama.cpp's types as a layout, not
as contract problems, and still refuses a type no quantizer writes for a tensor."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from click.testing import CliRunner
from gguf import quants
from gguf.constants import GGMLQuantizationType as Q
from requires import require

from parity import api
from parity.cli import cli
from parity.compare.metrics import rel_l2
from parity.contract.engine import RunOptions, load_engine
from parity.gguf import lcp_layouts, support, synth
from parity.gguf.container import GGUFFile, TensorData, tensor_nbytes, write_gguf
from parity.gguf.inventory import lcp_file_types, validate
from parity.gguf.quant_blocks import RANDOM_BLOCK_TYPES, random_blocks
from parity.gguf.weights import Weights
from parity.tracing.runner import run_sequence, stack

ISSUE_FTYPES = ("Q4_K_M", "Q2_K", "Q3_K_M", "Q5_K_M", "Q6_K", "IQ4_XS", "Q8_0")
EXTRA_FTYPES = ("F16", "BF16", "MXFP4_MOE", "Q4_K_S")
# ftypes whose ffn_down type depends on the layer through n_layers/8 or /16 (0 on tiny's 6 layers)
LAYER_RULE_FTYPES = ("Q3_K_M", "IQ4_XS", "Q4_K_S", "Q4_K_M")
TOKENS = [0, 243, 77, 33, 87, 12]


def types(path) -> dict[str, str]:
    w = Weights(path)
    return {n: w.info(n).type_name for n in w.names}


def lcp_model(model_dir, ftype: str):
    path = model_dir / f"tiny-synth-lcp-{ftype.lower()}.gguf"
    if not path.exists():
        synth.synthesize(path, "tiny", f"lcp-{ftype}", seed=0)
    return path


@pytest.mark.parametrize("ftype", ISSUE_FTYPES + EXTRA_FTYPES)
def test_lcp_layout_gives_every_tensor_llamacpps_type(llamacpp_quantized, model_dir, ftype):
    ours, theirs = types(lcp_model(model_dir, ftype)), types(llamacpp_quantized(ftype))
    assert set(ours) == set(theirs)
    assert {n: t for n, t in ours.items() if theirs[n] != t} == {}
    w = Weights(llamacpp_quantized(ftype))
    assert lcp_file_types(w.tensor_infos(), w.config) == [ftype]   # no other mirrored ftype gives this mix


@pytest.fixture(scope="module")
def deep_f32(tmp_path_factory):
    """The tiny preset with 17 layers (and 4 experts, to stay small): llama.cpp's n_layers/8 (= 2) and /16 (= 1)
    layer rules fire."""
    require("llama_cpp")
    path = tmp_path_factory.mktemp("deep") / "deep-f32.gguf"
    deep = dataclasses.replace(synth.PRESETS["tiny"], compress_ratios=(0, 0, *(4, 128) * 7, 4), n_routed_experts=4,
                               n_activated_experts=2)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(synth.PRESETS, "deep", deep)
        synth.synthesize(path, "deep", "f32", seed=0)
    return path


@pytest.mark.parametrize("ftype", LAYER_RULE_FTYPES)
def test_layer_rules_on_a_deeper_model(deep_f32, tmp_path, ftype):
    out = api.quantize_llamacpp(deep_f32, tmp_path / "q.gguf", ftype, threads=2)["path"]
    w = Weights(out)
    assert w.config.n_layers == 17
    for name in w.names:
        info = w.info(name)
        want = lcp_layouts.tensor_type(name, info.ne, ftype, 17) or Weights(deep_f32).info(name).ggml_type
        assert info.ggml_type == want, (name, info.type_name, Q(want).name)
    down = {Q(w.info(f"blk.{l}.ffn_down_exps.weight").ggml_type) for l in range(17)}
    assert len(down) == 2   # the rule picked two types across the layers


def test_synth_bogus_quant_names_the_valid_choices(tmp_path):
    r = CliRunner().invoke(cli, ["synth", "--quant", "bogus", "-o", str(tmp_path / "x.gguf")])
    assert r.exit_code == 2 and "'bogus' is not one of" in r.output
    assert all(f"lcp-{ft}" in r.output for ft in ISSUE_FTYPES) and "real-mix" in r.output
    with pytest.raises(ValueError, match="choose from f32, real-mix, mxfp4, lcp-F16"):
        synth.synthesize(tmp_path / "x.gguf", "tiny", "lcp-Q4_K_X")
    assert not (tmp_path / "x.gguf").exists()


def test_lcp_q4_k_m_runs_in_the_reference(model_dir):   # Q4_K, Q5_0 and Q6_K blocks
    engine = load_engine("reference", str(lcp_model(model_dir, "Q4_K_M")), RunOptions(fp8_kv=False, fp4_indexer=False))
    logits = stack(run_sequence(engine, TOKENS), "logits")
    assert logits.shape == (len(TOKENS), engine.config.vocab_size)
    assert np.isfinite(logits).all() and float(logits.std()) > 0


def test_lcp_q8_0_holds_the_f32_weights_quantized(model_dir, tiny_f32):
    # Q8_0 is quantized from the float weights (gguf-py): the forward stays near the f32 model's, while a layout
    # of random k-quant blocks (Q4_K_M) is a different model
    off = RunOptions(fp8_kv=False, fp4_indexer=False)
    q8, f32, q4 = (stack(run_sequence(load_engine("reference", str(p), off), TOKENS), "logits")
                   for p in (lcp_model(model_dir, "Q8_0"), tiny_f32, lcp_model(model_dir, "Q4_K_M")))
    assert float(rel_l2(q8, f32).max()) < 0.025   # measured 0.018 .. 0.022 per position
    assert float(rel_l2(q4, f32).min()) > 1.0     # measured 1.35 .. 1.46


@pytest.mark.parametrize("qtype", sorted(RANDOM_BLOCK_TYPES))
def test_random_blocks_of_every_drawn_type_hit_the_scale(qtype):
    blocks = random_blocks(qtype, (16, 512), 0.05, np.random.default_rng(1))
    vals = quants.dequantize(blocks, qtype)    # gguf-py decodes them: valid blocks
    assert vals.shape == (16, 512) and np.isfinite(vals).all()
    assert abs(vals.std() / 0.05 - 1) < 0.10
    assert abs(vals.mean()) < 0.1 * 0.05


@pytest.mark.parametrize("engine", ("reference", "torch"))
def test_both_engines_read_every_type_the_quantizer_writes(engine):
    # validate accepts these on any tensor llama.cpp re-types: each must run in both engines
    got = support.engine_reads(engine, lcp_layouts.WRITTEN_TYPES)
    assert got["available"] and got["runs"], {t: ok for t, ok in got["reads"].items() if not ok}
    assert len(got["reads"]) == 25


@pytest.mark.parametrize("ftype", ("Q8_0", "Q4_K_M"))
def test_inspect_reports_llamacpps_types_as_a_layout(llamacpp_quantized, ftype):
    r = CliRunner().invoke(cli, ["inspect", "-m", str(llamacpp_quantized(ftype)), "--json"])
    assert r.exit_code == 0, r.output
    v = json.loads(r.output)["validation"]
    assert v["ok"] and v["problems"] == []
    n = len(v["differs"])
    assert v["layout"] == f"llama.cpp quantizer {ftype}-style, differs from the release in {n} tensor(s)"
    text = CliRunner().invoke(cli, ["inspect", "-m", str(llamacpp_quantized(ftype))], env={"COLUMNS": "200"}).output
    assert f"layout: llama.cpp quantizer {ftype}-style" in text and "validation: OK" in text


def test_a_type_no_quantizer_writes_is_refused_naming_tensor_and_types(model_dir, tmp_path):
    src = GGUFFile(lcp_model(model_dir, "Q8_0"))
    swap = {"blk.0.attn_norm.weight": Q.Q8_0, "blk.0.ffn_gate_tid2eid.weight": Q.F32, "output_hc_fn.weight": Q.Q8_K}
    tensors = []
    for n, info in src.tensors.items():
        if n in swap:   # zero bytes: the table is what validate reads
            tensors.append(TensorData(n, info.ne, int(swap[n]), bytes(tensor_nbytes(info.ne, swap[n]))))
        else:
            tensors.append(TensorData(n, info.ne, info.ggml_type, bytes(src.data(n))))
    bad = tmp_path / "bad.gguf"
    write_gguf(bad, dict(src.kv), tensors)
    problems = validate(Weights(bad).tensor_infos(), Weights(bad).config).problems
    assert problems == (
        "tensor output_hc_fn.weight: type Q8_K not allowed (allowed: BF16, F16, F32; nor a type llama.cpp's "
        "quantizer writes)",
        "tensor blk.0.attn_norm.weight: type Q8_0 not allowed (allowed: F32; llama.cpp's quantizer never re-types "
        "it)",
        "tensor blk.0.ffn_gate_tid2eid.weight: type F32 not allowed (allowed: I32; llama.cpp's quantizer never "
        "re-types it)",
    )
    r = CliRunner().invoke(cli, ["inspect", "-m", str(bad)], env={"COLUMNS": "250"})
    assert r.exit_code == 1 and "validation: 3 problem(s)" in r.output
    assert "blk.0.attn_norm.weight: type Q8_0 not allowed" in r.output
