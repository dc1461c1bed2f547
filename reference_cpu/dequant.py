"""Fast, bit-exact pure-NumPy dequantizers for the ggml types found in deepseek4 GGUFs.

Every function reproduces `gguf.quants.dequantize` to the last float32 bit (same operations in the
same order, only regrouped into fewer, larger array operations): no Python loop runs over blocks, only
over chunks of `CHUNK_VALUES` values so that the intermediates stay in the L2 cache. The lookup tables
(IQ2_XXS grid and sign patterns, MXFP4 E2M1 values and E8M0 scales) are derived from `gguf.quants`
at import, never retyped.
"""

from __future__ import annotations

import numpy as np
from gguf import quants
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as Q

from parity.contract.errors import TensorError

CHUNK_VALUES = 1 << 18  # values per chunk: 1 MiB of float32 output, so temporaries stay in L2


def _signed_iq2_grid() -> np.ndarray:
    """S[g * 128 + k, j] = iq2xxs_grid[g][j] * (-1 if bit j of ksigns_iq2xs[k] else +1).
    [32768, 8] float32: one row per (grid index, 7-bit sign index) pair."""
    quants.IQ2_XXS.init_grid()
    grid = np.asarray(quants.IQ2_XXS.grid, dtype=np.float32).reshape(256, 8)
    ksigns = np.frombuffer(quants.IQ2_XXS.ksigns, dtype=np.uint8)
    neg = (ksigns[:, None] >> np.arange(8, dtype=np.uint8)) & 1
    sign = np.where(neg == 1, np.float32(-1), np.float32(1))
    return (grid[:, None, :] * sign[None, :, :]).reshape(256 * 128, 8)


IQ2_SIGNED_GRID = _signed_iq2_grid()
MXFP4_VALUES = np.asarray(quants.MXFP4.kvalues, dtype=np.float32)                          # [16] doubled E2M1
# F16_VALUES[bits] = float32 value of the half with those bits, by numpy's own cast (what gguf.quants does)
F16_VALUES = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)
E8M0_HALF = quants.MXFP4.e8m0_to_fp32_half(np.arange(256, dtype=np.uint8)).astype(np.float32)  # [256]
_IQ2_SIGN_SHIFTS = np.array([0, 7, 14, 21], dtype=np.uint32)
_PAIRS = np.arange(256)
# MXFP4_PAIRS[byte] = (kvalue[byte & 15], kvalue[byte >> 4]) packed as one uint64
MXFP4_PAIRS = np.stack([MXFP4_VALUES[_PAIRS & 15], MXFP4_VALUES[_PAIRS >> 4]], axis=1).view(np.uint64).ravel()
_LOW2 = np.uint64(0x0303030303030303)
_LOW4 = np.uint64(0x0F0F0F0F0F0F0F0F)


def _shift_pattern(shifts: tuple[int, ...], groups: int) -> np.ndarray:
    """Per-word right shifts that unpack `len(shifts)` bit planes of `groups` 4-word code groups per block.
    [blocks per chunk, groups, len(shifts), 4] uint64"""
    n = CHUNK_VALUES // 256
    pattern = np.array(shifts, dtype=np.uint64).reshape(1, 1, -1, 1)
    return np.ascontiguousarray(np.broadcast_to(pattern, (n, groups, len(shifts), 4)))


_Q2_SHIFT = _shift_pattern((0, 2, 4, 6), 2)
_Q4_SHIFT = _shift_pattern((0, 4), 4)


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The little-endian f16 at byte offset `at` of every block, as float32.
    [n, size] uint8 -> [n]"""
    return blocks[:, at : at + 2].view("<f2").astype(np.float32).reshape(-1)


def _scale(out: np.ndarray, scale: np.ndarray) -> None:
    """out[r, :] *= scale[r]  (the scale is expanded first: a contiguous multiply beats a broadcast one).
    out [R, S], scale [R]"""
    np.multiply(out, np.repeat(scale, out.shape[1]).reshape(out.shape), out=out)


def _shift_down(out: np.ndarray, minimum: np.ndarray) -> None:
    """out[r, :] -= minimum[r].
    out [R, S], minimum [R]"""
    np.subtract(out, np.repeat(minimum, out.shape[1]).reshape(out.shape), out=out)


def _unpack_codes(packed: np.ndarray, pattern: np.ndarray, mask: np.uint64) -> np.ndarray:
    """Bit planes of packed code bytes, plane after plane, each byte keeping its own bits (shift < 8).
    packed [n, groups, 4] uint64, pattern [>= n, groups, planes, 4] -> [n, groups * planes * 32] uint8"""
    n, groups, _ = packed.shape
    planes = pattern.shape[2]
    words = np.repeat(packed.reshape(n, groups, 1, 4), planes, axis=2)
    np.right_shift(words, pattern[:n], out=words)
    np.bitwise_and(words, mask, out=words)
    return words.view(np.uint8).reshape(n, groups * planes * 32)


def q8_0(blocks: np.ndarray, out: np.ndarray) -> None:
    """x = q · d  (q int8, d f16 per 32 values).
    blocks [n, 34] uint8 -> out [n, 32] float32"""
    np.copyto(out, blocks[:, 2:].view(np.int8), casting="unsafe")
    _scale(out, _f16(blocks, 0))


def q2_k(blocks: np.ndarray, out: np.ndarray) -> None:
    """x = (d · (s & 15)) · q − dmin · (s >> 4)  per 16-value sub-block, q 2-bit.
    blocks [n, 84] uint8 -> out [n, 256] float32"""
    n = blocks.shape[0]
    scales = blocks[:, :16]
    dl = _f16(blocks, 80)[:, None] * (scales & 15).astype(np.float32)
    ml = _f16(blocks, 82)[:, None] * (scales >> 4).astype(np.float32)
    codes = _unpack_codes(blocks[:, 16:80].view("<u8").reshape(n, 2, 4), _Q2_SHIFT, _LOW2)
    np.copyto(out, codes, casting="unsafe")
    _scale(out.reshape(n * 16, 16), dl.reshape(-1))
    _shift_down(out.reshape(n * 16, 16), ml.reshape(-1))


def _k4_scale_min(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unpack ggml's 12-byte K_SCALE field into 8 six-bit scales and 8 six-bit mins.
    [n, 12] uint8 -> ([n, 8], [n, 8]) uint8"""
    d, m, md = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = np.concatenate([d & 63, (md & 15) | ((d >> 2) & 48)], axis=1)
    mn = np.concatenate([m & 63, (md >> 4) | ((m >> 2) & 48)], axis=1)
    return sc, mn


def q4_k(blocks: np.ndarray, out: np.ndarray) -> None:
    """x = (d · sc) · q − dmin · m  per 32-value sub-block, q 4-bit, sc/m 6-bit.
    blocks [n, 144] uint8 -> out [n, 256] float32"""
    n = blocks.shape[0]
    sc, mn = _k4_scale_min(blocks[:, 4:16])
    dl = _f16(blocks, 0)[:, None] * sc.astype(np.float32)
    ml = _f16(blocks, 2)[:, None] * mn.astype(np.float32)
    codes = _unpack_codes(blocks[:, 16:].view("<u8").reshape(n, 4, 4), _Q4_SHIFT, _LOW4)
    np.copyto(out, codes, casting="unsafe")
    _scale(out.reshape(n * 8, 32), dl.reshape(-1))
    _shift_down(out.reshape(n * 8, 32), ml.reshape(-1))


def iq2_xxs(blocks: np.ndarray, out: np.ndarray) -> None:
    """x = (d · (0.5 + b>>28) · 0.25) · ±grid  per 32-value group; the sign is folded into the grid table.
    blocks [n, 66] uint8 -> out [n, 256] float32"""
    n = blocks.shape[0]
    high = blocks[:, 2:].view("<u4").reshape(n, 8, 2)[:, :, 1]
    db = _f16(blocks, 0)[:, None] * (np.float32(0.5) + (high >> 28).astype(np.float32)) * np.float32(0.25)
    grid_idx = blocks[:, 2:].reshape(n, 8, 8)[:, :, 0:4].astype(np.uint16) << 7
    sign_idx = (high[:, :, None] >> _IQ2_SIGN_SHIFTS) & np.uint32(127)
    rows = np.bitwise_or(grid_idx, sign_idx, dtype=np.uint16)
    np.take(IQ2_SIGNED_GRID, rows.reshape(n * 8, 4), axis=0, out=out.reshape(n * 8, 4, 8))
    _scale(out.reshape(n * 8, 32), db.reshape(-1))


def mxfp4(blocks: np.ndarray, out: np.ndarray) -> None:
    """x = e8m0_half(e) · kvalue[nibble]; low nibbles are values 0..15, high nibbles 16..31.
    blocks [n, 17] uint8 -> out [n, 32] float32"""
    n = blocks.shape[0]
    pairs = np.take(MXFP4_PAIRS, blocks[:, 1:]).view(np.float32).reshape(n, 16, 2)
    np.copyto(out.reshape(n, 2, 16), pairs.transpose(0, 2, 1))
    _scale(out, E8M0_HALF[blocks[:, 0]])


def f16(blocks: np.ndarray, out: np.ndarray) -> None:
    """x = float32(h), as a lookup in the 65536-entry table (faster than NumPy's cast, same bits by construction).
    blocks [n, 2] uint8 -> out [n, 1] float32"""
    np.take(F16_VALUES, blocks.view("<u2").reshape(-1), out=out.reshape(-1))


def bf16(blocks: np.ndarray, out: np.ndarray) -> None:
    """x = bits(h) << 16 reinterpreted as float32.
    blocks [n, 2] uint8 -> out [n, 1] float32"""
    np.left_shift(blocks.view("<u2"), 16, out=out.view(np.uint32), dtype=np.uint32)


def f32(blocks: np.ndarray, out: np.ndarray) -> None:
    """x = x.
    blocks [n, 4] uint8 -> out [n, 1] float32"""
    np.copyto(out, blocks.view("<f4"))


KERNELS = {Q.F32: f32, Q.F16: f16, Q.BF16: bf16, Q.Q8_0: q8_0, Q.Q2_K: q2_k, Q.Q4_K: q4_k,
           Q.IQ2_XXS: iq2_xxs, Q.MXFP4: mxfp4}


def dequantize(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> np.ndarray:
    """Raw ggml blocks -> float32 values (I32 -> int32 passthrough), bit-identical to gguf.quants.
    raw: uint8 bytes (any shape, contiguous) -> numpy `shape` (reversed ne)"""
    try:
        qtype = Q(int(ggml_type))
    except ValueError as exc:
        raise TensorError(f"unknown ggml type {ggml_type}") from exc
    shape = tuple(int(s) for s in shape)
    raw = np.asarray(raw)
    if raw.dtype != np.uint8:
        raise TensorError(f"{qtype.name}: raw data must be uint8 bytes, got {raw.dtype}")
    if qtype == Q.I32:
        _check_size(raw.size, int(np.prod(shape)) * 4, qtype, shape)
        return np.ascontiguousarray(raw).reshape(-1).view("<i4").reshape(shape)
    if qtype not in KERNELS:
        raise TensorError(f"no dequantizer for ggml type {qtype.name} ({int(qtype)})")
    block, size = GGML_QUANT_SIZES[qtype]
    if not shape or shape[-1] % block:
        raise TensorError(f"{qtype.name}: row length of shape {shape} is not a multiple of the block size {block}")
    n_blocks = int(np.prod(shape)) // block
    _check_size(raw.size, n_blocks * size, qtype, shape)
    blocks = np.ascontiguousarray(raw).reshape(n_blocks, size)
    out = np.empty((n_blocks, block), dtype=np.float32)
    kernel = KERNELS[qtype]
    step = CHUNK_VALUES // block  # blocks per chunk (block sizes are 1..256)
    for lo in range(0, n_blocks, step):
        kernel(blocks[lo : lo + step], out[lo : lo + step])
    return out.reshape(shape)


def _check_size(got: int, want: int, qtype: Q, shape: tuple[int, ...]) -> None:
    if got != want:
        raise TensorError(f"{qtype.name} tensor of shape {shape} needs {want} bytes, got {got}")
