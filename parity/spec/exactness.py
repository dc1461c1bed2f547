"""Output exactness, tie-aware (spec v4-mtp-dspark §6.3.1): the candidate's speculative tokens vs its own plain greedy
decode vs the reference's plain greedy decode, on the same prompt.

At the first step s where any two differ (all three agree before s, so the reference's row s is on the shared
prefix): margin = ref logit of its top-1 − ref logit of the other token (the candidate's, spec's or plain's, the
larger gap when both differ); TIE when margin <= τ = the envelope's tie margin at the top-1 logit's size, else
WRONG; spec-induced when the plain decode agrees with the reference there and the speculative one does not.
Steps after a divergence are not compared (the prefixes differ from there on).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from parity.bisect.envelope import Envelope
from parity.spec.attribution import ulps


@dataclass(frozen=True)
class Divergence:
    """The first step where spec, plain and reference disagree. position = the row predicting it."""

    step: int
    position: int
    cls: str                  # TIE | WRONG
    spec_induced: bool
    spec: int
    plain: int
    reference: int
    margin: float             # reference top-1 minus the other token's logit (absolute)
    margin_ulps: float
    tie: float                # τ at that logit size (absolute)
    tie_ulps: float


def first_divergence(spec: Sequence[int], plain: Sequence[int], reference: Sequence[int], ref_logits: np.ndarray,
                     n_prompt: int, env: Envelope) -> Divergence | None:
    """None when the three token lists are equal. spec/plain/reference: generated tokens [S]; ref_logits: the
    reference's rows predicting them [S, V]."""
    for s, (a, b, r) in enumerate(zip(spec, plain, reference, strict=True)):
        if a == b == r:
            continue
        row = np.asarray(ref_logits[s], np.float64)
        top = float(row[r])
        margin = max(top - row[t] for t in (a, b))
        tie = env.tie_margin(top)
        return Divergence(s, n_prompt - 1 + s, "TIE" if margin <= tie else "WRONG", b == r != a, int(a), int(b),
                          int(r), float(margin), ulps(margin, top), float(tie), ulps(tie, top))
    return None
