"""Random but *valid* k-quant / i-quant blocks for synthetic models.

gguf-py cannot quantize the k-quants or i-quants, so synthetic files hold random codes with block
scales chosen so that the dequantized weights have (close to) a requested standard deviation and
near-zero mean. Block layouts (ggml): Q2_K = scales[16] qs[64] d dmin (84 B / 256);
Q3_K = hmask[32] qs[64] scales[12] d (110 B / 256); Q4_K = d dmin scales[12] qs[128] (144 B / 256);
Q5_K = d dmin scales[12] qh[32] qs[128] (176 B / 256); Q6_K = ql[128] qh[64] scales[16] d (210 B / 256);
IQ2_XXS = d + 32 x u16 (66 B / 256; every byte pattern of the 64 code bytes is valid: grid index, 7-bit
sign index, 4-bit group scale); IQ4_XS = d scales_h[2] scales_l[4] qs[128] (136 B / 256);
IQ4_NL = d qs[16] (18 B / 32). For Q3_K, Q6_K and the IQ4 types every code byte pattern is valid and the
value is d x (signed scale) x (code value): random codes with d = +-1 per block have zero mean.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from gguf import quants
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as Q


def _q2_k_codes(n: int, rng: np.random.Generator) -> np.ndarray:
    """Q2_K blocks with d = dmin = 1: value = (s&15)*q - (s>>4), q in 0..3, min ~ 1.5*scale."""
    scale = rng.integers(1, 11, size=(n, 16), dtype=np.uint8)
    minimum = np.minimum(np.rint(1.5 * scale), 15).astype(np.uint8)
    qs = rng.integers(0, 256, size=(n, 64), dtype=np.uint8)
    one = np.full((n, 1), np.float16(1.0)).view(np.uint8)
    return np.concatenate([scale | (minimum << 4), qs, one, one], axis=1)


def _pack_k4_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Pack 8 six-bit scales and mins per block into ggml's 12-byte K_SCALE layout."""
    out = np.zeros((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = (mn[:, 0:4] & 63) | ((mn[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 15) | ((mn[:, 4:8] & 15) << 4)
    return out


def _q4_k_codes(n: int, rng: np.random.Generator) -> np.ndarray:
    """Q4_K blocks with d = 1, dmin = 8: value = sc*q - 8*m with m ~ 7.5*sc/8 (zero mean)."""
    sc = rng.integers(16, 64, size=(n, 8), dtype=np.uint8)
    mn = np.minimum(np.rint(7.5 * sc / 8.0), 63).astype(np.uint8)
    qs = rng.integers(0, 256, size=(n, 128), dtype=np.uint8)
    d = np.full((n, 1), np.float16(1.0)).view(np.uint8)
    dmin = np.full((n, 1), np.float16(8.0)).view(np.uint8)
    return np.concatenate([d, dmin, _pack_k4_scales(sc, mn), qs], axis=1)


def _iq2_xxs_codes(n: int, rng: np.random.Generator) -> np.ndarray:
    """IQ2_XXS blocks with d = 1 and uniformly random code bytes (every pattern is a valid block)."""
    d = np.full((n, 1), np.float16(1.0)).view(np.uint8)
    return np.concatenate([d, rng.integers(0, 256, size=(n, 64), dtype=np.uint8)], axis=1)


def _q5_k_codes(n: int, rng: np.random.Generator) -> np.ndarray:
    """Q5_K blocks with d = 1, dmin = 16: value = sc*q - 16*m, q in 0..31, m ~ 15.5*sc/16 (zero mean)."""
    sc = rng.integers(16, 64, size=(n, 8), dtype=np.uint8)
    mn = np.minimum(np.rint(15.5 * sc / 16.0), 63).astype(np.uint8)
    qhs = rng.integers(0, 256, size=(n, 32 + 128), dtype=np.uint8)
    d = np.full((n, 1), np.float16(1.0)).view(np.uint8)
    dmin = np.full((n, 1), np.float16(16.0)).view(np.uint8)
    return np.concatenate([d, dmin, _pack_k4_scales(sc, mn), qhs], axis=1)


def _signed_d_codes(offset: int, qtype: Q) -> Callable[[int, np.random.Generator], np.ndarray]:
    """Blocks of `qtype` with uniformly random bytes and the f16 d at byte `offset` set to +-1."""
    size = GGML_QUANT_SIZES[qtype][1]

    def codes(n: int, rng: np.random.Generator) -> np.ndarray:
        blocks = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
        d = rng.choice(np.array([1.0, -1.0], np.float16), size=(n, 1))
        blocks[:, offset : offset + 2] = d.view(np.uint8)
        return blocks

    return codes


# byte offsets of the f16 super-block scales (d, and dmin where present) inside each block
_SCALE_OFFSETS = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,),
                  Q.IQ2_XXS: (0,), Q.IQ4_XS: (0,), Q.IQ4_NL: (0,)}
_CODES = {Q.Q2_K: _q2_k_codes, Q.Q4_K: _q4_k_codes, Q.Q5_K: _q5_k_codes, Q.IQ2_XXS: _iq2_xxs_codes} | {
    t: _signed_d_codes(_SCALE_OFFSETS[t][0], t) for t in (Q.Q3_K, Q.Q6_K, Q.IQ4_XS, Q.IQ4_NL)}
RANDOM_BLOCK_TYPES = frozenset(_CODES)  # the types `random_blocks` can draw


def random_blocks(qtype: Q, shape: tuple[int, ...], std: float, rng: np.random.Generator) -> np.ndarray:
    """uint8 blocks for a tensor of numpy `shape` whose dequantized values have std ~= `std`."""
    block, size = GGML_QUANT_SIZES[qtype]
    if shape[-1] % block:
        raise ValueError(f"{qtype.name}: last dim {shape[-1]} is not a multiple of {block}")
    n = int(np.prod(shape)) // block
    blocks = _CODES[qtype](n, rng)
    sample = quants.dequantize(blocks[: min(n, 64)], qtype)
    unit_std = float(np.std(sample))
    for off in _SCALE_OFFSETS[qtype]:
        cur = blocks[:, off : off + 2].copy().view(np.float16).astype(np.float32)
        blocks[:, off : off + 2] = (cur * (std / unit_std)).astype(np.float16).view(np.uint8)
    return blocks.reshape(*shape[:-1], shape[-1] // block * size)
