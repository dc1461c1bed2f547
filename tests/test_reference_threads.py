"""The reference's worker threads: sized from affinity and the cgroup quota, and never changing a result."""

from __future__ import annotations

import os

import numpy as np
import pytest

from parity.contract.cpus import cgroup_cpu_limit, parse_quota, usable_cpus
from parity.contract.engine import RunOptions
from parity.contract.errors import ParityError
from parity.tracing.runner import run_sequence
from reference_cpu.engine import ReferenceEngine
from reference_cpu.threads import Workers

PROMPT = np.random.default_rng(17).integers(2, 290, 37)


def _bytes(results) -> list[bytes]:
    out = []
    for r in results:
        out += [r.logits.tobytes(), *(a.tobytes() for a in r.checkpoints.values())]
        for cap in r.captures:
            out += [cap[k].tobytes() for k in sorted(cap)]
        for d in r.diags:
            out += [d.expert_ids.tobytes(), d.expert_weights.tobytes(),
                    b"" if d.index_sel is None else d.index_sel.tobytes()]
    return out


@pytest.mark.parametrize("layout", ["f32", "mxfp4"])
def test_results_are_bit_identical_for_1_2_and_3_threads(layout, tiny_f32, tiny_mxfp4):
    model = str({"f32": tiny_f32, "mxfp4": tiny_mxfp4}[layout])
    runs = {n: _bytes(run_sequence(ReferenceEngine(model, RunOptions(), threads=n), PROMPT, decode_steps=3,
                                   chunk=11, capture=True)) for n in (1, 2, 3)}
    assert runs[1] == runs[2] == runs[3]


def test_the_thread_count_is_also_an_engine_argument(tiny_f32):
    """RunOptions(engine_args=("threads=N",)) (what `trace --engine-arg threads=N` and the bench pass) sets the pool."""
    assert ReferenceEngine(str(tiny_f32), RunOptions(engine_args=("threads=3",))).workers.n == 3
    assert ReferenceEngine(str(tiny_f32), RunOptions(), threads=2).workers.n == 2
    assert ReferenceEngine(str(tiny_f32), RunOptions()).workers.n == usable_cpus()


def test_workers_split_and_order():
    w = Workers(3)
    pieces = w.split(10)
    assert [i for p in pieces for i in p] == list(range(10)) and len(pieces) == 10
    assert Workers(1).split(10) == [range(10)]
    assert w.map(lambda x: x * x, range(7)) == [x * x for x in range(7)]
    with pytest.raises(ParityError, match="threads must be >= 1"):
        Workers(0)


def test_quota_parsing():
    assert parse_quota("max", "100000") is None and parse_quota("-1\n", "100000\n") is None
    assert parse_quota("150000", "100000") == 1.5


def test_cgroup_v2_limit_is_the_smallest_over_ancestors(tmp_path):
    inner = tmp_path / "a" / "b"
    inner.mkdir(parents=True)
    (tmp_path / "a" / "cpu.max").write_text("300000 100000\n")
    (inner / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_limit("0::/a/b\n", tmp_path) == 3.0
    (inner / "cpu.max").write_text("150000 100000\n")
    assert cgroup_cpu_limit("0::/a/b\n", tmp_path) == 1.5
    assert cgroup_cpu_limit("0::/\n", tmp_path) is None


def test_cgroup_v1_cpu_controller(tmp_path):
    d = tmp_path / "cpu,cpuacct" / "job"
    d.mkdir(parents=True)
    (d / "cpu.cfs_quota_us").write_text("250000\n")
    (d / "cpu.cfs_period_us").write_text("100000\n")
    text = "12:memory:/job\n4:cpu,cpuacct:/job\n2:cpuacct:/job\n0::/\n"
    assert cgroup_cpu_limit(text, tmp_path) == 2.5
    (d / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_cpu_limit(text, tmp_path) is None


def test_usable_cpus_is_within_the_affinity_mask():
    n = usable_cpus()
    assert 1 <= n <= len(os.sched_getaffinity(0))
