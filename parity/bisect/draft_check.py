"""`check` on draft checkpoints: the drafter as one more layer after the trunk, teacher-forced and judged by the
round-off null.

The reference's draft head (an engine opened with the same drafter) runs on the candidate's own trunk carriers
(`parity.tracing.drafts.draft_records`: the MTP gets the candidate's X^(L), DSpark the candidate's tapped layers;
the anchors are the run's tokens, at the last position the candidate's own argmax there), and so do N round-off
twins of it (`RoundoffTwins`: every sub-op of the draft blocks, the MTP input and the heads' logits perturbed at
the float32 ulp level). Per draft checkpoint q and position p: e(q, p) = relL2(candidate, R0) and the twins'
e_i(q, p) = relL2(R_i, R0); `parity.bisect.null.judge` counts the cells outside every twin against the
Binomial(cells, 1/(N+1)) tail, checkpoint by checkpoint in order. The first significant checkpoint is the defect.

What this judges and what it does not: each draft checkpoint is compared with the reference computed from the
candidate's *trunk* carriers, not from the candidate's earlier draft checkpoints; so a departure at mtp.0.in
carries into mtp.0.attn, mtp.0 and the logits, and only the first departing checkpoint is the culprit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from parity.bisect.null import N_TWINS, NullTest, judge
from parity.compare.metrics import rel_l2
from parity.contract.checkpoints import FINAL_NORM, block
from parity.contract.engine import Engine, RoundoffTwins
from parity.tracing.drafts import draft_names, draft_records, tapped_layers
from parity.tracing.records import Trace


@dataclass(frozen=True)
class DraftRow:
    """One draft checkpoint: the candidate's worst distance from the reference, the twins' worst, the null test."""

    checkpoint: str
    err: float
    twin_max: float
    test: NullTest

    @property
    def departs(self) -> bool:
        return self.test.significant


@dataclass(frozen=True)
class DraftCheck:
    rows: tuple[DraftRow, ...]    # every draft checkpoint, in order
    notes: tuple[str, ...]

    @property
    def first(self) -> DraftRow | None:
        """The first draft checkpoint outside the round-off null (None: every one inside)."""
        return next((r for r in self.rows if r.departs), None)


def unjudged(trace: Trace) -> str | None:
    """Why the draft checkpoints of `trace` cannot be teacher-forced (None: they can)."""
    h, vec = trace.header, trace.vectors or {}
    names = draft_names(h.draft)
    if h.positions != list(range(len(h.tokens))):
        return "the draft checkpoints need every position traced (the drafter replays every pair / main row)"
    missing = [n for n in names if n not in vec]
    if missing:
        return f"no full vectors of {missing[0]} (trace with --full all)"
    if FINAL_NORM not in h.checkpoints:
        return "no final_norm records: the last round's anchor (the candidate's argmax) is unknown"
    return None


def draft_check(trace: Trace, reference: Engine, n_twins: int = N_TWINS,
                on_twin: Callable[[int], None] | None = None) -> DraftCheck:
    """The module's test (the caller has checked `unjudged(trace)` is None). reference: the reference engine
    opened with the candidate's drafter; it must offer `RoundoffTwins`."""
    h, vec = trace.header, trace.vectors or {}
    names = draft_names(h.draft)
    layers = tapped_layers(reference, h.draft)
    missing = [block(l) for l in layers if block(l) not in vec]
    if missing:
        return DraftCheck((), (f"draft checkpoints not judged: the candidate recorded no full vectors of {missing[0]}, "
                               "the drafter's input",))
    carriers = {l: np.asarray(vec[block(l)], np.float32) for l in layers}
    final = trace.checkpoint_rows(FINAL_NORM)
    last_argmax = int(trace.ckpt["argmax"][final[-1]])

    def run(engine: Engine) -> dict[str, np.ndarray]:
        return draft_records(engine, h.draft, carriers, h.tokens, h.positions, last_argmax)

    exact = run(reference)
    if not isinstance(reference, RoundoffTwins):
        raise TypeError(f"engine {reference.name} has no round-off twins: the draft null needs them")
    twins = []
    for i in range(n_twins):
        twins.append(run(reference.roundoff_twin(i + 1)))
        if on_twin:
            on_twin(i + 1)
    rows = []
    for name in names:
        pos = np.asarray(h.positions_of(name))
        e = rel_l2(exact[name], vec[name])
        t = np.stack([rel_l2(exact[name], tw[name]) for tw in twins])
        test = judge({name: e}, {name: t}, {name: pos})
        rows.append(DraftRow(name, float(e.max(initial=0.0)), float(t.max(initial=0.0)), test))
    return DraftCheck(tuple(rows), ())
