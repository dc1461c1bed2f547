"""The tie-aware verdict of one greedy step, shared by the bisector and the logprob comparison.

Given the reference's and the candidate's top entries at one step (token id, score; scores are
logits or logprobs, descending), the step is:
* MATCH    - same top-1 token, and the top-1 scores agree within `drift_tol`;
* DRIFT    - same top-1 token, but the top-1 scores differ by more than `drift_tol`;
* TIE-FLIP - different top-1 token, and the reference itself could not separate the two: the
             reference's score gap between its top-1 and the candidate's pick is <= `tie_margin`;
* WRONG    - different top-1 token with a reference margin above `tie_margin`, or a candidate
             pick that is not in the reference's top list at all.
`tie_margin` should come from the measured noise envelope at that logit size, not a constant.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum


class StepVerdict(str, Enum):
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
