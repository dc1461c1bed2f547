"""Opt-in approximate numerics that reproduce known engine behaviours (`RunOptions.act_quant`, `kv_cache`).

Each is a pure rounding function; the exact path never calls them. The roundings are computed in float32, as
the engines they model do, and returned in the input's dtype.

- Q8_0 (llama.cpp's CPU backend before a matmul with a quantized weight whose vec_dot type is Q8_0): blocks of
  32 along the row, d = amax/127 stored as f16, q = round-half-even(x·127/amax) (the x86 SIMD path of ggml's
  `quantize_row_q8_0`; the scalar `_ref` path uses x·(1/d) and rounds half away from zero), x' = q·f16(d).
- bf16 / f16: round to nearest even of that type.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from parity.contract.errors import ParityError

F32 = np.float32
Q8_0_BLOCK = 32


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


def input_rounding(act_quant: str, weight_quantized: bool) -> Callable[[np.ndarray], np.ndarray] | None:
    """The rounding a matmul's input gets: q8_0 only before quantized weights, bf16/f16 before every weight."""
    if act_quant == "none" or (act_quant == "q8_0" and not weight_quantized):
        return None
    if act_quant not in ROUNDINGS:
        raise ParityError(f"act_quant={act_quant!r}; expected none, {', '.join(ROUNDINGS)}")
    return ROUNDINGS[act_quant]
