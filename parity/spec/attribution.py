"""Acceptance attribution (spec v4-mtp-dspark §6.1-§6.2): the reference re-runs every round of a speculative run on
the candidate's own committed prefix and drafts, and each drafted position gets one label.

Per round r (anchor at position c+1, drafts d_1..d_k, γ verified, a' accepted): the reference verifier rows
ρ_0..ρ_γ come from one batch [t_{c+1}, d_1..d_γ] on the reference state of the committed prefix (restored and
replayed after a rejection as the driver does); μ_i = top-1 − top-2 of row i; τ_i = the envelope's tie margin at
that logit size. The reference drafter drafts d*_1..d*_k on the candidate's own drafter inputs (MTP: its chain
teacher-forced on the candidate's drafts; DSpark: its own block); scripted drafts are their own reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from parity.check.envelope import Envelope
from parity.contract.engine import Engine
from parity.contract.progress import SILENT, ProgressSink
from parity.spec.accept import Slot, first_max, label
from parity.spec.drafts import DSparkSource, MTPSource, need_snapshots
from parity.spec.driver import Round, SpecRun, state_view
from parity.spec.stateparity import first_difference, state_tolerance
from parity.tracing.runner import forward_chunk


@dataclass(frozen=True)
class StateDivergence:
    """The first round after whose commit a cache differs from the reference's on the same prefix."""

    round: int
    start_pos: int
    component: str            # e.g. blk.2.comp.rows, mtp.blk.6.raw, dspark.0.rows
    kind: str                 # shape | non-finite | values
    why: str


@dataclass(frozen=True)
class RoundAttribution:
    """The reference's view of one round: labels (one per drafted position d_1..d_k), ρ_0..ρ_γ, μ and τ per
    verify row (absolute logits), gaps = ℓ_ref(ρ_j) − ℓ_ref(v_j) per verify row (0 where the candidate picked ρ_j;
    v_{a'} is the token committed from row a'), the reference drafter's d*_1..d*_k, and the first draft checkpoint
    where the candidate's drafter departs from the reference drafter on the candidate's inputs (spec §6.3.4; the
    state tolerance, in the checkpoints' order; None: none departs, or scripted drafts)."""

    labels: tuple[str, ...]
    reference: tuple[int, ...]
    margins: tuple[float, ...]
    ties: tuple[float, ...]
    gaps: tuple[float, ...]
    reference_drafts: tuple[int, ...]
    drafter: tuple[str, str, str] | None = None   # the first draft checkpoint departing: (name, kind, why)


def top_two_margin(logits: np.ndarray) -> np.ndarray:
    """μ = top-1 − top-2 per row (0 on an exact tie).  logits [q, V] -> [q]."""
    two = -np.partition(-np.asarray(logits, np.float64), 1, axis=1)[:, :2]
    return two[:, 0] - two[:, 1]


def ulps(x: float, at: float) -> float:
    """x in float32 ulps at the magnitude `at` (the spacing of float32 numbers next to |at|)."""
    return float(x / np.spacing(np.float32(abs(at))))


def label_round(r: Round, rho: np.ndarray, margins: np.ndarray, ties: np.ndarray, star: np.ndarray,
                star_logits: np.ndarray | None, env: Envelope) -> tuple[str, ...]:
    """Labels of d_1..d_k: positions after γ or after the first rejection (i > a' + 1) are NOT-VERIFIED."""
    out = []
    for i, d in enumerate(r.drafts, start=1):
        if i > r.verified or i > r.accepted + 1:
            out.append(label(None))
            continue
        s = int(star[i - 1]) if i <= len(star) else d
        gap, tie = 0.0, 0.0
        if s != d and star_logits is not None:
            row = star_logits[i - 1]
            gap, tie = float(row[s] - row[d]), env.tie_margin(float(row[s]))
        out.append(label(Slot(d, r.verify[i - 1], int(rho[i - 1]), float(margins[i - 1]), float(ties[i - 1]), s,
                              gap, tie, i - 1 not in r.not_first_max)))
    return tuple(out)


def attribute(ref: Engine, source: MTPSource | DSparkSource | None, run: SpecRun, env: Envelope,
              progress: ProgressSink = SILENT, own_inputs: bool = False
              ) -> tuple[list[RoundAttribution], StateDivergence | None]:
    """One `RoundAttribution` per round of `run`, and the first round whose committed state differs from the
    reference's (when the run recorded its states). `source`: the reference engine's drafter of the run's kind
    (None for scripted drafts). `own_inputs`: the reference drafter drafts on the reference trunk's own rows of the
    committed prefix (a run read from a trace, which records no drafter inputs) instead of `run.inputs`.
    `progress.count` counts the attributed rounds."""
    snapshot, restore = need_snapshots(ref).snapshot, ref.restore
    state = ref.new_state()
    rows = forward_chunk(ref, state, np.asarray(run.prompt, np.int64), 0)
    out, divergence, tol = [], None, state_tolerance(env)
    for n, (r, first) in enumerate(zip(run.rounds, run.feed_first, strict=True)):
        star, star_logits, drafter = np.asarray(r.drafts), None, None
        if source is not None:
            inputs = source.inputs(rows) if own_inputs else run.inputs[n]
            p = source.draft(inputs, run.tokens, first, forced=np.asarray(r.drafts, np.int64))
            star, star_logits = p.drafts, p.logits
            cand_ckpts = run.draft_checkpoints[n] if n < len(run.draft_checkpoints) else {}
            drafter = first_difference(cand_ckpts, p.checkpoints, tol) if cand_ckpts else None
        saved = snapshot(state)
        batch = np.asarray([r.anchor, *r.drafts[: r.verified]], np.int64)
        rows = forward_chunk(ref, state, batch, r.start_pos)
        logits = rows.logits
        if r.accepted < r.verified:
            state = restore(state, saved)
            rows = forward_chunk(ref, state, batch[: r.accepted + 1], r.start_pos)
        rho, margins = first_max(logits), top_two_margin(logits)
        ties = np.array([env.tie_margin(float(row.max())) for row in logits])
        labels = label_round(r, rho, margins, ties, star, star_logits, env)
        idx = np.arange(len(rho))
        gaps = logits[idx, rho].astype(np.float64) - logits[idx, np.asarray(r.row_tokens)]
        out.append(RoundAttribution(labels, tuple(map(int, rho)), tuple(map(float, margins)),
                                    tuple(map(float, ties)), tuple(map(float, gaps)), tuple(map(int, star)),
                                    drafter))
        if divergence is None:
            shown = run.states[n] if run.states else None
            found = first_difference(shown, reference_view(ref, state, source, shown, run.state_scope), tol) \
                if shown is not None else None
            found = found or anchor_difference(r, rho, gaps, ties)
            divergence = StateDivergence(n, r.start_pos, *found) if found else None
        progress.count("reference attribution", n + 1, len(run.rounds))
    return out, divergence


def reference_view(ref: Engine, state: object, source: MTPSource | DSparkSource | None, shown: dict[str, np.ndarray],
                   scope: str | None) -> dict[str, np.ndarray]:
    """The reference's caches in `StateView` layout, cut to the components `shown` when the candidate shows only
    some (`scope`: a `PartialStateView`'s note; None: it shows all)."""
    full = state_view(ref, state, source)
    return full if scope is None else {k: full[k] for k in shown if k in full}


def anchor_difference(r: Round, rho: np.ndarray, gaps: np.ndarray, ties: np.ndarray) -> tuple[str, str, str] | None:
    """The next anchor as a state component (spec §6.3.2): the token committed after the accepted drafts against the
    reference's argmax ρ_{a'} of row a'. ('anchor', kind, why) when they differ by more than the tie threshold
    (kind `token`), by a tie broken against the rule in the candidate's own row a' (`tie-break`) or by a token taken
    from another verify row than a' (`row`); None when equal or a near-tie flip of row a' (noise: its label and the
    committed verdict say so)."""
    a, anchor = r.accepted, r.next_anchor
    if anchor == rho[a]:
        return None
    if gaps[a] > ties[a]:
        kind = "token"
    elif r.bonus is not None:
        kind = "row"
    elif a in r.not_first_max:
        kind = "tie-break"
    else:
        return None
    row = "row a'" if r.bonus is None else "not from row a'"
    return "anchor", kind, (f"next anchor {anchor} ({row}) vs reference {int(rho[a])} (row a' = {a}); reference "
                            f"gap {gaps[a]:.3g}, tie threshold {ties[a]:.3g}")


def online_per_slot(rounds: list[Round], depth: int) -> list[float | None]:
    """The candidate's acceptance of slot i: of the rounds that verified slot i (i <= γ), the share with a' >= i
    (cumulative per position, as the published per-position figures). None where no round verified slot i."""
    out = []
    for i in range(1, depth + 1):
        tried = [r for r in rounds if r.verified >= i]
        out.append(sum(r.accepted >= i for r in tried) / len(tried) if tried else None)
    return out


def offline_per_slot(rounds: list[Round], attrs: list[RoundAttribution], tokens: list[int],
                     depth: int) -> list[float | None]:
    """The reference drafter's acceptance of slot i on the same trajectory: of the rounds whose trajectory is known
    that far, the share whose d*_1..d*_i equal the committed tokens t_{c+2}..t_{c+1+i}."""
    out = []
    for i in range(1, depth + 1):
        hits = tried = 0
        for r, a in zip(rounds, attrs, strict=True):
            truth = tokens[r.start_pos + 1 : r.start_pos + 1 + i]
            if len(a.reference_drafts) >= i and len(truth) == i:
                tried += 1
                hits += list(a.reference_drafts[:i]) == truth
        out.append(hits / tried if tried else None)
    return out
