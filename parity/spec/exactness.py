"""Output exactness, tie-aware (spec v4-mtp-dspark §6.3.1): the candidate's speculative tokens vs its own plain greedy
decode vs the reference's plain greedy decode, on the same prompt.

At the first step s where any two differ (all three agree before s, so the reference's row s is on the shared
prefix): margin = ref logit of its top-1 − ref logit of the other token (the candidate's, spec's or plain's, the
larger gap when both differ); TIE when margin <= τ = the envelope's tie margin at the top-1 logit's size, else
WRONG; spec-induced when the plain decode agrees with the reference there and the speculative one does not.
Steps after a divergence are not compared (the prefixes differ from there on).

`committed_verdicts` goes on past it, teacher-forced (spec §6.3.1 re-sync): every token the speculative run
committed is a verify row's argmax v_j, and the attribution has the reference's row on the same committed prefix,
so each committed token is MATCH (v_j = ρ_j), TIE (ℓ_ref(ρ_j) − ℓ_ref(v_j) <= τ_j) or WRONG.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from parity.check.envelope import Envelope
from parity.spec.attribution import RoundAttribution, ulps
from parity.spec.driver import Round


@dataclass(frozen=True)
class Divergence:
    """The first step where spec, plain and reference disagree. position = the row predicting it."""

    step: int
    position: int
    cls: str                  # TIE | WRONG
    spec_induced: bool | None         # None: no plain decode to tell (a run read from a trace)
    spec: int
    plain: int | None
    reference: int
    margin: float             # reference top-1 minus the other token's logit (absolute)
    margin_ulps: float
    tie: float                # τ at that logit size (absolute)
    tie_ulps: float


def first_divergence(spec: Sequence[int], plain: Sequence[int] | None, reference: Sequence[int],
                     ref_logits: np.ndarray, n_prompt: int, env: Envelope) -> Divergence | None:
    """None when the three token lists are equal. spec/plain/reference: generated tokens [S]; ref_logits: the
    reference's rows predicting them [S, V]. plain None: there is no plain decode (a run read from a trace), spec
    is compared with the reference alone and `spec_induced` is None."""
    for s, (a, r) in enumerate(zip(spec, reference, strict=True)):
        b = a if plain is None else plain[s]
        if a == b == r:
            continue
        row = np.asarray(ref_logits[s], np.float64)
        top = float(row[r])
        margin = max(top - row[t] for t in (a, b))
        tie = env.tie_margin(top)
        return Divergence(s, n_prompt - 1 + s, "TIE" if margin <= tie else "WRONG",
                          None if plain is None else b == r != a, int(a), None if plain is None else int(b),
                          int(r), float(margin), ulps(margin, top), float(tie), ulps(tie, top))
    return None


@dataclass(frozen=True)
class Committed:
    """One committed token of the speculative run judged on its own prefix (step 0 = the prefill's argmax)."""

    step: int
    position: int             # the row that predicted it
    cls: str                  # MATCH | TIE | WRONG
    token: int
    reference: int
    margin: float             # ℓ_ref(reference) − ℓ_ref(token)
    tie: float


def committed_verdicts(rounds: Sequence[Round], attrs: Sequence[RoundAttribution], first: int, first_reference: int,
                       first_logits: np.ndarray, n_prompt: int, steps: int, env: Envelope) -> list[Committed]:
    """Every committed token in order: the prefill's (`first`, judged on the reference's prefill row
    `first_logits` [V] with its argmax `first_reference`), then each round's v_0..v_{a'-1} and its bonus
    (`Round.row_tokens`); at most `steps`."""
    row = np.asarray(first_logits, np.float64)
    gap, tie = float(row[first_reference] - row[first]), env.tie_margin(float(row[first_reference]))
    out = [Committed(0, n_prompt - 1, verdict(first, first_reference, gap, tie), first, first_reference, gap, tie)]
    for r, a in zip(rounds, attrs, strict=True):
        for j in range(r.accepted + 1):
            if len(out) == steps:
                return out
            t = r.row_tokens[j]   # v_j; the bonus (the next anchor) at j = a'
            out.append(Committed(len(out), r.start_pos + j, verdict(t, a.reference[j], a.gaps[j], a.ties[j]), t,
                                 a.reference[j], a.gaps[j], a.ties[j]))
    return out


def verdict(token: int, reference: int, gap: float, tie: float) -> str:
    """MATCH when the tokens agree, TIE when the reference's gap between them is <= tie, else WRONG."""
    return "MATCH" if token == reference else "TIE" if gap <= tie else "WRONG"
