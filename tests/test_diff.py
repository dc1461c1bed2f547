"""Differ: metric definitions (closed forms), self-diff, first drift on a controlled perturbation,
preflight refusals, full-vector vs fingerprint metrics, plots and exports."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
from fake_engine import FakeEngine

from parity import api
from parity.compare import metrics
from parity.compare.differ import PreflightError
from parity.compare.printers import to_markdown
from parity.contract.errors import ParityError, TraceError
from parity.tracing.export import export_arrays

PROMPT = [0, 5, 7, 9, 11, 13, 15, 17]


# ----------------------------------------------------------------------------------------------
# Metrics

def test_metric_closed_forms():
    a = np.array([[3.0, 4.0]])          # |a| = 5
    b = np.array([[3.0, 4.5]])          # b - a = (0, 0.5)
    assert metrics.rel_l2(a, b)[0] == pytest.approx(0.1)
    assert metrics.nmse(a, b)[0] == pytest.approx(0.01)
    assert metrics.sqnr_db(a, b)[0] == pytest.approx(20.0)
    assert metrics.max_abs(a, b)[0] == 0.5
    assert metrics.cosine(a, b)[0] == pytest.approx((9 + 18) / (5 * math.hypot(3, 4.5)))
    assert metrics.sqnr_from_rel_l2(0.01) == pytest.approx(40.0)
    # equal norms: rel_l2^2 = 2 (1 - cos)
    c = np.array([[4.0, 3.0]])
    assert 1 - metrics.cosine(a, c)[0] == pytest.approx(metrics.rel_l2(a, c)[0] ** 2 / 2)
    assert metrics.cosine_at_rel_l2(metrics.rel_l2(a, c)[0]) == pytest.approx(metrics.cosine(a, c)[0])
    same = metrics.cosine(a, a)
    assert same[0] == 1.0 and metrics.rel_l2(a, a)[0] == 0.0 and math.isinf(metrics.sqnr_db(a, a)[0])


# ----------------------------------------------------------------------------------------------
# Diffs on the fake engine

@pytest.fixture(scope="module")
def runs(tiny_f32):
    def run(perturb=None, full=None, **kw):
        return api.trace(FakeEngine(str(tiny_f32), perturb=perturb), tiny_f32, kw.pop("tokens", PROMPT),
                         positions=kw.pop("positions", "all"), decode=2, full=full, **kw)
    return run


def test_self_diff_is_exact(runs):
    t = runs()
    r = api.diff(t, t)
    assert r and r.exact and r.first_drift is None
    assert (r.table["rel_l2"] == 0).all() and (r.table["cosine"] == 1).all() and (r.table["norm_ratio"] == 1).all()
    assert len(r.table) == len(t.header.checkpoints) * len(t.header.positions)
    assert "bit-exact" in to_markdown(r)


@pytest.mark.parametrize("layer", [0, 2, 5])
def test_first_drift_is_the_perturbed_layer(runs, layer):
    r = api.diff(runs(), runs(perturb={layer: 0.05}))
    assert r.first_drift["checkpoint"] == f"blk.{layer}.attn" and r.first_drift["layer"] == layer
    upstream = r.table[r.table["depth"] < layer + 0.5]
    assert upstream["exact"].all()
    assert r.table[r.table["checkpoint"] == f"blk.{layer}.attn"]["drift"].all()


def test_perturbation_below_threshold_is_not_drift(runs):
    # the fake perturbation adds eps * a unit-variance direction to a carrier of about the same scale: rel-L2 ~ eps
    # (measured: 1.17e-5 at worst, fingerprint estimates), 100x below the 1e-3 threshold; upstream stays exact
    r = api.diff(runs(), runs(perturb={3: 1e-5}))
    assert r.first_drift is None and not r.exact
    assert 5e-6 < r.table["rel_l2"].max() < 2e-5
    assert r.table[r.table["depth"] < 3.5]["exact"].all()
    tight = api.diff(runs(), runs(perturb={3: 1e-5}), rel_tol=1e-7)
    assert tight.first_drift["layer"] == 3


def test_full_vectors_give_exact_metrics_and_fingerprints_estimate_them(runs):
    a, b = runs(full="all"), runs(perturb={1: 0.05}, full="all")
    full = api.diff(a, b)
    fp = api.diff(dataclasses.replace(a, vectors=None), dataclasses.replace(b, vectors=None))
    assert set(full.table["method"]) == {"full"} and set(fp.table["method"]) == {"fp"}
    va, vb = a.vectors["blk.3"], b.vectors["blk.3"]
    row = full.table[full.table["checkpoint"] == "blk.3"]
    np.testing.assert_allclose(row["rel_l2"], np.linalg.norm((vb - va).reshape(len(va), -1), axis=1)
                               / np.linalg.norm(va.reshape(len(va), -1), axis=1), rtol=1e-6)
    np.testing.assert_allclose(row["max_abs"], np.abs(vb - va).reshape(len(va), -1).max(axis=1), rtol=1e-6)
    assert fp.table["max_abs"].isna().all()
    drifting = full.table["rel_l2"] > 0
    ratio = fp.table["rel_l2"][drifting] / full.table["rel_l2"][drifting]
    assert ratio.min() > 0.5 and ratio.max() < 2.0  # 64-dim JL estimate: ~18% relative spread
    assert full.first_drift["checkpoint"] == fp.first_drift["checkpoint"] == "blk.1.attn"


@pytest.mark.parametrize("bad", [0.0, -1e-3, float("nan"), float("inf")])
def test_thresholds_must_be_positive_and_finite(runs, bad):
    t = runs()
    with pytest.raises(ParityError, match="rel_tol must be a positive finite number"):
        api.diff(t, t, rel_tol=bad)
    with pytest.raises(ParityError, match="norm_tol must be a positive finite number"):
        api.diff(t, t, norm_tol=bad)


def test_forced_diff_stops_at_the_first_token_difference(runs):
    a = runs()
    b = runs(tokens=[0, 5, 7, 9, 11, 13, 15, 18])
    r = api.diff(a, b, force=True)
    assert any("position 7" in w for w in r.warnings)
    assert r.table["pos"].max() == 6  # positions from the first differing token on are not comparable
    assert r.first_drift is None


# ----------------------------------------------------------------------------------------------
# Preflight

def test_preflight_refuses_different_tokens(runs):
    with pytest.raises(PreflightError, match="token ids differ at position 3"):
        api.diff(runs(), runs(tokens=[0, 5, 7, 10, 11, 13, 15, 17]))


def test_preflight_refuses_different_models(runs):
    a = runs()
    other = {**a.header.model, "header_sha256": "0" * 32}
    b = dataclasses.replace(a, header=dataclasses.replace(a.header, model=other))
    with pytest.raises(PreflightError, match="model identity differs"):
        api.diff(a, b)
    renamed = dataclasses.replace(a, header=dataclasses.replace(a.header, model={**a.header.model, "file": "x.gguf"}))
    assert api.diff(a, renamed).exact  # the file name is not the model's identity


def test_preflight_refuses_different_checkpoint_sets(runs, tiny_f32, tmp_path):
    a = runs()
    text = api.save_trace(a, tmp_path / "a.trace").read_text()
    lines = [ln.replace(" blk.5.attn", "") if ln.startswith("checkpoints ") else ln
             for ln in text.split("\n") if not ln.startswith("ckpt 6 blk.5.attn ")]
    (tmp_path / "b.trace").write_text("\n".join(lines))
    b = api.load_trace(tmp_path / "b.trace")
    with pytest.raises(PreflightError, match=r"checkpoint sets differ: only in A \['blk.5.attn'\]"):
        api.diff(a, b)
    forced = api.diff(a, b, force=True)
    assert "blk.5.attn" not in set(forced.table["checkpoint"]) and forced.exact and forced.warnings


def test_preflight_refuses_different_positions(runs):
    with pytest.raises(PreflightError, match="traced positions differ"):
        api.diff(runs(), runs(positions="last"))
    assert len(api.diff(runs(), runs(positions="last"), force=True).table["pos"].unique()) == 1


def test_json_and_markdown_reports(runs):
    r = api.diff(runs(), runs(perturb={4: 0.05}))
    d = json.loads(json.dumps(r.to_dict()))
    assert d["first_drift"]["checkpoint"] == "blk.4.attn" and not d["agree"]
    assert len(d["checkpoints"]) == 14 and d["thresholds"]["rel_tol"] == 1e-3
    md = to_markdown(r)
    assert "first drifting checkpoint: blk.4.attn" in md and "| blk.4.attn | fp |" in md


# ----------------------------------------------------------------------------------------------
# Plot and export

def test_plot_file_is_produced(runs, tmp_path):
    import matplotlib

    r = api.diff(runs(), runs(perturb={2: 0.05}))
    assert api.plot(r, tmp_path / "drift.png").stat().st_size > 10_000
    with matplotlib.rc_context({"svg.fonttype": "none"}):  # keep text as text to read the labels back
        svg = api.plot(r, tmp_path / "drift.svg").read_text()
        flat = api.plot(api.diff(runs(), runs()), tmp_path / "flat.svg").read_text()
    assert "first drift: blk.2.attn (rel-L2" in svg and svg.count("first drift: blk.2.attn") >= 2  # title + legend
    assert "all checkpoints agree" in flat and "first drift" not in flat


def test_export_arrays_shapes_and_values(runs, tmp_path, tiny_f32):
    t = runs(full="all")
    path = api.export(t, tmp_path / "out.npz")
    with np.load(path) as z:
        assert z["blk.2"].shape == (10, 4, 256) and z["blk.2.attn"].shape == (10, 4, 256)
        assert z["final_norm"].shape == (10, 256) and z["logits"].shape == (10, 290)
        assert z["positions"].tolist() == list(range(10)) and z["tokens"].tolist() == t.header.tokens
        np.testing.assert_array_equal(z["embed"][3, 0], FakeEngine(str(tiny_f32)).emb[PROMPT[3]])
    with pytest.raises(TraceError, match="--full"):
        export_arrays(runs())


def test_non_finite_statistics_are_drift(runs):
    a = runs()
    b = runs()
    row = b.checkpoint_rows("blk.3")[2]
    b.ckpt.cols["rms"] = b.ckpt["rms"].copy()
    b.ckpt.cols["rms"][row] = np.nan
    r = api.diff(a, b)
    assert r.first_drift["checkpoint"] == "blk.3" and r.first_drift["reason"] == "non-finite values"
    assert r.first_drift["first_pos"] == 2


# ----------------------------------------------------------------------------------------------
# The console table (printers)

def _hand_report(rows, n_layers=43):
    """A DiffReport from hand-written (checkpoint, pos, rel_l2, norm_ratio) rows; drift by the documented rule."""
    import pandas as pd

    from parity.compare.differ import LAYER_COLUMNS, DiffReport, Thresholds
    from parity.contract.checkpoints import checkpoint_depth

    th = Thresholds()
    t = pd.DataFrame(rows, columns=["checkpoint", "pos", "rel_l2", "norm_ratio"])
    t["depth"] = [checkpoint_depth(c, n_layers) for c in t["checkpoint"]]
    t["layer"], t["method"], t["cosine"] = 0, "fp", 1.0 - t["rel_l2"] ** 2 / 2
    t["sqnr_db"] = -20 * np.log10(t["rel_l2"])
    t["max_abs"], t["stream_ratio_min"], t["stream_ratio_max"] = np.nan, t["norm_ratio"], t["norm_ratio"]
    t["finite"], t["exact"] = True, False
    t["drift"] = (t["rel_l2"] > th.rel_tol) | ((t["norm_ratio"] - 1).abs() > th.norm_tol)
    t["argmax_a"] = t["argmax_b"] = 0
    side = {"engine": "reference", "version": "1", "dtype": "float32", "model": {}, "flags": {}, "n_tokens": 20000,
            "n_prompt": 16000}
    first = None
    if t["drift"].any():
        row = t[t["drift"]].sort_values("depth").iloc[0]
        first = {"checkpoint": row["checkpoint"], "layer": 0, "first_pos": int(row["pos"]),
                 "worst_pos": int(row["pos"]), "positions": [int(row["pos"])], "method": "fp",
                 "rel_l2": row["rel_l2"], "norm_ratio": row["norm_ratio"], "cosine": row["cosine"], "reason": "x"}
    return DiffReport(side, side, th, [], t, pd.DataFrame(columns=LAYER_COLUMNS), first)


def test_table_shows_each_failing_metrics_own_worst_position():
    from parity.compare.printers import checkpoint_rows, text_table

    # an RMS fault at position 13 while rel-L2 is worst (but under threshold) at position 2
    r = _hand_report([("blk.4", 2, 8e-4, 1.0), ("blk.4", 13, 1e-5, 1.01), ("blk.4", 20, 2e-6, 1.0)])
    (row,) = checkpoint_rows(r)
    assert (row.pos, row.failing, row.norm_ratio, row.rel_l2, row.rel_l2_pos) == (13, "norm ratio", 1.01, 8e-4, 2)
    line = text_table(r).splitlines()[2].split()
    assert line == ["blk.4", "fp", "13", "8.000e-04", "1.010000*", "0.99999968", "DRIFT", "1/3"]
    # rel-L2 failing wins the position over a simultaneous RMS failure elsewhere
    r = _hand_report([("blk.4", 2, 5e-3, 1.0), ("blk.4", 13, 1e-5, 1.01)])
    (row,) = checkpoint_rows(r)
    assert (row.pos, row.failing, row.norm_ratio) == (2, "rel-L2", 1.01)
    from parity.compare.printers import worst_rows

    (d,) = worst_rows(r)
    got = (d["pos"], d["failing"], d["norm_ratio"], d["max_abs"], d["status"])
    assert got == (2, "rel-L2", 1.01, None, "DRIFT 2/2")  # max_abs is NaN on fingerprints -> null


def test_compact_table_fits_100_columns_without_cutting():
    from parity.compare.printers import text_table

    names = ["embed", *(n for layer in range(43) for n in (f"blk.{layer}.attn", f"blk.{layer}")), "final_norm"]
    rows = [(n, p, (2.599e-3 if p else 2e-3) if n == "blk.42.attn" else 1.234567e-7, 1.000001) for n in names
            for p in (0, 16383)]
    r = _hand_report(rows)
    compact = text_table(r).splitlines()
    assert max(len(x) for x in compact) <= 100 and len(compact) == 2 + len(names)
    assert "blk.42.attn" in compact[-3] and "2.599e-03*" in compact[-3] and "DRIFT 2/2" in compact[-3]
    assert "16383" in compact[-3] and "1.235e-07" in compact[-2]  # numbers whole
    wide = text_table(r, wide=True).splitlines()
    assert "SQNR dB" in wide[0] and "stream ratios" in wide[0] and "1.0000..1.0000" in wide[-3]
    assert max(len(x) for x in wide) > 100  # wide adds columns; it is not held to 100


def test_heatmap_scale_is_fixed_and_tied_to_the_threshold(runs):
    from parity.compare.plot import LOG_MAX, LOG_MIN, drift_figure, threshold_colormap

    agree, fail = api.diff(runs(), runs(perturb={2: 1e-6})), api.diff(runs(), runs(perturb={2: 0.05}))
    images = [drift_figure(r).axes[2].images[0] for r in (agree, fail)]
    assert [im.get_clim() for im in images] == [(LOG_MIN, LOG_MAX)] * 2  # never rescaled per plot
    cmap, th = threshold_colormap(1e-3), np.log10(1e-3)
    below = cmap((th - 0.1 - LOG_MIN) / (LOG_MAX - LOG_MIN))
    above = cmap((th + 0.1 - LOG_MIN) / (LOG_MAX - LOG_MIN))
    assert below[0] == pytest.approx(below[1]) and above[0] > above[2] + 0.3  # grey below, red above
    cbar_label = drift_figure(fail).axes[3].get_ylabel()
    assert "fixed log scale" in cbar_label and "threshold 0.001" in cbar_label


def test_heatmap_marks_the_decode_boundary_and_labels_half_layers(runs):
    from parity.compare.plot import drift_figure

    r = api.diff(runs(), runs(perturb={2: 0.05}))
    ax = drift_figure(r).axes[2]
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert labels[:4] == ["embed", "0a", "0", "1a"] and labels[-1] == "final" and "2a" in labels
    # 8 prompt tokens + 2 decode: positions 0..9, the line between row 7 (prompt's last) and row 8
    horizontal = [ln.get_ydata()[0] for ln in ax.get_lines() if ln.get_ydata()[0] == ln.get_ydata()[1]]
    assert 7.5 in horizontal and any("decode" in t.get_text() for t in ax.texts)


def test_long_titles_wrap_instead_of_being_cut():
    from parity.compare.plot import wrapped_title

    text = "first drift: " + " ".join(f"blk.{i}.attn" for i in range(30))
    wrapped = wrapped_title(text, 40)
    assert wrapped.replace("\n", " ") == text and max(len(x) for x in wrapped.splitlines()) <= 40


def test_bisect_plot_title_is_wrapped_not_cut(tmp_path):
    from parity.bisect.bisect_report import BisectReport
    from parity.bisect.bisect_report import plot as plot_report
    from parity.bisect.findings import Culprit, LayerDeparts
    from parity.compare.verdict import Verdict

    report = BisectReport(Verdict.DEFECT, Culprit(2, "compressor_rows", 31, 3, LayerDeparts(True)), 28, 4,
                          list(range(32)), {"k": 10.0}, {})
    line = ("DEFECT at layer 2, sub-op compressor_rows: decode step 3 (position 31); the layer departs by the "
            "round-off null on the reference's inputs, no single captured sub-op does")   # the summary's first line
    fig = plot_report(report, str(tmp_path / "b.png"))
    assert fig._suptitle.get_text().replace("\n", " ") == line and "\n" in fig._suptitle.get_text()
    assert (tmp_path / "b.png").exists()
