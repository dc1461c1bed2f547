"""Greedy trajectories: each generated step classified MATCH / TIE-FLIP / DRIFT / WRONG.

Step s is the next-token prediction at position P-1+s (P = prompt length; step 0 comes from the prompt's last
position, step s >= 1 from decode step s-1). The candidate is always fed the reference's greedy token
(teacher forcing), so after a TIE-FLIP or WRONG step it continues on the reference's path instead of
stopping, and every step is judged on the same prefix as the reference. Margins come from the envelope at
the logit size of that step (`Envelope.tie_margin`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from parity.check.envelope import Envelope
from parity.compare.verdict import StepVerdict, classify_step
from parity.contract.checkpoints import block
from parity.tracing.stats import top_k

TOP = 5  # entries kept per side; a candidate pick outside the reference's top-5 is WRONG by definition


@dataclass(frozen=True)
class StepRecord:
    step: int
    position: int
    verdict: StepVerdict
    ref_token: int
    cand_token: int
    ref_margin: float      # reference logit gap between its top-1 and the candidate's top-1 (0 when equal)
    tie_margin: float      # noise gap at this logit size (envelope)
    top1_delta: float      # candidate minus reference logit of the reference's top-1 token


def top_entries(logits: np.ndarray, n: int = TOP) -> list[tuple[int, float]]:
    """The n largest (id, logit), descending; ties broken by the lower id (argmax convention).
    logits: [V]"""
    ids, _ = top_k(np.asarray(logits)[None], n)
    return [(int(i), float(logits[i])) for i in ids[0]]


def classify_steps(ref_logits: np.ndarray, cand_logits: np.ndarray, first_position: int,
                   env: Envelope) -> list[StepRecord]:
    """One record per row. ref_logits, cand_logits: [S, V] (rows = positions first_position..)."""
    out = []
    for s, (r, c) in enumerate(zip(ref_logits, cand_logits, strict=True)):
        rt, ct = top_entries(r), top_entries(c)
        tie = env.tie_margin(rt[0][1])
        verdict, margin = classify_step(rt, ct, tie_margin=tie, drift_tol=tie)
        out.append(StepRecord(s, first_position + s, verdict, rt[0][0], ct[0][0], margin, tie,
                              float(c[rt[0][0]] - r[rt[0][0]])))
    return out


@dataclass(frozen=True)
class Trajectory:
    steps: list[StepRecord]
    step_layer_excess: np.ndarray   # [S, L] free-running excess over the envelope of blk.l at each step's position

    @property
    def counts(self) -> dict[str, int]:
        c = Counter(s.verdict.value for s in self.steps)
        return {v.value: c.get(v.value, 0) for v in StepVerdict}

    @property
    def first_divergent(self) -> StepRecord | None:
        """First step whose top-1 differs (TIE-FLIP or WRONG)."""
        return next((s for s in self.steps if s.verdict in (StepVerdict.TIE_FLIP, StepVerdict.WRONG)), None)

    @property
    def first_wrong(self) -> StepRecord | None:
        return next((s for s in self.steps if s.verdict is StepVerdict.WRONG), None)

    @property
    def divergence_rate(self) -> float:
        """Fraction of steps whose top-1 differs."""
        n = sum(s.verdict in (StepVerdict.TIE_FLIP, StepVerdict.WRONG) for s in self.steps)
        return n / len(self.steps)

    def first_layer_at(self, step: int) -> int | None:
        """Earliest layer whose excess exceeds 1 at `step` (what caused the step's divergence), or None."""
        hot = np.flatnonzero(self.step_layer_excess[step] > 1)
        return int(hot[0]) if len(hot) else None


def trajectory(ref_logits: np.ndarray, cand_logits: np.ndarray, free_errors: dict[str, np.ndarray],
               n_prompt: int, n_layers: int, env: Envelope) -> Trajectory:
    """Classify the generated steps (positions n_prompt-1 ..) and build the step x layer excess map.
    ref_logits, cand_logits: [T, V]; free_errors: checkpoint -> per-position rel-L2 [T]."""
    first = n_prompt - 1
    steps = classify_steps(ref_logits[first:], cand_logits[first:], first, env)
    cols = [env.excess_at(block(l), free_errors[block(l)][first:]) for l in range(n_layers)]
    return Trajectory(steps, np.stack(cols, axis=1))
