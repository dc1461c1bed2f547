"""Torch dequantizers for the GGUF block formats of deepseek4 files, bit-exact with `gguf.quants`.

Every function maps raw block bytes (a uint8 tensor [..., nbytes], any device) to float32
[..., n_elems]; the float operations are the ones ggml/gguf-py use, in the same order, so the
results match `gguf.quants.dequantize` bit for bit. Lookup tables that are data (the IQ2_XXS grid
and sign table) are taken from gguf-py at import time, never retyped.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import quants
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as Q

from parity.errors import TensorError

QK_K = 256
quants.IQ2_XXS.init_grid()
_IQ2XXS_GRID = np.ascontiguousarray(quants.IQ2_XXS.grid.reshape(256, 8).astype(np.float32))
_KSIGNS = np.frombuffer(quants.IQ2_XXS.ksigns, dtype=np.uint8)
# sign table expanded once: row i = the 8 factors (+1 / -1) that ksigns[i]'s bits select
_IQ2XXS_SIGNS = np.where((_KSIGNS[:, None] >> np.arange(8)) & 1, np.float32(-1), np.float32(1)).astype(np.float32)
_MXFP4_VALUES = np.array(quants.MXFP4.kvalues, dtype=np.float32)
_TABLES: dict[tuple[str, torch.device], torch.Tensor] = {}


def _table(name: str, device: torch.device) -> torch.Tensor:
    key = (name, device)
    if key not in _TABLES:
        src = {"grid": _IQ2XXS_GRID, "signs": _IQ2XXS_SIGNS, "mxfp4": _MXFP4_VALUES}[name]
        _TABLES[key] = torch.from_numpy(src).to(device)
    return _TABLES[key]


def _blocks(raw: torch.Tensor, qtype: Q) -> tuple[torch.Tensor, tuple[int, ...]]:
    """[..., nbytes] -> ([n_blocks, type_size], leading shape); the byte count must fill whole blocks."""
    _, size = GGML_QUANT_SIZES[qtype]
    if raw.dtype != torch.uint8:
        raise TensorError(f"{qtype.name}: raw blocks must be uint8, got {raw.dtype}")
    if raw.shape[-1] % size:
        raise TensorError(f"{qtype.name}: {raw.shape[-1]} bytes per row is not a multiple of {size}")
    return raw.reshape(-1, size), tuple(raw.shape[:-1])


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Two bytes (little-endian) per value -> float32 (exact)."""
    return b.contiguous().view(torch.float16).to(torch.float32)


def _u32(b: torch.Tensor) -> torch.Tensor:
    """Four bytes (little-endian) per value -> int64 holding the unsigned 32-bit word."""
    return b.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def dequant_f32(raw: torch.Tensor) -> torch.Tensor:
    """x = bytes as float32.  [..., 4n] -> [..., n]"""
    return raw.contiguous().view(torch.float32).clone()


def dequant_f16(raw: torch.Tensor) -> torch.Tensor:
    """x = float32(f16).  [..., 2n] -> [..., n]"""
    return _f16(raw)


def dequant_bf16(raw: torch.Tensor) -> torch.Tensor:
    """x = bits << 16 read as float32.  [..., 2n] -> [..., n]"""
    bits = raw.contiguous().view(torch.int16).to(torch.int32) << 16
    return bits.view(torch.float32)


def dequant_q8_0(raw: torch.Tensor) -> torch.Tensor:
    """x = q * d per 32-block (d f16, q int8).  [..., 34k] -> [..., 32k]"""
    b, lead = _blocks(raw, Q.Q8_0)
    d = _f16(b[:, :2])
    q = b[:, 2:].contiguous().view(torch.int8).to(torch.float32)
    return (q * d).reshape(*lead, -1)


def dequant_q2_k(raw: torch.Tensor) -> torch.Tensor:
    """x = (d*(s&15))*q - dmin*(s>>4) per 16-element sub-block, q 2-bit.  [..., 84k] -> [..., 256k]"""
    b, lead = _blocks(raw, Q.Q2_K)
    n = b.shape[0]
    scales, qs = b[:, :16], b[:, 16:80]
    d, dmin = _f16(b[:, 80:82]), _f16(b[:, 82:84])
    dl = (d * (scales & 0xF).to(torch.float32)).reshape(n, 16, 1)
    ml = (dmin * (scales >> 4).to(torch.float32)).reshape(n, 16, 1)
    shift = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device).reshape(1, 1, 4, 1)
    q = ((qs.reshape(n, 2, 1, 32) >> shift) & 3).reshape(n, 16, 16).to(torch.float32)
    return (dl * q - ml).reshape(*lead, -1)


def _k4_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack ggml's 12-byte K_SCALE layout into 8 six-bit scales and 8 six-bit mins per block."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def dequant_q4_k(raw: torch.Tensor) -> torch.Tensor:
    """x = (d*sc_j)*q - dmin*m_j per 32-element sub-block j, q 4-bit.  [..., 144k] -> [..., 256k]"""
    b, lead = _blocks(raw, Q.Q4_K)
    n = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k4_scale_min(b[:, 4:16])
    dl = (d * sc.to(torch.float32)).reshape(n, 8, 1)
    ml = (dmin * mn.to(torch.float32)).reshape(n, 8, 1)
    shift = torch.tensor([0, 4], dtype=torch.uint8, device=b.device).reshape(1, 1, 2, 1)
    q = ((b[:, 16:].reshape(n, 4, 1, 32) >> shift) & 0x0F).reshape(n, 8, 32).to(torch.float32)
    return (dl * q - ml).reshape(*lead, -1)


def dequant_iq2_xxs(raw: torch.Tensor) -> torch.Tensor:
    """x = (d*(0.5+s)*0.25) * grid[a_i] * sign per 32-group (words a, b; s = b>>28).  [..., 66k] -> [..., 256k]"""
    b, lead = _blocks(raw, Q.IQ2_XXS)
    n = b.shape[0]
    d = _f16(b[:, :2])
    words = _u32(b[:, 2:]).reshape(n, 8, 2)
    hi = words[..., 1]
    db = (d * (0.5 + (hi >> 28).to(torch.float32)) * 0.25).reshape(n, 8, 1, 1)
    shifts = torch.tensor([0, 7, 14, 21], dtype=torch.int64, device=b.device)
    sign_idx = (hi.unsqueeze(-1) >> shifts) & 0x7F                                   # [n, 8, 4]
    signs = _table("signs", b.device)[sign_idx]                                      # [n, 8, 4, 8]
    grid_idx = b[:, 2:].reshape(n, 8, 8)[..., :4].to(torch.int64)                   # bytes of word a
    grid = _table("grid", b.device)[grid_idx]                                        # [n, 8, 4, 8]
    return (db * grid * signs).reshape(*lead, -1)


def _e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """2^(e-128) as float32 (ggml_e8m0_to_fp32_half), exact for every byte e."""
    e = e.to(torch.int32)
    bits = torch.where(e < 2, torch.bitwise_left_shift(torch.full_like(e, 0x00200000), e.clamp(max=1)), (e - 1) << 23)
    return bits.view(torch.float32)


def dequant_mxfp4(raw: torch.Tensor) -> torch.Tensor:
    """x = 2^(e-128) * kvalue[q] per 32-block (e8m0 e, 4-bit codes; low nibbles first).  [..., 17k] -> [..., 32k]"""
    b, lead = _blocks(raw, Q.MXFP4)
    n = b.shape[0]
    d = _e8m0_half(b[:, :1])
    qs = b[:, 1:]
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=-1).to(torch.int64)
    return (d * _table("mxfp4", b.device)[codes]).reshape(n, 32).reshape(*lead, -1)


DEQUANT = {
    Q.F32: dequant_f32, Q.F16: dequant_f16, Q.BF16: dequant_bf16, Q.Q8_0: dequant_q8_0,
    Q.Q2_K: dequant_q2_k, Q.Q4_K: dequant_q4_k, Q.IQ2_XXS: dequant_iq2_xxs, Q.MXFP4: dequant_mxfp4,
}


def dequantize(raw: torch.Tensor, qtype: int) -> torch.Tensor:
    """Dispatch on the ggml type.  uint8 [..., row_bytes] -> float32 [..., row_elems]"""
    fn = DEQUANT.get(Q(qtype))
    if fn is None:
        raise TensorError(f"ggml type {Q(qtype).name} has no torch dequantizer (supported: "
                          f"{', '.join(t.name for t in DEQUANT)})")
    return fn(raw)
