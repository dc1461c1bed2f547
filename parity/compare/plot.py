"""Drift-profile figures drawn from a `DiffReport` (never recomputing a diff).

One figure, three panels: RMS norm ratio vs depth (band = min..max over positions, line = last
position, threshold band 1 +- norm_tol), 1 - cosine vs depth on a log scale (worst position, with the
cosine threshold 1 - rel_tol^2/2), and a position x checkpoint heatmap of log10 rel-L2. The first
drifting checkpoint is marked on every panel.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from parity.compare.differ import DiffReport

FLOOR = 1e-12      # where exact zeros sit on the rel-L2 heatmap
COS_FLOOR = 1e-16  # ... and on the 1 - cosine axis (float64 resolution of a cosine near 1)


def _depth_ticks(report: DiffReport) -> tuple[list[float], list[str]]:
    """Tick positions and labels: embed, layer numbers at blk.l, final_norm."""
    s = report.summary
    ticks, labels = [], []
    for name, depth in zip(s["checkpoint"], s["depth"], strict=True):
        if name.endswith(".attn"):
            continue
        ticks.append(depth)
        labels.append("embed" if name == "embed" else "final" if name == "final_norm" else name.split(".")[1])
    return ticks, labels


def plot_drift(report: DiffReport, out: str | os.PathLike) -> Path:
    """Write the drift-profile figure of `report` to `out` (format from the extension) and return the path.

    report.table: [rows = checkpoint x position] -> one PNG/PDF/SVG with 3 panels.
    """
    from matplotlib.figure import Figure

    t = report.table.sort_values(["depth", "pos"], kind="stable")
    th = report.thresholds
    by = t.groupby("depth", sort=True)
    depth = np.array(sorted(t["depth"].unique()))
    last = t[t["pos"] == t["pos"].max()].set_index("depth")["norm_ratio"].reindex(depth)
    fig = Figure(figsize=(13, 9.5), layout="constrained")
    gs = fig.add_gridspec(2, 2, height_ratios=[1, 1.1])
    ax_n, ax_c, ax_h = fig.add_subplot(gs[0, 0]), fig.add_subplot(gs[0, 1]), fig.add_subplot(gs[1, :])
    ticks, labels = _depth_ticks(report)
    first = report.first_drift
    first_depth = None if first is None else t.loc[t["checkpoint"] == first["checkpoint"], "depth"].iloc[0]

    ax_n.fill_between(depth, by["norm_ratio"].min().to_numpy(), by["norm_ratio"].max().to_numpy(), alpha=0.3,
                      color="tab:blue", label="min..max over positions")
    ax_n.plot(depth, last.to_numpy(), "o-", ms=3, color="tab:blue", label=f"position {t['pos'].max()}")
    ax_n.axhspan(1 - th.norm_tol, 1 + th.norm_tol, color="tab:green", alpha=0.15, label=f"1 ± {th.norm_tol:g}")
    ax_n.set(title="RMS norm ratio B/A vs depth", xlabel="layer", ylabel="rms(B) / rms(A)")

    one_minus = np.maximum(1.0 - by["cosine"].min().to_numpy(), COS_FLOOR)
    ax_c.semilogy(depth, one_minus, "o-", ms=3, color="tab:purple", label="worst position")
    ax_c.axhline(max(1 - th.cos_tol, COS_FLOOR), color="tab:red", ls="--",
                 label=f"threshold: cos = 1 - {1 - th.cos_tol:.1e}")
    ax_c.set(title="cosine vs depth (plotted as 1 - cosine)", xlabel="layer", ylabel="1 - cos(A, B)")
    ax_c.set_ylim(COS_FLOOR / 2, max(1.0, one_minus.max() * 2))

    for ax in (ax_n, ax_c):
        ax.set_xticks(ticks, labels, fontsize=7 if len(ticks) > 20 else 9)
        ax.grid(alpha=0.3)
    if first is not None:
        for ax in (ax_n, ax_c):
            ax.axvline(first_depth, color="tab:red", ls=":", lw=1.5, label=f"first drift: {first['checkpoint']}")
    ax_n.legend(fontsize=8, loc="best")
    ax_c.legend(fontsize=8, loc="best")

    grid = t.pivot_table(index="pos", columns="depth", values="rel_l2", aggfunc="max")
    img = np.log10(np.maximum(grid.to_numpy(dtype=np.float64), FLOOR))
    im = ax_h.imshow(img, aspect="auto", origin="lower", cmap="magma", interpolation="nearest",
                     extent=(-0.5, len(grid.columns) - 0.5, -0.5, len(grid.index) - 0.5))
    cols = list(grid.columns)
    keep = [i for i, d in enumerate(cols) if d in ticks]
    ax_h.set_xticks(keep, [labels[ticks.index(cols[i])] for i in keep], fontsize=7 if len(keep) > 20 else 9)
    if len(grid.index) <= 40:
        ax_h.set_yticks(range(len(grid.index)), [str(p) for p in grid.index], fontsize=7)
    ax_h.set(title="relative L2 error (log10) by position and checkpoint (half steps = blk.l.attn)",
             xlabel="layer", ylabel="position")
    cb = fig.colorbar(im, ax=ax_h, label="log10 rel-L2")
    cb.ax.axhline(np.log10(th.rel_tol), color="cyan", lw=2)
    if first is not None:
        ax_h.axvline(cols.index(first_depth) - 0.5, color="cyan", ls="--", lw=1.5)
    verdict = "all checkpoints agree" if first is None else f"first drift: {first['checkpoint']} ({first['reason']})"
    fig.suptitle(f"Drift profile — A = {report.a['engine']} vs B = {report.b['engine']} — {verdict}", fontsize=12)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out
