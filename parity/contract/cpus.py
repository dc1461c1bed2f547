"""How many CPUs this process may use: its affinity mask (`os.sched_getaffinity`), capped by the cgroup CPU quota
(v2 `cpu.max`, v1 `cpu.cfs_quota_us / cpu.cfs_period_us`) of its cgroup and every ancestor — not `nproc`.
Engines size their thread pools with it (the reference's workers, the torch engine's intra-op and expert threads).

`passive_openmp()` asks OpenMP (torch's intra-op threads) to put idle threads to sleep instead of spinning; `parity`
and `gpu_engine` call it when imported, before torch is.
"""

from __future__ import annotations

import math
import os
from pathlib import Path


def parse_quota(quota: str, period: str) -> float | None:
    """CPUs a quota allows: quota/period, None when unlimited ('max' in v2, -1 in v1)."""
    if quota.strip() in ("max", "-1"):
        return None
    return int(quota) / int(period)


def cgroup_dirs(proc_cgroup: str, root: Path) -> list[Path]:
    """The cgroup directories holding this process's CPU limits, innermost first, and every ancestor.

    proc_cgroup: the text of /proc/self/cgroup; root: the cgroup mount (/sys/fs/cgroup).
    v2 lines are '0::/path'; v1 lines naming the cpu controller are 'N:cpu,cpuacct:/path'.
    """
    dirs = []
    for line in proc_cgroup.splitlines():
        _, controllers, path = line.split(":", 2)
        names = controllers.split(",")
        base = root if controllers == "" else root / controllers if "cpu" in names else None
        if base is None:
            continue
        parts = [p for p in path.split("/") if p]
        dirs += [base.joinpath(*parts[:k]) for k in range(len(parts), -1, -1)]
    return dirs


def cgroup_cpu_limit(proc_cgroup: str, root: Path) -> float | None:
    """The smallest CPU quota over the process's cgroups (v2 cpu.max or v1 cfs files), None when unlimited."""
    limits = []
    for d in cgroup_dirs(proc_cgroup, root):
        if (d / "cpu.max").is_file():
            limits.append(parse_quota(*(d / "cpu.max").read_text().split()))
        elif (d / "cpu.cfs_quota_us").is_file():
            limits.append(parse_quota((d / "cpu.cfs_quota_us").read_text(), (d / "cpu.cfs_period_us").read_text()))
    found = [x for x in limits if x is not None]
    return min(found) if found else None


def usable_cpus() -> int:
    """CPUs this process may use: its affinity mask, capped by the cgroup quota rounded up (at least 1)."""
    n = len(os.sched_getaffinity(0))
    proc = Path("/proc/self/cgroup")
    limit = cgroup_cpu_limit(proc.read_text(), Path("/sys/fs/cgroup")) if proc.is_file() else None
    return max(1, min(n, math.ceil(limit))) if limit is not None else n


def passive_openmp() -> str:
    """OMP_WAIT_POLICY=PASSIVE unless the environment names a policy; returns the policy in effect.

    OpenMP (libgomp, torch's intra-op threads) reads it once, when torch is imported, so it acts only in a process
    that calls this first (`import parity` / `import gpu_engine` do; a program that imported torch before keeps
    libgomp's default). With the default, the idle threads of a team spin at every barrier: on the tiny test model at
    load 9-11 on 2 cores an 8-token prefill with 2 intra-op threads took 0.35-1.24 s of CPU against 0.03-0.05 s with
    1 thread or with 2 passive ones; on a real layer the passive policy measured no slower (docs/bench.md, "Under
    load")."""
    return os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
