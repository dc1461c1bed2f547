"""Drafter GGUFs (MTP, DSpark) in the four published layouts: synthesis, strict reading, the trunk pair, the CLI.

Expected names, counts and types come from the spec's tables (v4-mtp-dspark §5: ds4's MTP file has 32 tensors,
its DSpark file 81 = 3 x 24 + 2 + 7) and from gguf-py's own reader, not from the code under test.
"""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
from click.testing import CliRunner
from gguf import GGUFReader, GGUFValueType
from gguf import quants as gguf_quants
from gguf.constants import GGMLQuantizationType as Q

from parity.cli import cli
from parity.contract.errors import MetadataError, TensorError
from parity.gguf.container import VT, GGUFFile, TensorData, Value, write_gguf
from parity.gguf.drafter import merged_weights, open_drafter, split_columns
from parity.gguf.inventory import expected_tensors
from parity.gguf.synth import synthesize
from parity.gguf.synth_draft import synthesize_drafter
from parity.gguf.weights import Weights

L, D, V, H = 6, 256, 290, 4   # the tiny preset: 6 layers, dim 256, 290 tokens, 4 HC streams
# ds4's per-layer suffixes of one MTP / DSpark block (spec §5.1 table): 23 weights + the selection bias
BLOCK_WEIGHTS = (
    "hc_attn_fn", "hc_attn_scale", "hc_attn_base", "attn_norm", "attn_q_a", "attn_q_a_norm", "attn_q_b", "attn_kv",
    "attn_kv_a_norm", "attn_sinks", "attn_output_a", "attn_output_b", "hc_ffn_fn", "hc_ffn_scale", "hc_ffn_base",
    "ffn_norm", "ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_shexp", "ffn_up_shexp",
    "ffn_down_shexp")
BLOCK_SUFFIXES = (*(f"{s}.weight" for s in BLOCK_WEIGHTS), "exp_probs_b.bias")
PAIRS = {"mtp": ("ds4-mtp", "llamacpp-mtp"), "dspark": ("ds4-dspark", "dflash")}


@pytest.fixture(scope="module")
def drafters(tiny_f32, tmp_path_factory):
    """(layout, quant) -> a synthesized drafter for the tiny f32 trunk, seed 0."""
    d = tmp_path_factory.mktemp("drafters")
    out = {}
    for kind, layouts in PAIRS.items():
        for layout in layouts:
            for quant in ("f32", "q8_0"):
                out[layout, quant] = synthesize_drafter(d / f"{layout}-{quant}.gguf", tiny_f32, kind, layout, 0, quant)
    return out


@pytest.fixture(scope="module")
def trunk(tiny_f32):
    return Weights(tiny_f32)


def rewrite(src, dst, kv=None, drop=(), add=(), replace_tensors=()):
    """A copy of GGUF `src` with metadata `kv` merged in (None values delete), tensors in `drop` removed, the
    TensorData in `replace_tensors` swapped in by name and those in `add` appended."""
    f = GGUFFile(src)
    meta = {k: v for k, v in (f.kv | (kv or {})).items() if v is not None}
    swap = {t.name: t for t in replace_tensors}
    tensors = [swap.get(n) or TensorData(n, i.ne, i.ggml_type, bytes(f.data(n)))
               for n, i in f.tensors.items() if n not in drop]
    write_gguf(dst, meta, tensors + list(add))
    return dst


# ------------------------------------------------------------------------------------------------
# What synth writes, read by gguf-py


def test_synthesized_files_have_the_published_names_keys_and_types(drafters):
    ds4_mtp = GGUFReader(drafters["ds4-mtp", "f32"])
    names = {t.name for t in ds4_mtp.tensors}
    extras = {f"mtp.0.{x}.weight" for x in ("e_proj", "h_proj", "enorm", "hnorm", "norm", "hc_head_fn",
                                            "hc_head_base", "hc_head_scale")}
    assert names == {f"mtp.0.{s}" for s in BLOCK_SUFFIXES} | extras and len(names) == 32   # ds4: 32 tensors
    assert ds4_mtp.fields["general.architecture"].contents() == "deepseek4"

    lcp = GGUFReader(drafters["llamacpp-mtp", "q8_0"])
    t = {x.name: x for x in lcp.tensors}
    assert {f"blk.{L}.{s}" for s in BLOCK_SUFFIXES} <= set(t)
    assert list(t[f"blk.{L}.nextn.eh_proj.weight"].shape) == [2 * D, D]   # ne: [e | h] along the input axis
    assert t[f"blk.{L}.nextn.eh_proj.weight"].tensor_type == Q.Q8_0
    assert {"token_embd.weight", "output.weight", "output_norm.weight", "output_hc_fn.weight",
            f"blk.{L}.nextn.shared_head_norm.weight", f"blk.{L}.nextn.enorm.weight"} <= set(t)
    fields = lcp.fields
    assert fields["deepseek4.block_count"].contents() == L + 1
    assert fields["deepseek4.nextn_predict_layers"].types == [GGUFValueType.UINT32]
    assert fields["deepseek4.nextn_predict_layers"].contents() == 1
    assert fields["deepseek4.attention.compress_ratios"].contents() == [0, 0, 4, 128, 4, 128, 0]
    assert len(fields["deepseek4.swiglu_clamp_exp"].contents()) == L + 1

    dsp = GGUFReader(drafters["ds4-dspark", "f32"])
    names = {t.name for t in dsp.tensors}
    assert len(names) == 81 and {f"mtp.{s}.{b}" for s in range(3) for b in BLOCK_SUFFIXES} <= names
    assert {"mtp.0.main_proj.weight", "mtp.0.main_norm.weight", "mtp.2.norm.weight", "mtp.2.hc_head_fn.weight",
            "mtp.2.markov_head.markov_w1.weight", "mtp.2.confidence_head.proj.weight"} <= names
    assert "mtp.0.hc_head_fn.weight" not in names   # only the last stage has the head
    f = dsp.fields
    assert f["general.architecture"].contents() == "deepseek4-dspark"
    assert f["dspark.block_size"].types == [GGUFValueType.UINT32] and f["dspark.block_size"].contents() == 5
    assert f["dspark.target_layer_ids"].types == [GGUFValueType.ARRAY, GGUFValueType.INT32]
    assert f["dspark.target_layer_ids"].contents() == [3, 4, 5]   # the last 3 trunk layers, 0-based
    assert f["dspark.markov_rank"].contents() == 16 and f["dspark.stage_count"].contents() == 3

    dfl = GGUFReader(drafters["dflash", "f32"])
    t = {x.name: x for x in dfl.tensors}
    assert list(t["fc.weight"].shape) == [3 * D, D] and list(t["markov_w1.weight"].shape) == [16, V]
    assert list(t["conf_proj.weight"].shape) == [D + 16, 1]
    assert dfl.fields["general.architecture"].contents() == "dflash"
    assert dfl.fields["dflash.target_layers"].contents() == [4, 5, 6]   # ids + 1
    assert dfl.fields["tokenizer.ggml.mask_token_id"].contents() == V - 1


# ------------------------------------------------------------------------------------------------
# Round trip: one canonical drafter, whatever the layout


@pytest.mark.parametrize("quant", ["f32", "q8_0"])
@pytest.mark.parametrize("kind", ["mtp", "dspark"])
def test_layouts_give_the_same_canonical_tensors_bit_for_bit(drafters, trunk, kind, quant):
    a, b = (open_drafter(drafters[lay, quant], trunk.config) for lay in PAIRS[kind])
    assert a.config.kind == b.config.kind == kind and a.config.layout != b.config.layout
    assert replace(a.config, layout="x") == replace(b.config, layout="x")
    assert a.model_config == b.model_config
    assert a.weights.names == b.weights.names
    assert len(a.weights.names) == (32 if kind == "mtp" else 81)
    for n in a.weights.names:
        ia, ib = a.weights.info(n), b.weights.info(n)
        assert (ia.ne, ia.ggml_type) == (ib.ne, ib.ggml_type), n
        assert np.array_equal(a.weights.raw(n), b.weights.raw(n)), n
    if kind == "dspark":
        assert a.config.target_layer_ids == (3, 4, 5) and a.config.n_blocks == 3 and a.config.markov_rank == 16
        assert a.config.block_size == 5 and a.config.noise_token_id == V - 1


def test_eh_proj_halves_match_gguf_py(drafters, trunk):
    """mtp.e_proj / h_proj of the llama.cpp file = columns [0, D) / [D, 2D) of eh_proj dequantized by gguf-py."""
    for quant in ("f32", "q8_0"):
        path = drafters["llamacpp-mtp", quant]
        t = next(x for x in GGUFReader(path).tensors if x.name == f"blk.{L}.nextn.eh_proj.weight")
        eh = gguf_quants.dequantize(t.data, t.tensor_type).reshape(D, 2 * D)
        w = open_drafter(path, trunk.config).weights
        assert np.array_equal(w.tensor("mtp.e_proj.weight"), eh[:, :D])
        assert np.array_equal(w.tensor("mtp.h_proj.weight"), eh[:, D:])
        assert not np.array_equal(eh[:, :D], eh[:, D:])


def test_model_config_and_merged_weights(drafters, trunk):
    d = open_drafter(drafters["ds4-dspark", "f32"], trunk.config)
    cfg = d.model_config
    assert cfg.n_layers == L + 3 and cfg.compress_ratios[L:] == (0, 0, 0)
    assert cfg.swiglu_limit[L:] == (trunk.config.swiglu_limit[-1],) * 3
    assert all(not cfg.is_hash_layer(layer) for layer in range(L, L + 3))
    m = merged_weights(trunk, d)
    assert m.config is cfg
    required = {s.name for s in expected_tensors(cfg) if s.required}
    assert required <= set(m.names)   # the extended model's whole contract is served
    assert set(m.names) - required == {n for n in d.weights.names if n.startswith("dspark.")}
    assert np.array_equal(m.raw("token_embd.weight"), trunk.raw("token_embd.weight"))
    assert np.array_equal(m.raw(f"blk.{L + 2}.attn_sinks.weight"),
                          GGUFFile(drafters["ds4-dspark", "f32"]).data("mtp.2.attn_sinks.weight"))
    assert m.identity()["header_sha256"] == trunk.identity()["header_sha256"]
    assert m.identity()["draft"]["file"] == drafters["ds4-dspark", "f32"].name
    for n in d.weights.names:   # every weight finite and small (a forward stays finite)
        x = d.weights.tensor(n)
        assert np.abs(x).max() < 10, n


# ------------------------------------------------------------------------------------------------
# Refusals, each naming the key or tensor


def refused(path, trunk_cfg, error, *needles):
    with pytest.raises(error) as e:
        open_drafter(path, trunk_cfg)
    for needle in needles:
        assert needle in str(e.value), (needle, str(e.value))
    return str(e.value)


def test_missing_stage_is_refused(drafters, trunk, tmp_path):
    src = GGUFFile(drafters["ds4-dspark", "f32"])
    bad = rewrite(src.path, tmp_path / "a.gguf", drop=[n for n in src.tensors if n.startswith("mtp.1.")])
    refused(bad, trunk.config, TensorError, "stage 1 missing", "mtp.1.")
    src = GGUFFile(drafters["dflash", "f32"])
    bad = rewrite(src.path, tmp_path / "b.gguf", drop=[n for n in src.tensors if n.startswith("blk.2.")])
    refused(bad, trunk.config, TensorError, "stage 2 missing", "blk.2.", "dflash.block_count")


def test_both_families_are_refused(drafters, trunk, tmp_path):
    extra = TensorData("mtp.0.main_norm.weight", (D,), int(Q.F32), np.ones(D, "<f4").tobytes())
    bad = rewrite(drafters["ds4-mtp", "f32"], tmp_path / "a.gguf", add=[extra])
    refused(bad, trunk.config, TensorError, "both", "mtp.0.main_norm.weight", "mtp.0.")
    extra = TensorData("fc.weight", (3 * D, D), int(Q.F32), np.zeros((D, 3 * D), "<f4").tobytes())
    bad = rewrite(drafters["llamacpp-mtp", "f32"], tmp_path / "b.gguf", add=[extra])
    refused(bad, trunk.config, TensorError, "both", "fc.weight", f"blk.{L}.nextn.")


def test_wrong_eh_proj_shape_is_refused(drafters, trunk, tmp_path):
    name = f"blk.{L}.nextn.eh_proj.weight"
    wrong = TensorData(name, (D, D), int(Q.F32), np.zeros((D, D), "<f4").tobytes())
    bad = rewrite(drafters["llamacpp-mtp", "f32"], tmp_path / "a.gguf", replace_tensors=[wrong])
    refused(bad, trunk.config, TensorError, name, f"shape {(D, D)}", f"expected {(D, 2 * D)}")


def test_float_block_size_and_other_bad_keys_are_refused(drafters, trunk, tmp_path):
    dsp = drafters["ds4-dspark", "f32"]
    cases = [
        ({"dspark.block_size": Value(VT.F32, 5.0)}, "dspark.block_size", "F32"),
        ({"dspark.block_size": None}, "dspark.block_size", "missing"),
        ({"dspark.noise_token_id": Value(VT.U32, V)}, "dspark.noise_token_id", str(V)),
        ({"dspark.target_layer_ids": Value(VT.ARRAY, [3, 4, L], VT.I32)}, "dspark.target_layer_ids", f"= {L}"),
        ({"deepseek4.dspark.block_size": Value(VT.U32, 6)}, "deepseek4.dspark.block_size", "both spellings"),
        ({"dspark.expert_count": Value(VT.U32, 16)}, "dspark.expert_count", "16"),
        ({"general.architecture": Value(VT.STRING, "dflash")}, "general.architecture", "deepseek4-dspark"),
    ]
    for i, (kv, *needles) in enumerate(cases):
        refused(rewrite(dsp, tmp_path / f"d{i}.gguf", kv=kv), trunk.config, MetadataError, *needles)
    dfl = drafters["dflash", "f32"]
    bad = rewrite(dfl, tmp_path / "f.gguf", kv={"dflash.target_layers": Value(VT.ARRAY, [0, 5, 6], VT.I32)})
    refused(bad, trunk.config, MetadataError, "dflash.target_layers", "ids + 1", "entry 0 = 0")
    bad = rewrite(dfl, tmp_path / "g.gguf", kv={"dflash.sample_from_anchor": Value(VT.BOOL, True)})
    refused(bad, trunk.config, MetadataError, "dflash.sample_from_anchor")
    lcp = drafters["llamacpp-mtp", "f32"]
    bad = rewrite(lcp, tmp_path / "h.gguf", kv={"deepseek4.nextn_predict_layers": Value(VT.U32, 2)})
    refused(bad, trunk.config, MetadataError, "deepseek4.nextn_predict_layers", "[1, 1]")
    bad = rewrite(lcp, tmp_path / "i.gguf", kv={"deepseek4.attention.compress_ratios": Value(
        VT.ARRAY, [0, 0, 4, 128, 4, 128, 4], VT.I32)})
    refused(bad, trunk.config, MetadataError, "deepseek4.attention.compress_ratios")


def test_missing_and_unexpected_tensors_are_refused(drafters, trunk, tmp_path):
    bad = rewrite(drafters["ds4-mtp", "f32"], tmp_path / "a.gguf", drop=["mtp.0.attn_sinks.weight"],
                  add=[TensorData("mtp.0.attn_compressor_norm.weight", (96,), int(Q.F32), bytes(4 * 96))])
    refused(bad, trunk.config, TensorError, "missing tensor mtp.0.attn_sinks.weight",
            "unexpected tensor mtp.0.attn_compressor_norm.weight")


def test_drafter_of_another_trunk_is_refused(drafters, trunk, tmp_path):
    other = replace(trunk.config, dim=2 * D)   # a trunk of another width
    refused(drafters["ds4-mtp", "f32"], other, TensorError, "mtp.0.e_proj.weight", f"expected {(2 * D, 2 * D)}")
    refused(drafters["dflash", "f32"], other, MetadataError, "dflash.embedding_length", str(2 * D))
    refused(drafters["llamacpp-mtp", "f32"], other, MetadataError, "deepseek4.embedding_length", str(D))
    other_trunk = Weights(synthesize(tmp_path / "other.gguf", "tiny", "f32", seed=1))   # same dims, other weights
    d = open_drafter(drafters["llamacpp-mtp", "f32"], other_trunk.config)
    with pytest.raises(TensorError, match="token_embd.weight differs from the trunk's token_embd.weight"):
        merged_weights(other_trunk, d)


def test_split_refuses_a_cut_inside_a_quant_block():
    ne = (96, 2)   # two rows of 96 = 3 Q8_0 blocks
    raw = gguf_quants.quantize(np.ones((2, 96), np.float32), Q.Q8_0)
    with pytest.raises(TensorError, match="multiples of the block size 32"):
        split_columns(raw, ne, int(Q.Q8_0), 48, "eh")
    a, b = split_columns(raw, ne, int(Q.Q8_0), 32, "eh")
    assert a.shape == (2, 34) and b.shape == (2, 68)   # 34 bytes per Q8_0 block


# ------------------------------------------------------------------------------------------------
# Every integer width


@pytest.mark.parametrize("vt", [VT.U8, VT.I8, VT.U16, VT.I16, VT.U32, VT.I32, VT.U64, VT.I64])
def test_integer_keys_of_every_width(drafters, trunk, tmp_path, vt):
    kv = {k: Value(vt, v) for k, v in (("dspark.block_size", 5), ("dspark.noise_token_id", 100),
                                       ("dspark.markov_rank", 16), ("dspark.stage_count", 3))}
    kv["dspark.target_layer_ids"] = Value(VT.ARRAY, [3, 4, 5], vt)
    d = open_drafter(rewrite(drafters["ds4-dspark", "f32"], tmp_path / "a.gguf", kv=kv), trunk.config)
    assert (d.config.block_size, d.config.noise_token_id, d.config.markov_rank, d.config.n_blocks) == (5, 100, 16, 3)
    assert d.config.target_layer_ids == (3, 4, 5)
    kv = {"dflash.block_size": Value(vt, 5), "tokenizer.ggml.mask_token_id": Value(vt, 7),
          "dflash.block_count": Value(vt, 3), "dflash.target_layers": Value(VT.ARRAY, [4, 5, 6], vt)}
    d = open_drafter(rewrite(drafters["dflash", "f32"], tmp_path / "b.gguf", kv=kv), trunk.config)
    assert (d.config.block_size, d.config.noise_token_id, d.config.target_layer_ids) == (5, 7, (3, 4, 5))
    lcp = rewrite(drafters["llamacpp-mtp", "f32"], tmp_path / "c.gguf",
                  kv={"deepseek4.nextn_predict_layers": Value(vt, 1), "deepseek4.block_count": Value(vt, L + 1)})
    assert open_drafter(lcp, trunk.config).config.layout == "llamacpp-mtp"


# ------------------------------------------------------------------------------------------------
# CLI


def test_cli_synth_and_inspect_draft(tmp_path):
    run = CliRunner().invoke
    t, d = tmp_path / "t.gguf", tmp_path / "mtp.gguf"
    r = run(cli, ["synth", "-o", str(t), "--draft", "mtp", "--draft-layout", "llamacpp", "--draft-out", str(d)])
    assert r.exit_code == 0, r.output
    r = run(cli, ["inspect", "-m", str(t), "--draft", str(d), "--json"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.output)
    assert rep["validation"]["ok"] and rep["head"]["kind"] == "mtp" and rep["head"]["layout"] == "llamacpp-mtp"
    assert rep["head"]["layers"] == [L] and rep["tensor_count"] == 34   # 31 own (eh_proj holds two) + 3 copies
    assert rep["keys"]["deepseek4.nextn_predict_layers"] == "U32 1"
    r = run(cli, ["inspect", "-m", str(t), "--draft", str(d)], env={"COLUMNS": "200"})
    assert r.exit_code == 0 and "llamacpp-mtp" in r.output and "drafter: OK" in r.output
    other = tmp_path / "other.gguf"
    assert run(cli, ["synth", "-o", str(other), "--seed", "1"]).exit_code == 0
    r = run(cli, ["inspect", "-m", str(other), "--draft", str(d)], env={"COLUMNS": "200"})
    assert r.exit_code == 1 and "token_embd.weight differs" in r.output
    r = run(cli, ["synth", "-o", str(t), "--draft", "dspark", "--draft-layout", "llamacpp", "--draft-out", str(d)])
    assert r.exit_code == 2 and "not a dspark layout" in r.output
