"""`check` on draft checkpoints: the drafter as one more layer after the trunk, teacher-forced and judged by the
round-off null.

The reference's draft head (an engine opened with the same drafter) runs on the candidate's own trunk carriers
(`parity.tracing.drafts.draft_records`: the MTP gets the candidate's X^(L), DSpark the candidate's tapped layers;
the anchors are the run's tokens, at the last position the candidate's own argmax there), and so do N round-off
twins of it (`RoundoffTwins`: every sub-op of the draft blocks, the MTP input and the heads' logits perturbed at
the float32 ulp level). Per draft checkpoint q and position p: e(q, p) = relL2(candidate, R0) and the twins'
e_i(q, p) = relL2(R_i, R0); `parity.check.null.judge` counts the cells outside every twin against the
Binomial(cells, 1/(N+1)) tail, checkpoint by checkpoint in order. The first significant checkpoint is the defect.

What this judges and what it does not: each draft checkpoint is compared with the reference computed from the
candidate's *trunk* carriers, not from the candidate's earlier draft checkpoints; so a departure at mtp.0.in
carries into mtp.0.attn, mtp.0 and the logits, and only the first departing checkpoint is the culprit.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import numpy as np

from parity.check.null import ALPHA, N_TWINS, NullTest, binomial_tail, judge
from parity.compare.metrics import rel_l2
from parity.contract.checkpoints import FINAL_NORM, block
from parity.contract.engine import Engine, RoundoffTwins, RunOptions
from parity.contract.errors import ParityError, TraceError
from parity.gguf.weights import same_model
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
    twins: dict[str, np.ndarray] = field(default_factory=dict)  # per checkpoint the twins' distances from R0 [N, P]

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


def check_drafter(trace: Trace, identity: Mapping[str, Any], name: str) -> None:
    """The drafter file given to judge `trace` (its `identity`, file `name`) must be the one its header names: a
    TraceError otherwise, and for a trace without draft checkpoints."""
    d = trace.header.draft
    if not d:
        raise TraceError(f"--draft {name}: the candidate trace has no draft checkpoints (trace it with --draft)")
    if not same_model(dict(identity), {k: d[k] for k in ("file", "size", "header_sha256", "data_sha256")}):
        raise TraceError(f"--draft {name}: not the candidate's drafter (the trace header names {d['file']}, "
                         f"{d['size']} bytes, header {d['header_sha256']}, layout {d['layout']})")


def draft_check(trace: Trace, reference: Engine, n_twins: int = N_TWINS,
                on_twin: Callable[[int], None] | None = None) -> DraftCheck:
    """The module's test (the caller has checked `unjudged(trace)` is None). reference: the reference engine
    opened with the candidate's drafter; it must offer `RoundoffTwins`."""
    h, vec = trace.header, trace.vectors or {}
    layers = tapped_layers(reference, h.draft)
    missing = [block(l) for l in layers if block(l) not in vec]
    if missing:
        return DraftCheck((), (f"draft checkpoints not judged: the candidate recorded no full vectors of {missing[0]}, "
                               "the drafter's input",))
    names = draft_names(h.draft)
    return judge_records(reference, names, partial(_candidate_records, trace), vec, h.positions_of, n_twins, on_twin)


def judge_records(reference: Engine, names: Sequence[str], run: Callable[[Engine], dict[str, np.ndarray]],
                  cand: Mapping[str, np.ndarray], positions_of: Callable[[str], list[int]], n_twins: int = N_TWINS,
                  on_twin: Callable[[int], None] | None = None) -> DraftCheck:
    """The module's test on the candidate's draft records `cand` (checkpoint -> [P_name, ...]): `run(engine)` gives
    an engine's records on the same inputs; R0 = run(reference), R_i = run of its twin i."""
    if not isinstance(reference, RoundoffTwins):
        raise ParityError(f"engine {reference.name} has no round-off twins: the drafter's null needs them")
    exact = run(reference)
    twins = []
    for i in range(n_twins):
        twins.append(run(reference.roundoff_twin(i + 1)))
        if on_twin:
            on_twin(i + 1)
    rows, dist = [], {}
    for name in names:
        e = rel_l2(exact[name], cand[name])
        dist[name] = np.stack([rel_l2(exact[name], tw[name]) for tw in twins])
        test = judge({name: e}, {name: dist[name]}, {name: np.asarray(positions_of(name))})
        rows.append(DraftRow(name, float(e.max(initial=0.0)), float(dist[name].max(initial=0.0)), test))
    return DraftCheck(tuple(rows), (), dist)


@dataclass(frozen=True)
class DraftFaultMatch:
    name: str
    exceed: int       # cells outside every twin, over all draft checkpoints, of the candidate around the fault's run
    cells: int
    worst: float      # the largest distance of the candidate from the fault's run

    @property
    def explains(self) -> bool:
        return self.exceed == 0 or binomial_tail(self.cells, 1.0 / (N_TWINS + 1), self.exceed) >= ALPHA


def draft_library(trace: Trace, dc: DraftCheck, base: RunOptions,
                  fault_engines: Sequence[tuple[str, Callable[[RunOptions], Engine], tuple[str, ...]]],
                  ) -> tuple[DraftFaultMatch | None, int]:
    """Every drafter fault of the trace's head kind (fault names `mtp-*` / `dspark-*`) as a mutation of the draft
    head on the candidate's trunk carriers (factories open the engine with the candidate's drafter), judged by the
    reference's twins: the candidate's distances from the fault's run against the twins' distances from R0, cell by
    cell, as `draft_check`. Returns the best reproduction (fewest exceeding cells, then the worst distance) and the
    draft-head runs spent; an engine whose clean run already reproduces the candidate credits none of its faults."""
    h, vec = trace.header, trace.vectors or {}
    best, runs = None, 0
    for _name, factory, faults in fault_engines:
        mine = [f for f in faults if f.startswith(h.draft["kind"] + "-")]
        if not mine:
            continue
        clean = _match("clean", _candidate_records(trace, factory(replace(base, inject=()))), vec, dc)
        runs += 1
        if clean.explains:
            continue
        for fault in mine:
            m = _match(fault, _candidate_records(trace, factory(replace(base, inject=(fault,)))), vec, dc)
            runs += 1
            if best is None or (m.exceed, m.worst) < (best.exceed, best.worst):
                best = m
    return best, runs


def _match(name: str, got: dict[str, np.ndarray], vec: dict[str, np.ndarray], dc: DraftCheck) -> DraftFaultMatch:
    exceed = cells = 0
    worst = 0.0
    for q, twins in dc.twins.items():
        e = rel_l2(got[q], vec[q])
        exceed += int((~(e <= twins.max(axis=0))).sum())
        cells += len(e)
        worst = max(worst, float(np.nan_to_num(e, nan=np.inf).max(initial=0.0)))
    return DraftFaultMatch(name, exceed, cells, worst)


def _candidate_records(trace: Trace, engine: Engine) -> dict[str, np.ndarray]:
    """`engine`'s draft head on the candidate's trunk carriers (as `draft_check` runs the reference)."""
    h, vec = trace.header, trace.vectors or {}
    carriers = {l: np.asarray(vec[block(l)], np.float32) for l in tapped_layers(engine, h.draft)}
    last = int(trace.ckpt["argmax"][trace.checkpoint_rows(FINAL_NORM)[-1]])
    return draft_records(engine, h.draft, carriers, h.tokens, h.positions, last)
