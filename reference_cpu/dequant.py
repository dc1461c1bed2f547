"""Fast, bit-exact pure-NumPy dequantizers for every ggml weight type gguf-py reads.

Types: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K, IQ1_S, IQ1_M, IQ2_XXS,
IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ4_NL, IQ4_XS, TQ1_0, TQ2_0, MXFP4 (and I32 passed through as int32).
Every function reproduces `gguf.quants.dequantize` to the last float32 bit (same operations in the same order, only
regrouped into fewer, larger array operations; a product with an exact ±1 sign or an exact integer sum may be formed
first, which changes no bit): no Python loop runs over blocks, only over chunks of `CHUNK_VALUES` values so that the
intermediates stay in the L2 cache. The lookup tables (the IQ grids and sign patterns, the IQ4 / MXFP4 values, the
E8M0 scales) are derived from `gguf.quants` at import, never retyped. Q8_K has no dequantizer in gguf-py; its
values follow ggml's `dequantize_row_q8_K`, x = d·q with a float32 d.
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


def _shift_pattern(shifts: tuple[int, ...], groups: int, words: int = 4) -> np.ndarray:
    """Per-word right shifts that unpack `len(shifts)` bit planes of `groups` code groups of `words` uint64 per block.
    [blocks per chunk, groups, len(shifts), words] uint64"""
    n = CHUNK_VALUES // 256
    pattern = np.array(shifts, dtype=np.uint64).reshape(1, 1, -1, 1)
    return np.ascontiguousarray(np.broadcast_to(pattern, (n, groups, len(shifts), words)))


_Q2_SHIFT = _shift_pattern((0, 2, 4, 6), 2)
_Q4_SHIFT = _shift_pattern((0, 4), 4)
_BIT_SHIFT = _shift_pattern(tuple(range(8)), 1)      # 8 one-bit planes of 32 bytes (Q3_K hmask, Q5_K qh)
_Q6_LOW_SHIFT = _shift_pattern((0, 4), 2, words=8)   # Q6_K ql: two halves of 64 bytes, low then high nibbles
_LOW1 = np.uint64(0x0101010101010101)


def _grid(cls: type) -> np.ndarray:
    """gguf-py's decoded grid of an IQ type.  -> [rows, values per row] float32"""
    cls.init_grid()
    return np.asarray(cls.grid, dtype=np.float32).reshape(cls.grid_shape)


def _sign_rows(bits: np.ndarray, width: int) -> np.ndarray:
    """Row k = the `width` factors (+1 / -1) that bits 0 .. width-1 of bits[k] select (bit set -> -1).
    [K] integers -> [K, width] float32"""
    neg = (bits[:, None].astype(np.uint32) >> np.arange(width, dtype=np.uint32)) & 1
    return np.where(neg == 1, np.float32(-1), np.float32(1))


def _nibble_pair_table(values: np.ndarray) -> np.ndarray:
    """T[byte] = (values[byte & 15], values[byte >> 4]) as two float32 packed in one uint64.  [16] -> [256] uint64"""
    v = np.asarray(values, dtype=np.float32)
    return np.ascontiguousarray(np.stack([v[_PAIRS & 15], v[_PAIRS >> 4]], axis=1)).view(np.uint64).ravel()


def _signed_iq2_xs_grid() -> np.ndarray:
    """S[w] = iq2xs_grid[w & 511] * signs(ksigns_iq2xs[w >> 9]) for every 16-bit code word w.  [65536, 8] float32"""
    words = np.arange(1 << 16)
    return _grid(quants.IQ2_XS)[words & 511] * _sign_rows(KSIGNS[words >> 9], 8)


def _signed_quarter_grid(grid: np.ndarray) -> np.ndarray:
    """For 4-value grids: S[g * 16 + s] = grid[g] * signs(s), s a 4-bit sign nibble.  [G, 4] -> [G * 16, 4] float32"""
    return (grid[:, None, :] * _sign_rows(np.arange(16), 4)[None, :, :]).reshape(-1, 4)


def _signed_half_grid(grid: np.ndarray) -> np.ndarray:
    """For 8-value grids split in halves: S[(g * 2 + h) * 16 + s] = grid[g, 4h : 4h + 4] * signs(s).
    [G, 8] -> [G * 32, 4] float32"""
    return _signed_quarter_grid(grid.reshape(-1, 4))


def _iq1_delta_grid() -> np.ndarray:
    """D[neg * 2048 + g] = iq1s_grid[g] + (-1/8 if neg else +1/8)  (exact sums).  [4096, 8] float32"""
    grid = _grid(quants.IQ1_S)
    delta = np.float32(quants.IQ1_S.delta)
    return np.concatenate([grid + delta, grid + -delta])


KSIGNS = np.frombuffer(quants.IQ2_XXS.ksigns, dtype=np.uint8)                 # [128] even-parity sign bytes
IQ2_XS_SIGNED_GRID = _signed_iq2_xs_grid()                                      # [65536, 8]
IQ2_S_SIGNED_GRID = _signed_half_grid(_grid(quants.IQ2_S))                      # [1024 * 2 * 16, 4]
IQ3_XXS_SIGNED_GRID = _signed_quarter_grid(_grid(quants.IQ3_XXS))               # [256 * 16, 4]
IQ3_S_SIGNED_GRID = _signed_quarter_grid(_grid(quants.IQ3_S))                   # [512 * 16, 4]
IQ1_DELTA_GRID = _iq1_delta_grid()                                              # [4096, 8]
IQ4_VALUES = np.asarray(quants.IQ4_NL.kvalues, dtype=np.float32)               # [16]
IQ4_PAIRS = _nibble_pair_table(IQ4_VALUES)
Q4_0_PAIRS = _nibble_pair_table(np.arange(16) - 8)    # q - 8
Q4_1_PAIRS = _nibble_pair_table(np.arange(16))        # q
# TQ1_0: byte b holds five base-3 digits; digit p = ((b·3^p mod 256)·3) >> 8, stored minus 1
_TQ1_POW = np.array([1, 3, 9, 27, 81], dtype=np.uint32)
TQ1_DIGITS = ((((_PAIRS[:, None] * _TQ1_POW) & 255) * 3 >> 8).astype(np.float32) - 1).astype(np.float32)  # [256, 5]


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
    packed [n, groups, W] uint64, pattern [>= n, groups, planes, W] -> [n, groups * planes * W * 8] uint8"""
    n, groups, width = packed.shape
    planes = pattern.shape[2]
    words = np.repeat(packed.reshape(n, groups, 1, width), planes, axis=2)
    np.right_shift(words, pattern[:n], out=words)
    np.bitwise_and(words, mask, out=words)
    return words.view(np.uint8).reshape(n, groups * planes * width * 8)


def _codes_minus(codes: np.ndarray, offset: int, out: np.ndarray) -> None:
    """out = codes − offset as float32 (exact: small integers; 5x faster than a table lookup with intp indices).
    codes [...] uint8 -> out (same size)"""
    np.copyto(out.reshape(codes.shape), codes, casting="unsafe")
    np.subtract(out, np.float32(offset), out=out)


def _take(table: np.ndarray, idx: np.ndarray, out: np.ndarray) -> None:
    """out = table[idx] row by row (indices are in range by construction: no bounds pass).
    table [R, w] or [R], idx [...] -> out [idx.size * w] (any shape of that size)"""
    width = table.shape[1] if table.ndim == 2 else 1
    np.take(table, idx.reshape(-1), axis=0, out=out.reshape((-1, width) if table.ndim == 2 else -1), mode="clip")


def _shift_up(out: np.ndarray, offset: np.ndarray) -> None:
    """out[r, :] += offset[r].
    out [R, S], offset [R]"""
    np.add(out, np.repeat(offset, out.shape[1]).reshape(out.shape), out=out)


def _nibbles32(qs: np.ndarray, pairs: np.ndarray, out: np.ndarray) -> None:
    """Values of 32 four-bit codes in 16 bytes: low nibbles are values 0..15, high nibbles 16..31, each looked up.
    qs [m, 16] uint8, pairs [256] uint64 (`_nibble_pair_table`) -> out [m, 32] float32"""
    m = qs.shape[0]
    pair = np.take(pairs, qs).view(np.float32).reshape(m, 16, 2)
    np.copyto(out.reshape(m, 2, 16), pair.transpose(0, 2, 1))


def _bits32(qh: np.ndarray) -> np.ndarray:
    """Bit j of the little-endian 32-bit word as element j.  [m, 4] uint8 -> [m, 32] uint8 (0 / 1)"""
    return np.unpackbits(qh, axis=1, bitorder="little")


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


def _k_scale_min(blocks: np.ndarray, codes: np.ndarray, out: np.ndarray) -> None:
    """out = (d · sc) · q − (dmin · m) per 32-value sub-block, with the 6-bit scales and mins of bytes 4..15
    (Q4_K and Q5_K).  blocks [n, size] uint8, codes [n, 256] uint8 -> out [n, 256] float32"""
    n = blocks.shape[0]
    sc, mn = _k4_scale_min(blocks[:, 4:16])
    dl = _f16(blocks, 0)[:, None] * sc.astype(np.float32)
    ml = _f16(blocks, 2)[:, None] * mn.astype(np.float32)
    np.copyto(out, codes, casting="unsafe")
    _scale(out.reshape(n * 8, 32), dl.reshape(-1))
    _shift_down(out.reshape(n * 8, 32), ml.reshape(-1))


def q4_k(blocks: np.ndarray, out: np.ndarray) -> None:
    """x = (d · sc) · q − dmin · m  per 32-value sub-block, q 4-bit, sc/m 6-bit.
    blocks [n, 144] uint8 -> out [n, 256] float32"""
    n = blocks.shape[0]
    _k_scale_min(blocks, _unpack_codes(blocks[:, 16:].view("<u8").reshape(n, 4, 4), _Q4_SHIFT, _LOW4), out)


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


def q4_0(blocks: np.ndarray, out: np.ndarray) -> None:
    """x = d · (q − 8)  (q 4-bit, d f16 per 32 values; low nibbles are values 0..15).
    blocks [n, 18] uint8 -> out [n, 32] float32"""
    _nibbles32(blocks[:, 2:], Q4_0_PAIRS, out)
    _scale(out, _f16(blocks, 0))


def q4_1(blocks: np.ndarray, out: np.ndarray) -> None:
    """x = d · q + m  (q 4-bit, d and m f16 per 32 values).
    blocks [n, 20] uint8 -> out [n, 32] float32"""
    _nibbles32(blocks[:, 4:], Q4_1_PAIRS, out)
    _scale(out, _f16(blocks, 0))
    _shift_up(out, _f16(blocks, 2))


def _q5_values(blocks: np.ndarray, qh_at: int, pairs: np.ndarray, out: np.ndarray) -> None:
    """5-bit codes as floats: the low nibbles' values (`pairs`, values 0..15 then 16..31) plus 16 · bit j of the
    32-bit qh (an exact small-integer sum: the same value as the integer code's).
    blocks [n, size] uint8 (qh at byte qh_at, 16 code bytes after it) -> out [n, 32] float32"""
    _nibbles32(blocks[:, qh_at + 4 :], pairs, out)
    high = _bits32(blocks[:, qh_at : qh_at + 4])
    high <<= 4
    np.add(out, high, out=out, casting="unsafe")


Q5_0_PAIRS = _nibble_pair_table(np.arange(16) - 16)   # (q & 15) - 16


def q5_0(blocks: np.ndarray, out: np.ndarray) -> None:
    """x = d · (q − 16)  (q 5-bit: low nibble + one bit of the 32-bit qh << 4, d f16 per 32 values).
    blocks [n, 22] uint8 -> out [n, 32] float32"""
    _q5_values(blocks, 2, Q5_0_PAIRS, out)
    _scale(out, _f16(blocks, 0))


def q5_1(blocks: np.ndarray, out: np.ndarray) -> None:
    """x = d · q + m  (q 5-bit, d and m f16 per 32 values).
    blocks [n, 24] uint8 -> out [n, 32] float32"""
    _q5_values(blocks, 4, Q4_1_PAIRS, out)
    _scale(out, _f16(blocks, 0))
    _shift_up(out, _f16(blocks, 2))


def _q3_k_scales(packed: np.ndarray) -> np.ndarray:
    """16 six-bit scales minus 32: low nibbles from bytes 0..7 (low halves first), 2 high bits from bytes 8..11.
    [n, 12] uint8 -> [n, 16] float32"""
    low = np.concatenate([packed[:, :8] & 15, packed[:, :8] >> 4], axis=1)
    high = np.concatenate([(packed[:, 8:12] >> (2 * k)) & 3 for k in range(4)], axis=1)
    return (low | (high << 4)).astype(np.float32) - np.float32(32)


def q3_k(blocks: np.ndarray, out: np.ndarray) -> None:
    """x = (d · (s − 32)) · (q − 4·(1 − h))  per 16-value sub-block; q 2-bit, h one bit of hmask, s 6-bit.
    blocks [n, 110] uint8 -> out [n, 256] float32"""
    n = blocks.shape[0]
    dl = _f16(blocks, 108)[:, None] * _q3_k_scales(blocks[:, 96:108])
    low = _unpack_codes(blocks[:, 32:96].view("<u8").reshape(n, 2, 4), _Q2_SHIFT, _LOW2)
    high = _unpack_codes(blocks[:, :32].view("<u8").reshape(n, 1, 4), _BIT_SHIFT, _LOW1)
    low |= high << 2
    _codes_minus(low, 4, out)                         # (low | high << 2) − 4 = low − 4·(1 − high)
    _scale(out.reshape(n * 16, 16), dl.reshape(-1))


def q5_k(blocks: np.ndarray, out: np.ndarray) -> None:
    """x = (d · sc) · q − dmin · m  per 32-value sub-block, q 5-bit (4 low bits + one bit of qh), sc/m 6-bit.
    blocks [n, 176] uint8 -> out [n, 256] float32"""
    n = blocks.shape[0]
    codes = _unpack_codes(blocks[:, 48:].view("<u8").reshape(n, 4, 4), _Q4_SHIFT, _LOW4)
    codes |= _unpack_codes(blocks[:, 16:48].view("<u8").reshape(n, 1, 4), _BIT_SHIFT, _LOW1) << 4
    _k_scale_min(blocks, codes, out)


def q6_k(blocks: np.ndarray, out: np.ndarray) -> None:
    """x = (d · s) · (q − 32)  per 16-value sub-block, q 6-bit (nibble of ql | 2 bits of qh << 4), s int8.
    blocks [n, 210] uint8 -> out [n, 256] float32"""
    n = blocks.shape[0]
    dl = _f16(blocks, 208)[:, None] * blocks[:, 192:208].view(np.int8).astype(np.float32)
    codes = _unpack_codes(blocks[:, :128].view("<u8").reshape(n, 2, 8), _Q6_LOW_SHIFT, _LOW4)
    codes |= _unpack_codes(blocks[:, 128:192].view("<u8").reshape(n, 2, 4), _Q2_SHIFT, _LOW2) << 4
    _codes_minus(codes, 32, out)
    _scale(out.reshape(n * 16, 16), dl.reshape(-1))


def q8_k(blocks: np.ndarray, out: np.ndarray) -> None:
    """x = d · q  (q int8, d float32 per 256 values; the 16 int16 block sums are not needed).
    blocks [n, 292] uint8 -> out [n, 256] float32"""
    np.copyto(out, blocks[:, 4:260].view(np.int8), casting="unsafe")
    _scale(out, blocks[:, :4].view("<f4").reshape(-1))


def tq1_0(blocks: np.ndarray, out: np.ndarray) -> None:
    """x = d · t, t ∈ {−1, 0, 1}: five base-3 digits per byte of qs (bytes 0..31 -> values p·32 + j, bytes
    32..47 -> 160 + p·16 + j), four per byte of qh (-> 240 + p·4 + j).
    blocks [n, 54] uint8 -> out [n, 256] float32"""
    n = blocks.shape[0]
    np.copyto(out[:, :160].reshape(n, 5, 32), np.take(TQ1_DIGITS, blocks[:, :32], axis=0).transpose(0, 2, 1))
    np.copyto(out[:, 160:240].reshape(n, 5, 16), np.take(TQ1_DIGITS, blocks[:, 32:48], axis=0).transpose(0, 2, 1))
    np.copyto(out[:, 240:].reshape(n, 4, 4), np.take(TQ1_DIGITS, blocks[:, 48:52], axis=0)[:, :, :4].transpose(0, 2, 1))
    _scale(out, _f16(blocks, 52))


def tq2_0(blocks: np.ndarray, out: np.ndarray) -> None:
    """x = d · (q − 1), q 2-bit (planes as Q2_K).
    blocks [n, 66] uint8 -> out [n, 256] float32"""
    n = blocks.shape[0]
    _codes_minus(_unpack_codes(blocks[:, :64].view("<u8").reshape(n, 2, 4), _Q2_SHIFT, _LOW2), 1, out)
    _scale(out, _f16(blocks, 64))


def _iq2_group_scales(d: np.ndarray, packed: np.ndarray) -> np.ndarray:
    """db = d · (0.5 + s) · 0.25 for the 4-bit scales s of 8 bytes (low nibble first).  d [n], [n, 8] -> [n, 16]"""
    s = np.stack([packed & 15, packed >> 4], axis=2).reshape(packed.shape[0], 16)
    return d[:, None] * (np.float32(0.5) + s.astype(np.float32)) * np.float32(0.25)


def iq2_xs(blocks: np.ndarray, out: np.ndarray) -> None:
    """x = db · grid[w & 511] · signs(ksigns[w >> 9]) per 8 values (w the 16-bit code word), db per 16 values.
    blocks [n, 74] uint8 -> out [n, 256] float32"""
    n = blocks.shape[0]
    _take(IQ2_XS_SIGNED_GRID, blocks[:, 2:66].view("<u2"), out)
    _scale(out.reshape(n * 16, 16), _iq2_group_scales(_f16(blocks, 0), blocks[:, 66:74]).reshape(-1))


def iq2_s(blocks: np.ndarray, out: np.ndarray) -> None:
    """x = db · grid[qs | 2 bits of qh << 8] · signs(sign byte) per 8 values, db per 16 values; looked up a half
    grid row (4 values) at a time with its sign nibble.
    blocks [n, 82] uint8 -> out [n, 256] float32"""
    n = blocks.shape[0]
    qh = blocks[:, 66:74]
    high = np.stack([(qh >> (2 * k)) & 3 for k in range(4)], axis=2).reshape(n, 32).astype(np.uint16)
    row = (blocks[:, 2:34].astype(np.uint16) | (high << 8)) << 5                      # [n, 32] grid row · 32
    signs = blocks[:, 34:66]
    idx = np.stack([row | (signs & 15), row | 16 | (signs >> 4)], axis=2)             # [n, 32, 2]
    _take(IQ2_S_SIGNED_GRID, idx, out)
    _scale(out.reshape(n * 16, 16), _iq2_group_scales(_f16(blocks, 0), blocks[:, 74:82]).reshape(-1))


def iq3_xxs(blocks: np.ndarray, out: np.ndarray) -> None:
    """x = (d · (0.5 + w>>28) · 0.5) · grid[q] · signs  per 32-value group (w its 32-bit word: four 7-bit ksigns
    indices, one per 8 values); looked up 4 values at a time with their sign nibble.
    blocks [n, 98] uint8 -> out [n, 256] float32"""
    n = blocks.shape[0]
    words = blocks[:, 66:98].view("<u4")                                              # [n, 8]
    db = _f16(blocks, 0)[:, None] * (np.float32(0.5) + (words >> 28).astype(np.float32)) * np.float32(0.5)
    ks = KSIGNS[(words[:, :, None] >> _IQ2_SIGN_SHIFTS) & np.uint32(127)].astype(np.uint16)  # [n, 8, 4]
    nib = np.stack([ks & 15, ks >> 4], axis=3)                                        # [n, 8, 4, 2]
    idx = (blocks[:, 2:66].astype(np.uint16).reshape(n, 8, 4, 2) << 4) | nib
    _take(IQ3_XXS_SIGNED_GRID, idx, out)
    _scale(out.reshape(n * 8, 32), db.reshape(-1))


def iq3_s(blocks: np.ndarray, out: np.ndarray) -> None:
    """x = (d · (1 + 2s)) · grid[qs | bit of qh << 8] · signs  per 32-value group (s 4-bit); looked up 4 values at
    a time with their sign nibble.
    blocks [n, 110] uint8 -> out [n, 256] float32"""
    n = blocks.shape[0]
    sc = np.stack([blocks[:, 106:110] & 15, blocks[:, 106:110] >> 4], axis=2).reshape(n, 8)
    db = _f16(blocks, 0)[:, None] * (1 + 2 * sc).astype(np.float32)
    row = blocks[:, 2:66].astype(np.uint16) | (np.unpackbits(blocks[:, 66:74], axis=1, bitorder="little")
                                               .astype(np.uint16) << 8)
    signs = blocks[:, 74:106]
    nib = np.stack([signs & 15, signs >> 4], axis=2).reshape(n, 64)
    _take(IQ3_S_SIGNED_GRID, (row << 4) | nib, out)
    _scale(out.reshape(n * 8, 32), db.reshape(-1))


def iq1_s(blocks: np.ndarray, out: np.ndarray) -> None:
    """x = (d · (2·(h>>12 & 7) + 1)) · (grid[qs | 3 bits of h << 8] ± 1/8)  per 32-value group, h its 16-bit word
    (bit 15 set: −1/8).
    blocks [n, 50] uint8 -> out [n, 256] float32"""
    n = blocks.shape[0]
    qh = blocks[:, 34:50].view("<u2")                                                 # [n, 8]
    dl = _f16(blocks, 0)[:, None] * (2 * ((qh >> 12) & 7) + 1).astype(np.float32)
    high = (qh[:, :, None] >> np.array([0, 3, 6, 9], dtype=np.uint16)) & 7           # [n, 8, 4]
    idx = blocks[:, 2:34].astype(np.uint16).reshape(n, 8, 4) | (high << 8) | ((qh[:, :, None] >> 15) << 11)
    _take(IQ1_DELTA_GRID, idx, out)
    _scale(out.reshape(n * 8, 32), dl.reshape(-1))


def iq1_m(blocks: np.ndarray, out: np.ndarray) -> None:
    """x = (d · (2s + 1)) · (grid[qs | 3 bits of qh << 8] ± 1/8)  per 16 values (s 3-bit), the sign of 1/8 per 8
    values from bit 3 of that nibble of qh (set: −1/8); d is the f16 assembled from the top nibbles of
    the four 16-bit scale words.
    blocks [n, 56] uint8 -> out [n, 256] float32"""
    n = blocks.shape[0]
    words = blocks[:, 48:56].view("<u2")                                              # [n, 4]
    d_bits = (words[:, 0] >> 12) | ((words[:, 1] >> 12) << 4) | ((words[:, 2] >> 12) << 8) | ((words[:, 3] >> 12) << 12)
    sc = (words[:, :, None] >> np.array([0, 3, 6, 9], dtype=np.uint16)) & 7          # [n, 4, 4]
    dl = F16_VALUES[d_bits][:, None] * (2 * sc.reshape(n, 16) + 1).astype(np.float32)
    qh = blocks[:, 32:48]
    nib = np.stack([qh & 15, qh >> 4], axis=2).reshape(n, 32).astype(np.uint16)
    idx = blocks[:, :32].astype(np.uint16) | ((nib & 7) << 8) | ((nib >> 3) << 11)
    _take(IQ1_DELTA_GRID, idx, out)
    _scale(out.reshape(n * 16, 16), dl.reshape(-1))


def iq4_nl(blocks: np.ndarray, out: np.ndarray) -> None:
    """x = d · kvalues[q]  (q 4-bit, d f16 per 32 values; low nibbles are values 0..15).
    blocks [n, 18] uint8 -> out [n, 32] float32"""
    _nibbles32(blocks[:, 2:], IQ4_PAIRS, out)
    _scale(out, _f16(blocks, 0))


def iq4_xs(blocks: np.ndarray, out: np.ndarray) -> None:
    """x = (d · (s − 32)) · kvalues[q]  per 32-value group, s 6-bit (low nibble from scales_l, 2 bits of the
    16-bit scales_h), 16 code bytes per group laid out as IQ4_NL.
    blocks [n, 136] uint8 -> out [n, 256] float32"""
    n = blocks.shape[0]
    high = (blocks[:, 2:4].view("<u2") >> np.arange(0, 16, 2, dtype=np.uint16)) & 3   # [n, 8]
    low = np.stack([blocks[:, 4:8] & 15, blocks[:, 4:8] >> 4], axis=2).reshape(n, 8)
    dl = _f16(blocks, 0)[:, None] * ((low | (high.astype(np.uint8) << 4)).astype(np.float32) - np.float32(32))
    _nibbles32(blocks[:, 8:].reshape(n * 8, 16), IQ4_PAIRS, out.reshape(n * 8, 32))
    _scale(out.reshape(n * 8, 32), dl.reshape(-1))


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


KERNELS = {Q.F32: f32, Q.F16: f16, Q.BF16: bf16, Q.Q4_0: q4_0, Q.Q4_1: q4_1, Q.Q5_0: q5_0, Q.Q5_1: q5_1,
           Q.Q8_0: q8_0, Q.Q2_K: q2_k, Q.Q3_K: q3_k, Q.Q4_K: q4_k, Q.Q5_K: q5_k, Q.Q6_K: q6_k, Q.Q8_K: q8_k,
           Q.IQ1_S: iq1_s, Q.IQ1_M: iq1_m, Q.IQ2_XXS: iq2_xxs, Q.IQ2_XS: iq2_xs, Q.IQ2_S: iq2_s,
           Q.IQ3_XXS: iq3_xxs, Q.IQ3_S: iq3_s, Q.IQ4_NL: iq4_nl, Q.IQ4_XS: iq4_xs, Q.TQ1_0: tq1_0, Q.TQ2_0: tq2_0,
           Q.MXFP4: mxfp4}


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
