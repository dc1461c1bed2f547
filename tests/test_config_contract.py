"""The strict deepseek4 metadata contract: types, widths, ranges, missing keys, derivations."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parity.contract.errors import MetadataError
from parity.gguf.config import config_from_metadata
from parity.gguf.container import INTEGER_TYPES, VT, Value
from parity.gguf.synth import metadata, preset_config
from parity.gguf.vocab import synthetic_vocab

VOCAB = len(synthetic_vocab().tokens)
BASE_CFG = preset_config("tiny", VOCAB)
BASE_KV = metadata(BASE_CFG, "tiny")
P = "deepseek4."

WIDTH_RANGE = {
    VT.U8: (0, 2**8 - 1), VT.I8: (-(2**7), 2**7 - 1), VT.U16: (0, 2**16 - 1), VT.I16: (-(2**15), 2**15 - 1),
    VT.U32: (0, 2**32 - 1), VT.I32: (-(2**31), 2**31 - 1), VT.U64: (0, 2**64 - 1), VT.I64: (-(2**63), 2**63 - 1),
}
INT_KEYS = [k for k, v in BASE_KV.items() if v.type in INTEGER_TYPES and not k.startswith("general.")]
FLOAT_KEYS = [k for k, v in BASE_KV.items() if v.type == VT.F32]
# keys whose value can move freely inside a range without breaking other keys, and the config field they set
FREE_INT_KEYS = {
    P + "context_length": ("context_length", 1, 2**40),
    P + "attention.sliding_window": ("window_size", 1, 2**24),
    P + "attention.indexer.top_k": ("index_topk", 1, 2**24),
    P + "hyper_connection.sinkhorn_iterations": ("hc_sinkhorn_iters", 1, 10000),
    P + "hash_layer_count": ("hash_layer_count", 0, 6),
    "tokenizer.ggml.eos_token_id": ("eos_token_id", 0, VOCAB - 1),
    P + "attention.output_lora_rank": ("o_lora_rank", 1, 2**20),
}
REQUIRED = [k for k in BASE_KV if k.startswith(P) and k not in (
    P + "vocab_size", P + "swiglu_clamp_shexp", P + "embedding_length_out", P + "rope.scaling.type",
    P + "rope.scaling.factor", P + "rope.scaling.original_context_length", P + "rope.scaling.yarn_beta_fast",
    P + "rope.scaling.yarn_beta_slow")] + ["general.architecture", "tokenizer.ggml.bos_token_id",
                                          "tokenizer.ggml.eos_token_id"]


def load(kv: dict, shapes: dict | None = None):
    return config_from_metadata(kv, "model.gguf", shapes)


def with_key(key: str, value: Value | None) -> dict:
    kv = dict(BASE_KV)
    if value is None:
        del kv[key]
    else:
        kv[key] = value
    return kv


def test_synthetic_metadata_reads_back_as_the_preset_config():
    assert load(BASE_KV) == BASE_CFG


FITTING_WIDTHS = [(k, w) for k in INT_KEYS for w, (lo, hi) in WIDTH_RANGE.items() if lo <= BASE_KV[k].value <= hi]


@pytest.mark.parametrize("key,width", FITTING_WIDTHS, ids=[f"{k}-{w.name}" for k, w in FITTING_WIDTHS])
def test_every_integer_key_accepts_every_width_its_value_fits(key, width):
    assert load(with_key(key, Value(width, BASE_KV[key].value))) == BASE_CFG


@pytest.mark.parametrize("key", sorted(FREE_INT_KEYS))
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_free_integer_keys_round_trip_any_in_range_value(key, data):
    field, lo, hi = FREE_INT_KEYS[key]
    width = data.draw(st.sampled_from([w for w, (a, b) in WIDTH_RANGE.items() if a <= lo and b >= lo]))
    wlo, whi = WIDTH_RANGE[width]
    value = data.draw(st.integers(max(lo, wlo), min(hi, whi)))
    cfg = load(with_key(key, Value(width, value)))
    assert getattr(cfg, field if field != "hash_layer_count" else "n_hash_layers") == value


@pytest.mark.parametrize("elem", sorted(INTEGER_TYPES), ids=lambda w: w.name)
def test_compress_ratios_accept_any_integer_element_type(elem):
    ratios = [*BASE_CFG.compress_ratios, 0]
    cfg = load(with_key(P + "attention.compress_ratios", Value(VT.ARRAY, ratios, elem)))
    assert cfg.compress_ratios == BASE_CFG.compress_ratios


@pytest.mark.parametrize("key", REQUIRED)
def test_missing_required_key_is_an_error_naming_it(key):
    with pytest.raises(MetadataError, match=rf"model\.gguf: key '{key}'.*missing"):
        load(with_key(key, None))


@pytest.mark.parametrize("key", INT_KEYS)
def test_float_or_string_where_an_integer_is_required(key):
    for bad in (Value(VT.F32, 4.0), Value(VT.STRING, "4"), Value(VT.BOOL, True)):
        with pytest.raises(MetadataError) as e:
            load(with_key(key, bad))
        msg = str(e.value)
        assert key in msg and "integer" in msg and bad.type.name in msg and "model.gguf" in msg


@pytest.mark.parametrize("key", FLOAT_KEYS)
def test_integer_or_string_where_a_float_is_required(key):
    for bad in (Value(VT.U32, 1), Value(VT.STRING, "1.0")):
        with pytest.raises(MetadataError, match=rf"key '{key}': expected a float"):
            load(with_key(key, bad))


@pytest.mark.parametrize("key,length", [(k, n) for k in (P + "swiglu_clamp_exp", P + "swiglu_clamp_shexp")
                                        for n in (0, 1, 5, 8, 44)]
                         + [(P + "attention.compress_ratios", n) for n in (0, 1, 5)])
def test_wrong_per_layer_array_length(key, length):
    old = BASE_KV[key]
    values = (list(old.value) * 10)[:length]
    with pytest.raises(MetadataError, match=rf"key '{key}'.*{length} entries"):
        load(with_key(key, Value(VT.ARRAY, values, old.elem_type)))


def test_per_layer_arrays_accept_block_count_and_the_mtp_slot():
    for n in (6, 7):
        kv = with_key(P + "attention.compress_ratios", Value(VT.ARRAY, [0, 0, 4, 128, 4, 128, 0][:n], VT.I32))
        kv[P + "swiglu_clamp_exp"] = Value(VT.ARRAY, [1.5] * n, VT.F32)
        assert load(kv).compress_ratios == (0, 0, 4, 128, 4, 128)


@pytest.mark.parametrize("extra", [1, 2, 38])
def test_compress_ratios_longer_than_block_count_are_accepted_and_the_extra_noted(extra):
    """Spec correction 2: at least block_count entries, the first block_count used (a real release has 46 for 43)."""
    n = BASE_CFG.n_layers
    ratios = [*BASE_CFG.compress_ratios, *([0, 4, 128] * extra)[:extra]]
    cfg = load(with_key(P + "attention.compress_ratios", Value(VT.ARRAY, ratios, VT.I32)))
    assert cfg.compress_ratios == BASE_CFG.compress_ratios
    assert f"{n + extra} entries for {n} layers" in cfg.notes["compress_ratios"]
    assert f"{extra} extra" in cfg.notes["compress_ratios"]


def test_error_messages_cap_the_quoted_value():
    huge = Value(VT.ARRAY, np.arange(10**6, dtype=np.int32), VT.I32)
    for key in (P + "block_count", "tokenizer.ggml.tokens"):
        with pytest.raises(MetadataError) as e:
            load(with_key(key, huge))
        assert key in str(e.value) and len(str(e.value)) < 300, str(e.value)[:400]


@pytest.mark.parametrize("bad", [Value(VT.STRING, "abc"), Value(VT.U32, 7),
                                 Value(VT.ARRAY, list(range(VOCAB)), VT.I32)])
def test_token_list_of_the_wrong_type_is_an_error_naming_it(bad):
    with pytest.raises(MetadataError, match=r"key 'tokenizer\.ggml\.tokens': expected an array of STRING"):
        load(with_key("tokenizer.ggml.tokens", bad))


def test_float_array_where_integer_array_required():
    with pytest.raises(MetadataError, match="compress_ratios.*array of integers.*array\\[F32\\]"):
        load(with_key(P + "attention.compress_ratios", Value(VT.ARRAY, [0.0] * 7, VT.F32)))


@pytest.mark.parametrize("key,value", [
    (P + "block_count", Value(VT.I32, -1)),
    (P + "expert_count", Value(VT.I64, -8)),
    (P + "attention.compress_ratios", Value(VT.ARRAY, [0, 0, 4, -128, 4, 128, 0], VT.I32)),
    (P + "expert_gating_func", Value(VT.U32, 1)),
    (P + "expert_used_count", Value(VT.U32, 9)),  # more than expert_count
    (P + "attention.head_count_kv", Value(VT.U32, 2)),
    (P + "rope.dimension_count", Value(VT.U32, 33)),  # odd
    (P + "attention.layer_norm_rms_epsilon", Value(VT.F32, float("nan"))),
    (P + "expert_weights_norm", Value(VT.BOOL, False)),
    (P + "rope.scaling.type", Value(VT.STRING, "linear")),
    ("general.architecture", Value(VT.STRING, "deepseek2")),
    ("tokenizer.ggml.eos_token_id", Value(VT.U32, VOCAB)),
])
def test_out_of_range_values_are_errors_naming_the_key(key, value):
    with pytest.raises(MetadataError, match=rf"key '{key}'"):
        load(with_key(key, value))


def test_vocab_size_derivation_is_explicit_and_reported():
    kv = with_key(P + "vocab_size", None)
    with pytest.raises(MetadataError, match="vocab_size"):
        load(kv)  # nothing to derive it from
    cfg = load(kv, {"token_embd.weight": (VOCAB, 256)})
    assert cfg.vocab_size == VOCAB
    assert "token_embd.weight" in cfg.derived["vocab_size"]


def test_shared_clamp_derivation_and_no_yarn_are_reported():
    kv = with_key(P + "swiglu_clamp_shexp", None)
    cfg = load(kv)
    assert cfg.swiglu_limit_shexp == cfg.swiglu_limit and "swiglu_clamp_exp" in cfg.derived["swiglu_limit_shexp"]
    for k in [k for k in BASE_KV if k.startswith(P + "rope.scaling.")]:
        del kv[k]
    cfg = load(kv)
    assert cfg.yarn is False and "yarn" in cfg.derived


def test_yarn_keys_are_required_once_yarn_is_declared():
    with pytest.raises(MetadataError, match="rope.scaling.factor"):
        load(with_key(P + "rope.scaling.factor", None))


def test_token_list_must_match_vocab_size():
    kv = with_key("tokenizer.ggml.tokens", Value(VT.ARRAY, synthetic_vocab().tokens[:-1], VT.STRING))
    with pytest.raises(MetadataError, match="tokenizer.ggml.tokens"):
        load(kv)

