"""What a `bisect` culprit rests on, as data: one frozen record per kind of finding (`Culprit.finding`), and the
stages that replace the trunk's verdict (`DrafterOutcome`, `CheckJudgement`) keeping what they replaced. No record
holds a sentence: the words are made by the printers of `parity.bisect.bisect_report` (`culprit_words`, `summary`).

* `EmbedDiffers`: the candidate's embedding lookup differs (a position, no layer);
* `HeadDiffers`: every layer clean, the final norm / output head differ;
* `SubopDeparts`: the drill-down's culprit sub-op (its `SubopResult`, status 'defect');
* `LayerDeparts`: the layer departs but no single captured sub-op does (`by_null`: judged by the round-off null,
  else by the envelope's floors: the defect is between captures);
* `SubopNoise`: no defect, the layer's first 'noise' sub-op (a QAT code flip, a near-tie) names the noise;
* `InheritedDrift`: no candidate layer departs on the reference's inputs: amplified sub-envelope drift, and the QAT
  code flip it tips over at the culprit layer (`flip`, None when none is isolated);
* `DraftDeparts`: a draft checkpoint outside its round-off twins (the candidate's draft head on the reference's
  trunk carriers);
* `CheckCause`: `check`'s defect cause on the same run, when `check` places the culprit elsewhere (`by_check`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from parity.check.null import NullTest
from parity.check.subops import SubopResult
from parity.compare.verdict import Verdict

if TYPE_CHECKING:
    from parity.check.check import Cause, CheckReport


@dataclass(frozen=True)
class EmbedDiffers:
    """The candidate's embedding lookup differs from the reference's (at the culprit's position)."""


@dataclass(frozen=True)
class HeadDiffers:
    """Every layer is clean; the final norm / output head differ."""


@dataclass(frozen=True)
class SubopDeparts:
    """The drill-down's culprit sub-op, status 'defect'."""

    result: SubopResult


@dataclass(frozen=True)
class LayerDeparts:
    """The layer departs but no single captured sub-op does: `by_null` True when the layer departs by the
    round-off null on the reference's inputs, False when judged by the envelope's floors (between captures)."""

    by_null: bool


@dataclass(frozen=True)
class SubopNoise:
    """No defect: the culprit layer's first 'noise' sub-op."""

    result: SubopResult


@dataclass(frozen=True)
class InheritedDrift:
    """No candidate layer departs on the reference's inputs: the free-running `excess` (largest, at `checkpoint`)
    is amplified sub-envelope drift; the splice first departs after `splice_layer`; `flip`: the sub-op result with
    the isolated QAT code flip the drift tips over at the culprit layer (None: none found there)."""

    excess: float
    checkpoint: str
    splice_layer: int
    flip: SubopResult | None


@dataclass(frozen=True)
class DraftDeparts:
    """`engine`'s draft head on the reference's trunk carriers departs at the culprit draft checkpoint: `test` its
    round-off null test, `rel_l2` its largest distance."""

    engine: str
    test: NullTest
    rel_l2: float


@dataclass(frozen=True)
class CheckCause:
    """`check`'s defect cause on the same run, placing the culprit where bisect did not."""

    cause: Cause


Finding = (EmbedDiffers | HeadDiffers | SubopDeparts | LayerDeparts | SubopNoise | InheritedDrift | DraftDeparts
           | CheckCause)


@dataclass(frozen=True)
class Culprit:
    """Where the run departs and what it rests on."""

    layer: int | str               # layer index, or "embed" / "head" / "drafter CHECKPOINT"
    subop: str | None
    position: int | None
    decode_step: int | None        # 0-based decode step when the position is past the prompt
    finding: Finding


@dataclass(frozen=True)
class DrafterOutcome:
    """The drafter stage after a trunk with no defect: `twins` round-off twins judged every draft checkpoint; the
    trunk's own verdict and culprit (the report's are the drafter's when a draft checkpoint departs)."""

    twins: int
    trunk_verdict: Verdict
    trunk_culprit: Culprit | None


@dataclass(frozen=True)
class CheckJudgement:
    """`check`'s report on the same run, whose verdict the bisect report carries (`parity.bisect.by_check`), and
    bisect's own verdict and culprit it replaced (kept as evidence)."""

    check: CheckReport
    own_verdict: Verdict
    own_culprit: Culprit | None
