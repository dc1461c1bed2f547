"""`bisect`'s verdict is `check`'s on the same run (one judgement, docs/check.md "One judgement").

`bisect` drives both engines live and localises (splice probes, teacher-forced attribution, sub-op drill-down);
its own screen compares the free-running run with K x the envelope's floor and its local test runs the candidate
on the reference's inputs. Either could call a run that `check` judges otherwise. So the candidate's run is also
recorded as a trace (every position, full vectors) and judged by `check` (the round-off null on the candidate's own
inputs, the benign hypotheses, the defect library): the verdict, its headline and the culprit's layer are
`check`'s; bisect's localisation stays as evidence, and its culprit (sub-op, position) is kept where it names the
layer `check` names.
"""

from __future__ import annotations

from dataclasses import replace

from parity.bisect.bisect_report import BisectReport
from parity.bisect.findings import CheckCause, CheckJudgement, Culprit
from parity.check.check import CheckReport
from parity.check.check_report import headline
from parity.compare.verdict import CauseKind, Verdict
from parity.contract.errors import ParityError


def judged_by_check(report: BisectReport, checked: CheckReport) -> BisectReport:
    """`report` with `checked`'s verdict and culprit; `checked` and bisect's own verdict and culprit are kept
    (`BisectReport.by_check`): the summary puts check's headline above bisect's own (`bisect_report.summary`)."""
    return replace(report, verdict=checked.verdict, culprit=_culprit(report, checked),
                   by_check=CheckJudgement(checked, report.verdict, report.culprit))


def _culprit(report: BisectReport, checked: CheckReport) -> Culprit | None:
    """bisect's culprit where it names check's culprit layer (it adds the sub-op), else check's own; none for a
    MATCH, and for a NOISE bisect's (the benign flip it named) only when bisect also said noise."""
    if checked.verdict is not Verdict.DEFECT:
        return report.culprit if checked.verdict is Verdict.NOISE and report.verdict is Verdict.NOISE else None
    c = checked.culprit
    cause = next(x for x in checked.causes if x.kind is CauseKind.DEFECT)
    if c is None or (c.layer is None and cause.name != "embedding-differs"):   # check names a layer, or the embedding
        raise ParityError(f"check's DEFECT ({cause.name}) names no culprit layer: {headline(checked)}")
    layer = "embed" if c.layer is None else c.layer
    if report.culprit is not None and report.culprit.layer == layer:
        return report.culprit
    return Culprit(layer, c.subop, c.position, c.decode_step, CheckCause(cause))
