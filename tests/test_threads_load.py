"""Speed on a busy machine (issue 27 point 6): what the changes for it must keep.

The torch engine's intra-op thread count comes from its engine argument threads=N or from the usable CPUs (not from
an inherited OMP_NUM_THREADS), is re-applied at every layer call, changes no result and shows in the engine's version
(the trace header's engine_version) and in the bench worker's output. The differ's and the trace reader's faster
indexer-selection code gives the answers of the plain definitions.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from requires import require_that
from trace_samples import toy_trace

from gpu_engine.engine import TorchEngine
from parity.bench.measure import engine_threads, torch_args
from parity.compare.differ import _sel_compare
from parity.contract.cpus import usable_cpus
from parity.contract.engine import RunOptions
from parity.contract.errors import ParityError, TraceError
from parity.tracing.records import Trace, make_table
from parity.tracing.runner import run_sequence
from parity.tracing.validate import check_tables

PROMPT = [3, 17, 42, 5, 99, 7, 11, 250]


def _torch(model, threads: int | None = None) -> TorchEngine:
    return TorchEngine(str(model), RunOptions(engine_args=(f"threads={threads}",) if threads else ()))


def _outputs(engine: TorchEngine) -> list[np.ndarray]:
    """Every carrier checkpoint and the logits of an 8-token prefill and 3 decode steps."""
    out = []
    for r in run_sequence(engine, PROMPT, decode_steps=3):
        out += [*r.checkpoints.values(), r.logits]
    return out


def test_torch_threads_default_is_the_usable_cpus_not_omp_num_threads(tiny_f32, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # what CI and the shells here export
    torch.set_num_threads(1)
    engine = _torch(tiny_f32)
    n = usable_cpus()
    assert engine.threads == n and torch.get_num_threads() == n
    assert engine.version.endswith(f", {n} intra-op thread{'s' if n > 1 else ''})")


def test_torch_threads_argument_is_honoured_per_engine_and_changes_no_bit(tiny_realmix):
    one, two = _torch(tiny_realmix, 1), _torch(tiny_realmix, 2)
    assert torch.get_num_threads() == 2 and "2 intra-op threads" in two.version
    assert "1 intra-op thread)" in one.version
    a = _outputs(one)
    assert torch.get_num_threads() == 1  # engine `one` re-applied its own count (torch's is process-wide)
    b = _outputs(two)
    assert torch.get_num_threads() == 2
    assert len(a) == len(b) and all(x.tobytes() == y.tobytes() for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("arg", ["threads=0", "threads=two", "threads=", "threads=-1"])
def test_bad_threads_argument_is_refused(tiny_f32, arg):
    with pytest.raises(ParityError, match=rf"unknown engine argument '{arg}'.*threads=N \(N >= 1\)"):
        TorchEngine(str(tiny_f32), RunOptions(engine_args=(arg,)))


def test_bench_records_the_threads_each_engine_chose(tiny_f32):
    assert torch_args("torch", 3) == ["threads=3"]
    assert torch_args("reference", 3) == [] and torch_args("torch", None) == []
    engine = _torch(tiny_f32, 1)
    assert engine_threads(engine) == {"torch_intra_op": 1, "engine": 1, "expert": engine.expert_threads}

    from reference_cpu.engine import ReferenceEngine

    ref = ReferenceEngine(str(tiny_f32), RunOptions(engine_args=("threads=3",)))
    assert engine_threads(ref)["engine"] == 3


def _lists(row: np.ndarray) -> list[int]:
    return sorted(int(v) for v in row if v >= 0)


def test_sel_compare_gives_the_sorted_list_answers():
    rng = np.random.default_rng(7)
    for _ in range(400):
        n, width = int(rng.integers(1, 7)), int(rng.integers(0, 6))
        x = rng.integers(-3, 6, (n, width))
        y = x.copy()
        for i in range(n):  # some rows permuted (same list), some changed, some widened with -1 padding
            kind = rng.integers(0, 3)
            y[i] = rng.permutation(y[i]) if kind == 1 else rng.integers(-3, 6, width) if kind == 2 else y[i]
        if rng.random() < 0.2:
            y = np.concatenate([y, np.full((n, 1), -1)], axis=1)
        mismatch, dup_x, dup_y = _sel_compare(x, y)
        for i in range(n):
            lx, ly = _lists(x[i]), _lists(y[i])
            assert mismatch[i] == (lx != ly)
            assert dup_x[i] == (len(set(lx)) < len(lx)) and dup_y[i] == (len(set(ly)) < len(ly))


def _with_sel(sel: list[list[int]]) -> Trace:
    t = toy_trace(0)
    cols = {**t.attn.cols, "sel": np.asarray(sel, np.int32)}
    return Trace(t.header, t.ckpt, t.hc, t.moe, make_table("attn", cols, {"S": len(sel[0])}))


def _check(t: Trace) -> None:
    def fail(field: str, msg: str) -> TraceError:
        return TraceError(f"{field}: {msg}")

    check_tables(t.header, {k: getattr(t, k) for k in ("ckpt", "hc", "moe", "attn")}, fail)


def test_trace_reader_sel_rules():
    t = toy_trace(0)  # rows: layer 0 (no selection) x 3 positions, then layer 1 (selection [0, -1, -1]) x 3
    _check(t)
    good = t.attn["sel"].tolist()
    bad = [r.copy() for r in good]
    bad[4][2] = -2
    with pytest.raises(TraceError, match="attn.sel: n_comp must be >= 0 and selections >= -1"):
        _check(_with_sel(bad))
    bad = [r.copy() for r in good]
    bad[1][1] = 0  # a layer-0 row (has_sel false) holding an entry
    with pytest.raises(TraceError, match=r"has_sel false\) must hold only -1"):
        _check(_with_sel(bad))


def test_reference_with_worker_threads_holds_openblas_to_one_thread(tiny_f32):
    from reference_cpu.engine import ReferenceEngine
    from reference_cpu.threads import loaded_openblas

    blas = loaded_openblas()
    require_that(bool(blas), "an OpenBLAS behind NumPy that this process can find (the wheels ship one)")
    for set_threads, _ in blas:
        set_threads(2)
    ReferenceEngine(str(tiny_f32), RunOptions(engine_args=("threads=1",)))
    assert [get() for _, get in blas] == [2] * len(blas)  # one worker thread: BLAS keeps its own setting
    engine = ReferenceEngine(str(tiny_f32), RunOptions(engine_args=("threads=2",)))
    assert [get() for _, get in blas] == [1] * len(blas) and engine.workers.blas_threads_before == [2] * len(blas)


def test_bench_tables_name_the_load_beside_every_timing():
    from test_bench import _trace_diff, _worker, perf_report

    from parity.bench import measure

    ref, tor = _worker("reference", [4], [8.0], [0.8]), _worker("torch", [4], [2.0], [0.2])
    ref["runs"][0]["load"], tor["runs"][0]["load"] = 3.9, 4.1
    ref["tracing"]["load"] = 4.4
    ref["threads"], tor["threads"] = {"torch_intra_op": 2, "engine": 2}, {"torch_intra_op": 2, "engine": 2, "expert": 2}
    report = perf_report(
        machine={"cpu": "Test CPU", "cores": 2, "memory_gb": 24.0, "python": "3", "numpy": "x", "torch": "y",
                 "load_avg_start": [3.5, 0, 0], "cuda": None}, load_end=4.6, device="cpu", wall_s=10.0,
        engines={"reference": ref, "torch": tor}, dequant_load=3.7, dequant_load_end=3.8,
        dequant=[{"type": "F32", "values": 1 << 20, "gguf_mvs": 1.0, "reference_mvs": 1.0, "torch_mvs": 1.0,
                  "reference_speedup": 1.0, "torch_speedup": 1.0, "reference_exact": True, "torch_exact": True}],
        trace_diff=_trace_diff(checkpoints=88, positions=4096, from_npz_s=0.5, load=3.9, cpu_s=0.6))
    rows = {r[0]: r[1:] for r in measure.summary_rows(report)}
    assert rows["model decode estimate: 43 x mean layer decode @ctx 24"][2] == "(load 3.9 / 4.1)"
    assert rows["reference: trace recording / forward (24 tok, every position)"][2] == "+4.00 % (load 4.4)"
    assert measure.scaling_rows(report) == [(24, ["8.000", "0.800", "2.000", "0.200", "load 3.9 / 4.1"])]
    md = measure.render_markdown(report)
    assert "load average at start 3.5, at end 4.6;" in md
    assert "bit-exact vs gguf.quants; load 3.7 at the start, 3.8 at the end)" in md
    assert "Threads: reference torch_intra_op 2, engine 2; torch torch_intra_op 2, engine 2, expert 2." in md


@pytest.mark.parametrize("module", ["parity", "gpu_engine"])
def test_importing_parity_or_the_engine_asks_openmp_for_passive_waiting(module):
    """Idle OpenMP threads spin at every barrier unless OMP_WAIT_POLICY says otherwise (libgomp reads it when torch
    loads): importing parity or gpu_engine sets PASSIVE before torch, and an explicit setting wins."""
    import os
    import subprocess
    import sys

    code = f"import os, sys; import {module}; print(os.environ['OMP_WAIT_POLICY'], 'torch' in sys.modules)"
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["PASSIVE", "False"]
    out = subprocess.run([sys.executable, "-c", code], env={**env, "OMP_WAIT_POLICY": "ACTIVE"}, capture_output=True,
                         text=True, check=True).stdout
    assert out.split()[0] == "ACTIVE"
