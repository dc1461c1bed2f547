"""Drift-profile figures drawn from a `DiffReport` (never recomputing a diff).

One figure, three panels: RMS norm ratio vs depth (band = min..max over positions, line = last
position, threshold band 1 +- norm_tol), 1 - cosine vs depth on a log scale (worst position, with the
cosine threshold 1 - rel_tol^2/2), and a position x checkpoint heatmap of rel-L2. The heatmap's colour
scale is FIXED (log10 rel-L2 from 1e-9 to 1, the same on every plot): greys below the rel-L2 threshold,
reds above it, so an all-agree plot stays pale and a failure is red whatever the other cells hold.
Every column is labelled (`2a` = the half-layer checkpoint blk.2.attn), a line marks where the prompt
ends and decode begins, and the first drifting checkpoint is marked on every panel.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from parity.compare.differ import DiffReport
from parity.compare.rows import by_depth
from parity.contract.checkpoints import draft_kind
from parity.contract.files import save_figure

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

LOG_MIN, LOG_MAX = -9.0, 0.0   # the heatmap's fixed colour range, log10 rel-L2 (float32 noise sits near -7)
FLOOR = 10.0 ** LOG_MIN        # exact zeros and anything smaller sit at the bottom of the scale
COS_FLOOR = 1e-16              # where 1 - cosine = 0 sits (float64 resolution of a cosine near 1)
TITLE_WIDTH = 110              # characters per title line (the title wraps, never cut)


def column_label(name: str) -> str:
    """Short heatmap/axis label of a checkpoint: embed, 2a (blk.2.attn), 2 (blk.2), final; draft checkpoints as
    named without the head's prefix (m0.in for mtp.0.in, ds.logits for dspark.logits)."""
    kind = draft_kind(name)
    if kind is not None:
        return ("m" if kind == "mtp" else "ds.") + name.partition(".")[2]
    if name == "embed":
        return "embed"
    if name == "final_norm":
        return "final"
    parts = name.split(".")
    return parts[1] + ("a" if name.endswith(".attn") else "")


def wrapped_title(text: str, width: int = TITLE_WIDTH) -> str:
    """`text` broken into lines of at most `width` characters (for titles that must not be cut)."""
    return "\n".join(textwrap.wrap(text, width)) or text


def threshold_colormap(rel_tol: float):
    """Greys from LOG_MIN up to log10(rel_tol), reds above: a colormap whose colour change IS the threshold."""
    from matplotlib import colormaps
    from matplotlib.colors import ListedColormap

    n = 256
    split = round(float(n * (np.log10(rel_tol) - LOG_MIN) / (LOG_MAX - LOG_MIN)))
    split = min(max(split, 1), n - 1)
    low = colormaps["Greys"](np.linspace(0.05, 0.45, split))
    high = colormaps["YlOrRd"](np.linspace(0.45, 1.0, n - split))
    return ListedColormap(np.concatenate([low, high]), name="rel_l2_threshold")


def drift_figure(report: DiffReport):
    """The drift-profile `matplotlib.figure.Figure` of `report` (3 panels, see the module docstring)."""
    from matplotlib.figure import Figure

    t = report.table.sort_values(["depth", "pos"], kind="stable")
    th = report.thresholds
    rows = by_depth(report.rows)  # one per checkpoint, each at its own depth
    depth = np.array([r.depth for r in rows])
    labels = [column_label(r.checkpoint) for r in rows]
    fig = Figure(figsize=(13, 9.5), layout="constrained")
    gs = fig.add_gridspec(2, 2, height_ratios=[1, 1.1])
    ax_n, ax_c, ax_h = fig.add_subplot(gs[0, 0]), fig.add_subplot(gs[0, 1]), fig.add_subplot(gs[1, :])
    first = report.first_drift
    at_first = [r.depth for r in rows if r.checkpoint == (first or {}).get("checkpoint")]  # none for a logits drift
    first_depth = at_first[0] if at_first else None
    small = 6 if len(depth) > 40 else 8
    _norm_panel(ax_n, t, depth, th.norm_tol)
    _cosine_panel(ax_c, np.array([r.cosine for r in rows]), depth, th.cos_tol)
    for ax in (ax_n, ax_c):
        ax.set_xticks(depth, labels, fontsize=small, rotation=90 if len(depth) > 20 else 0)
        ax.grid(alpha=0.3)
    if first_depth is not None:
        for ax in (ax_n, ax_c):
            ax.axvline(first_depth, color="tab:red", ls=":", lw=1.5, label=f"first drift: {first['checkpoint']}")
    ax_n.legend(fontsize=8, loc="best")
    ax_c.legend(fontsize=8, loc="best")
    _heatmap(fig, ax_h, t, depth, labels, small, report.a.get("n_prompt"), th.rel_tol)
    if first_depth is not None:
        ax_h.axvline(list(depth).index(first_depth) - 0.5, color="tab:blue", ls="--", lw=1.5)
    verdict = "all checkpoints agree" if first is None else f"first drift: {first['checkpoint']} ({first['reason']})"
    fig.suptitle(wrapped_title(f"Drift profile — A = {report.a['engine']} vs B = {report.b['engine']} — {verdict}"),
                 fontsize=12)
    return fig


def _norm_panel(ax: Axes, t: pd.DataFrame, depth: np.ndarray, norm_tol: float) -> None:
    """The RMS norm ratio panel: min..max band over positions, the last position's line, the 1 +- norm_tol band.
    t: the report's table sorted by depth and position."""
    by = t.groupby("depth", sort=True)
    last = t[t["pos"] == t["pos"].max()].set_index("depth")["norm_ratio"].reindex(depth)
    ax.fill_between(depth, by["norm_ratio"].min().to_numpy(), by["norm_ratio"].max().to_numpy(), alpha=0.3,
                    color="tab:blue", label="min..max over positions")
    ax.plot(depth, last.to_numpy(), "o-", ms=3, color="tab:blue", label=f"position {t['pos'].max()}")
    ax.axhspan(1 - norm_tol, 1 + norm_tol, color="tab:green", alpha=0.15, label=f"1 ± {norm_tol:g}")
    ax.set(title="RMS norm ratio B/A vs depth", xlabel="checkpoint (2a = blk.2.attn)", ylabel="rms(B) / rms(A)")


def _cosine_panel(ax: Axes, cosine: np.ndarray, depth: np.ndarray, cos_tol: float) -> None:
    """The 1 - cosine panel (worst position per checkpoint, log scale) with the cosine threshold."""
    one_minus = np.maximum(1.0 - cosine, COS_FLOOR)
    ax.semilogy(depth, one_minus, "o-", ms=3, color="tab:purple", label="worst position")
    ax.axhline(max(1 - cos_tol, COS_FLOOR), color="tab:red", ls="--",
               label=f"threshold: cos = 1 - {1 - cos_tol:.1e}")
    ax.set(title="cosine vs depth (plotted as 1 - cosine)", xlabel="checkpoint (2a = blk.2.attn)",
           ylabel="1 - cos(A, B)")
    ax.set_ylim(COS_FLOOR / 2, max(1.0, one_minus.max() * 2))


def _heatmap(fig: Figure, ax: Axes, t: pd.DataFrame, depth: np.ndarray, labels: list[str], small: int,
             n_prompt: int | None, rel_tol: float) -> None:
    """The position x checkpoint rel-L2 heatmap on the fixed colour scale, its prompt/decode line and colour bar."""
    grid = t.pivot_table(index="pos", columns="depth", values="rel_l2", aggfunc="max")
    grid = grid.reindex(columns=depth)
    # a cell with no row (a draft checkpoint has none at some positions) is left blank; a NaN rel-L2 is red
    missing = t.assign(n=1).pivot_table(index="pos", columns="depth", values="n", aggfunc="sum").reindex(
        index=grid.index, columns=depth).isna().to_numpy()
    img = np.log10(np.clip(np.nan_to_num(grid.to_numpy(dtype=np.float64), nan=1.0, posinf=1.0), FLOOR, 1.0))
    img = np.ma.masked_array(img, missing)
    cmap = threshold_colormap(rel_tol).with_extremes(bad="white")
    im = ax.imshow(img, aspect="auto", origin="lower", cmap=cmap, vmin=LOG_MIN,
                   vmax=LOG_MAX, interpolation="nearest",
                   extent=(-0.5, len(depth) - 0.5, -0.5, len(grid.index) - 0.5))
    ax.set_xticks(range(len(depth)), labels, fontsize=small, rotation=90 if len(depth) > 20 else 0)
    rows = list(grid.index)
    if len(rows) <= 40:
        ax.set_yticks(range(len(rows)), [str(p) for p in rows], fontsize=7)
    decode_rows = [i for i, p in enumerate(rows) if n_prompt is not None and p >= n_prompt]
    if decode_rows and decode_rows[0] > 0:
        y = decode_rows[0] - 0.5
        ax.axhline(y, color="tab:blue", lw=1.5)
        ax.text(-0.45, y, "decode ↑ / prompt ↓", va="center", ha="left", fontsize=7, color="tab:blue",
                bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.8, "pad": 1})
    ax.set(title="relative L2 error by position and checkpoint (fixed scale; red = above the rel-L2 threshold)",
           xlabel="checkpoint (Na = half-layer blk.N.attn, N = blk.N" + ("; blank = no record there" if missing.any()
                                                                            else "") + ")", ylabel="position")
    cb = fig.colorbar(im, ax=ax, label=f"rel-L2, fixed log scale (black line: threshold {rel_tol:g})")
    ticks = list(range(int(LOG_MIN), int(LOG_MAX) + 1, 3))
    cb.set_ticks(ticks, labels=[f"1e{k}" for k in ticks])
    cb.ax.axhline(np.log10(rel_tol), color="black", lw=2)


def plot_drift(report: DiffReport, out: str | os.PathLike) -> Path:
    """Write the drift-profile figure of `report` to `out` (format from the extension) and return the path."""
    return save_figure(drift_figure(report), out, dpi=110)


def png_bytes(report: DiffReport, dpi: int = 90) -> bytes:
    """The drift-profile figure as PNG bytes (for embedding)."""
    import io

    buf = io.BytesIO()
    drift_figure(report).savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()
