"""GGUF container: a bounded, memory-mapped reader and a deterministic writer.

The reader never trusts a declared count or length: every read is checked against the bytes that
remain, so a corrupt file fails with `GGUFError` instead of hanging or allocating gigabytes.
Layout (spec v4-residual-ffn-gguf §2): magic "GGUF", u32 version, u64 n_tensors, u64 n_kv, KV
entries, tensor infos (name, n_dims, ne[ne0 first], ggml type, offset), padding to
`general.alignment`, data section.
"""

from __future__ import annotations

import array
import io
import itertools
import os
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from parity.contract.errors import GGUFError, quote
from parity.contract.files import atomic_write
from parity.gguf.mapping import file_map

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4
# Python objects per entry cost ~300 bytes: these caps keep a hostile count within the reader's memory bound
# (peak <= 2 x file size + 16 MiB, tests/test_fuzz_gguf.py); real files are far below them.
MAX_KV = 1 << 14
MAX_TENSORS = 1 << 14
# Name lengths are capped before a byte is decoded (a length corrupted to the rest of the file is refused, not
# decoded): the GGUF spec caps keys at 65535 bytes; ggml stores a tensor name in char[GGML_MAX_NAME = 64] with its NUL.
MAX_KEY_BYTES = (1 << 16) - 1
MAX_TENSOR_NAME_BYTES = 63


class VT(IntEnum):
    """GGUF metadata value types."""

    U8 = 0
    I8 = 1
    U16 = 2
    I16 = 3
    U32 = 4
    I32 = 5
    F32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    U64 = 10
    I64 = 11
    F64 = 12


SCALAR_FORMAT = {
    VT.U8: "<B", VT.I8: "<b", VT.U16: "<H", VT.I16: "<h", VT.U32: "<I", VT.I32: "<i",
    VT.F32: "<f", VT.BOOL: "<?", VT.U64: "<Q", VT.I64: "<q", VT.F64: "<d",
}
SCALAR_DTYPE = {
    VT.U8: "<u1", VT.I8: "<i1", VT.U16: "<u2", VT.I16: "<i2", VT.U32: "<u4", VT.I32: "<i4",
    VT.F32: "<f4", VT.BOOL: "<u1", VT.U64: "<u8", VT.I64: "<i8", VT.F64: "<f8",
}
INTEGER_TYPES = frozenset({VT.U8, VT.I8, VT.U16, VT.I16, VT.U32, VT.I32, VT.U64, VT.I64})
FLOAT_TYPES = frozenset({VT.F32, VT.F64})


@dataclass(frozen=True)
class Value:
    """One metadata value with its GGUF type (and element type for arrays)."""

    type: VT
    value: Any
    elem_type: VT | None = None

    def type_name(self) -> str:
        if self.type == VT.ARRAY:
            return f"array[{self.elem_type.name}]"
        return self.type.name


@dataclass(frozen=True)
class TensorInfo:
    """A tensor's entry in the table. `ne` is ggml order (ne0 fastest); `shape` is reversed(ne)."""

    name: str
    ne: tuple[int, ...]
    ggml_type: int
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.ne))

    @property
    def type_name(self) -> str:
        return GGMLQuantizationType(self.ggml_type).name


def tensor_nbytes(ne: tuple[int, ...], ggml_type: int) -> int:
    """Bytes of a tensor of `ne` elements in `ggml_type`; ne0 must be a whole number of blocks."""
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    if ne[0] % block:
        raise GGUFError(f"ne0={ne[0]} is not a multiple of the {GGMLQuantizationType(ggml_type).name} block {block}")
    n = 1
    for d in ne:
        n *= d
    return n // block * size


class _Cursor:
    """Bounds-checked little-endian reads over a byte buffer."""

    def __init__(self, buf: memoryview, path: str) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > len(self.buf):
            raise GGUFError(
                f"{self.path}: truncated or corrupt: {what} needs {n} bytes at offset {self.pos}, "
                f"file has {len(self.buf)}"
            )

    def scalar(self, vt: VT, what: str) -> Any:
        fmt = SCALAR_FORMAT[vt]
        size = struct.calcsize(fmt)
        self.need(size, what)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return v

    def string(self, what: str, max_bytes: int | None = None) -> str:
        """A u64 length then that many UTF-8 bytes; a length over `max_bytes` is refused before decoding."""
        n = self.scalar(VT.U64, f"{what} length")
        if max_bytes is not None and n > max_bytes:
            raise GGUFError(f"{self.path}: {what} at offset {self.pos - 8} declares {n} bytes, at most {max_bytes} "
                            "allowed (a corrupt length)")
        self.need(n, what)
        raw = self.buf[self.pos : self.pos + n]  # decoded from the mapping, no intermediate copy
        self.pos += n
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError as e:
            raise GGUFError(f"{self.path}: {what} is not valid UTF-8 at offset {self.pos - n}") from e

    def value(self, vt_code: int, what: str, depth: int = 0) -> Value:
        try:
            vt = VT(vt_code)
        except ValueError:
            raise GGUFError(f"{self.path}: {what}: unknown value type {vt_code}") from None
        if vt == VT.STRING:
            return Value(vt, self.string(what))
        if vt == VT.ARRAY:
            if depth:
                raise GGUFError(f"{self.path}: {what}: nested arrays are not supported")
            et_code = self.scalar(VT.U32, f"{what} element type")
            count = self.scalar(VT.U64, f"{what} element count")
            try:
                et = VT(et_code)
            except ValueError:
                raise GGUFError(f"{self.path}: {what}: unknown array element type {et_code}") from None
            if et == VT.ARRAY:
                raise GGUFError(f"{self.path}: {what}: nested arrays are not supported")
            if et == VT.STRING:
                return Value(vt, self.strings(count, what), et)
            width = np.dtype(SCALAR_DTYPE[et]).itemsize
            self.need(count * width, f"{what} ({count} x {et.name})")
            arr = np.frombuffer(self.buf, dtype=SCALAR_DTYPE[et], count=count, offset=self.pos)
            self.pos += count * width
            return Value(vt, arr.astype(bool) if et == VT.BOOL else arr, et)  # a read-only view of the mapping
        return Value(vt, self.scalar(vt, what))

    def strings(self, count: int, what: str) -> StringArray:
        """`count` strings as a `StringArray`: one int64 offset per entry (each entry has >= 8 file bytes)."""
        self.need(count * 8, f"{what} ({count} strings)")  # each string has at least its u64 length
        starts = array.array("q")  # 8 bytes per entry, no Python object per string
        buf, pos, size, unpack = self.buf, self.pos, len(self.buf), struct.Struct("<Q").unpack_from
        for i in range(count):
            if pos + 8 > size:
                self.pos = pos
                self.need(8, f"{what}[{i}] length")
            (n,) = unpack(buf, pos)
            pos += 8
            if n > size - pos:
                self.pos = pos
                self.need(n, f"{what}[{i}]")
            if n:
                try:
                    str(buf[pos: pos + n], "utf-8")  # validated now, decoded again when read
                except UnicodeDecodeError:
                    raise GGUFError(f"{self.path}: {what}[{i}] is not valid UTF-8 at offset {pos}") from None
            starts.append(pos)
            pos += n
        self.pos = pos
        return StringArray(buf, np.frombuffer(starts, np.int64) if count else np.zeros(0, np.int64))


class StringArray(Sequence):
    """A GGUF string array kept as offsets into the mapped file; items decode on access (a list-like).

    `starts[i]` is where string i's bytes begin; its u64 length sits in the 8 bytes before."""

    def __init__(self, buf: memoryview, starts: np.ndarray) -> None:
        self._buf, self._starts = buf, starts

    def __len__(self) -> int:
        return len(self._starts)

    def __getitem__(self, i: int | slice) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        start = int(self._starts[i])
        (n,) = struct.unpack_from("<Q", self._buf, start - 8)
        return str(self._buf[start: start + n], "utf-8")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        head = ", ".join(repr(s[:20]) for s in self[:3])
        return f"StringArray({len(self)} strings: [{head}{', ...' if len(self) > 3 else ''}])"


class GGUFFile:
    """A memory-mapped GGUF file: metadata `kv`, tensor table `tensors`, raw bytes via `data(name)`."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = str(path)
        size = Path(self.path).stat().st_size
        if size < 24:
            raise GGUFError(f"{self.path}: truncated: {size} bytes is smaller than a GGUF header")
        self._file_map = file_map(self.path)
        self._map = self._file_map.array
        cur = _Cursor(memoryview(self._map), self.path)
        magic = bytes(self._map[:4])
        if magic != MAGIC:
            raise GGUFError(f"{self.path}: bad magic {magic!r}, expected {MAGIC!r}")
        cur.pos = 4
        self.version = cur.scalar(VT.U32, "version")
        if self.version not in SUPPORTED_VERSIONS:
            raise GGUFError(f"{self.path}: unsupported GGUF version {self.version} (supported: 2, 3)")
        n_tensors = cur.scalar(VT.U64, "tensor count")
        n_kv = cur.scalar(VT.U64, "metadata count")
        # every KV needs >= 8+4 bytes and every tensor info >= 8+4+8+4+8: refuse impossible counts now
        cur.need(n_kv * 12 + n_tensors * 32, f"{n_kv} metadata entries and {n_tensors} tensor infos")
        if n_kv > MAX_KV or n_tensors > MAX_TENSORS:
            raise GGUFError(f"{self.path}: {n_kv} metadata entries / {n_tensors} tensors: more than this reader "
                            f"accepts ({MAX_KV} / {MAX_TENSORS}; a V4 shard has < 100 / < 3000)")
        self.kv: dict[str, Value] = {}
        for i in range(n_kv):
            key = cur.string(f"metadata key #{i}", MAX_KEY_BYTES)
            if key in self.kv:
                raise GGUFError(f"{self.path}: duplicate metadata key {quote(key)}")
            self.kv[key] = cur.value(cur.scalar(VT.U32, f"type of {quote(key)}"), f"metadata {quote(key)}")
        self.alignment = self._alignment()
        infos = []
        for i in range(n_tensors):
            name = cur.string(f"tensor name #{i}", MAX_TENSOR_NAME_BYTES)
            n_dims = cur.scalar(VT.U32, f"n_dims of {quote(name)}")
            if not 1 <= n_dims <= MAX_DIMS:
                raise GGUFError(f"{self.path}: tensor {quote(name)} has n_dims={n_dims} (allowed 1..{MAX_DIMS})")
            ne = tuple(cur.scalar(VT.U64, f"ne of {quote(name)}") for _ in range(n_dims))
            ggml_type = cur.scalar(VT.U32, f"type of {quote(name)}")
            offset = cur.scalar(VT.U64, f"offset of {quote(name)}")
            infos.append((name, ne, ggml_type, offset))
        self.data_start = -(-cur.pos // self.alignment) * self.alignment
        self.tensors: dict[str, TensorInfo] = {}
        for name, ne, ggml_type, offset in infos:
            self.tensors[name] = self._check_tensor(name, ne, ggml_type, offset, size)
        self._check_disjoint()

    def _check_disjoint(self) -> None:
        """Tensor data ranges lie in the data section and do not overlap (two names, one set of bytes)."""
        by_start = sorted(self.tensors.values(), key=lambda t: (t.offset, t.nbytes))
        for prev, t in itertools.pairwise(by_start):
            if t.offset < prev.offset + prev.nbytes:
                a, b = (f"{quote(x.name)} (bytes {x.offset}..{x.offset + x.nbytes})" for x in (prev, t))
                raise GGUFError(f"{self.path}: tensors {a} and {b} overlap")

    def _alignment(self) -> int:
        v = self.kv.get("general.alignment")
        if v is None:
            return DEFAULT_ALIGNMENT
        if v.type not in INTEGER_TYPES or not 1 <= v.value <= 1 << 20 or v.value & (v.value - 1):
            raise GGUFError(f"{self.path}: general.alignment must be a power-of-two integer, got {quote(v.value)}")
        return int(v.value)

    def _check_tensor(self, name: str, ne: tuple, ggml_type: int, offset: int, size: int) -> TensorInfo:
        if name in self.tensors:
            raise GGUFError(f"{self.path}: duplicate tensor {quote(name)}")
        try:
            qtype = GGMLQuantizationType(ggml_type)
        except ValueError:
            raise GGUFError(f"{self.path}: tensor {quote(name)} has unknown ggml type {ggml_type}") from None
        if qtype not in GGML_QUANT_SIZES:
            raise GGUFError(f"{self.path}: tensor {quote(name)} has unsupported ggml type {qtype.name}")
        if any(d < 1 or d > 1 << 40 for d in ne):
            raise GGUFError(f"{self.path}: tensor {quote(name)} has an impossible dimension in ne={ne}")
        if offset % self.alignment:
            raise GGUFError(f"{self.path}: tensor {quote(name)} offset {offset} is not aligned to {self.alignment}")
        try:
            nbytes = tensor_nbytes(ne, ggml_type)
        except GGUFError as e:
            raise GGUFError(f"{self.path}: tensor {quote(name)}: {e}") from None
        start = self.data_start + offset
        if start + nbytes > size:
            raise GGUFError(
                f"{self.path}: tensor {quote(name)} runs past the end of the file "
                f"(bytes {start}..{start + nbytes}, file has {size})"
            )
        return TensorInfo(name, ne, ggml_type, start, nbytes)

    def data(self, name: str) -> np.ndarray:
        """The tensor's raw bytes (uint8 view into the mapping, no copy)."""
        info = self.tensors[name]
        return self._map[info.offset : info.offset + info.nbytes]

    def release(self, raw: np.ndarray) -> None:
        """Drop the pages under `raw`, a view of this file's bytes (`data`, or a slice of it), from the process's
        resident set (`FileMap.release`: read back from the page cache when next used); an array that is not a
        view of this file (a copy) is left alone."""
        start = raw.__array_interface__["data"][0] - self._map.__array_interface__["data"][0]
        if 0 <= start <= self._map.nbytes - raw.nbytes:
            self._file_map.release(start, start + raw.nbytes)

    def header_bytes(self) -> memoryview:
        """Header, metadata and tensor table (everything before the data section)."""
        return memoryview(self._map)[: self.data_start]


# ----------------------------------------------------------------------------------------------
# Writer


def _encode_value(v: Value) -> bytes:
    if v.type == VT.STRING:
        raw = v.value.encode("utf-8")
        return struct.pack("<Q", len(raw)) + raw
    if v.type == VT.ARRAY:
        head = struct.pack("<IQ", int(v.elem_type), len(v.value))
        if v.elem_type == VT.STRING:
            return head + b"".join(_encode_value(Value(VT.STRING, s)) for s in v.value)
        return head + np.asarray(v.value, dtype=SCALAR_DTYPE[v.elem_type]).tobytes()
    return struct.pack(SCALAR_FORMAT[v.type], v.value)


@dataclass(frozen=True)
class TensorData:
    """A tensor to write: ggml-order `ne`, type, and its already-encoded bytes -- or a callable that yields
    them in pieces when the file is written (streaming: a tensor's bytes never all in memory at once)."""

    name: str
    ne: tuple[int, ...]
    ggml_type: int
    raw: bytes | Callable[[], Iterable[bytes | memoryview]]


def write_gguf(path: str | os.PathLike, kv: dict[str, Value], tensors: list[TensorData],
               alignment: int = DEFAULT_ALIGNMENT) -> None:
    """Write a GGUF v3 file with `atomic_write` (mode 0644). Same inputs give identical bytes."""
    too_long = [(k, MAX_KEY_BYTES) for k in kv if len(k.encode()) > MAX_KEY_BYTES] + \
        [(t.name, MAX_TENSOR_NAME_BYTES) for t in tensors if len(t.name.encode()) > MAX_TENSOR_NAME_BYTES]
    if too_long:
        name, cap = too_long[0]
        raise GGUFError(f"writing {quote(name)}: {len(name.encode())} bytes, more than the {cap} a reader accepts")
    parts = [MAGIC, struct.pack("<IQQ", 3, len(tensors), len(kv))]
    for key, val in kv.items():
        parts += [_encode_value(Value(VT.STRING, key)), struct.pack("<I", int(val.type)), _encode_value(val)]
    offset = 0
    for t in tensors:
        expected = tensor_nbytes(t.ne, t.ggml_type)
        if not callable(t.raw) and len(t.raw) != expected:
            raise GGUFError(f"writing {t.name!r}: {len(t.raw)} bytes given, ne={t.ne} needs {expected}")
        parts += [_encode_value(Value(VT.STRING, t.name)), struct.pack("<I", len(t.ne)),
                  struct.pack(f"<{len(t.ne)}Q", *t.ne), struct.pack("<IQ", t.ggml_type, offset)]
        offset += -(-expected // alignment) * alignment
    header = b"".join(parts)
    header += b"\0" * (-len(header) % alignment)

    def write(f: io.BufferedWriter) -> None:
        f.write(header)
        for t in tensors:
            n = 0
            for piece in (t.raw() if callable(t.raw) else (t.raw,)):
                n += memoryview(piece).nbytes
                f.write(piece)
            if n != (expected := tensor_nbytes(t.ne, t.ggml_type)):
                raise GGUFError(f"writing {t.name!r}: {n} bytes given, ne={t.ne} needs {expected}")
            f.write(b"\0" * (-n % alignment))

    atomic_write(path, write)
