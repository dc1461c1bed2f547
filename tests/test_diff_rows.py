"""One judged row per checkpoint of a diff (issue 26 point 2): `CheckpointRow` from hand-written position tables
(expected values worked out by hand from the table), and every per-checkpoint view (summary, printers' JSON, gate)
reading the same rows; DiffReport and GateResult frozen."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from parity import api
from parity.compare.differ import LAYER_COLUMNS, DiffReport, Thresholds
from parity.compare.gate import _case, run_gate
from parity.compare.printers import worst_rows
from parity.contract.checkpoints import checkpoint_depth

TRACES = Path(__file__).resolve().parent.parent / "traces"


def _report(rows: list[tuple]) -> DiffReport:
    """A DiffReport from (checkpoint, pos, rel_l2, norm_ratio, finite) rows; drift by the documented rule."""
    th = Thresholds()
    t = pd.DataFrame(rows, columns=["checkpoint", "pos", "rel_l2", "norm_ratio", "finite"])
    t["depth"] = [checkpoint_depth(c, 4) for c in t["checkpoint"]]
    t["layer"], t["method"], t["cosine"] = 0, "fp", 1.0 - t["rel_l2"] ** 2 / 2
    t["sqnr_db"] = -20 * np.log10(t["rel_l2"])
    t["max_abs"], t["stream_ratio_min"], t["stream_ratio_max"] = np.nan, t["norm_ratio"], t["norm_ratio"]
    t["exact"], t["argmax_a"], t["argmax_b"] = False, 0, 0
    t["drift"] = ~t["finite"] | ~(t["rel_l2"] <= th.rel_tol) | ~((t["norm_ratio"] - 1).abs() <= th.norm_tol)
    side = {"engine": "reference", "version": "1", "dtype": "float32", "model": {}, "flags": {}, "n_tokens": 30,
            "n_prompt": 30}
    return DiffReport(side, side, th, [], t, pd.DataFrame(columns=LAYER_COLUMNS), None)


def test_a_row_keeps_each_metrics_own_worst_and_nan_is_the_worst():
    r = _report([("blk.1", 2, 8e-4, 1.0, True), ("blk.1", 13, 1e-5, 1.01, True), ("blk.1", 20, np.nan, 1.0, False)])
    (row,) = r.rows
    assert (row.failing, row.pos, row.finite) == ("non-finite", 20, False)
    assert np.isnan(row.rel_l2) and row.rel_l2_pos == 20 and row.rel_l2_nanmax == 8e-4
    assert (row.norm_ratio, row.norm_ratio_pos, row.norm_dev_nanmax) == (1.01, 13, pytest.approx(0.01))
    assert (row.positions, row.drifting) == (3, 2)   # the NaN position and the RMS one
    assert row.failing_at(1.0, 0.1) == ["non-finite", "rel-L2"]   # NaN is above every tolerance


def test_failing_at_names_the_metrics_over_the_given_tolerances():
    (row,) = _report([("blk.1", 2, 8e-4, 1.0, True), ("blk.1", 13, 1e-5, 1.01, True)]).rows
    assert row.failing == "norm ratio" and row.pos == 13
    assert row.failing_at(1e-3, 2e-2) == []
    assert row.failing_at(1e-4, 1e-3) == ["rel-L2", "norm ratio"]
    case = _case(row, Thresholds(rel_tol=1e-4, norm_tol=2e-2), require_top1=True)
    assert case["problems"] == ["rel-L2 8.000e-04 > 0.0001 (would pass at rel_tol >= 8.000e-04)"]
    assert (case["max_rel_l2"], case["max_norm_dev"]) == (8e-4, pytest.approx(0.01))


def test_summary_and_worst_json_read_the_same_rows():
    r = _report([("blk.0", 0, 1e-7, 1.0, True), ("blk.0", 1, 2e-7, 1.0, True),      # OK
                 ("blk.1", 0, 2e-6, 1.01, True), ("blk.1", 1, 1e-6, 1.0, True),     # NOISE: RMS beyond norm_tol
                 ("blk.2", 0, 3e-4, 1.0, True), ("blk.2", 1, 8e-4, 1.0, True)])     # DRIFT: far outside the floor
    s = r.summary
    assert s["checkpoint"].tolist() == ["blk.0", "blk.1", "blk.2"]
    assert s["worst_pos"].tolist() == [1, 0, 1] and s["rel_l2"].tolist() == [2e-7, 2e-6, 8e-4]
    assert s["norm_ratio"].tolist() == [1.0, 1.01, 1.0]   # at the worst rel-L2 position
    worst = worst_rows(r)
    assert [(w["pos"], w["status"]) for w in worst] == [(1, "ok"), (0, "DRIFT 1/2"), (1, "ok")]


def test_diff_and_gate_agree_on_a_real_drift():
    a, b = api.load_trace(TRACES / "tiny-f32.trace"), api.load_trace(TRACES / "tiny-f32.trace")
    b.ckpt["fp"][30:200] *= 1 + 3e-3   # rel-L2 3e-3 at the rows' checkpoints: above the default rel_tol 1e-3
    gate = run_gate(a, b)
    rows = {row.checkpoint: row for row in gate.report.rows}
    cases = [c for c in gate.cases if c["checkpoint"] in rows]
    assert len(cases) == len(rows) and any(not c["passed"] for c in cases) and any(c["passed"] for c in cases)
    for c in cases:   # the gate at the diff's own thresholds judges as the diff's rows do
        row = rows[c["checkpoint"]]
        assert c["passed"] == (row.failing == "" and not (c["checkpoint"] == "final_norm" and row.top1_flips))
    with pytest.raises(dataclasses.FrozenInstanceError):
        gate.report.first_drift = None
    with pytest.raises(dataclasses.FrozenInstanceError):
        gate.passed = True


def test_rows_of_an_interleaved_unsorted_table_group_by_checkpoint_in_first_appearance_order():
    r = _report([("blk.1", 9, 2e-4, 1.0, True), ("blk.0", 4, 1e-4, 1.0, True), ("blk.1", 3, 2e-4, 1.0, True),
                 ("blk.0", 1, 3e-4, 1.0, True)])
    assert [(x.checkpoint, x.positions, x.rel_l2_pos) for x in r.rows] == [("blk.1", 2, 3), ("blk.0", 2, 1)]
