"""The greedy accept rule, the confidence gates and the label of a drafted position (spec v4-mtp-dspark §4.1-§4.3,
§6.2). Pure functions of token ids and numbers; no engine here."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from parity.contract.errors import ParityError

GATES = ("none", "first-below", "cumulative")
LABELS = ("ACCEPT-OK", "DRAFTER-MISS", "DRAFTER-DRIFT", "FALSE-REJECT", "FALSE-ACCEPT", "NEAR-TIE",
          "VERIFIER-DEFECT", "NOT-VERIFIED")
DEFECT_LABELS = ("VERIFIER-DEFECT", "DRAFTER-DRIFT", "FALSE-ACCEPT")   # any of these: exit status 1


@dataclass(frozen=True)
class Gate:
    """A confidence gate on the DSpark confidences σ(c_j) (§4.3): `none`; `first-below` keeps the drafts before
    the first j with σ(c_j) < p (DSPEC, llama.cpp --spec-draft-p-min); `cumulative` keeps draft j while
    ∏_{i<=j} σ(c_i) >= p (TS --spec-pmin)."""

    kind: str
    p: float = 0.0

    @classmethod
    def parse(cls, text: str) -> Gate:
        """`none` | `first-below:P` | `cumulative:P` with 0 < P < 1, else a ParityError naming the value."""
        kind, sep, value = text.partition(":")
        if kind == "none" and not sep:
            return cls("none")
        if kind in GATES[1:] and sep:
            try:
                p = float(value)
            except ValueError:
                p = float("nan")
            if 0 < p < 1:
                return cls(kind, p)
        raise ParityError(f"gate {text!r}: expected none, first-below:P or cumulative:P with 0 < P < 1")

    def __str__(self) -> str:
        return self.kind if self.kind == "none" else f"{self.kind}:{self.p:g}"

    def keep(self, confidence: np.ndarray | None, k: int) -> int:
        """How many of the k leading drafts pass. confidence: raw confidence logits c [k] (σ applied here), or
        None for a head without one (then only `none` is allowed)."""
        if self.kind == "none":
            return k
        if confidence is None:
            raise ParityError(f"gate {self}: the drafter has no confidence head (only DSpark has one); use --gate none")
        sig = 1.0 / (1.0 + np.exp(-np.asarray(confidence, np.float64)))
        passed = sig >= self.p if self.kind == "first-below" else np.cumprod(sig) >= self.p
        return int(np.argmin(passed)) if not passed.all() else len(passed)


def first_max(logits: np.ndarray) -> np.ndarray:
    """Verifier argmax per row, the first of equal maxima (§4.2).  logits [q, V] -> int [q]."""
    return np.asarray(logits).argmax(axis=1)


def accept_length(drafts: np.ndarray, verify: np.ndarray) -> int:
    """a' = max{i <= γ : d_j = v_{j-1} for all j <= i} (§4.1).  drafts d_1..d_γ [γ], verify v_0..v_γ [γ + 1]."""
    drafts, verify = np.asarray(drafts), np.asarray(verify)
    if len(verify) != len(drafts) + 1:
        raise ParityError(f"accept: {len(drafts)} drafts need {len(drafts) + 1} verify rows, got {len(verify)}")
    miss = np.flatnonzero(drafts != verify[:-1])
    return int(miss[0]) if len(miss) else len(drafts)


@dataclass(frozen=True)
class Slot:
    """What the label of one verified drafted position needs (§6.1): the draft d_i, the candidate's verify argmax
    v_{i-1}, the reference verifier's argmax ρ_{i-1} with its top-1/top-2 margin μ and tie threshold τ, the
    reference drafter's draft d*_i and its logit gap between d*_i and d_i with that row's tie threshold;
    own_first_max: v_{i-1} is the first maximum of the candidate's own logits row (False: the candidate broke a tie
    against the rule of §4.2, or picked no maximum at all)."""

    draft: int
    verify: int
    reference: int
    margin: float
    tie: float
    reference_draft: int
    draft_gap: float
    draft_tie: float
    own_first_max: bool = True


def label(slot: Slot | None) -> str:
    """The one label of a drafted position (§6.2, checked top-down); None = not verified (cut by a gate, the
    draft budget or the step budget, or after the first rejection).

    Verifier wrong (v ≠ ρ): NEAR-TIE when μ <= τ (noise can reorder the reference's top two) and v is the first
    maximum of the candidate's own row, else FALSE-REJECT (d = ρ: a right draft rejected), FALSE-ACCEPT (d = v: a
    wrong draft accepted) or VERIFIER-DEFECT (neither): a pick against the tie-break rule is no noise (§4.2).
    Verifier right: ACCEPT-OK (d = ρ), DRAFTER-MISS (d ≠ ρ and the reference drafter proposes the same), NEAR-TIE
    (the drafters differ where the reference drafter's gap between d* and d is <= its τ), else DRAFTER-DRIFT."""
    if slot is None:
        return "NOT-VERIFIED"
    if slot.verify != slot.reference:
        if slot.margin <= slot.tie and slot.own_first_max:
            return "NEAR-TIE"
        return ("FALSE-REJECT" if slot.draft == slot.reference else
                "FALSE-ACCEPT" if slot.draft == slot.verify else "VERIFIER-DEFECT")
    if slot.draft == slot.reference:
        return "ACCEPT-OK"
    if slot.draft == slot.reference_draft:
        return "DRAFTER-MISS"
    return "NEAR-TIE" if slot.draft_gap <= slot.draft_tie else "DRAFTER-DRIFT"
