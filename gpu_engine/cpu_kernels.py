"""The torch engine's CPU kernels (`cpu_kernels.c`), compiled for this machine on first use and called via ctypes.

Two operations over raw GGUF blocks: `dequantize` (bit-identical to gguf.quants) and `matvec`, a product with a few
activation rows that decodes one weight row at a time into a cache-resident buffer instead of materialising the whole
float32 matrix. The C decoders cover every type the torch dequantizers know (`TYPES`, the keys of
`gpu_engine.dequant.DEQUANT`: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K,
IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ4_NL, IQ4_XS, TQ1_0, TQ2_0, MXFP4; Q8_1 has none, gguf-py
cannot decode it); each follows gguf.quants' float operations in its order, e.g. Q4_1 is (d*q) + m and Q3_K
(d*(s-32)) * q. Their lookup tables are the torch dequantizers' own (`gpu_engine.dequant`: the IQ2_XXS int8 signed
grid, the MXFP4 and IQ4 values, `IQ_TABLES`), passed by address, never retyped in C. A type they lack is a
TensorError naming it. The shared library is built with the system C compiler (`$CC`, else `cc`) at `-O3
-march=native -ffp-contract=off` into `$XDG_CACHE_HOME/v4parity` (default `~/.cache/v4parity`), named by a hash of
the source, the flags, the compiler's version and the CPU's feature flags, so a changed source or machine gets its
own build.
ctypes releases the GIL during each call, so the engine's expert threads run the kernels concurrently.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import torch
from gguf import quants
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as Q

from gpu_engine.dequant import IQ2XXS_SIGNED_I8, IQ_TABLES, MXFP4_VALUES
from parity.contract.errors import ParityError, TensorError
from parity.contract.files import atomic_write_bytes

SOURCE = Path(__file__).with_name("cpu_kernels.c")
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-strict-aliasing", "-Wno-psabi", "-shared", "-fPIC")
# what the C decoders handle (`find` in cpu_kernels.c): every type of the torch dequantizers
TYPES = (Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q8_K,
         Q.IQ1_S, Q.IQ1_M, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S, Q.IQ4_NL, Q.IQ4_XS, Q.TQ1_0, Q.TQ2_0,
         Q.MXFP4)
# the tables of cpu_kernels.c's `tables` struct, in its order (each a contiguous array; the C side reads its address)
TABLE_NAMES = ("f16", "iq2_signed", "mxfp4", "e8m0_half", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq1", "iq4", "tq1",
               "ksigns")


class _Tables(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in TABLE_NAMES]


def _lookup_tables() -> dict[str, np.ndarray]:
    """The decoders' tables (`TABLE_NAMES` order), derived from gguf-py (never retyped): every half's float32 value
    (numpy's cast, as gguf.quants), the E8M0 half scales, and the torch dequantizers' own IQ2_XXS signed grid, MXFP4
    values and `IQ_TABLES` (IQ grids with their signs, IQ1 grid +- 1/8, IQ4 values, TQ1 digits, ksigns); the signed
    IQ2 / IQ3 grids and the IQ4 values hold small integers and are passed as int8 (a 4- or 8-value row is one load)."""
    tables = {
        "f16": np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32),
        "iq2_signed": IQ2XXS_SIGNED_I8,
        "mxfp4": MXFP4_VALUES,
        "e8m0_half": quants.MXFP4.e8m0_to_fp32_half(np.arange(256, dtype=np.uint8)).astype(np.float32),
        **IQ_TABLES,
    }
    tables |= {name: _int8(name, tables[name]) for name in ("iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq4")}
    return {name: np.ascontiguousarray(tables[name]) for name in TABLE_NAMES}


def _int8(name: str, table: np.ndarray) -> np.ndarray:
    """A float32 table of small integers as int8 (same shape); a ParityError if one of gguf-py's values is not one."""
    packed = table.astype(np.int8)
    if not np.array_equal(packed.astype(np.float32), table):
        raise ParityError(f"CPU kernels: gguf-py's {name} table holds values that are not int8 integers; the C "
                          f"decoders read it as int8")
    return packed


def _compiler() -> str:
    cc = os.environ.get("CC") or "cc"
    path = shutil.which(cc)
    if path is None:
        raise ParityError(f"torch engine: the CPU kernels need a C compiler and {cc!r} is not on PATH (set CC, or pass "
                          f"--engine-arg cpu_kernels=torch / RunOptions(engine_args=('cpu_kernels=torch',)) for the "
                          f"slower torch-ops path)")
    return path


def _cpu_flags() -> str | None:
    """The CPU feature line of /proc/cpuinfo (part of the build's name: -march=native differs per CPU); None where
    there is none to read."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None
    return next((line for line in lines if line.startswith(("flags", "Features"))), None)


def _build(cc: str) -> Path:
    """Path of the compiled library, building it first when this source / compiler / CPU has no build yet. Where
    the CPU's features cannot be read, a build for this process only (never a cached one another CPU might load)."""
    flags = _cpu_flags()
    if flags is None:
        return _compile(cc, Path(tempfile.mkdtemp(prefix="v4parity-kernels-")) / "cpu_kernels.so")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), *FLAGS, version, flags]).encode()).hexdigest()[:16]
    lib = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "v4parity" / f"cpu_kernels-{key}.so"
    if not lib.exists():
        with tempfile.TemporaryDirectory() as tmp:  # concurrent builders each rename a complete file into place
            atomic_write_bytes(lib, _compile(cc, Path(tmp) / "cpu_kernels.so").read_bytes())
    return lib


def _compile(cc: str, out: Path) -> Path:
    proc = subprocess.run([cc, *FLAGS, "-o", str(out), str(SOURCE)], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise ParityError(f"torch engine: compiling {SOURCE.name} with {cc} failed (exit {proc.returncode}):\n"
                          f"{proc.stderr.strip()[-2000:]}\n(--engine-arg cpu_kernels=torch, "
                          f"RunOptions(engine_args=('cpu_kernels=torch',)), runs without them)")
    return out


class Kernels:
    """The loaded library and its tables (kept alive here: the C side holds only their addresses)."""

    def __init__(self, path: Path) -> None:
        self.lib = ctypes.CDLL(str(path))
        self._arrays = _lookup_tables()
        self._tables = _Tables(*(self._arrays[name].ctypes.data for name in TABLE_NAMES))
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        self.lib.v4p_dequantize.argtypes = [ctypes.POINTER(_Tables), ctypes.c_int, p, i64, p]
        self.lib.v4p_matvec.argtypes = [ctypes.POINTER(_Tables), ctypes.c_int, p, i64, i64, i64, i64, p, i64, p, i64]
        self.lib.v4p_dequantize.restype = self.lib.v4p_matvec.restype = ctypes.c_int

    def dequantize(self, raw: torch.Tensor, qtype: int, out: torch.Tensor) -> None:
        """out[:] = the float32 values of raw's blocks.  raw uint8 contiguous CPU, out float32 contiguous CPU."""
        block, size = _block(qtype)
        _require(raw, torch.uint8, "raw blocks")
        _require(out, torch.float32, "output")
        if raw.numel() % size or out.numel() != raw.numel() // size * block:
            raise TensorError(f"{Q(qtype).name}: {raw.numel()} bytes do not hold the {out.numel()} output values")
        _check(self.lib.v4p_dequantize(self._tables, int(qtype), raw.data_ptr(), out.numel(), out.data_ptr()), qtype)

    def matvec(self, raw: torch.Tensor, qtype: int, x: torch.Tensor, y: torch.Tensor, r0: int, r1: int) -> None:
        """y[:, r0:r1] = x W[r0:r1]ᵀ, W decoded one row at a time.  raw uint8 [rows, row_bytes], x float32 [n, k]
        contiguous, y float32 [n, rows] contiguous (all CPU); shapes are checked (the C side trusts them)."""
        block, size = _block(qtype)
        for t, dtype, what in ((raw, torch.uint8, "raw blocks"), (x, torch.float32, "x"), (y, torch.float32, "y")):
            _require(t, dtype, what)
        (rows, row_bytes), (n, k) = raw.shape, x.shape
        if row_bytes * block != k * size or y.shape != (n, rows) or not 0 <= r0 <= r1 <= rows:
            raise TensorError(f"{Q(qtype).name} matvec: W {tuple(raw.shape)} bytes, x {tuple(x.shape)}, "
                              f"y {tuple(y.shape)}, rows [{r0}, {r1}) do not fit together")
        _check(self.lib.v4p_matvec(self._tables, int(qtype), raw.data_ptr(), row_bytes, r0, r1, k, x.data_ptr(), n,
                                   y.data_ptr(), rows), qtype)


def _block(qtype: int) -> tuple[int, int]:
    """(values, bytes) per block of a type the C decoders handle; a TensorError naming any other type."""
    if qtype not in TYPES:
        supported = ", ".join(t.name for t in TYPES)
        raise TensorError(f"ggml type {Q(qtype).name} has no CPU kernel (supported: {supported})")
    return GGML_QUANT_SIZES[Q(qtype)]


def _require(t: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    if t.dtype != dtype or t.device.type != "cpu" or not t.is_contiguous():
        raise TensorError(f"CPU kernel: {what} must be a contiguous {dtype} CPU tensor, got {t.dtype} on "
                          f"{t.device} (contiguous: {t.is_contiguous()})")


def _check(rc: int, qtype: int) -> None:
    if rc == -2:
        raise MemoryError("CPU kernel: no memory for a row buffer")
    if rc != 0:
        raise ParityError(f"CPU kernel for {Q(qtype).name} returned {rc}")


@functools.cache
def load() -> Kernels:
    """The CPU kernels of this process, built on first use (a ParityError naming the compiler when that fails)."""
    return Kernels(_build(_compiler()))
