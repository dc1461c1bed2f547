"""The harness's verdict vocabulary, in one place: every verdict and status a report holds is a member of an enum
here (str-valued, so JSON and text keep the spelling they always had), and the records decisions are made on.

* `Verdict`: a run's verdict (MATCH / NOISE / DEFECT), the one vocabulary of `check`, `bisect` and the rest (`bisect`
  prints it in its own words, 'no defect' / 'noise' / 'defect': `parity.bisect.bisect_report.verdict_word`);
* sub-statuses: `SubopStatus` (a sub-op in a drill-down), `RowStatus` (a checkpoint row of `check`), `CauseKind`
  (a cause of `check`), `Judged` (what `check`'s local verdict rests on), `LayerKind` (a layer in `bisect`'s
  attribution), `StepVerdict` (one greedy step);
* `QuantFlip`: an isolated QAT code flip as numbers (format, capture, count, first position), so "is it a code
  flip, of which format" is read from fields, never from prose; `flip_words` is its printer.

The tie-aware verdict of one greedy step, shared by the bisector and the logprob comparison: given the
reference's and the candidate's top entries at one step (token id, score; scores are logits or logprobs,
descending), the step is:
* MATCH    - same top-1 token, and the top-1 scores agree within `drift_tol`;
* DRIFT    - same top-1 token, but the top-1 scores differ by more than `drift_tol`;
* TIE-FLIP - different top-1 token, and the reference itself could not separate the two: the
             reference's score gap between its top-1 and the candidate's pick is <= `tie_margin`;
* WRONG    - different top-1 token with a reference margin above `tie_margin`, or a candidate
             pick that is not in the reference's top list at all.
`tie_margin` should come from the measured noise envelope at that logit size, not a constant.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum


class Verdict(StrEnum):
    """A run's verdict: MATCH (nothing outside the round-off null / envelope), NOISE (departures, every one
    explained as benign), DEFECT (a departure no benign hypothesis explains)."""

    MATCH = "MATCH"
    NOISE = "NOISE"
    DEFECT = "DEFECT"

    @classmethod
    def of_causes(cls, kinds: Iterable[CauseKind]) -> Verdict:
        """DEFECT when some cause is a defect, NOISE when there are causes (all benign), else MATCH."""
        kinds = list(kinds)
        return cls.DEFECT if CauseKind.DEFECT in kinds else cls.NOISE if kinds else cls.MATCH


class CauseKind(StrEnum):
    """What a cause of `check` is: benign numerics (NOISE) or a defect."""

    BENIGN = "benign"
    DEFECT = "defect"


class Judged(StrEnum):
    """What `check`'s local verdict rests on."""

    OP_LEVEL = "op-level"         # every sub-op on the candidate's own dumped inputs
    LAYER_LEVEL = "layer-level"   # each layer on the candidate's own carrier
    FREE_RUNNING = "free-running"  # no teacher-forced verdict


class RowStatus(StrEnum):
    """One checkpoint row of `check`'s table."""

    OK = "ok"                    # inside the envelope (and, where judged, inside the round-off null)
    OUTSIDE = "outside"          # free-running outside the envelope, locally inside: inherited
    LOCAL = "local"              # the layer departs on the candidate's own inputs
    STRUCTURAL = "structural"    # a discrete difference no round-off twin makes
    NOT_JUDGED = "not judged"    # the candidate recorded no full vectors here


class LayerKind(StrEnum):
    """One layer in `bisect`'s attribution: where its free-running error comes from."""

    LOCAL = "local"              # the layer departs on the reference's inputs (or a visible-row count differs)
    PROPAGATED = "propagated"    # outside free-running only: drift from upstream
    CLEAN = "clean"


class SubopStatus(StrEnum):
    """One sub-op of a drill-down: within round-off, departing only by benign flips / ties, or the culprit."""

    OK = "ok"
    NOISE = "noise"
    DEFECT = "defect"


class QuantFormat(StrEnum):
    """A QAT round trip's float format (the value is how reports name it)."""

    FP8_E4M3 = "FP8 e4m3"
    FP4_E2M1 = "FP4 e2m1"

    @property
    def mbits(self) -> int:
        """Mantissa bits of the format (the size of one code step)."""
        return {QuantFormat.FP8_E4M3: 3, QuantFormat.FP4_E2M1: 1}[self]


@dataclass(frozen=True)
class QuantFlip:
    """Isolated one-code steps of a QAT round trip in one capture of a layer (rows that differ only there)."""

    capture: str             # rope_kv, comp_rows or index_rows
    format: QuantFormat
    count: int               # rows of this capture with a flip
    first_position: int      # the first position of the layer's flip cascade (this capture's or an earlier one's)


def flip_words(flip: QuantFlip) -> str:
    """'1 isolated FP8 e4m3 code flip(s) in rope_kv from position 15'."""
    return f"{flip.count} isolated {flip.format} code flip(s) in {flip.capture} from position {flip.first_position}"


class StepVerdict(StrEnum):
    """One greedy step (the module doc: MATCH / TIE-FLIP / DRIFT / WRONG)."""

    MATCH = "MATCH"
    TIE_FLIP = "TIE-FLIP"
    DRIFT = "DRIFT"
    WRONG = "WRONG"


def classify_step(ref_top: Sequence[tuple[int, float]], cand_top: Sequence[tuple[int, float]],
                  tie_margin: float, drift_tol: float) -> tuple[StepVerdict, float]:
    """(verdict, reference margin between its top-1 and the candidate's top-1; for a candidate pick outside
    `ref_top`, the gap to the last listed entry, a lower bound)."""
    if not ref_top or not cand_top:
        raise ValueError("classify_step needs at least one entry on each side")
    ref_id, ref_score = ref_top[0]
    cand_id, cand_score = cand_top[0]
    if cand_id == ref_id:
        verdict = StepVerdict.MATCH if abs(cand_score - ref_score) <= drift_tol else StepVerdict.DRIFT
        return verdict, 0.0
    ref_scores = dict(ref_top)
    if cand_id not in ref_scores:
        # outside the reference's top-k: the margin is at least the gap to its last listed entry;
        # a token the reference did not even list is never called a tie
        return StepVerdict.WRONG, ref_score - ref_top[-1][1]
    margin = ref_score - ref_scores[cand_id]
    return (StepVerdict.TIE_FLIP if margin <= tie_margin else StepVerdict.WRONG), margin
