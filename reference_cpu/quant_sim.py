"""QAT round trips simulated at inference: FP8-e4m3 KV nope dims, Hadamard, FP4-e2m1 indexer (spec attention §6).

Each round trip is quantize -> dequantize with a power-of-two block scale s = 2^⌈log2(amax/qmax)⌉. The `*_codes`
functions return the integer codes (sign bit | magnitude index) and block scale exponents, so code flips between
two runs can be counted (`count_code_flips`).
"""

from __future__ import annotations

import numpy as np

E4M3_MAX = 448.0
E4M3_AMAX_FLOOR = 1e-4
E2M1_MAX = 6.0
E2M1_AMAX_FLOOR = 6.0 * 2.0**-126
E2M1_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def ceil_log2(x: np.ndarray) -> np.ndarray:
    """⌈log2 x⌉ exactly (bit-level, via frexp: x = m·2^e, m ∈ [0.5, 1)) for x > 0.

    x [...] -> int [...].
    """
    m, e = np.frexp(x)
    return np.where(m == 0.5, e - 1, e)


def pow2_block_scale_exp(blocks: np.ndarray, qmax: float, amax_floor: float, inv_qmax: bool) -> np.ndarray:
    """k = ⌈log2(max(amax, floor) / qmax)⌉ per block, the exponent of the scale s = 2^k (§6.1, §6.3).

    blocks [..., nb, bs] -> int [..., nb]. `inv_qmax` forms amax · fl(1/qmax) in the block dtype, as the
    official FP8 kernel does; otherwise amax / qmax.
    """
    amax = np.maximum(np.abs(blocks).max(axis=-1), blocks.dtype.type(amax_floor))
    ratio = amax * blocks.dtype.type(1.0 / qmax) if inv_qmax else amax / blocks.dtype.type(qmax)
    return ceil_log2(ratio)


def e4m3_round(v: np.ndarray) -> np.ndarray:
    """Nearest float8-e4m3fn value, ties to even: step 2^-9 below 2^-6, else 2^(⌊log2|v|⌋-3) (§6.1).

    v [...] with |v| ≤ 448 -> [...].
    """
    a = np.abs(v)
    _, e = np.frexp(a)  # a = m·2^e, m ∈ [0.5, 1) -> ⌊log2 a⌋ = e - 1
    step = np.where(a < 2.0**-6, 2.0**-9, np.ldexp(1.0, e - 4)).astype(v.dtype)
    return np.copysign(np.rint(a / step) * step, v)


def e2m1_round(v: np.ndarray) -> np.ndarray:
    """Nearest of ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}, ties to even code: step 0.5 / 1 / 2 below 2 / 4 / above (§6.3).

    v [...] with |v| ≤ 6 -> [...].
    """
    a = np.abs(v)
    step = np.where(a < 2, 0.5, np.where(a < 4, 1.0, 2.0)).astype(v.dtype)
    return np.copysign(np.rint(a / step) * step, v)


def _blocks(x: np.ndarray, size: int) -> np.ndarray:
    if x.shape[-1] % size:
        raise ValueError(f"last dim {x.shape[-1]} is not a multiple of the block size {size}")
    return x.reshape(*x.shape[:-1], x.shape[-1] // size, size)


def fp8_e4m3_roundtrip(x: np.ndarray, block: int = 64) -> np.ndarray:
    """b ← E4M3(clamp(b/s, ±448))·s per block of `block`, s = 2^⌈log2(max(amax, 1e-4)/448)⌉ (§6.1).

    x [..., k·block] -> same shape.
    """
    b = _blocks(x, block)
    s = np.ldexp(np.ones((), x.dtype), pow2_block_scale_exp(b, E4M3_MAX, E4M3_AMAX_FLOOR, True))[..., None]
    return (e4m3_round(np.clip(b / s, -E4M3_MAX, E4M3_MAX)) * s).reshape(x.shape)


def fp8_sim_nope(kv: np.ndarray, nope_dim: int, block: int = 64) -> np.ndarray:
    """FP8SIM_nope: e4m3 round trip of dims [0, nope_dim) in blocks of 64; the rope tail stays exact (§6.1).

    kv [..., hd] -> [..., hd] (a new array).
    """
    out = kv.copy()
    out[..., :nope_dim] = fp8_e4m3_roundtrip(kv[..., :nope_dim], block)
    return out


def hadamard_matrix(n: int) -> np.ndarray:
    """Had = H_n / √n, Sylvester/natural order: H[i, j] = (-1)^popcount(i & j); symmetric, orthonormal (§6.2).

    -> [n, n] float64 (n a power of two).
    """
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {n}")
    i = np.arange(n)
    return (1.0 - 2.0 * (np.bitwise_count(np.bitwise_and.outer(i, i)) & 1)) / np.sqrt(n)


def hadamard(x: np.ndarray) -> np.ndarray:
    """Had(u) = (1/√n) H_n u over the last axis (§6.2).

    x [..., n] -> [..., n].
    """
    return x @ hadamard_matrix(x.shape[-1]).astype(x.dtype)


def fp4_e2m1_roundtrip(x: np.ndarray, block: int = 32) -> np.ndarray:
    """FP4SIM: b ← E2M1(clamp(b/s, ±6))·s per block of 32, s = 2^⌈log2(max(amax, 6·2^-126)/6)⌉ (§6.3).

    x [..., k·block] -> same shape.
    """
    b = _blocks(x, block)
    s = np.ldexp(np.ones((), x.dtype), pow2_block_scale_exp(b, E2M1_MAX, E2M1_AMAX_FLOOR, False))[..., None]
    return (e2m1_round(np.clip(b / s, -E2M1_MAX, E2M1_MAX)) * s).reshape(x.shape)


def e4m3_codes(x: np.ndarray, block: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """Codes of the e4m3 round trip: (sign<<7 | index of |q| in the 127-value grid, block scale exponent k).

    x [..., k·block] -> codes uint8 [..., k·block], scale exponents int [..., k].
    A zero is code 0 whatever its sign, so ±0 never count as a flip.
    """
    b = _blocks(x, block)
    k = pow2_block_scale_exp(b, E4M3_MAX, E4M3_AMAX_FLOOR, True)
    q = e4m3_round(np.clip(b / np.ldexp(np.ones((), x.dtype), k)[..., None], -E4M3_MAX, E4M3_MAX))
    a = np.abs(q).astype(np.float64)
    m, e = np.frexp(a)  # normal: a = (1 + f/8)·2^(e-1), exponent field e - 1 + 7
    normal = (e + 6) * 8 + np.rint((2 * m - 1) * 8)
    mag = np.where(a < 2.0**-6, np.rint(a / 2.0**-9), normal)
    codes = (mag + 128 * ((q < 0) & (a > 0))).astype(np.uint8)
    return codes.reshape(x.shape), k


def e2m1_codes(x: np.ndarray, block: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """Codes of the e2m1 round trip: (sign<<3 | index of |q| in {0, .5, 1, 1.5, 2, 3, 4, 6}, block scale exponent).

    x [..., k·block] -> codes uint8 [..., k·block], scale exponents int [..., k].
    """
    b = _blocks(x, block)
    k = pow2_block_scale_exp(b, E2M1_MAX, E2M1_AMAX_FLOOR, False)
    q = e2m1_round(np.clip(b / np.ldexp(np.ones((), x.dtype), k)[..., None], -E2M1_MAX, E2M1_MAX))
    a = np.abs(q).astype(np.float64)
    mag = np.searchsorted(E2M1_GRID, a)
    codes = (mag + 8 * ((q < 0) & (a > 0))).astype(np.uint8)
    return codes.reshape(x.shape), k


def count_code_flips(codes_a: tuple[np.ndarray, np.ndarray], codes_b: tuple[np.ndarray, np.ndarray]) -> int:
    """Number of quantized elements whose (code, block scale) differs between two runs.

    codes_* = (codes [..., k·bs], scale exponents [..., k]) from `e4m3_codes` / `e2m1_codes` -> int.
    """
    (ca, ka), (cb, kb) = codes_a, codes_b
    if ca.shape != cb.shape:
        raise ValueError(f"code arrays differ in shape: {ca.shape} vs {cb.shape}")
    bs = ca.shape[-1] // ka.shape[-1]
    scale_differs = np.repeat(ka != kb, bs, axis=-1)
    return int(np.count_nonzero((ca != cb) | scale_differs))
