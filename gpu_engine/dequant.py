"""Torch dequantizers for the GGUF block formats of deepseek4 files, bit-exact with `gguf.quants`.

Every function writes the float32 values of raw block bytes (a uint8 tensor [..., nbytes], any device) into a
flat output [n_elems] (on the CPU in pieces of CHUNK_VALUES, so temporaries stay small and are reused; a caller
may pass reused scratch memory as the output, which avoids page-faulting a fresh 32 MiB array per expert).
The float operations are the ones ggml/gguf-py use, in the same order, so the results match
`gguf.quants.dequantize` bit for bit. Lookup tables that are data (the IQ2_XXS grid and sign table) are taken
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
_TABLES: dict[tuple[str, torch.device], torch.Tensor] = {}


def _table(name: str, device: torch.device) -> torch.Tensor:
    key = (name, device)
    if key not in _TABLES:
        src = {"signed_grid_i8": IQ2XXS_SIGNED_I8.view(np.int64).reshape(-1), "mxfp4": MXFP4_VALUES}[name]
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


DEQUANT = {
    Q.F32: dequant_f32, Q.F16: dequant_f16, Q.BF16: dequant_bf16, Q.Q8_0: dequant_q8_0,
    Q.Q2_K: dequant_q2_k, Q.Q4_K: dequant_q4_k, Q.IQ2_XXS: dequant_iq2_xxs, Q.MXFP4: dequant_mxfp4,
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
