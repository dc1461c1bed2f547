"""Opt-in approximate numerics that reproduce known engine behaviours (`RunOptions.act_quant`, `kv_cache`).

Each is a pure rounding function; the exact path never calls them. The roundings are computed in float32, as
the engines they model do, and returned in the input's dtype.

- Q8_0 (llama.cpp's CPU backend before a matmul with a quantized weight whose vec_dot type is Q8_0): blocks of
  32 along the row, d = amax/127 stored as f16, q = round-half-even(x·127/amax) (the x86 SIMD path of ggml's
  `quantize_row_q8_0`; the scalar `_ref` path uses x·(1/d) and rounds half away from zero), x' = q·f16(d).
- Q8_K (the same backend before Q2_K / Q4_K / IQ2_XXS weights): blocks of 256, m = the block's value of largest
  magnitude (the first such), s = -127/m, q = min(127, round-half-even(s·x)), x' = q·d with the float32 d = 1/s
  (ggml's `quantize_row_q8_K_ref`, which its x86 build calls).
- bf16 / f16: round to nearest even of that type.
- Q8_1 (before Q4_1 / Q5_1 weights): the values of Q8_0 (d = amax/127 stored as f16, q = round(x·127/amax), the
  same x86 SIMD rounding) plus a stored f16 sum s = d·Σq, which the Q4_1 / Q5_1 dot products use for the weight's
  min term. Modelled as the value round trip x' = q·f16(d) only: the rounding of s is not modelled.
- llamacpp: what llama.cpp's CPU backend does before each matmul, chosen by the weight's type (its `vec_dot_type` in
  ggml-cpu's `type_traits_cpu`): Q8_0 before Q4_0 / Q5_0 / Q8_0 / IQ4_NL / MXFP4; Q8_1 before Q4_1 / Q5_1; Q8_K
  before Q2_K / Q3_K / Q4_K / Q5_K / Q6_K, IQ1_S / IQ1_M / IQ2_XXS / IQ2_XS / IQ2_S / IQ3_XXS / IQ3_S / IQ4_XS and
  TQ1_0 / TQ2_0; f16 before F16, bf16 before BF16, nothing before F32 (Q8_K weights have no vec_dot in ggml-cpu and
  are refused, as is every type not listed).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from gguf.constants import GGMLQuantizationType as Q

from parity.contract.errors import ParityError

F32 = np.float32
Q8_0_BLOCK = 32
Q8_K_BLOCK = 256


def q8_0_roundtrip(x: np.ndarray) -> np.ndarray:
    """x' = q·f16(d) per block of 32, d = amax/127, q = rint(x·(127/amax)) ∈ [-127, 127] (0 for an all-zero block).

    x [..., k] with k a multiple of 32 -> [..., k] in x's dtype.
    """
    if x.shape[-1] % Q8_0_BLOCK:
        raise ParityError(f"act_quant=q8_0: row length {x.shape[-1]} is not a multiple of the Q8_0 block {Q8_0_BLOCK}")
    b = x.astype(F32).reshape(*x.shape[:-1], -1, Q8_0_BLOCK)
    amax = np.abs(b).max(axis=-1, keepdims=True)
    d16 = (amax / F32(127)).astype(np.float16).astype(F32)
    with np.errstate(divide="ignore"):
        inv = np.where(amax != 0, F32(127) / amax, F32(0))
    q = np.rint(b * inv)
    return (q * d16).reshape(x.shape).astype(x.dtype)


def q8_1_roundtrip(x: np.ndarray) -> np.ndarray:
    """The values of llama.cpp's Q8_1 activations: x' = q·f16(d), exactly as Q8_0 (`q8_0_roundtrip`; blocks of 32,
    d = amax/127). The block's stored sum s = f16(d·Σq), which Q4_1 / Q5_1 dot products multiply by the weight's min,
    is not modelled (it differs from Σx' by its own f16 rounding).  x [..., k], k a multiple of 32 -> [..., k]"""
    return q8_0_roundtrip(x)


def q8_k_roundtrip(x: np.ndarray) -> np.ndarray:
    """x' = q·d per block of 256: m = the first value of largest |x|, s = -127/m, q = min(127, rint(s·x)), d = 1/s
    (float32; 0 for an all-zero block).  x [..., k] with k a multiple of 256 -> [..., k] in x's dtype."""
    if x.shape[-1] % Q8_K_BLOCK:
        raise ParityError(f"Q8_K activations: row length {x.shape[-1]} is not a multiple of the block {Q8_K_BLOCK}")
    b = x.astype(F32).reshape(*x.shape[:-1], -1, Q8_K_BLOCK)
    m = np.take_along_axis(b, np.abs(b).argmax(axis=-1)[..., None], axis=-1)
    with np.errstate(divide="ignore"):
        s = np.where(m != 0, F32(-127) / m, F32(0))
        d = np.where(m != 0, F32(1) / s, F32(0))
    q = np.minimum(np.rint(b * s), F32(127))
    return (q * d).reshape(x.shape).astype(x.dtype)


def bf16_round(x: np.ndarray) -> np.ndarray:
    """Nearest bfloat16 value, ties to even (the top 16 bits of the float32 after rounding).  [...] -> [...] x.dtype."""
    u = np.ascontiguousarray(x, dtype=F32).view(np.uint32)
    r = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return r.view(F32).astype(x.dtype)


def f16_round(x: np.ndarray) -> np.ndarray:
    """Nearest float16 value, ties to even, via float32 (as an f32 -> f16 store).  [...] -> [...] x.dtype."""
    return x.astype(F32).astype(np.float16).astype(x.dtype)


ROUNDINGS: dict[str, Callable[[np.ndarray], np.ndarray]] = {"q8_0": q8_0_roundtrip, "bf16": bf16_round,
                                                            "f16": f16_round}
# llama.cpp's CPU backend: the activation type of a matmul with each weight type (None: the float32 input as is)
# (ggml-cpu's `type_traits_cpu[type].vec_dot_type`; Q8_K itself has no vec_dot there and is not listed)
_Q8_0_BEFORE = (Q.Q4_0, Q.Q5_0, Q.Q8_0, Q.IQ4_NL, Q.MXFP4)
_Q8_1_BEFORE = (Q.Q4_1, Q.Q5_1)
_Q8_K_BEFORE = (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ1_S, Q.IQ1_M, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS,
                Q.IQ3_S, Q.IQ4_XS, Q.TQ1_0, Q.TQ2_0)
LLAMACPP_ROUNDING: dict[Q, Callable[[np.ndarray], np.ndarray] | None] = {
    **dict.fromkeys(_Q8_0_BEFORE, q8_0_roundtrip), **dict.fromkeys(_Q8_1_BEFORE, q8_1_roundtrip),
    **dict.fromkeys(_Q8_K_BEFORE, q8_k_roundtrip), Q.F16: f16_round, Q.BF16: bf16_round, Q.F32: None}
UNQUANTIZED = (Q.F32, Q.F16, Q.BF16)


def input_rounding(act_quant: str, weight_type: int) -> Callable[[np.ndarray], np.ndarray] | None:
    """The rounding a matmul's input gets before a weight of ggml type `weight_type`: q8_0 only before quantized
    weights, bf16 / f16 before every weight, llamacpp by the weight's type (`LLAMACPP_ROUNDING`)."""
    weight = Q(weight_type)
    if act_quant == "none" or (act_quant == "q8_0" and weight in UNQUANTIZED):
        return None
    if act_quant == "llamacpp":
        if weight not in LLAMACPP_ROUNDING:
            raise ParityError(f"act_quant=llamacpp: no model of llama.cpp's activations before a {weight.name} weight "
                              f"(modelled: {', '.join(t.name for t in LLAMACPP_ROUNDING)})")
        return LLAMACPP_ROUNDING[weight]
    if act_quant not in ROUNDINGS:
        raise ParityError(f"act_quant={act_quant!r}; expected none, llamacpp, {', '.join(ROUNDINGS)}")
    return ROUNDINGS[act_quant]
