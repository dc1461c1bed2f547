"""The ggml type llama.cpp's quantizer gives each deepseek4 tensor, per llama.cpp file type (ftype).

Mirrors llama.cpp's `src/llama-quant.cpp` (read at ggml-org/llama.cpp 007dbbf; the tests compare it with the
quantizer built into llama-cpp-python 0.3.36) for a source file whose weights are all F32 and default quantize
parameters (no importance matrix, no overrides, not `pure`):
* `tensor_allows_quantization`: only tensors with >= 2 dimensions whose name ends in "weight" are quantized,
  never a `_norm.weight`, the router `ffn_gate_inp.weight` or the hash table `ffn_gate_tid2eid.weight`
  (`NEVER_QUANTIZED`); every other tensor keeps its source type (1-D HC scales/bases, `attn_sinks`,
  `exp_probs_b.bias` ...);
* `llama_ftype_get_default_type`: the ftype's default type (`DEFAULT_TYPE`); a non-quantized default (F16, BF16)
  is written as is, with no per-tensor choice and no fallback;
* `llama_tensor_get_type_impl`: `output.weight` -> Q8_0 for MXFP4_MOE, for a row not a multiple of the default
  type's block, and for Q8_0, else Q6_K (`_output_type`); MXFP4_MOE: 3-D tensors (expert stacks) -> MXFP4, the
  rest (token_embd too) -> Q8_0; `ffn_down*` per ftype and layer (`FFN_DOWN`, with `use_more_bits`);
  deepseek4's attention names (attn_q_a, attn_q_b, attn_kv, attn_output_a/b, compressor, indexer, HC fn)
  match none of llama.cpp's attention categories and get the default type, as do ffn_gate/ffn_up;
* `tensor_type_fallback`: a row length (ne[0]) not a multiple of the chosen type's block -> `FALLBACK`, F16
  when even that block does not divide it.
`tests/test_lcp_layouts.py` checks every tensor's type against files written by llama.cpp's quantizer itself.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as Q

# llama_ftype_get_default_type, for the ftypes v4parity mirrors
DEFAULT_TYPE = {
    "F16": Q.F16, "BF16": Q.BF16, "Q8_0": Q.Q8_0, "MXFP4_MOE": Q.MXFP4, "Q2_K": Q.Q2_K, "Q3_K_M": Q.Q3_K,
    "Q4_K_S": Q.Q4_K, "Q4_K_M": Q.Q4_K, "Q5_K_M": Q.Q5_K, "Q6_K": Q.Q6_K, "IQ4_XS": Q.IQ4_XS,
}
FTYPES = tuple(DEFAULT_TYPE)

# tensor_type_fallback: the type written when a row is not a multiple of the chosen type's block
FALLBACK = {
    Q.IQ1_S: Q.IQ4_NL, Q.IQ1_M: Q.IQ4_NL, Q.IQ2_XXS: Q.IQ4_NL, Q.IQ2_XS: Q.IQ4_NL, Q.IQ2_S: Q.IQ4_NL,
    Q.IQ3_XXS: Q.IQ4_NL, Q.IQ3_S: Q.IQ4_NL, Q.IQ4_XS: Q.IQ4_NL, Q.Q2_K: Q.Q4_0, Q.Q3_K: Q.Q4_0,
    Q.TQ1_0: Q.Q4_0, Q.TQ2_0: Q.Q4_0, Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0,
}

# Every type llama.cpp's quantizer writes for some ftype (default table, per-tensor picks, fallbacks, F16/F32
# for odd rows) that both v4parity engines dequantize (tested; not Q8_K, an activation type only, nor the
# NVFP4 / Q1_0 / Q2_0 types of newer llama.cpp versions).
WRITTEN_TYPES = frozenset({
    Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K,
    Q.IQ1_S, Q.IQ1_M, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S, Q.IQ4_NL, Q.IQ4_XS, Q.TQ1_0, Q.TQ2_0,
    Q.MXFP4,
})

# tensor_allows_quantization: name fragments llama.cpp never quantizes (those a deepseek4 file can hold)
NEVER_QUANTIZED = ("_norm.weight", "ffn_gate_inp.weight", "ffn_gate_tid2eid.weight")
# llama.cpp's attention categories (tensor_get_category): deepseek4 has none; a name with one is not mirrored
_ATTENTION_CATEGORIES = ("attn_qkv.weight", "attn_kv_b.weight", "attn_v.weight", "attn_k.weight",
                         "attn_q.weight", "attn_output.weight")


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's `use_more_bits(i_layer, n_layers)`: the first and last eighth of the layers and every third
    layer in between (C integer division)."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


# llama_tensor_get_type_impl, FFN_DOWN branch (non-Falcon, no imatrix): (layer, n_layers) -> type; an ftype
# absent here keeps its default type for ffn_down
FFN_DOWN: dict[str, Callable[[int, int], Q]] = {
    "Q2_K": lambda i, n: Q.Q3_K,
    "Q3_K_M": lambda i, n: Q.Q5_K if i < n // 16 else Q.Q4_K,
    "Q4_K_M": lambda i, n: Q.Q6_K if use_more_bits(i, n) else Q.Q4_K,
    "Q5_K_M": lambda i, n: Q.Q6_K if use_more_bits(i, n) else Q.Q5_K,
    "IQ4_XS": lambda i, n: Q.Q5_K if i < n // 8 else Q.IQ4_XS,
    "Q4_K_S": lambda i, n: Q.Q5_K if i < n // 8 else Q.Q4_K,
}


def block_size(qtype: Q) -> int:
    """Elements per block of `qtype` (1 for F32/F16/BF16)."""
    return GGML_QUANT_SIZES[qtype][0]


def quantizes(name: str, ne: tuple[int, ...]) -> bool:
    """Whether llama.cpp's quantizer re-types tensor `name` of ggml shape `ne` (tensor_allows_quantization)."""
    n_dims = max((i + 1 for i, d in enumerate(ne) if d != 1), default=1)   # ggml_n_dims: trailing 1s dropped
    return n_dims >= 2 and name.endswith("weight") and not any(f in name for f in NEVER_QUANTIZED)


def _output_type(ftype: str, ncols: int) -> Q:
    """llama_tensor_get_type_impl's OUTPUT branch (untied `output.weight`, no output_tensor_type given)."""
    default = DEFAULT_TYPE[ftype]
    if ftype == "MXFP4_MOE" or ncols % block_size(default):
        return Q.Q8_0
    return default if default == Q.Q8_0 else Q.Q6_K


def _layer(name: str) -> int:
    m = re.match(r"blk\.(\d+)\.", name)
    if m is None:
        raise ValueError(f"llama.cpp layout: cannot find the layer of tensor {name!r} (expected blk.N.)")
    return int(m.group(1))


def _chosen_type(name: str, ne: tuple[int, ...], ftype: str, n_layers: int) -> Q:
    """llama_tensor_get_type_impl for a quantized default type, before the fallback."""
    if any(c in name for c in _ATTENTION_CATEGORIES):
        raise ValueError(f"llama.cpp layout: tensor {name!r} is in a llama.cpp attention category this "
                         "deepseek4 mirror does not encode")
    if name == "output.weight":
        return _output_type(ftype, ne[0])
    if ftype == "MXFP4_MOE":
        return Q.MXFP4 if len(ne) > 2 and ne[2] > 1 else Q.Q8_0
    if "ffn_down" in name and ftype in FFN_DOWN:
        return FFN_DOWN[ftype](_layer(name), n_layers)
    return DEFAULT_TYPE[ftype]


def fallback(qtype: Q, ncols: int) -> Q:
    """tensor_type_fallback: `qtype` if its block divides the row length `ncols`, else its fallback, else F16."""
    if ncols % block_size(qtype) == 0:
        return qtype
    if qtype not in FALLBACK:
        raise ValueError(f"llama.cpp defines no fallback for {qtype.name} (row length {ncols})")
    return FALLBACK[qtype] if ncols % block_size(FALLBACK[qtype]) == 0 else Q.F16


def tensor_type(name: str, ne: tuple[int, ...], ftype: str, n_layers: int) -> Q | None:
    """The type llama.cpp's quantizer at `ftype` writes for tensor `name` (ggml shape `ne`) of an `n_layers`
    model; None when it keeps the tensor's source type (`quantizes` is False)."""
    if ftype not in DEFAULT_TYPE:
        raise ValueError(f"unknown llama.cpp file type {ftype!r}; mirrored: {', '.join(FTYPES)}")
    if not quantizes(name, ne):
        return None
    default = DEFAULT_TYPE[ftype]
    if block_size(default) == 1:   # F16 / BF16: not a quantized type, written as is
        return default
    return fallback(_chosen_type(name, ne, ftype, n_layers), ne[0])
