"""Reading the uncompressed zips v4parity writes (binary traces, vectors side files), defensively.

`StoredZip(path)` maps the file once; `array(member, field)` returns a member's `.npy` array as a read-only
view of the mapping after checking the local header, the CRC-32 and that the `.npy` header's shape and dtype
account for exactly the member's bytes (so a corrupt count never allocates). Compressed or encrypted members
are refused (v4parity and `numpy.savez` write stored members). Every failure, whatever the zip or numpy
layer raised, is a `TraceError` naming the file and the field.
"""

from __future__ import annotations

import hashlib
import io
import math
import mmap
import struct
import zipfile
import zlib
from pathlib import Path

import numpy as np

from parity.contract.errors import TraceError

ZIP_MAGIC = b"PK\x03\x04"
# what zipfile / numpy raise on a damaged archive or .npy header (zip version bytes: NotImplementedError)
ZIP_ERRORS = (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, OSError, struct.error, NotImplementedError,
              EOFError, KeyError, OverflowError, RuntimeError, SyntaxError)
_NPY_HEADERS = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}


class StoredZip:
    """A memory-mapped zip of stored members."""

    def __init__(self, path: str | Path) -> None:
        self.src = str(path)
        try:
            with open(path, "rb") as f:
                self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                with zipfile.ZipFile(f) as z:
                    infos = z.infolist()
        except ZIP_ERRORS as e:
            raise self.fail("file", f"not a readable zip ({type(e).__name__}: {str(e)[:120]})") from None
        self.members = {info.filename: info for info in infos}

    def fail(self, field: str, msg: str) -> TraceError:
        return TraceError(f"{self.src}: field '{field}': {msg}")

    def sha256(self) -> str:
        """Content id of the whole file (the bytes mapped, whatever was renamed over the path since)."""
        return hashlib.sha256(self.map).hexdigest()

    def npy_names(self) -> list[str]:
        return [n[:-4] for n in self.members if n.endswith(".npy")]

    def raw(self, member: str, field: str) -> memoryview:
        """The stored bytes of `member`, CRC-checked."""
        info = self.members.get(member)
        if info is None:
            raise self.fail(field, f"member {member} is missing")
        if info.compress_type != zipfile.ZIP_STORED or info.flag_bits & 1:
            raise self.fail(field, f"member {member} is compressed or encrypted; write an uncompressed zip")
        at, size = info.header_offset, len(self.map)
        if at + 30 > size or self.map[at: at + 4] != ZIP_MAGIC:
            raise self.fail(field, f"bad local file header for member {member}")
        name_len, extra_len = struct.unpack("<HH", self.map[at + 26: at + 30])
        start = at + 30 + name_len + extra_len
        if start + info.file_size > size:
            raise self.fail(field, f"member {member} runs past the end of the file")
        data = memoryview(self.map)[start: start + info.file_size]
        if zlib.crc32(data) != info.CRC:
            raise self.fail(field, f"bad CRC-32 for member {member}")
        return data

    def text(self, member: str, field: str) -> str:
        try:
            return bytes(self.raw(member, field)).decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(field, f"member {member} is not UTF-8 text") from None

    def array(self, name: str, field: str) -> np.ndarray:
        """Member `<name>.npy` as an array view (no copy)."""
        data = self.raw(f"{name}.npy", field)
        try:
            head = io.BytesIO(data[: 1 << 16])
            version = np.lib.format.read_magic(head)
            if version not in _NPY_HEADERS:
                raise ValueError(f"unsupported .npy format version {version}")
            shape, fortran, dtype = _NPY_HEADERS[version](head)
        except ZIP_ERRORS as e:
            raise self.fail(field, f"bad .npy header ({str(e)[:120]})") from None
        if dtype.hasobject or dtype.itemsize == 0:
            raise self.fail(field, f"dtype {dtype} is not allowed")
        count = math.prod(shape)
        if head.tell() + count * dtype.itemsize != len(data):
            raise self.fail(field, f"{len(data) - head.tell()} data bytes for shape {shape} of {dtype}")
        return np.frombuffer(data, dtype, count, head.tell()).reshape(shape, order="F" if fortran else "C")
