"""One read-only memory mapping per model file and process, and releasing its pages.

Every `GGUFFile` opened on the same file (the same device, inode and size) while another is alive shares that
one's mapping, so a process that opens a model twice (the harness for its config, an engine for its weights, a
second engine beside it) holds its pages once. The mapping keeps a descriptor of the file open (Python's `mmap`
duplicates it), so the inode cannot be reused by another file while the entry lives; a file rewritten in place at
the same size reads the same through the shared mapping as through a fresh one (the mapping is `MAP_SHARED`).

`FileMap.release(start, stop)` drops a byte range's pages from the process's resident set (`MADV_DONTNEED`): they
stay in the OS page cache, and the next read maps them again. A reader that keeps its own decoded copy (the
reference's weight store) releases the raw bytes it decoded, so a model's file is not resident twice: once as
bytes, once as floats.
"""

from __future__ import annotations

import mmap
import os
import weakref

import numpy as np

_OPEN: weakref.WeakValueDictionary[tuple[int, int, int], FileMap] = weakref.WeakValueDictionary()


class FileMap:
    """A whole file mapped read-only: `array` (uint8, one element per byte) and `release`."""

    def __init__(self, fileno: int) -> None:
        self._mmap = mmap.mmap(fileno, 0, access=mmap.ACCESS_READ)
        self.array = np.frombuffer(self._mmap, dtype=np.uint8)

    def release(self, start: int, stop: int) -> None:
        """Drop the pages holding bytes [start, stop) from the resident set (whole pages: a neighbour's bytes on
        the edge pages are read back from the page cache when next used)."""
        if not 0 <= start <= stop <= len(self.array):
            raise ValueError(f"byte range [{start}, {stop}) outside the mapping's {len(self.array)} bytes")
        first = start - start % mmap.PAGESIZE
        if stop > first:
            self._mmap.madvise(mmap.MADV_DONTNEED, first, stop - first)


def file_map(path: str) -> FileMap:
    """The process's mapping of `path`: the live one of the same file if there is one, else a new one."""
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        key = (st.st_dev, st.st_ino, st.st_size)
        found = _OPEN.get(key)
        if found is None:
            found = _OPEN[key] = FileMap(f.fileno())
    return found
