"""A `BisectReport` (frozen report data) and its printers: the text summary, JSON, a figure and an HTML page.

The search (`parity.bisect.search`) builds the report; every word and number a person reads is written here. The
report keeps its text summary as a field (`summary`, part of the JSON document) because `bisect`'s verdict is
later re-judged by `check` (`parity.bisect.by_check`), which puts `check`'s headline above it; the field is always
written by a function of this module.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from parity.bisect.trajectory import Trajectory
from parity.check.attribution import LayerAttribution, LayerRouting
from parity.check.subops import SubopResult
from parity.compare.verdict import BisectVerdict


@dataclass(frozen=True)
class Culprit:
    layer: int | str               # layer index, or "embed" / "head"
    subop: str | None
    position: int | None
    decode_step: int | None        # 0-based decode step when the position is past the prompt
    detail: str


@dataclass(frozen=True)
class SpliceProbe:
    k: int                 # candidate below k, reference from k
    excess: float          # max excess over the candidate's checkpoints below k and the spliced ones from k on
    clean: bool
    row_mismatch: tuple[int, int] | None = None   # (layer, position) of a visible-row-count difference


@dataclass(frozen=True)
class BisectReport:
    verdict: BisectVerdict         # "defect" | "no defect" | "noise" (`Verdict` in bisect's words)
    summary: str                   # the text summary, written by this module's printers
    culprit: Culprit | None
    n_prompt: int
    decode: int
    tokens: list[int]
    envelope: dict                 # k, eps, dtype, calibration
    max_excess: dict[str, float]   # checkpoint -> free-running max excess
    row_mismatch: tuple[int, int] | None = None   # free run: first (layer, position) with another visible-row count
    attribution: list[LayerAttribution] = field(default_factory=list)
    routing: list[LayerRouting] = field(default_factory=list)
    probes: list[SpliceProbe] = field(default_factory=list)
    subops: list[SubopResult] = field(default_factory=list)
    trajectory: Trajectory | None = None
    runs: dict[str, int] = field(default_factory=dict)     # engine runs by kind
    seconds: dict[str, float] = field(default_factory=dict)
    check: dict | None = None      # `check`'s JSON document on the same run, whose verdict this is (`bisect.by_check`)

    def __post_init__(self) -> None:
        object.__setattr__(self, "verdict", BisectVerdict(self.verdict))   # a mistyped word is an error naming it

    def to_dict(self) -> dict[str, Any]:
        """The JSON document: every field of the report (numpy arrays as nested lists), the trajectory with its
        counts, first divergent step, divergence rate and step x layer excess."""
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["culprit"] = asdict(self.culprit) if self.culprit else None
        d["attribution"] = [asdict(a) | {"kind": a.kind} for a in self.attribution]
        d["probes"] = [asdict(p) for p in self.probes]
        d["routing"] = [asdict(r) for r in self.routing]
        d["subops"] = [s.to_dict() for s in self.subops]
        if self.trajectory is not None:
            t = self.trajectory
            fd = t.first_divergent
            d["trajectory"] = {"steps": [asdict(s) for s in t.steps], "counts": t.counts,
                               "first_divergent_step": fd.step if fd else None,
                               "divergence_rate": t.divergence_rate, "step_layer_excess": t.step_layer_excess}
        return _plain(d)


# ---------------------------------------------------------------- text summary

def step_counts(traj: Trajectory) -> str:
    """'3 MATCH, 1 DRIFT': the trajectory's steps per verdict, or 'none'."""
    return ", ".join(f"{n} {v}" for v, n in traj.counts.items() if n) or "none"


def clean_summary(report: BisectReport, worst_position: int) -> str:
    """The summary of a run with every checkpoint inside the envelope: the largest excess, where it is
    (`worst_position`: its position along the checkpoint with the largest excess), the steps, routing flips."""
    worst = max(report.max_excess, key=report.max_excess.get)
    flips = sum(r.flips for r in report.routing)
    assert report.trajectory is not None
    return (f"NO DEFECT: every checkpoint within the envelope (max excess {report.max_excess[worst]:.2g} at "
            f"{worst}, position {worst_position}); steps {step_counts(report.trajectory)}"
            + (f"; {flips} routing flips, all without effect beyond the envelope" if flips else ""))


def summarize(report: BisectReport) -> str:
    """The verdict of a localised run in a few lines: where, local vs propagated, noise or defect, the evidence
    numbers (the envelope's K from `report.envelope`)."""
    c = report.culprit
    assert c is not None
    head = "DEFECT" if report.verdict is BisectVerdict.DEFECT else "NOISE (no defect)"
    where = f" at layer {c.layer}" if isinstance(c.layer, int) else f" at {c.layer}"
    if report.verdict is BisectVerdict.NOISE and c.subop is None:
        where = ""
    lines = [f"{head}{where}" + (f", sub-op {c.subop}" if c.subop else "") + f": {c.detail}"]
    lines += _culprit_layer_lines(report)
    if report.probes:
        lines.append(f"  mirror splice (candidate below k, reference from k): {_probe_words(report.probes)}")
    flips = [r for r in report.routing if r.flips or r.index_diffs]
    if flips:
        lines.append("  routing (free-running): " + "; ".join(_routing_words(r) for r in flips[:3]))
    if report.trajectory is not None:
        lines.append(_trajectory_line(report.trajectory))
    return "\n".join(lines)


def _culprit_layer_lines(report: BisectReport) -> list[str]:
    """The culprit layer's local vs free-running excess, and the culprit sub-op's error over its floor."""
    c = report.culprit
    if c is None or not isinstance(c.layer, int) or not report.attribution:
        return []
    a = report.attribution[c.layer]
    lines = [f"  layer {a.layer}: local (teacher-forced) rel-L2 {a.local:.3g}, free-running {a.free:.3g}, "
             f"envelope floor {a.floor:.3g} (k={report.envelope['k']:g}) -> local excess {a.local_excess:.3g}, "
             f"free excess {a.free_excess:.3g}: {a.kind}"
             + (f" (visible compressed-row count differs from position {a.row_mismatch})"
                if a.row_mismatch is not None else "")]
    sub = next((s for s in report.subops if s.name == c.subop), None)
    if sub is not None and sub.floor > 0:
        lines.append(f"  sub-op {sub.name}: local error {sub.err:.3g} vs floor {sub.floor:.3g} "
                     f"(excess {sub.excess:.3g})")
    return lines


def _probe_words(probes: Sequence[SpliceProbe]) -> str:
    return ", ".join(f"k={p.k} " + ("clean" if p.clean else f"excess {p.excess:.2g}" if p.row_mismatch is None
                     else "visible-row count differs at layer {} position {}".format(*p.row_mismatch))
                     for p in probes)


def _routing_words(r: LayerRouting) -> str:
    parts = [f"{r.flips} expert-set flips ({r.noise_flips} within router-margin noise, largest margin "
             f"{r.largest_flip_margin:.3g})"] if r.flips else []
    parts += [f"{r.index_diffs} indexer-selection differences"] if r.index_diffs else []
    return f"layer {r.layer}: " + ", ".join(parts)


def _trajectory_line(t: Trajectory) -> str:
    fd = t.first_divergent
    first = "no divergent step"
    if fd:
        hot = t.first_layer_at(fd.step)
        cause = f"layer excursion from layer {hot}" if hot is not None else "no layer outside the envelope"
        first = (f"first divergent step {fd.step} ({fd.verdict.value}, reference margin {fd.ref_margin:.3g} vs "
                 f"tie margin {fd.tie_margin:.3g}; {cause})")
    return (f"  trajectory: {len(t.steps)} steps ({step_counts(t)}); {first}; "
            f"divergence rate {t.divergence_rate:.2f}")


def drafter_clean_summary(trunk: str, n_twins: int) -> str:
    """The trunk's summary followed by the drafter stage's line when every draft checkpoint is within its twins."""
    return trunk + f"\ndrafter: every draft checkpoint within its {n_twins} round-off twins"


def drafter_defect_summary(culprit: Culprit, where: str, trunk: str) -> str:
    """A drafter DEFECT first (`culprit.layer` is 'drafter CHECKPOINT'), the trunk's summary after it."""
    return f"DEFECT at {culprit.layer}, {where}: {culprit.detail}\ntrunk: " + trunk


def judged_summary(headline: str, own: BisectVerdict, verdict: BisectVerdict, summary: str) -> str:
    """`check`'s headline first (the verdict is check's, `parity.bisect.by_check`), a line when bisect's own screen
    (`own`) said otherwise, then bisect's summary indented as evidence."""
    lines = [headline]
    if own != verdict:
        lines.append(f"  (bisect's own screen said {own.value!r}; the verdict is check's, on the same run)")
    lines += ["bisect's localisation (evidence):", *("  " + ln for ln in summary.splitlines())]
    return "\n".join(lines)


# ---------------------------------------------------------------- JSON, figure, HTML

def _plain(x: Any) -> Any:
    """Plain JSON-able values: numpy arrays as nested lists, enums as their values, non-finite floats as text."""
    if isinstance(x, np.ndarray):
        return _plain(x.tolist())
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, float) and not np.isfinite(x):
        return str(x)
    if hasattr(x, "value") and not isinstance(x, (int, float, str)):
        return x.value
    return x




def plot(report: BisectReport, path: str) -> object:
    """Two panels from the report only: the step x layer excess map, and local vs free excess per layer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    t = report.trajectory
    if t is not None:
        im = ax1.imshow(np.log10(np.maximum(t.step_layer_excess, 1e-3)), aspect="auto", cmap="magma",
                        vmin=-3, vmax=max(1.0, float(np.log10(max(t.step_layer_excess.max(), 1e-3)))))
        fig.colorbar(im, ax=ax1, label="log10 excess over envelope")
        ax1.set_xlabel("layer")
        ax1.set_ylabel("generated step")
        ax1.set_title("free-running excess (> 0 = outside the envelope)")
    if report.attribution:
        ls = [a.layer for a in report.attribution]
        ax2.semilogy(ls, [max(a.local_excess, 1e-3) for a in report.attribution], "o-", label="local (teacher-forced)")
        ax2.semilogy(ls, [max(a.free_excess, 1e-3) for a in report.attribution], "s--", label="free-running")
        ax2.axhline(1, color="gray", lw=1)
        if report.culprit is not None and isinstance(report.culprit.layer, int):
            ax2.axvline(report.culprit.layer, color="red", lw=1, label=f"culprit: layer {report.culprit.layer}")
        ax2.set_xlabel("layer")
        ax2.set_ylabel("excess over envelope")
        ax2.legend()
    else:
        ax2.text(0.5, 0.5, "no attribution needed:\nevery checkpoint inside the envelope", ha="center", va="center")
        ax2.set_axis_off()
    from parity.compare.plot import wrapped_title
    from parity.contract.files import save_figure

    fig.suptitle(wrapped_title(report.summary.splitlines()[0]), fontsize=9)  # wrapped, never cut
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
    return fig


def to_html(path: str, report: BisectReport) -> Path:
    """`bisect --html`: one self-contained page, the verdict first, the full summary, the figure of `plot`."""
    from parity.compare.html import Section, image, plot_png, preformatted, write_html

    sections = [Section("Summary", preformatted(report.summary)),
                Section("Excess map", image(plot_png(plot, report), "bisect excess map"))]
    return write_html(path, "v4parity bisect", report.summary.splitlines()[0], report.verdict != BisectVerdict.DEFECT,
                      sections)
