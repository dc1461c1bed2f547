"""Where independent work units run: in this process, in N worker processes, or as Ray tasks (one home for the
executors `validate` and `check` / `bisect` share).

A unit is a top-level function and its arguments (both picklable); `WorkPool.ordered` yields the results in the
order the units were given (what a report that must not depend on the executor merges), `WorkPool.unordered` as
they finish (what a resumable store appends). The pool is opened once (`with WorkPool(...) as pool:`) and serves
every call until it is closed, so worker processes keep what they cached (engines) between calls.

Worker processes are started with `spawn` and one BLAS/OpenMP thread each (unless the environment already sets
OMP_NUM_THREADS / OPENBLAS_NUM_THREADS / MKL_NUM_THREADS), the setting Ray gives its one-CPU tasks, so both
executors compute with the same thread count.

`ray`: None (no Ray), "local" (a new local instance with `workers` CPUs, stopped at the end; never RAY_ADDRESS or
the cluster the last `ray start` on this machine recorded: `ray.init()` without an address would join those), or
a cluster address ("auto", "host:port", "ray://host:port"; the files the units read must be readable on every
node). A Ray session already initialised in this process is used as it is and left running.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from parity.contract.errors import ParityError

THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
LOCAL_RAY_CPUS = 2


def _call(unit: tuple[Callable[..., Any], tuple]) -> Any:
    fn, args = unit
    return fn(*args)


class WorkPool:
    """Serial (workers 1, no Ray), `workers` spawned processes, or Ray tasks of one CPU each (see the module doc)."""

    def __init__(self, workers: int = 1, ray: str | None = None,
                 warm: tuple[Callable[..., Any], tuple] | None = None) -> None:
        """`warm`: (function, args) each worker process runs when it starts (e.g. importing the engines its
        units will load), while this process goes on; Ray workers start on demand and are not warmed."""
        if workers < 1:
            raise ParityError(f"workers must be >= 1, got {workers}")
        self.workers, self.ray, self.warm = workers, ray, warm
        self._pool: Any = None
        self._ray: Any = None
        self._started_ray = False

    def describe(self) -> str:
        if self.ray is None:
            return "in-process" if self.workers == 1 else f"{self.workers} worker processes"
        return f"Ray ({'local, ' + str(self.workers) + ' CPUs' if self.ray == 'local' else self.ray})"

    @property
    def serial(self) -> bool:
        return self.ray is None and self.workers == 1

    def __enter__(self) -> WorkPool:
        if self.ray is not None:
            self._ray = _start_ray(self.ray, self.workers)
            self._started_ray = self._ray is not None
            if self._ray is None:
                import ray

                self._ray = ray
        elif self.workers > 1:
            for var in THREAD_VARS:
                os.environ.setdefault(var, "1")
            self._pool = multiprocessing.get_context("spawn").Pool(
                self.workers, *(self.warm if self.warm is not None else ()))
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:   # every result was taken or is abandoned: no need to wait for a clean exit
            self._pool.terminate()
            self._pool.join()
            self._pool = None
        if self._started_ray:
            self._ray.shutdown()
            self._started_ray = False
        self._ray = None

    def share(self, obj: Any) -> Any:
        """`obj` as a unit argument that many units share: stored once in Ray's object store (a top-level
        argument Ray resolves before the call), else the object itself."""
        return self._ray.put(obj) if self._ray is not None else obj

    def ordered(self, fn: Callable[..., Any], units: Sequence[tuple]) -> Iterator[Any]:
        """fn(*args) for every args tuple of `units`, yielded in the order of `units`."""
        if self._ray is not None:
            remote = self._ray.remote(num_cpus=1)(fn)
            for ref in [remote.remote(*args) for args in units]:
                yield self._ray.get(ref)
        elif self._pool is not None:
            yield from self._pool.imap(_call, [(fn, args) for args in units], chunksize=1)
        else:
            for args in units:
                yield fn(*args)

    def unordered(self, fn: Callable[..., Any], units: Sequence[tuple]) -> Iterator[Any]:
        """fn(*args) for every args tuple of `units`, yielded as they finish."""
        if self._ray is not None:
            remote = self._ray.remote(num_cpus=1)(fn)
            pending = [remote.remote(*args) for args in units]
            while pending:
                done, pending = self._ray.wait(pending, num_returns=1)
                yield self._ray.get(done[0])
        elif self._pool is not None:
            yield from self._pool.imap_unordered(_call, [(fn, args) for args in units], chunksize=1)
        else:
            for args in units:
                yield fn(*args)


def _start_ray(address: str, local_cpus: int) -> Any:
    """ray.init for `address` ("local": a new instance with `local_cpus` CPUs); the module, or None when a Ray
    session was already initialised in this process (then it is used and not stopped)."""
    try:
        import ray
    except ImportError:
        raise ParityError("--ray needs Ray: pip install 'v4parity[ray]'") from None
    if ray.is_initialized():
        return None
    if address == "local":  # a new instance, never RAY_ADDRESS or the last `ray start` cluster
        ray.init(address="local", num_cpus=local_cpus, include_dashboard=False, log_to_driver=False)
        return ray
    try:
        ray.init(address=address, log_to_driver=False)
    except ConnectionError as e:
        raise ParityError(f"--ray {address}: cannot connect to the Ray cluster ({e}). A cluster started with "
                          "`ray start` uses token authentication: set RAY_AUTH_MODE=token (the token is "
                          "read from ~/.ray/auth_token) or pass --ray auto on a node of the cluster") from None
    return ray
