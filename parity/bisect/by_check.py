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

from parity.bisect.bisect_report import BisectReport, Culprit, judged_summary
from parity.check.check import CheckReport
from parity.check.check_report import cause_words, headline, to_json
from parity.compare.verdict import BisectVerdict, CauseKind, Verdict
from parity.contract.errors import ParityError


def judged_by_check(report: BisectReport, checked: CheckReport) -> BisectReport:
    """`report` with `checked`'s verdict (in bisect's words, `Verdict.bisect_word`), culprit and headline; bisect's
    own summary follows as evidence (the text by `bisect_report.judged_summary`), and the check report is kept
    (`BisectReport.check`, its JSON)."""
    verdict = Verdict(checked.verdict).bisect_word
    return replace(report, verdict=verdict, culprit=_culprit(report, checked),
                   summary=judged_summary(headline(checked), report.verdict, verdict, report.summary),
                   check=to_json(checked))


def _culprit(report: BisectReport, checked: CheckReport) -> Culprit | None:
    """bisect's culprit where it names check's culprit layer (it adds the sub-op), else check's own; none for a
    MATCH, and for a NOISE bisect's (the benign flip it named) only when bisect also said noise."""
    if checked.verdict is not Verdict.DEFECT:
        return report.culprit if checked.verdict is Verdict.NOISE and report.verdict is BisectVerdict.NOISE else None
    c = checked.culprit
    cause = next(x for x in checked.causes if x.kind is CauseKind.DEFECT)
    if c is None or (c.layer is None and cause.name != "embedding-differs"):   # check names a layer, or the embedding
        raise ParityError(f"check's DEFECT ({cause.name}) names no culprit layer: {headline(checked)}")
    layer = "embed" if c.layer is None else c.layer
    if report.culprit is not None and report.culprit.layer == layer:
        return report.culprit
    return Culprit(layer, c.subop, c.position, c.decode_step, f"{cause.name}: {cause_words(cause)}")
