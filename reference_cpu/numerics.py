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
- llamacpp: what llama.cpp's CPU backend does before each matmul, chosen by the weight's type (its `vec_dot_type`):
  Q8_K before Q2_K / Q4_K / IQ2_XXS, Q8_0 before Q8_0 / MXFP4, f16 before F16, bf16 before BF16, nothing before F32.
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
LLAMACPP_ROUNDING: dict[Q, Callable[[np.ndarray], np.ndarray] | None] = {
    Q.Q2_K: q8_k_roundtrip, Q.Q4_K: q8_k_roundtrip, Q.IQ2_XXS: q8_k_roundtrip, Q.Q8_0: q8_0_roundtrip,
    Q.MXFP4: q8_0_roundtrip, Q.F16: f16_round, Q.BF16: bf16_round, Q.F32: None}
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
