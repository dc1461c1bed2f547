"""The full-depth bench's measurement of one child process and its descendants, its Amdahl fit and report
comparison, and the engines' whole-model timing on the tiny model (parity/bench/full_depth.py, engine_speed.py; the
bench itself is not run here: hours at full depth)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import FrozenInstanceError, fields
from pathlib import Path

import pytest
from requires import require

from parity.bench.full_depth import amdahl, descendants, run_measured, same_report
from parity.bench.full_depth_report import SpeedFound, StepRow
from parity.gguf.weights import Weights

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


# a child that starts a grandchild holding 256 MiB (it writes its pid to PIDFILE), then waits for it: the tree's
# memory, not the child's own
TREE = ("import subprocess, sys; subprocess.run([sys.executable, '-c', "
        "'import os, time; open(\"PIDFILE\", \"w\").write(str(os.getpid())); b = bytearray(256 << 20); "
        "time.sleep(SLEEP)'])")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_memory_is_the_process_trees(tmp_path):
    pidfile = tmp_path / "grandchild.pid"
    tree = TREE.replace("PIDFILE", str(pidfile))
    row = run_measured([sys.executable, "-c", tree.replace("SLEEP", "1.5")], tmp_path / "t.log",
                       anon_limit=4 << 30, timeout_s=60)
    assert row.exit == 0 and row.peak_anon >= 256 << 20
    # over the limit the whole tree is killed, the grandchild too, long before its sleep would end
    row = run_measured([sys.executable, "-c", tree.replace("SLEEP", "60")], tmp_path / "u.log",
                       anon_limit=128 << 20, timeout_s=60)
    assert row.killed.startswith("killed: anonymous RSS") and row.wall_s < 20
    grandchild = int(pidfile.read_text())
    for _ in range(50):   # SIGKILL is delivered asynchronously
        if not _alive(grandchild):
            break
        time.sleep(0.1)
    assert not _alive(grandchild)


def test_descendants_are_the_tree_below_a_process():
    child = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; subprocess.run([sys.executable, "
                              "'-c', 'import time; time.sleep(30)'])"], start_new_session=True)
    try:
        for _ in range(50):
            tree = descendants(child.pid)
            if len(tree) == 2:
                break
            time.sleep(0.1)
        assert tree[0] == child.pid and len(tree) == 2 and os.getpid() not in tree
    finally:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()


def test_amdahl_recovers_the_law_it_fits():
    # T(N) = 100 + 900 / N: 1000 s on one worker, 550 s on two
    a, b = amdahl([(1, 1000.0), (2, 550.0)])
    assert a == pytest.approx(100.0, rel=1e-12) and b == pytest.approx(900.0, rel=1e-12)
    a, b = amdahl([(1, 1000.0), (2, 550.0), (4, 325.0)])
    assert (a, b) == (pytest.approx(100.0, rel=1e-12), pytest.approx(900.0, rel=1e-12))


def test_same_report_ignores_only_wall_clock_seconds(tmp_path):
    doc = {"verdict": "DEFECT", "seconds": 1615.1, "envelope": {"source": "cache", "seconds": 0.016},
           "culprit": {"layer": 30}}
    serial, other = tmp_path / "serial.out", tmp_path / "other.out"
    serial.write_text(json.dumps(doc))
    other.write_text(json.dumps({**doc, "seconds": 900.5, "envelope": {"source": "cache", "seconds": 0.2}}))
    assert same_report(other, serial) is True
    other.write_text(json.dumps({**doc, "seconds": 900.5, "culprit": {"layer": 29}}))
    assert same_report(other, serial) is False
    other.write_text("Traceback ...")
    assert same_report(other, serial) is None


@pytest.mark.parametrize(("engine", "thread_arg"),
                         [("torch", "threads"), ("reference", "threads"), ("llamacpp", "lcp_threads")])
def test_engine_speed_times_the_whole_model(engine, thread_arg, tiny_f32, tmp_path):
    if engine == "llamacpp":
        require("llama_cpp")
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("5,9,13,17,21,25,29,33")
    out = subprocess.run([sys.executable, "-m", "parity.bench.engine_speed", engine, str(tiny_f32), str(prompt),
                          "--decode", "2", "--reps", "2", "--threads", "1", "--thread-arg", thread_arg],
                         capture_output=True, text=True, check=True, timeout=300)
    speed = SpeedFound.from_dict(json.loads(out.stdout.strip().splitlines()[-1]))
    assert (speed.engine, speed.prompt, speed.decode_steps, speed.reps, speed.threads) == (engine, 8, 2, 2, 1)
    assert 0 < speed.decode_s < speed.prefill_s + speed.load_s and speed.prefill_cpu_s > 0
    if engine == "llamacpp":   # one graph for the whole model: no per-layer times
        assert speed.prefill_layer_s is None and speed.decode_layer_s is None
    else:                       # the tiny model's layers, each timed; together at most the whole forward
        layers = Weights(str(tiny_f32)).config.n_layers
        assert len(speed.prefill_layer_s) == len(speed.decode_layer_s) == layers
        assert min(speed.prefill_layer_s) > 0 and sum(speed.prefill_layer_s) < speed.prefill_s


def test_only_llamacpp_runs_plain_and_a_plain_context_only_feeds(tiny_f32):
    require("llama_cpp")
    import numpy as np

    from parity.contract.engine import PlainDecode, RunOptions, load_engine
    from parity.contract.errors import ParityError

    off = RunOptions(fp8_kv=False, fp4_indexer=False)
    assert not isinstance(load_engine("torch", str(tiny_f32), off), PlainDecode)
    engine = load_engine("llamacpp", str(tiny_f32), off)
    assert isinstance(engine, PlainDecode)
    plain = engine.new_plain()
    engine.plain_decode(plain, np.array([5, 9, 13]), 0)
    engine.plain_decode(plain, np.array([17]), 3)
    with pytest.raises(ParityError, match="starts at position 9, the context expects 4"):
        engine.plain_decode(plain, np.array([21]), 9)
    with pytest.raises(ParityError, match=r"without the eval callback \(feed\(\) only\)"):
        plain.decode(np.array([21]), 4)
