"""The full-depth bench's measurement of one child process (parity/bench/full_depth.py; the bench itself is not
run here: hours at full depth)."""

from __future__ import annotations

import sys
from dataclasses import FrozenInstanceError, fields

import pytest

from parity.bench.full_depth import run_measured
from parity.bench.full_depth_report import StepRow

# a child that holds 256 MiB of touched anonymous memory for 1.5 s, then exits 3
HOLD = "import time; b = bytearray(256 << 20); time.sleep(1.5); raise SystemExit(3)"


def test_measures_anonymous_peak_cpu_and_exit(tmp_path):
    row = run_measured([sys.executable, "-c", HOLD], tmp_path / "a.log", anon_limit=4 << 30, timeout_s=60)
    assert row.exit == 3 and row.killed is None
    assert 256 << 20 <= row.peak_anon < 512 << 20  # the bytearray (zero-filled, so touched) + the interpreter
    assert row.peak_rss >= row.peak_anon and row.wall_s >= 1.5 and row.cpu_s > 0
    # a frozen record whose fields are the first keys of the step's row in full_depth.json, in order
    with pytest.raises(FrozenInstanceError):
        row.exit = 0  # type: ignore[misc]
    step = StepRow(**vars(row), what="hold", sizes={}).to_dict()
    assert list(step) == [f.name for f in fields(row)] + ["what", "sizes"] and step["exit"] == 3


def test_kills_over_the_memory_limit_or_the_time_limit(tmp_path):
    row = run_measured([sys.executable, "-c", HOLD], tmp_path / "b.log", anon_limit=128 << 20, timeout_s=60)
    assert row.killed.startswith("killed: anonymous RSS") and row.exit == -9
    row = run_measured([sys.executable, "-c", "import time; time.sleep(30)"], tmp_path / "c.log",
                       anon_limit=4 << 30, timeout_s=0.5)
    assert row.killed.startswith("killed: still running") and row.wall_s < 10
