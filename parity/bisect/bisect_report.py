"""A `BisectReport` (frozen report data) and its printers: the text summary, JSON, a figure and an HTML page.

The search (`parity.bisect.search`) builds the report, `parity.bisect.by_check` re-judges it by `check`; both store
data only (the culprit's finding, `parity.bisect.findings`; the drafter stage and `check`'s report with what they
replaced). Every word and number a person reads is written here: `summary(report)` (the text summary, also the
JSON document's "summary"), `culprit_words`, `verdict_word` (the verdict in bisect's words: 'no defect' /
'noise' / 'defect').
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from parity.bisect.findings import (
    CheckCause,
    CheckJudgement,
    Culprit,
    DraftDeparts,
    DrafterOutcome,
    EmbedDiffers,
    HeadDiffers,
    InheritedDrift,
    LayerDeparts,
    SubopDeparts,
    SubopNoise,
)
from parity.bisect.trajectory import Trajectory
from parity.check.attribution import LayerAttribution, LayerRouting
from parity.check.subops import SubopResult, subop_words
from parity.check.words import null_words
from parity.compare.jsonvalues import json_safe
from parity.compare.verdict import Verdict


@dataclass(frozen=True)
class SpliceProbe:
    k: int                 # candidate below k, reference from k
    excess: float          # max excess over the candidate's checkpoints below k and the spliced ones from k on
    clean: bool
    row_mismatch: tuple[int, int] | None = None   # (layer, position) of a visible-row-count difference


@dataclass(frozen=True)
class BisectReport:
    verdict: Verdict               # MATCH | NOISE | DEFECT (in bisect's words by `verdict_word`)
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
    worst_position: int | None = None    # a clean run: the position of the largest excess along its checkpoint
    drafter: DrafterOutcome | None = None   # the drafter stage, after a trunk with no defect
    by_check: CheckJudgement | None = None  # `check`'s report on the same run, whose verdict this is (`by_check`)

    def __post_init__(self) -> None:
        object.__setattr__(self, "verdict", Verdict(self.verdict))   # a mistyped verdict is an error naming it

    def to_dict(self) -> dict[str, Any]:
        """The JSON document: the verdict in bisect's words, the text summary, every data field of the report
        (numpy arrays as nested lists; the culprit and sub-ops with their evidence in words), the trajectory with
        its counts, first divergent step, divergence rate and step x layer excess, and `check`'s JSON document when
        the verdict is check's."""
        d: dict[str, Any] = {"verdict": verdict_word(self.verdict), "summary": summary(self)}
        d |= {k: getattr(self, k) for k in self.__dataclass_fields__ if k not in _NOT_IN_JSON}
        d["culprit"] = _culprit_json(self.culprit) if self.culprit else None
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
        d["check"] = self.by_check.check.to_dict() if self.by_check is not None else None
        return json_safe(d)


# data the JSON document renders (verdict, summary, check) or leaves to the summary (worst_position, drafter)
_NOT_IN_JSON = ("verdict", "worst_position", "drafter", "by_check")


def _culprit_json(c: Culprit) -> dict[str, Any]:
    """The culprit's JSON record: where, and what it rests on in words ("detail")."""
    return {"layer": c.layer, "subop": c.subop, "position": c.position, "decode_step": c.decode_step,
            "detail": culprit_words(c)}


# ---------------------------------------------------------------- words

_WORDS = {Verdict.MATCH: "no defect", Verdict.NOISE: "noise", Verdict.DEFECT: "defect"}


def verdict_word(v: Verdict) -> str:
    """The verdict in bisect's words (its JSON and text): 'no defect', 'noise', 'defect'."""
    return _WORDS[Verdict(v)]


def where_words(c: Culprit) -> str:
    """'prefill position 3', 'decode step 1 (position 15)' or 'position unknown'."""
    if c.position is None:
        return "position unknown"
    if c.decode_step is not None:
        return f"decode step {c.decode_step} (position {c.position})"
    return f"prefill position {c.position}"


def culprit_words(c: Culprit) -> str:
    """What the culprit rests on, in words (the JSON's culprit "detail", the summary's first line)."""
    f = c.finding
    if isinstance(f, EmbedDiffers):
        return f"{where_words(c)}; embedding lookup differs"
    if isinstance(f, HeadDiffers):
        return "layers clean; final norm / output head differ"
    if isinstance(f, SubopDeparts):
        return f"{where_words(c)}; {subop_words(f.result)}"
    if isinstance(f, LayerDeparts):
        why = ("the layer departs by the round-off null on the reference's inputs, no single captured sub-op does"
               if f.by_null else "no captured sub-op differs: the defect is between captures")
        return f"{where_words(c)}; {why}"
    if isinstance(f, SubopNoise):
        return subop_words(f.result)
    if isinstance(f, InheritedDrift):
        why = (f"{f.flip.name}: {subop_words(f.flip)}" if f.flip is not None else
               "no isolated QAT code flip found there (near-ties or amplification downstream)")
        return (f"no candidate layer departs on the reference's inputs; the excess ({f.excess:.3g} at {f.checkpoint}; "
                f"the splice first departs after layer {f.splice_layer}) is amplified sub-envelope drift; the "
                f"reference's layer {c.layer} on the candidate's inputs shows {why}")
    if isinstance(f, DraftDeparts):
        return (f"{f.engine}'s draft head on the reference's trunk carriers: {null_words(f.test)} "
                f"(rel-L2 {f.rel_l2:.3g})")
    if isinstance(f, CheckCause):
        from parity.check.check_report import cause_words

        return f"{f.cause.name}: {cause_words(f.cause)}"
    raise TypeError(f"not a bisect finding: {type(f).__name__}")


# ---------------------------------------------------------------- text summary

def step_counts(traj: Trajectory) -> str:
    """'3 MATCH, 1 DRIFT': the trajectory's steps per verdict, or 'none'."""
    return ", ".join(f"{n} {v}" for v, n in traj.counts.items() if n) or "none"


def summary(report: BisectReport) -> str:
    """The text summary: `check`'s headline over bisect's own summary when the verdict is check's; the drafter's
    DEFECT over the trunk's summary, or the trunk's summary and the drafter's line; else the clean or the
    localised run's summary."""
    if report.by_check is not None:
        j = report.by_check
        own = replace(report, verdict=j.own_verdict, culprit=j.own_culprit, by_check=None)
        return judged_summary(j.check, j.own_verdict, report.verdict, summary(own))
    if report.drafter is not None:
        d = report.drafter
        trunk = summary(replace(report, verdict=d.trunk_verdict, culprit=d.trunk_culprit, drafter=None))
        c = report.culprit
        if c is not None and isinstance(c.finding, DraftDeparts):
            return f"DEFECT at {c.layer}, {where_words(c)}: {culprit_words(c)}\ntrunk: " + trunk
        return trunk + f"\ndrafter: every draft checkpoint within its {d.twins} round-off twins"
    return summarize(report) if report.culprit is not None else clean_summary(report)


def clean_summary(report: BisectReport) -> str:
    """The summary of a run with every checkpoint inside the envelope: the largest excess, where it is
    (`worst_position`: its position along the checkpoint with the largest excess), the steps, routing flips."""
    worst = max(report.max_excess, key=report.max_excess.get)
    flips = sum(r.flips for r in report.routing)
    assert report.trajectory is not None
    return (f"NO DEFECT: every checkpoint within the envelope (max excess {report.max_excess[worst]:.2g} at "
            f"{worst}, position {report.worst_position}); steps {step_counts(report.trajectory)}"
            + (f"; {flips} routing flips, all without effect beyond the envelope" if flips else ""))


def summarize(report: BisectReport) -> str:
    """The verdict of a localised run in a few lines: where, local vs propagated, noise or defect, the evidence
    numbers (the envelope's K from `report.envelope`)."""
    c = report.culprit
    assert c is not None
    head = "DEFECT" if report.verdict is Verdict.DEFECT else "NOISE (no defect)"
    where = f" at layer {c.layer}" if isinstance(c.layer, int) else f" at {c.layer}"
    if report.verdict is Verdict.NOISE and c.subop is None:
        where = ""
    lines = [f"{head}{where}" + (f", sub-op {c.subop}" if c.subop else "") + f": {culprit_words(c)}"]
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


def judged_summary(check: Any, own: Verdict, verdict: Verdict, own_summary: str) -> str:
    """`check`'s headline first (the verdict is check's, `parity.bisect.by_check`), a line when bisect's own screen
    (`own`) said otherwise, then bisect's summary indented as evidence."""
    from parity.check.check_report import headline

    lines = [headline(check)]
    if own != verdict:
        lines.append(f"  (bisect's own screen said {verdict_word(own)!r}; the verdict is check's, on the same run)")
    lines += ["bisect's localisation (evidence):", *("  " + ln for ln in own_summary.splitlines())]
    return "\n".join(lines)


# ---------------------------------------------------------------- figure, HTML (JSON: `json_safe`)

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

    fig.suptitle(wrapped_title(summary(report).splitlines()[0]), fontsize=9)  # wrapped, never cut
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
    return fig


def to_html(path: str, report: BisectReport) -> Path:
    """`bisect --html`: one self-contained page, the verdict first, the full summary, the figure of `plot`."""
    from parity.compare.html import Section, image, plot_png, preformatted, write_html

    text = summary(report)
    sections = [Section("Summary", preformatted(text)),
                Section("Excess map", image(plot_png(plot, report), "bisect excess map"))]
    return write_html(path, "v4parity bisect", text.splitlines()[0], report.verdict is not Verdict.DEFECT, sections)
