"""Where the tasks run: in this process, in N worker processes, or as Ray tasks. Each yields the records as
they finish (in any order); the engines are loaded once per worker process (`worker.engine`).

Worker processes are started with `spawn` and one BLAS/OpenMP thread each (unless the environment already sets
OMP_NUM_THREADS / OPENBLAS_NUM_THREADS / MKL_NUM_THREADS), the setting Ray gives its one-CPU tasks, so both
executors compute with the same thread count.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Iterator, Sequence

from parity.contract.errors import ParityError
from parity.validate.worker import Job, Task, run_task

THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
LOCAL_RAY_CPUS = 2


def serial(job: Job, tasks: Sequence[Task]) -> Iterator[dict]:
    for t in tasks:
        yield run_task(job, t)


def _pool_task(args: tuple[Job, Task]) -> dict:
    return run_task(*args)


def processes(job: Job, tasks: Sequence[Task], workers: int) -> Iterator[dict]:
    for var in THREAD_VARS:
        os.environ.setdefault(var, "1")
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        yield from pool.imap_unordered(_pool_task, [(job, t) for t in tasks], chunksize=1)


def ray_tasks(job: Job, tasks: Sequence[Task], address: str | None, local_cpus: int) -> Iterator[dict]:
    """Each task a Ray task (one CPU); address None starts a local Ray instance with `local_cpus` CPUs (and
    stops it at the end). The GGUF path must be readable on every node.

    `ray.init()` without an address does not start a local instance when one can be found: it joins the cluster
    named by RAY_ADDRESS or the one the last `ray start` on this machine recorded (/tmp/ray/ray_current_cluster),
    then refuses `num_cpus` or runs the tasks there. Hence address="local" for --ray local."""
    try:
        import ray
    except ImportError:
        raise ParityError("--ray needs Ray: pip install 'v4parity[ray]'") from None
    started = not ray.is_initialized()
    if started:
        if address is None:  # "local": a new instance, never RAY_ADDRESS or the last `ray start` cluster
            ray.init(address="local", num_cpus=local_cpus, include_dashboard=False, log_to_driver=False)
        else:
            try:
                ray.init(address=address, log_to_driver=False)
            except ConnectionError as e:
                raise ParityError(f"--ray {address}: cannot connect to the Ray cluster ({e}). A cluster started with "
                                  "`ray start` uses token authentication: set RAY_AUTH_MODE=token (the token is "
                                  "read from ~/.ray/auth_token) or pass --ray auto on a node of the cluster") from None
    try:
        remote = ray.remote(num_cpus=1)(run_task)
        job_ref = ray.put(job)
        pending = [remote.remote(job_ref, t) for t in tasks]
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            yield ray.get(done[0])
    finally:
        if started:
            ray.shutdown()
