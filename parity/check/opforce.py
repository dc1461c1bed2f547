"""Op-level teacher forcing: every sub-op of a layer judged on the candidate's own input to that op.

When the candidate dumped its sub-ops (a complete llama.cpp capture: every mapped tensor), the reference runs
each op of layer l on the candidate's value of that op's inputs (`OpForcing`, `checkpoints.SUBOP_INPUTS`), so
roundings never accumulate from one op to the next: op k's local error is op k's alone. Each op's cells
(positions; emitted rows at their emitting position) are judged by the round-off null of the same forced run
(`parity.check.null`); discrete picks (expert sets, indexer rows) that differ are TIEs when some twin makes
the candidate's pick too, else structural. A layer's verdict is the verdict of its ops.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from parity.check import parallel
from parity.check.attribution import layer_input
from parity.check.discrete import DiscreteTie, PickDiffers, PickTie, RowsEmitted, Structural, pick_change
from parity.check.envelope import DISCRETE, ROW_CAPTURES
from parity.check.hypotheses import Fit, twins_make
from parity.check.null import N_TWINS, NullTest, judge
from parity.compare.metrics import rel_l2
from parity.contract.checkpoints import SUBOP_INPUTS, SUBOPS, block, block_attn
from parity.contract.engine import Engine, LayerOutput, OpForcing, RoundoffTwins
from parity.contract.errors import ParityError
from parity.tracing.runner import ChunkResult

OP_OF = {cap: op for op, caps in SUBOPS for cap in caps}


def given_of(dump: ChunkResult, layer: int) -> dict[str, np.ndarray]:
    """The candidate's sub-op values of one chunk, as `OpForcing.forward_ops` takes them (HC mixes included),
    C-contiguous (as a worker process receives them: `attribution.layer_input`)."""
    given = dict(dump.captures[layer])
    diag = dump.diags[layer]
    for which, (_pre, post, comb) in (("hc_attn", diag.hc_attn), ("hc_ffn", diag.hc_ffn)):
        given[f"{which}.post"], given[f"{which}.comb"] = post, comb
    return {k: np.ascontiguousarray(v) for k, v in given.items()}


def forced_run(engine: Engine, cand: Sequence[ChunkResult], dumps: Sequence[ChunkResult],
               layer: int) -> list[LayerOutput]:
    """`layer` over the candidate's chunks, every op on the candidate's inputs (one layer-run)."""
    check_forcing(engine, dumps, layer)
    state = engine.new_state()
    return [engine.forward_ops(state, layer, layer_input(c, layer), c.tokens, c.start_pos, given_of(d, layer))
            for c, d in zip(cand, dumps, strict=True)]


def check_forcing(engine: Engine, dumps: Sequence[ChunkResult], layer: int) -> None:
    """Refuse op-level forcing by an engine without `OpForcing`, or from dumps that lack an op's input."""
    if not isinstance(engine, OpForcing):
        raise ParityError(f"engine {engine.name} cannot run single ops on given inputs (OpForcing)")
    needed = {i for inputs in SUBOP_INPUTS.values() for i in inputs} - {"carrier"}
    missing = sorted(needed - set(given_of(dumps[0], layer)))
    if missing:
        raise ParityError(f"layer {layer}: the candidate's dumps lack sub-op input(s) {', '.join(missing)}: no "
                          "op-level forcing (checkpoints.SUBOP_INPUTS)")


def op_cells(a: Sequence[LayerOutput], b: Sequence[LayerOutput], ratio: int) -> dict[str, tuple[np.ndarray,
                                                                                              np.ndarray]]:
    """Per float capture: (rel-L2 per cell, the cell's position) between two runs' captures; emitted rows are
    compared row by row at their emitting position (j+1)·m - 1, each in the chunk that emitted it (in a forced run
    the rows of earlier chunks are the candidate's own: only a chunk's new rows are the reference's)."""
    out = {}
    for name in a[0].captures:
        if name in DISCRETE:
            continue
        if name in ROW_CAPTURES:   # equal counts: a count that differs is structural (`row_counts`)
            x, y = new_rows(a, name), new_rows(b, name)
            n = min(len(x), len(y))
            out[name] = (rel_l2(x[:n], y[:n]) if n else np.zeros(0), (np.arange(n) + 1) * max(ratio, 1) - 1)
            continue
        x = np.concatenate([o.captures[name] for o in a])
        y = np.concatenate([o.captures[name] for o in b])
        out[name] = (rel_l2(x, y), np.arange(len(x)))
    return out


def new_rows(outs: Sequence[LayerOutput], name: str) -> np.ndarray:
    """The rows each chunk emitted (its cumulative capture past the previous chunk's), in order.  [rows, d]"""
    caps = [o.captures[name] for o in outs]
    return np.concatenate([c[len(p):] for p, c in zip([caps[0][:0], *caps[:-1]], caps, strict=True)])


def _picks(outs: Sequence[LayerOutput], name: str) -> np.ndarray:
    return np.sort(np.concatenate([o.captures[name] for o in outs]), axis=1)


@dataclass(frozen=True)
class OpVerdict:
    """One layer judged op by op: the pooled test, each op's test, the culprit op, ties and structure."""

    fit: Fit
    ops: dict[str, NullTest]


def judge_ops(ref: Sequence[LayerOutput], twins: Sequence[Sequence[LayerOutput]], dumps: Sequence[ChunkResult],
              layer: int, ratio: int) -> OpVerdict:
    """The candidate's dumped sub-ops of `layer` against a forced run `ref` and its twins' forced runs."""
    own = [LayerOutput(d.checkpoints[block_attn(layer)], d.checkpoints[block(layer)], d.diags[layer],
                       d.captures[layer]) for d in dumps]
    cand = op_cells(ref, own, ratio)
    spread = [op_cells(ref, t, ratio) for t in twins]
    per_capture = {q: judge({q: cand[q][0]}, {q: np.stack([s[q][0][: len(cand[q][0])] for s in spread])},
                            {q: cand[q][1]}) for q in cand}
    # each op is its own test: Bonferroni over the captures judged, so one departing op is never diluted by the
    # cells of the others (a layer's verdict is the verdict of its ops)
    ops: dict[str, NullTest] = {}
    for q, t in per_capture.items():
        t = replace(t, p_value=min(1.0, t.p_value * len(per_capture)))
        if OP_OF[q] not in ops or t.p_value < ops[OP_OF[q]].p_value:
            ops[OP_OF[q]] = t
    pooled = judge({q: e for q, (e, _) in cand.items()},
                   {q: np.stack([s[q][0][: len(cand[q][0])] for s in spread]) for q in cand},
                   {q: p for q, (_, p) in cand.items()})
    struct: Structural | None = None
    ties: list[DiscreteTie] = []
    for name in ROW_CAPTURES:
        n_ref, n_own = len(ref[-1].captures[name]), len(own[-1].captures[name])
        if n_ref != n_own and struct is None:
            struct = RowsEmitted(OP_OF[name], name, n_own, n_ref, (min(n_ref, n_own) + 1) * max(ratio, 1) - 1)
    for name in DISCRETE:
        mine, theirs = _picks(ref, name), _picks(own, name)
        members = np.stack([_picks(t, name) for t in twins]) if twins else None
        for p in np.flatnonzero((mine != theirs).any(axis=1)):
            if twins_make(None if members is None else members[:, p], theirs[p], mine[p]):
                ties.append(PickTie(OP_OF[name], name, int(p), *pick_change(theirs[p], mine[p])))
            elif struct is None:
                struct = PickDiffers(OP_OF[name], name, int(p))
    significant = [op for op, _ in SUBOPS if op in ops and ops[op].significant]
    culprit = (struct.subop if struct is not None else significant[0] if significant else
               max(ops, key=lambda o: ops[o].exceed) if pooled.significant else None)
    positions = [p for p in (struct.position if struct is not None else None,
                             ops[culprit].first.position if culprit in ops and ops[culprit].first else None)
                 if p is not None]
    vec_err = {q: float(e.max(initial=0.0)) for q, (e, _) in cand.items()}
    strongest = min([pooled, *ops.values()], key=lambda t: t.p_value)
    fit = Fit(vec_err.get("hc_attn_post"), vec_err.get("hc_ffn_post"), replace(strongest, err=pooled.err), struct,
              tuple(ties), min(positions) if positions else None, culprit)
    return OpVerdict(fit, ops)


def op_verdict(engine: Engine, cand: Sequence[ChunkResult], dumps: Sequence[ChunkResult], layer: int,
               n: int = N_TWINS) -> OpVerdict:
    """Forced run of `layer` and n forced twin runs (1 + n layer-runs), judged op by op."""
    if not isinstance(engine, RoundoffTwins):
        raise ParityError(f"engine {engine.name} has no round-off twins (RoundoffTwins): no measured null")
    pooled = parallel.for_engine(engine)
    if pooled is None:
        ref = forced_run(engine, cand, dumps, layer)
        twins = [forced_run(engine.roundoff_twin(s), cand, dumps, layer) for s in range(1, n + 1)]
    else:   # 1 + n units on the work pool (`parity.check.parallel`), merged in seed order
        check_forcing(engine, dumps, layer)
        d, eref = pooled
        ref, *twins = [outs for outs, _ in d.layers([(eref, s or None, layer) for s in range(n + 1)], cand,
                                                    dumps=dumps)]
    return judge_ops(ref, twins, dumps, layer, engine.config.ratio(layer))
