"""Keep freed memory in the process instead of returning it to the kernel (glibc malloc tuning; speed only).

The reference allocates a fresh float32 array for every dequantized matrix (a routed expert is 32 MiB). glibc
serves blocks above its mmap threshold (at most 32 MiB) with a fresh `mmap` and gives them back with `munmap` on
free, so every such array costs its page faults again, and two worker threads faulting at once contend for the
process's memory map. With mmap for allocations off and the heap never trimmed, a freed array's pages are reused
by the next one. Measured on one real V4-Flash layer (docs/reference.md, "Memory"): 24-token prefill 3.40 -> 2.34 s
and decode 0.59 -> 0.33 s with one layer's cache share; peak anonymous memory 0.40 -> 0.50 GiB.
"""

from __future__ import annotations

import ctypes
import functools

M_TRIM_THRESHOLD = -1   # glibc <malloc.h>: heap top kept below this many free bytes
M_MMAP_MAX = -4         # glibc <malloc.h>: most blocks served by mmap at once (0: none)
NEVER_TRIM = 2**31 - 1  # mallopt takes an int


@functools.cache
def keep_freed_memory() -> bool:
    """Switch glibc malloc to reusing freed memory (once per process); False where the C library is not glibc."""
    libc = ctypes.CDLL(None)  # the symbols this process already has, its C library's among them
    if not hasattr(libc, "mallopt") or not hasattr(libc, "gnu_get_libc_version"):
        return False
    return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, NEVER_TRIM))
