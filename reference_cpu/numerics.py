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
- Q8_1 (before Q4_1 / Q5_1 weights): the values of Q8_0 (d = amax/127 stored as f16, q = rint(x·127/amax), the
  same x86 SIMD path of ggml's `quantize_row_q8_1`; the scalar `_ref` path uses x·(1/d) and roundf) plus a stored
  sum s = f16(d·Σq) with the float32 d (not the f16 one). The Q4_1 / Q5_1 dot product is, per block b of 32,
  d_w·d_x·Σ q_w·q_x + m_w·s_x, while the dequantized weight (d_w·q_w + m_w) times the round trip x' = q·d_x gives
  d_w·d_x·Σ q_w·q_x + m_w·d_x·Σq. The difference m_w·c, c = s_x − d_x·Σq (`q8_1_sum_residual`), is added by the
  matmul (`reference_cpu.linear.MinTerm`) with the weight's per-block mins (`block_mins`): y = W x' + M c.
- llamacpp: what llama.cpp's CPU backend does before each matmul, chosen by the weight's type (its `vec_dot_type` in
  ggml-cpu's `type_traits_cpu`): Q8_0 before Q4_0 / Q5_0 / Q8_0 / IQ4_NL / MXFP4; Q8_1 before Q4_1 / Q5_1; Q8_K
  before Q2_K / Q3_K / Q4_K / Q5_K / Q6_K, IQ1_S / IQ1_M / IQ2_XXS / IQ2_XS / IQ2_S / IQ3_XXS / IQ3_S / IQ4_XS and
  TQ1_0 / TQ2_0; f16 before F16, bf16 before BF16, nothing before F32 (Q8_K weights have no vec_dot in ggml-cpu and
  are refused, as is every type not listed).
"""

from __future__ import annotations

import math
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
    is `q8_1_sum_residual`'s business.  x [..., k], k a multiple of 32 -> [..., k] in x's dtype."""
    return q8_0_roundtrip(x)


def q8_1_sum_residual(x: np.ndarray) -> np.ndarray:
    """c = s − f16(d)·Σq per block of 32: how far the stored Q8_1 sum s = f16(d·Σq) (float32 d = amax/127, the x86
    SIMD `quantize_row_q8_1`) is from the sum of the round-tripped values Σx' = f16(d)·Σq.

    q = rint(x·(127/amax)) as in `q8_0_roundtrip` (0 for an all-zero block, so c = 0). Σq is an integer below 2^12
    and f16(d) has 11 significant bits, so f16(d)·Σq is exact in float32, and s − f16(d)·Σq is exact in float64 (both
    are multiples of 2^-24 below 2^29); the result is then cast to x's dtype. A block with d·Σq beyond f16's range
    stores s = ±inf in ggml, and so c = ±inf here.
    x [..., k], k a multiple of 32 -> c [..., k/32] in x's dtype.
    """
    if x.shape[-1] % Q8_0_BLOCK:
        raise ParityError(f"Q8_1 activations: row length {x.shape[-1]} is not a multiple of the block {Q8_0_BLOCK}")
    b = x.astype(F32).reshape(*x.shape[:-1], -1, Q8_0_BLOCK)
    amax = np.abs(b).max(axis=-1)
    d = amax / F32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(amax != 0, F32(127) / amax, F32(0))
    qsum = np.rint(b * inv[..., None]).sum(axis=-1, dtype=np.float64).astype(F32)   # an integer, exact in float32
    with np.errstate(over="ignore"):
        s16 = (d * qsum).astype(np.float16).astype(np.float64)
    d16 = d.astype(np.float16).astype(np.float64)
    return (s16 - d16 * qsum.astype(np.float64)).astype(x.dtype)


# bytes per block of 32 weights of the types with a per-block min m (f16 at bytes 2..3 after the f16 scale d):
# Q4_1 = d, m, qs[16]; Q5_1 = d, m, qh[4], qs[16] (ggml's block_q4_1 / block_q5_1, gguf-py's quants.py)
MIN_BLOCK_BYTES: dict[Q, int] = {Q.Q4_1: 20, Q.Q5_1: 24}
MIN_BLOCK = 32


def block_mins(raw: np.ndarray, weight_type: int, shape: tuple[int, ...]) -> np.ndarray:
    """The f16 min m of every block of a Q4_1 / Q5_1 tensor, read from its bytes (w = d·q + m within a block).

    raw: the tensor's bytes (uint8, row-major blocks of 32 along the last axis), shape: numpy shape [..., in] with
    in a multiple of 32 -> M [..., in/32] float32.
    """
    kind = Q(weight_type)
    if kind not in MIN_BLOCK_BYTES:
        raise ParityError(f"block mins: a {kind.name} tensor has no per-block min (only "
                          f"{', '.join(t.name for t in MIN_BLOCK_BYTES)})")
    if shape[-1] % MIN_BLOCK:
        raise ParityError(f"block mins: row length {shape[-1]} is not a multiple of the block {MIN_BLOCK}")
    n_blocks = math.prod(shape) // MIN_BLOCK
    per = MIN_BLOCK_BYTES[kind]
    if raw.size != n_blocks * per:
        raise ParityError(f"block mins: {raw.size} bytes for a {kind.name} tensor of shape {tuple(shape)}, expected "
                          f"{n_blocks * per}")
    m = np.ascontiguousarray(raw.reshape(n_blocks, per)[:, 2:4]).view(np.float16)
    return m.astype(F32).reshape(*shape[:-1], shape[-1] // MIN_BLOCK)


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


def has_min_term(act_quant: str, weight_type: int) -> bool:
    """Whether a matmul with a weight of ggml type `weight_type` gets llama.cpp's per-block min term (y = W x' + M c,
    `q8_1_sum_residual`, `block_mins`): under act_quant=llamacpp, before Q4_1 / Q5_1 weights (Q8_1 activations)."""
    return act_quant == "llamacpp" and Q(weight_type) in _Q8_1_BEFORE


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
