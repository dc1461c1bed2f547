"""Worker threads of the reference: sized from the CPUs this process may use, never changing a result.

NumPy releases the GIL inside BLAS, dequantization and most ufuncs, so independent work items (routed
experts, attention queries, indexer queries, output groups) run concurrently. Every item is computed by
exactly the arithmetic it would get alone, and results are gathered in item order, so the output is
bit-identical for any thread count (tests/test_reference_threads.py). The default thread count is
`parity.contract.cpus.usable_cpus()` (affinity mask and cgroup quota, not `nproc`).

With workers of its own the reference holds NumPy's OpenBLAS to one thread (`single_threaded_blas`, called by
`Workers` with n > 1): a BLAS pool of one thread per core inside each worker thread oversubscribes the cores, and
OpenBLAS's idle threads spin. Measured on the real 2-layer file, 24-token prefill at load 12-19 on 2 cores:
42.9 s of CPU with OpenBLAS's default 2 threads against 12.7 s with 1 (docs/bench.md "Under load").
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from itertools import pairwise
from pathlib import Path
from typing import TypeVar

from parity.contract.errors import ParityError

T = TypeVar("T")
R = TypeVar("R")


# (set, get) thread-count functions of the OpenBLAS builds NumPy ships or links (scipy-openblas, 64-bit, plain)
OPENBLAS_SYMBOLS = (("scipy_openblas_set_num_threads64_", "scipy_openblas_get_num_threads64_"),
                    ("openblas_set_num_threads64_", "openblas_get_num_threads64_"),
                    ("openblas_set_num_threads", "openblas_get_num_threads"))


def loaded_openblas() -> list[tuple[Callable[[int], None], Callable[[], int]]]:
    """(set, get) of every OpenBLAS library this process has loaded (found in /proc/self/maps; none where that
    cannot be read)."""
    maps = Path("/proc/self/maps")
    try:
        paths = sorted({line.split()[-1] for line in maps.read_text().splitlines()
                        if "openblas" in line.rsplit("/", 1)[-1].lower() and ".so" in line})
    except OSError:
        return []
    found = []
    for path in paths:
        try:
            lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)  # the copy already loaded, never a new one
        except OSError:
            continue
        for set_name, get_name in OPENBLAS_SYMBOLS:
            if hasattr(lib, set_name) and hasattr(lib, get_name):
                found.append((getattr(lib, set_name), getattr(lib, get_name)))
                break
    return found


def single_threaded_blas() -> list[int]:
    """Set every loaded OpenBLAS to one thread (process-wide); returns the thread counts they had (empty where NumPy's
    BLAS is not an OpenBLAS found this way: it then keeps its own setting, e.g. OPENBLAS_NUM_THREADS)."""
    before = []
    for set_threads, get_threads in loaded_openblas():
        before.append(int(get_threads()))
        set_threads(1)
    return before


class Workers:
    """`map` over independent items with n threads (n = 1: in the calling thread); results in item order. With
    n > 1 NumPy's OpenBLAS is held to one thread (`single_threaded_blas`, the module docstring)."""

    def __init__(self, n: int) -> None:
        if n < 1:
            raise ParityError(f"reference engine: threads must be >= 1, got {n}")
        self.n = n
        self.blas_threads_before = single_threaded_blas() if n > 1 else []
        self.pool = ThreadPoolExecutor(n, thread_name_prefix="reference") if n > 1 else None

    def split(self, n: int) -> list[range]:
        """0..n-1 in consecutive pieces, a few per thread (one piece when n = 1 thread)."""
        parts = min(n, 4 * self.n if self.n > 1 else 1)
        bounds = [n * k // parts for k in range(parts + 1)]
        return [range(a, b) for a, b in pairwise(bounds) if b > a]

    def map(self, fn: Callable[[T], R], items: Iterable[T]) -> list[R]:
        items = list(items)
        if self.pool is None or len(items) < 2:
            return [fn(x) for x in items]
        return list(self.pool.map(fn, items))
