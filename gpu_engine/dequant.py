"""Torch dequantizers for every GGUF weight type gguf-py reads, bit-exact with `gguf.quants`.

Types: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K, IQ1_S, IQ1_M, IQ2_XXS,
IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ4_NL, IQ4_XS, TQ1_0, TQ2_0, MXFP4 (Q8_K has no gguf-py dequantizer: x = d·q with
its float32 d, as ggml's `dequantize_row_q8_K`).

Every function writes the float32 values of raw block bytes (a uint8 tensor [..., nbytes], any device) into a
flat output [n_elems] (on the CPU in pieces of CHUNK_VALUES, so temporaries stay small and are reused; a caller
may pass reused scratch memory as the output, which avoids page-faulting a fresh 32 MiB array per expert).
The float operations are the ones ggml/gguf-py use, in the same order, so the results match
`gguf.quants.dequantize` bit for bit (a product with an exact ±1 sign, or an exact small-integer sum, may be formed
first: that changes no bit). Lookup tables that are data (the IQ grids, sign tables, IQ4 / MXFP4 values) are taken
from gguf-py at import time, never retyped.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from gguf import quants
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as Q

from parity.contract.errors import TensorError

QK_K = 256
CHUNK_VALUES = 1 << 19  # CPU: values per piece (2 MiB of float32): temporaries stay in cache, few op dispatches
quants.IQ2_XXS.init_grid()
_IQ2XXS_GRID = np.asarray(quants.IQ2_XXS.grid, dtype=np.float32).reshape(256, 8)
_KSIGNS = np.frombuffer(quants.IQ2_XXS.ksigns, dtype=np.uint8)
# sign table expanded once: row i = the 8 factors (+1 / -1) that ksigns[i]'s bits select
_IQ2XXS_SIGNS = np.where((_KSIGNS[:, None] >> np.arange(8)) & 1, np.float32(-1), np.float32(1)).astype(np.float32)
# signed grid: row g * 128 + k = grid[g] * signs[k] (exact: a product with +-1), one gather per 8 values
_IQ2XXS_SIGNED = np.ascontiguousarray((_IQ2XXS_GRID[:, None, :] * _IQ2XXS_SIGNS[None, :, :]).reshape(32768, 8))
# the signed grid holds small integers (+-8, 25, 43): as int8 one row is 8 bytes, gathered as one int64 (256 KiB table)
IQ2XXS_SIGNED_I8 = _IQ2XXS_SIGNED.astype(np.int8)
if not np.array_equal(IQ2XXS_SIGNED_I8.astype(np.float32), _IQ2XXS_SIGNED):
    raise TensorError("IQ2_XXS grid from gguf-py is not int8-representable; the packed table would be inexact")
MXFP4_VALUES = np.array(quants.MXFP4.kvalues, dtype=np.float32)


def _iq_grid(cls: type) -> np.ndarray:
    """gguf-py's decoded grid of an IQ type.  -> [rows, values per row] float32"""
    cls.init_grid()
    return np.asarray(cls.grid, dtype=np.float32).reshape(cls.grid_shape)


def _signs(bits: np.ndarray, width: int) -> np.ndarray:
    """Row k: +1 / -1 per bit 0 .. width-1 of bits[k] (set -> -1).  [K] -> [K, width] float32"""
    neg = (bits[:, None].astype(np.int64) >> np.arange(width)) & 1
    return np.where(neg == 1, np.float32(-1), np.float32(1)).astype(np.float32)


def _quarter_signed(grid: np.ndarray) -> np.ndarray:
    """Row r * 16 + s = row r of a 4-wide grid times the signs of nibble s.  [R, 4] -> [R * 16, 4] float32"""
    return np.ascontiguousarray((grid[:, None, :] * _signs(np.arange(16), 4)[None]).reshape(-1, 4))


def _iq_tables() -> dict[str, np.ndarray]:
    """The IQ / TQ lookup tables (float32; products with +-1 and sums with +-1/8 are exact)."""
    words = np.arange(1 << 16)
    iq1 = _iq_grid(quants.IQ1_S)
    delta = np.float32(quants.IQ1_S.delta)
    digits = ((np.arange(256)[:, None] * np.array([1, 3, 9, 27, 81])) & 255) * 3 >> 8
    return {
        # IQ2_XS: row w = grid[w & 511] * signs(ksigns[w >> 9]), w the raw 16-bit code word
        "iq2_xs": np.ascontiguousarray(_iq_grid(quants.IQ2_XS)[words & 511] * _signs(_KSIGNS[words >> 9], 8)),
        # IQ2_S: row (g * 2 + half) * 16 + nibble = half of grid row g times the nibble's signs
        "iq2_s": _quarter_signed(_iq_grid(quants.IQ2_S).reshape(-1, 4)),
        "iq3_xxs": _quarter_signed(_iq_grid(quants.IQ3_XXS)),            # row g * 16 + nibble
        "iq3_s": _quarter_signed(_iq_grid(quants.IQ3_S)),                # row g * 16 + nibble
        "iq1": np.ascontiguousarray(np.concatenate([iq1 + delta, iq1 + -delta])),  # row neg * 2048 + g
        "iq4": np.array(quants.IQ4_NL.kvalues, dtype=np.float32),
        "tq1": (digits - 1).astype(np.float32),                          # [256, 5] base-3 digits minus 1
        "ksigns": _KSIGNS.astype(np.int32),
    }


IQ_TABLES = _iq_tables()
_TABLES: dict[tuple[str, torch.device], torch.Tensor] = {}


def _table(name: str, device: torch.device) -> torch.Tensor:
    key = (name, device)
    if key not in _TABLES:
        src = {"signed_grid_i8": IQ2XXS_SIGNED_I8.view(np.int64).reshape(-1), "mxfp4": MXFP4_VALUES, **IQ_TABLES}[name]
        _TABLES[key] = torch.from_numpy(src).to(device)
    return _TABLES[key]


def _blocks(raw: torch.Tensor, qtype: Q) -> torch.Tensor:
    """[..., nbytes] -> [n_blocks, type_size] (`dequantize` has checked dtype and whole blocks)."""
    return raw.reshape(-1, GGML_QUANT_SIZES[qtype][1])


def _packed(b: torch.Tensor) -> torch.Tensor:
    """A fresh contiguous copy of a byte slice (aligned storage, so it can be viewed as wider types; a one-block
    slice is already contiguous but may start at an odd offset)."""
    return b.clone(memory_format=torch.contiguous_format)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Two bytes (little-endian) per value -> float32 (exact)."""
    return _packed(b).view(torch.float16).to(torch.float32)


def _chunks(b: torch.Tensor, out: torch.Tensor, block_values: int):
    """Yield (blocks, out rows) pieces of about CHUNK_VALUES values on the CPU (one piece on other devices).
    b [n, size], out [n * block_values] -> iterator of ([m, size], [m, block_values])."""
    n = b.shape[0]
    rows = out.view(n, block_values)
    step = max(1, CHUNK_VALUES // block_values) if b.device.type == "cpu" else max(n, 1)
    for s in range(0, n, step):
        yield b[s : s + step], rows[s : s + step]


def dequant_f32(raw: torch.Tensor, out: torch.Tensor) -> None:
    """x = bytes as float32.  [..., 4n] -> [..., n]"""
    out.copy_(raw.contiguous().view(torch.float32).reshape(-1))


def dequant_f16(raw: torch.Tensor, out: torch.Tensor) -> None:
    """x = float32(f16).  [..., 2n] -> [..., n]"""
    out.copy_(raw.contiguous().view(torch.float16).reshape(-1))


def dequant_bf16(raw: torch.Tensor, out: torch.Tensor) -> None:
    """x = bits << 16 read as float32.  [..., 2n] -> [..., n]"""
    bits = out.view(torch.int32)
    bits.copy_(raw.contiguous().view(torch.int16).reshape(-1))  # sign-extended; the shift drops the high half
    bits.bitwise_left_shift_(16)


def dequant_q8_0(raw: torch.Tensor, out: torch.Tensor) -> None:
    """x = q * d per 32-block (d f16, q int8).  [..., 34k] -> [..., 32k]"""
    for b, o in _chunks(_blocks(raw, Q.Q8_0), out, 32):
        o.copy_(b[:, 2:].view(torch.int8))
        o.mul_(_f16(b[:, :2]))


def dequant_q2_k(raw: torch.Tensor, out: torch.Tensor) -> None:
    """x = (d*(s&15))*q - dmin*(s>>4) per 16-element sub-block, q 2-bit.  [..., 84k] -> [..., 256k]
    Codes unpacked four bytes at a time: plane j of a 32-bit word is (word >> 2j) & 0x03030303 (byte-wise)."""
    for b, o in _chunks(_blocks(raw, Q.Q2_K), out, QK_K):
        m = b.shape[0]
        scales = b[:, :16]
        words = _packed(b[:, 16:80]).view(torch.int32).view(m, 2, 8)
        planes = torch.stack([(words >> (2 * j)) & 0x03030303 for j in range(4)], dim=2)   # [m, 2, 4, 8]
        o = o.view(m, 16, 16)
        o.copy_(planes.view(torch.uint8).view(m, 16, 16))
        o.mul_((_f16(b[:, 80:82]) * (scales & 0xF)).unsqueeze(-1))
        o.sub_((_f16(b[:, 82:84]) * (scales >> 4)).unsqueeze(-1))


def _k4_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack ggml's 12-byte K_SCALE layout into 8 six-bit scales and 8 six-bit mins per block."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def dequant_q4_k(raw: torch.Tensor, out: torch.Tensor) -> None:
    """x = (d*sc_j)*q - dmin*m_j per 32-element sub-block j, q 4-bit.  [..., 144k] -> [..., 256k]"""
    shift = torch.tensor([0, 4], dtype=torch.uint8, device=raw.device).reshape(1, 1, 2, 1)
    for b, o in _chunks(_blocks(raw, Q.Q4_K), out, QK_K):
        m = b.shape[0]
        sc, mn = _k4_scale_min(b[:, 4:16])
        o = o.view(m, 8, 32)
        o.copy_(((b[:, 16:].reshape(m, 4, 1, 32) >> shift) & 0x0F).view(m, 8, 32))
        o.mul_((_f16(b[:, 0:2]) * sc).unsqueeze(-1))
        o.sub_((_f16(b[:, 2:4]) * mn).unsqueeze(-1))


def dequant_iq2_xxs(raw: torch.Tensor, out: torch.Tensor) -> None:
    """x = (d*(0.5+s)*0.25) * grid[a_i] * sign per 32-group (words a, b; s = b>>28).  [..., 66k] -> [..., 256k]
    One gather from the int8 signed grid (row a_i * 128 + 7-bit sign index, 8 values as one int64) per 8 values,
    an exact int8 -> float32 conversion, then the group scale (grid * sign is exact, so the order does not matter)."""
    table = _table("signed_grid_i8", raw.device)
    shifts = torch.tensor([0, 7, 14, 21], dtype=torch.int32, device=raw.device)
    for b, o in _chunks(_blocks(raw, Q.IQ2_XXS), out, QK_K):
        m = b.shape[0]
        groups = _packed(b[:, 2:])                                      # 8 groups of (a, b) words per block
        hi = groups.view(torch.int32).view(m, 8, 2)[..., 1:]                # b words (bits as int32) [m, 8, 1]
        db = _f16(b[:, :2]) * (0.5 + ((hi[..., 0] >> 28) & 0xF).to(torch.float32)) * 0.25  # [m, 8]
        idx = (groups.view(m, 8, 8)[..., :4].to(torch.int32) << 7) | ((hi >> shifts) & 0x7F)  # [m, 8, 4]
        o.copy_(torch.index_select(table, 0, idx.view(-1)).view(torch.int8).view(m, QK_K))
        o.view(m, 8, 32).mul_(db.unsqueeze(-1))


def _e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """2^(e-128) as float32 (ggml_e8m0_to_fp32_half), exact for every byte e."""
    e = e.to(torch.int32)
    bits = torch.where(e < 2, torch.bitwise_left_shift(torch.full_like(e, 0x00200000), e.clamp(max=1)), (e - 1) << 23)
    return bits.view(torch.float32)


def dequant_mxfp4(raw: torch.Tensor, out: torch.Tensor) -> None:
    """x = 2^(e-128) * kvalue[q] per 32-block (e8m0 e, 4-bit codes; low nibbles first).  [..., 17k] -> [..., 32k]"""
    table = _table("mxfp4", raw.device)
    for b, o in _chunks(_blocks(raw, Q.MXFP4), out, 32):
        qs = b[:, 1:]
        codes = torch.cat([qs & 0x0F, qs >> 4], dim=-1).to(torch.int64)
        torch.mul(_e8m0_half(b[:, :1]), table[codes], out=o)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """4-bit codes of 16-byte groups, low nibbles first.  [..., 16] uint8 -> [..., 32] uint8"""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _bits32(qh: torch.Tensor) -> torch.Tensor:
    """Bit j of each little-endian 32-bit word as element j.  [m, 4] uint8 -> [m, 32] int32 (0 / 1)"""
    word = _packed(qh).view(torch.int32)                                  # [m, 1]
    return (word >> torch.arange(32, dtype=torch.int32, device=qh.device)) & 1


def _planes(b: torch.Tensor, shifts: tuple[int, ...], mask: int) -> torch.Tensor:
    """Bit planes of groups of 32 code bytes, plane after plane: plane p of byte j of group g is element
    (g * planes + p) * 32 + j, (byte >> shift_p) & mask.  [m, 32 * groups] uint8 -> [m, 32 * groups * planes] uint8"""
    m = b.shape[0]
    words = _packed(b).view(torch.int32).view(m, -1, 1, 8)
    wide = mask * 0x01010101
    planes = torch.cat([(words >> s) & wide for s in shifts], dim=2)       # [m, groups, planes, 8]
    return planes.view(torch.uint8).view(m, -1)


def _gather(name: str, idx: torch.Tensor, o: torch.Tensor) -> None:
    """o = table rows idx, in order.  idx [...] integer -> o [idx.numel() * row width] (any shape of that size)"""
    table = _table(name, o.device)
    rows = torch.index_select(table, 0, idx.reshape(-1).to(torch.int64))
    o.copy_(rows.view(o.shape))


def _scale(o: torch.Tensor, scale: torch.Tensor) -> None:
    """o[r, g, :] *= scale[r, g].  o [m, values], scale [m, groups] (values = groups * group size)"""
    o.view(*scale.shape, -1).mul_(scale.unsqueeze(-1))


def _offset(o: torch.Tensor, add: torch.Tensor) -> None:
    """o[r, g, :] += add[r, g].  o [m, values], add [m, groups]"""
    o.view(*add.shape, -1).add_(add.unsqueeze(-1))


def dequant_q4_0(raw: torch.Tensor, out: torch.Tensor) -> None:
    """x = d * (q - 8) per 32-block (q 4-bit, low nibbles first).  [..., 18k] -> [..., 32k]"""
    for b, o in _chunks(_blocks(raw, Q.Q4_0), out, 32):
        o.copy_(_nibbles(b[:, 2:]))
        o.sub_(8)
        _scale(o, _f16(b[:, :2]))


def dequant_q4_1(raw: torch.Tensor, out: torch.Tensor) -> None:
    """x = d * q + m per 32-block (q 4-bit).  [..., 20k] -> [..., 32k]"""
    for b, o in _chunks(_blocks(raw, Q.Q4_1), out, 32):
        o.copy_(_nibbles(b[:, 4:]))
        _scale(o, _f16(b[:, :2]))
        _offset(o, _f16(b[:, 2:4]))


def dequant_q5_0(raw: torch.Tensor, out: torch.Tensor) -> None:
    """x = d * (q - 16) per 32-block (q = nibble | bit j of the 32-bit qh << 4).  [..., 22k] -> [..., 32k]"""
    for b, o in _chunks(_blocks(raw, Q.Q5_0), out, 32):
        o.copy_(_nibbles(b[:, 6:]).to(torch.int32) | (_bits32(b[:, 2:6]) << 4))
        o.sub_(16)
        _scale(o, _f16(b[:, :2]))


def dequant_q5_1(raw: torch.Tensor, out: torch.Tensor) -> None:
    """x = d * q + m per 32-block (q 5-bit as Q5_0).  [..., 24k] -> [..., 32k]"""
    for b, o in _chunks(_blocks(raw, Q.Q5_1), out, 32):
        o.copy_(_nibbles(b[:, 8:]).to(torch.int32) | (_bits32(b[:, 4:8]) << 4))
        _scale(o, _f16(b[:, :2]))
        _offset(o, _f16(b[:, 2:4]))


def dequant_q3_k(raw: torch.Tensor, out: torch.Tensor) -> None:
    """x = (d*(s-32)) * (q - 4*(1-h)) per 16-element sub-block; q 2-bit, h a bit of hmask, s 6-bit (low nibbles of
    bytes 0..7, 2 high bits of bytes 8..11).  [..., 110k] -> [..., 256k]"""
    for b, o in _chunks(_blocks(raw, Q.Q3_K), out, QK_K):
        sc = b[:, 96:108]
        low = torch.cat([sc[:, :8] & 0x0F, sc[:, :8] >> 4], dim=-1)
        high = torch.cat([(sc[:, 8:12] >> (2 * k)) & 3 for k in range(4)], dim=-1)
        dl = _f16(b[:, 108:110]) * ((low | (high << 4)).to(torch.float32) - 32)
        o.copy_(_planes(b[:, 32:96], (0, 2, 4, 6), 3) | (_planes(b[:, :32], tuple(range(8)), 1) << 2))
        o.sub_(4)
        _scale(o, dl)


def dequant_q5_k(raw: torch.Tensor, out: torch.Tensor) -> None:
    """x = (d*sc_j)*q - dmin*m_j per 32-element sub-block j, q 5-bit (nibble | a bit of qh << 4).
    [..., 176k] -> [..., 256k]"""
    for b, o in _chunks(_blocks(raw, Q.Q5_K), out, QK_K):
        sc, mn = _k4_scale_min(b[:, 4:16])
        o.copy_(_planes(b[:, 48:], (0, 4), 0x0F) | (_planes(b[:, 16:48], tuple(range(8)), 1) << 4))
        _scale(o, _f16(b[:, 0:2]) * sc)
        o.view(-1, 8, 32).sub_((_f16(b[:, 2:4]) * mn).unsqueeze(-1))


def dequant_q6_k(raw: torch.Tensor, out: torch.Tensor) -> None:
    """x = (d*s) * (q - 32) per 16-element sub-block, q 6-bit (nibble of ql | 2 bits of qh << 4), s int8.
    [..., 210k] -> [..., 256k]"""
    shift = torch.tensor([0, 4], dtype=torch.uint8, device=raw.device).reshape(1, 1, 2, 1)
    for b, o in _chunks(_blocks(raw, Q.Q6_K), out, QK_K):
        m = b.shape[0]
        low = ((b[:, :128].reshape(m, 2, 1, 64) >> shift) & 0x0F).reshape(m, QK_K)
        o.copy_(low | (_planes(b[:, 128:192], (0, 2, 4, 6), 3) << 4))
        o.sub_(32)
        _scale(o, _f16(b[:, 208:210]) * b[:, 192:208].view(torch.int8))


def dequant_q8_k(raw: torch.Tensor, out: torch.Tensor) -> None:
    """x = d * q per 256-block (q int8, d float32; the int16 block sums are not needed).  [..., 292k] -> [..., 256k]"""
    for b, o in _chunks(_blocks(raw, Q.Q8_K), out, QK_K):
        o.copy_(b[:, 4:260].view(torch.int8))
        o.mul_(_packed(b[:, :4]).view(torch.float32))


def dequant_tq1_0(raw: torch.Tensor, out: torch.Tensor) -> None:
    """x = d * t, t in {-1, 0, 1}: five base-3 digits per byte of qs[0:32] (values p*32 + j), of qs[32:48]
    (160 + p*16 + j), four per byte of qh (240 + p*4 + j).  [..., 54k] -> [..., 256k]"""
    table = _table("tq1", raw.device)
    for b, o in _chunks(_blocks(raw, Q.TQ1_0), out, QK_K):
        m = b.shape[0]
        digits = table[b[:, :52].to(torch.int64)]                          # [m, 52, 5]
        o[:, :160].view(m, 5, 32).copy_(digits[:, :32].transpose(1, 2))
        o[:, 160:240].view(m, 5, 16).copy_(digits[:, 32:48].transpose(1, 2))
        o[:, 240:].view(m, 4, 4).copy_(digits[:, 48:52, :4].transpose(1, 2))
        o.mul_(_f16(b[:, 52:54]))


def dequant_tq2_0(raw: torch.Tensor, out: torch.Tensor) -> None:
    """x = d * (q - 1), q 2-bit (planes as Q2_K).  [..., 66k] -> [..., 256k]"""
    for b, o in _chunks(_blocks(raw, Q.TQ2_0), out, QK_K):
        o.copy_(_planes(b[:, :64], (0, 2, 4, 6), 3))
        o.sub_(1)
        o.mul_(_f16(b[:, 64:66]))


def _iq2_scales(d: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """db = d*(0.5+s)*0.25 for the 4-bit scales of 8 bytes, low nibble first.  d [m, 1], [m, 8] -> [m, 16]"""
    s = torch.stack([packed & 0x0F, packed >> 4], dim=-1).view(packed.shape[0], 16)
    return d * (0.5 + s.to(torch.float32)) * 0.25


def dequant_iq2_xs(raw: torch.Tensor, out: torch.Tensor) -> None:
    """x = db * grid[w & 511] * signs(ksigns[w >> 9]) per 8 values (w 16-bit), db per 16.  [..., 74k] -> [..., 256k]"""
    for b, o in _chunks(_blocks(raw, Q.IQ2_XS), out, QK_K):
        words = _packed(b[:, 2:66]).view(torch.int16).to(torch.int32) & 0xFFFF
        _gather("iq2_xs", words, o)
        _scale(o, _iq2_scales(_f16(b[:, :2]), b[:, 66:74]))


def dequant_iq2_s(raw: torch.Tensor, out: torch.Tensor) -> None:
    """x = db * grid[qs | 2 bits of qh << 8] * signs(sign byte) per 8 values, db per 16; gathered half a grid row
    at a time with its sign nibble.  [..., 82k] -> [..., 256k]"""
    dev = raw.device
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.int32, device=dev)
    for b, o in _chunks(_blocks(raw, Q.IQ2_S), out, QK_K):
        m = b.shape[0]
        high = ((b[:, 66:74].to(torch.int32).unsqueeze(-1) >> shifts) & 3).view(m, 32)
        row = (b[:, 2:34].to(torch.int32) | (high << 8)) << 5
        signs = b[:, 34:66].to(torch.int32)
        _gather("iq2_s", torch.stack([row | (signs & 0x0F), row | 16 | (signs >> 4)], dim=-1), o)
        _scale(o, _iq2_scales(_f16(b[:, :2]), b[:, 74:82]))


def dequant_iq3_xxs(raw: torch.Tensor, out: torch.Tensor) -> None:
    """x = (d*(0.5+w>>28)*0.5) * grid[q] * signs per 32-group (w its 32-bit word of four 7-bit ksigns indices);
    gathered 4 values at a time with their sign nibble.  [..., 98k] -> [..., 256k]"""
    shifts = torch.tensor([0, 7, 14, 21], dtype=torch.int32, device=raw.device)
    ksigns = _table("ksigns", raw.device)
    for b, o in _chunks(_blocks(raw, Q.IQ3_XXS), out, QK_K):
        m = b.shape[0]
        words = _packed(b[:, 66:98]).view(torch.int32)                     # [m, 8]
        db = _f16(b[:, :2]) * (0.5 + ((words >> 28) & 0xF).to(torch.float32)) * 0.5
        ks = ksigns[((words.unsqueeze(-1) >> shifts) & 0x7F).to(torch.int64)]  # [m, 8, 4]
        nib = torch.stack([ks & 0x0F, ks >> 4], dim=-1)                    # [m, 8, 4, 2]
        _gather("iq3_xxs", (b[:, 2:66].to(torch.int32).view(m, 8, 4, 2) << 4) | nib, o)
        _scale(o, db)


def dequant_iq3_s(raw: torch.Tensor, out: torch.Tensor) -> None:
    """x = (d*(1+2s)) * grid[qs | bit of qh << 8] * signs per 32-group (s 4-bit); gathered 4 values at a time with
    their sign nibble.  [..., 110k] -> [..., 256k]"""
    bit = torch.arange(8, dtype=torch.int32, device=raw.device)
    for b, o in _chunks(_blocks(raw, Q.IQ3_S), out, QK_K):
        m = b.shape[0]
        sc = torch.stack([b[:, 106:110] & 0x0F, b[:, 106:110] >> 4], dim=-1).view(m, 8)
        db = _f16(b[:, :2]) * (1 + 2 * sc.to(torch.int32)).to(torch.float32)
        high = ((b[:, 66:74].to(torch.int32).unsqueeze(-1) >> bit) & 1).view(m, 64)
        signs = b[:, 74:106].to(torch.int32)
        nib = torch.stack([signs & 0x0F, signs >> 4], dim=-1).view(m, 64)
        _gather("iq3_s", ((b[:, 2:66].to(torch.int32) | (high << 8)) << 4) | nib, o)
        _scale(o, db)


def dequant_iq1_s(raw: torch.Tensor, out: torch.Tensor) -> None:
    """x = (d*(2*(h>>12 & 7)+1)) * (grid[qs | 3 bits of h << 8] +- 1/8) per 32-group, h its 16-bit word (bit 15 set:
    -1/8).  [..., 50k] -> [..., 256k]"""
    shifts = torch.tensor([0, 3, 6, 9], dtype=torch.int32, device=raw.device)
    for b, o in _chunks(_blocks(raw, Q.IQ1_S), out, QK_K):
        m = b.shape[0]
        qh = _packed(b[:, 34:50]).view(torch.int16).to(torch.int32) & 0xFFFF  # [m, 8]
        dl = _f16(b[:, :2]) * (2 * ((qh >> 12) & 7) + 1).to(torch.float32)
        high = (qh.unsqueeze(-1) >> shifts) & 7                            # [m, 8, 4]
        idx = b[:, 2:34].to(torch.int32).view(m, 8, 4) | (high << 8) | ((qh >> 15) << 11).unsqueeze(-1)
        _gather("iq1", idx, o)
        _scale(o, dl)


def dequant_iq1_m(raw: torch.Tensor, out: torch.Tensor) -> None:
    """x = (d*(2s+1)) * (grid[qs | 3 bits of qh << 8] +- 1/8) per 16 values (s 3-bit), the sign of 1/8 per 8 values
    from bit 3 of that nibble of qh (set: -1/8); d is the f16 made of the top nibbles of the four 16-bit scale words.
    [..., 56k] -> [..., 256k]"""
    shifts = torch.tensor([0, 3, 6, 9], dtype=torch.int32, device=raw.device)
    for b, o in _chunks(_blocks(raw, Q.IQ1_M), out, QK_K):
        m = b.shape[0]
        words = _packed(b[:, 48:56]).view(torch.int16).to(torch.int32) & 0xFFFF  # [m, 4]
        top = words >> 12
        d_bits = top[:, 0] | (top[:, 1] << 4) | (top[:, 2] << 8) | (top[:, 3] << 12)
        d = _f16(torch.stack([d_bits & 0xFF, d_bits >> 8], dim=-1).to(torch.uint8))                 # [m, 1]
        dl = d * (2 * ((words.unsqueeze(-1) >> shifts) & 7).view(m, 16) + 1).to(torch.float32)
        qh = b[:, 32:48].to(torch.int32)
        nib = torch.stack([qh & 0x0F, qh >> 4], dim=-1).view(m, 32)
        _gather("iq1", b[:, :32].to(torch.int32) | ((nib & 7) << 8) | ((nib >> 3) << 11), o)
        _scale(o, dl)


def dequant_iq4_nl(raw: torch.Tensor, out: torch.Tensor) -> None:
    """x = d * kvalues[q] per 32-block (q 4-bit, low nibbles first).  [..., 18k] -> [..., 32k]"""
    for b, o in _chunks(_blocks(raw, Q.IQ4_NL), out, 32):
        _gather("iq4", _nibbles(b[:, 2:]), o)
        _scale(o, _f16(b[:, :2]))


def dequant_iq4_xs(raw: torch.Tensor, out: torch.Tensor) -> None:
    """x = (d*(s-32)) * kvalues[q] per 32-group, s 6-bit (nibble of scales_l | 2 bits of the 16-bit scales_h << 4),
    16 code bytes per group as IQ4_NL.  [..., 136k] -> [..., 256k]"""
    shifts = torch.arange(0, 16, 2, dtype=torch.int32, device=raw.device)
    for b, o in _chunks(_blocks(raw, Q.IQ4_XS), out, QK_K):
        m = b.shape[0]
        high = (_packed(b[:, 2:4]).view(torch.int16).to(torch.int32) >> shifts) & 3   # [m, 8]
        low = torch.stack([b[:, 4:8] & 0x0F, b[:, 4:8] >> 4], dim=-1).view(m, 8).to(torch.int32)
        dl = _f16(b[:, :2]) * ((low | (high << 4)).to(torch.float32) - 32)
        _gather("iq4", _nibbles(b[:, 8:].reshape(m, 8, 16)), o)
        _scale(o, dl)


DEQUANT = {
    Q.F32: dequant_f32, Q.F16: dequant_f16, Q.BF16: dequant_bf16, Q.Q4_0: dequant_q4_0, Q.Q4_1: dequant_q4_1,
    Q.Q5_0: dequant_q5_0, Q.Q5_1: dequant_q5_1, Q.Q8_0: dequant_q8_0, Q.Q2_K: dequant_q2_k, Q.Q3_K: dequant_q3_k,
    Q.Q4_K: dequant_q4_k, Q.Q5_K: dequant_q5_k, Q.Q6_K: dequant_q6_k, Q.Q8_K: dequant_q8_k, Q.IQ1_S: dequant_iq1_s,
    Q.IQ1_M: dequant_iq1_m, Q.IQ2_XXS: dequant_iq2_xxs, Q.IQ2_XS: dequant_iq2_xs, Q.IQ2_S: dequant_iq2_s,
    Q.IQ3_XXS: dequant_iq3_xxs, Q.IQ3_S: dequant_iq3_s, Q.IQ4_NL: dequant_iq4_nl, Q.IQ4_XS: dequant_iq4_xs,
    Q.TQ1_0: dequant_tq1_0, Q.TQ2_0: dequant_tq2_0, Q.MXFP4: dequant_mxfp4,
}


def dequantize(raw: torch.Tensor, qtype: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Dispatch on the ggml type.  uint8 [..., row_bytes] -> float32 [..., row_elems]
    `out`: optional contiguous float32 tensor of the result's size (reused scratch memory), returned reshaped."""
    qtype = Q(qtype)
    fn = DEQUANT.get(qtype)
    if fn is None:
        raise TensorError(f"ggml type {qtype.name} has no torch dequantizer (supported: "
                          f"{', '.join(t.name for t in DEQUANT)})")
    block, size = GGML_QUANT_SIZES[qtype]
    if raw.dtype != torch.uint8:
        raise TensorError(f"{qtype.name}: raw blocks must be uint8, got {raw.dtype}")
    if raw.shape[-1] % size:
        raise TensorError(f"{qtype.name}: {raw.shape[-1]} bytes per row is not a multiple of {size}")
    shape = (*raw.shape[:-1], raw.shape[-1] // size * block)
    n = math.prod(shape)
    if out is None:
        out = torch.empty(n, dtype=torch.float32, device=raw.device)
    elif out.dtype != torch.float32 or not out.is_contiguous() or out.numel() != n or out.device != raw.device:
        raise TensorError(f"{qtype.name}: output buffer must be contiguous float32 with {n} values on {raw.device}")
    fn(raw, out.view(-1))
    return out.view(shape)
