"""Worker threads of the reference: sized from the CPUs this process may use, never changing a result.

NumPy releases the GIL inside BLAS, dequantization and most ufuncs, so independent work items (routed
experts, attention queries, indexer queries, output groups) run concurrently. Every item is computed by
exactly the arithmetic it would get alone, and results are gathered in item order, so the output is
bit-identical for any thread count (tests/test_reference_threads.py). The default thread count is
`parity.contract.cpus.usable_cpus()` (affinity mask and cgroup quota, not `nproc`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from itertools import pairwise
from typing import TypeVar

from parity.contract.errors import ParityError

T = TypeVar("T")
R = TypeVar("R")


class Workers:
    """`map` over independent items with n threads (n = 1: in the calling thread); results in item order."""

    def __init__(self, n: int) -> None:
        if n < 1:
            raise ParityError(f"reference engine: threads must be >= 1, got {n}")
        self.n = n
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
