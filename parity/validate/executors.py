"""Where the tasks run: in this process, in N worker processes, or as Ray tasks (`parity.contract.workpool`, the
executors `check` and `bisect` share). Each yields the records as they finish (in any order); the engines are
loaded once per worker process (`worker.engine`)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from parity.contract.workpool import LOCAL_RAY_CPUS, THREAD_VARS, WorkPool
from parity.validate.worker import Job, Task, run_task

__all__ = ["LOCAL_RAY_CPUS", "THREAD_VARS", "processes", "ray_tasks", "serial"]


def serial(job: Job, tasks: Sequence[Task]) -> Iterator[dict]:
    for t in tasks:
        yield run_task(job, t)


def processes(job: Job, tasks: Sequence[Task], workers: int) -> Iterator[dict]:
    with WorkPool(workers) as pool:
        yield from pool.unordered(run_task, [(job, t) for t in tasks])


def ray_tasks(job: Job, tasks: Sequence[Task], address: str | None, local_cpus: int) -> Iterator[dict]:
    """Each task a Ray task (one CPU); address None starts a local Ray instance with `local_cpus` CPUs (and
    stops it at the end). The GGUF path must be readable on every node (`WorkPool`)."""
    with WorkPool(local_cpus, "local" if address is None else address) as pool:
        job_ref = pool.share(job)
        yield from pool.unordered(run_task, [(job_ref, t) for t in tasks])
