"""Monte-Carlo round-off: a seeded random relative perturbation of an op's output at the float32 ulp level.

A twin of the reference built with `RunOptions.roundoff_seed = s` perturbs every sub-op output (and every input
it is given in op-level teacher forcing) as

    y' = y · (1 + r · SCALE · 2⁻²⁴ · √k),   r uniform in [-1, 1), k = the longest reduction inside the op

— the size of the round-off a float32 engine that sums in another order leaves (√k ulps of the result for a
k-term sum, as Monte-Carlo arithmetic's random rounding of every addition gives), times SCALE = 4 because one
perturbation per sub-op stands for the several roundings inside it (measured on a clean llama.cpp F32 capture,
op-level: SCALE = 1 leaves single ops up to 2.6x outside the largest of 19 twins, SCALE = 2 leaves 6-16 cells
per layer outside (the rope op at 8 of 48), SCALE = 4 at most 1; at layer level a clean torch run's local error
is then about 1/6 of the twins' largest: docs/check.md). r is a hash of
(seed, op name, element index, the value's bits): the same call gives the same result in any thread or chunk
order, and two seeds give independent perturbations. An ensemble of such twins is the round-off null of
`parity.check.null`.
"""

from __future__ import annotations

import math
import zlib

import numpy as np

ULP = 2.0**-24
SCALE = 4.0
_M1, _M2, _M3 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def uniform_hash(bits: np.ndarray, seed: int, salt: int) -> np.ndarray:
    """r ∈ [-1, 1) per element: splitmix64 of (bits, element index, seed, salt).  bits [...] -> float64 [...]"""
    h = bits.astype(np.uint64).ravel() * _M1
    h ^= (np.arange(h.size, dtype=np.uint64) + np.uint64((seed << 32) ^ salt)) * _M2
    h ^= h >> np.uint64(31)
    h *= _M3
    h ^= h >> np.uint64(29)
    return ((h >> np.uint64(11)).astype(np.float64) * 2.0**-52 - 1.0).reshape(bits.shape)


def jitter(y: np.ndarray, seed: int, name: str, k: int) -> np.ndarray:
    """y · (1 + r · SCALE · 2⁻²⁴ · √k), r = uniform_hash(float32 bits of y, seed, crc32(name)).  [...] -> [...];
    integer arrays (expert ids, selections) are returned unchanged."""
    if y.dtype.kind not in "f" or y.size == 0:
        return y
    bits = np.ascontiguousarray(y, dtype=np.float32).view(np.uint32)
    r = uniform_hash(bits, seed, zlib.crc32(name.encode()))
    return (y * (1.0 + r * (SCALE * ULP * math.sqrt(k)))).astype(y.dtype)
