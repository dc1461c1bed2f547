"""The round-off null: how far a correct implementation can land from the reference, measured per cell.

One layer (or one sub-op) runs on the candidate's own inputs three ways: the exact reference R0, N Monte-Carlo
round-off twins R1..RN (`RoundoffTwins`: every sub-op output perturbed by a seeded random relative error of
at most 2⁻²⁴·√k, `reference_cpu.roundoff`), and the candidate itself. Per cell c = (quantity, position):

    e_i(c) = relL2(R_i(c), R0(c)),   e(c) = relL2(candidate(c), R0(c)).

Where an FP8/FP4/Q8 code sits on a rounding boundary some twins flip it, so their spread there is the flip's
size: flip-prone cells are measured, not excused by a rule. A correct candidate is one more draw of the same
round-off (exchangeable with the twins), so at every cell P(e(c) > max_i e_i(c)) ≤ 1/(N+1). The number X of
exceeding cells among C is compared with the Binomial(C, 1/(N+1)) tail: the departure is significant when
P(Binomial ≥ X) < ALPHA. N_TWINS = 19 (per-cell rate 5 %), ALPHA = 1e-3; cells of one layer are positively
correlated (one flip moves every later position), which the binomial tail ignores: the false-alarm rate this
gives on correct runs is measured by `make bench` (docs/check.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from parity.check import parallel
from parity.compare.metrics import rel_l2
from parity.contract.checkpoints import block, block_attn
from parity.contract.engine import Engine, LayerOutput, RoundoffTwins
from parity.contract.errors import ParityError
from parity.tracing.runner import ChunkResult

N_TWINS = 19
ALPHA = 1e-3


def binomial_tail(n: int, p: float, x: int) -> float:
    """P(Binomial(n, p) >= x), summed in log space (exact for the n of a layer's cells)."""
    if x <= 0:
        return 1.0
    if x > n:
        return 0.0
    lp, lq = math.log(p), math.log1p(-p)
    logs = [math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1) + k * lp + (n - k) * lq
            for k in range(x, n + 1)]
    top = max(logs)
    return min(1.0, math.exp(top) * sum(math.exp(v - top) for v in logs))


@dataclass(frozen=True)
class Cell:
    """One cell outside every twin: quantity, position, the candidate's distance and the twins' largest."""

    quantity: str
    position: int
    err: float
    twin_max: float

    @property
    def ratio(self) -> float:
        return self.err / self.twin_max if self.twin_max > 0 else math.inf


@dataclass(frozen=True)
class NullTest:
    """The exceedance count of one comparison against its round-off ensemble, and its binomial p-value (in words:
    `parity.check.words.null_words`)."""

    cells: int
    exceed: int
    twins: int
    p_value: float
    first: Cell | None            # the earliest exceeding cell (position order, then quantity order)
    worst: Cell | None            # the exceeding cell farthest outside (largest err / twin max)
    err: float                    # the candidate's largest distance over all cells
    nonfinite: int = 0            # cells where the candidate is NaN / inf: round-off never gives one

    @property
    def significant(self) -> bool:
        return self.nonfinite > 0 or self.p_value < ALPHA


def judge(cand: Mapping[str, np.ndarray], twins: Mapping[str, np.ndarray],
          positions: Mapping[str, np.ndarray]) -> NullTest:
    """The stated test over every cell: cand[q] [T_q] candidate distances, twins[q] [N, T_q] twin distances (both
    from the exact run R0), positions[q] [T_q] the position of each cell (rows: the emitting position). A
    non-finite candidate cell is outside (distance inf) and makes the test significant on its own."""
    n = min((len(t) for t in twins.values()), default=0)
    cells, exceed, first, worst, err, nonfinite = 0, 0, None, None, 0.0, 0
    for q, e in cand.items():
        e = np.asarray(e, np.float64)
        nonfinite += int((~np.isfinite(e)).sum())
        e = np.where(np.isfinite(e), e, np.inf)
        top = np.asarray(twins[q], np.float64).max(axis=0) if len(twins[q]) else np.zeros_like(e)
        out = np.flatnonzero(e > top)
        cells += len(e)
        exceed += len(out)
        err = max(err, float(e.max(initial=0.0)))
        for i in out:
            c = Cell(q, int(positions[q][i]), float(e[i]), float(top[i]))
            if first is None or c.position < first.position:
                first = c
            if worst is None or c.ratio > worst.ratio:
                worst = c
    p = binomial_tail(cells, 1.0 / (n + 1), exceed) if n else (0.0 if exceed else 1.0)
    return NullTest(cells, exceed, n, p, first, worst, err, nonfinite)


@dataclass(frozen=True)
class LayerNull:
    """One layer's round-off ensemble on the candidate's inputs (`parity.check.null`): per carrier quantity the
    twins' distances from their exact run, [N, T], each twin's sorted expert set per position, [N, T, K], and
    its sorted indexer selection, [N, T, top_k] (None off CSA layers)."""

    dist: dict[str, np.ndarray]
    ids: np.ndarray | None
    sel: np.ndarray | None = None


def carriers(outs: Sequence[LayerOutput], layer: int) -> dict[str, np.ndarray]:
    """A layer run's two carriers by checkpoint name, every position: blk.l.attn, blk.l -> [T, H, D]."""
    return {block_attn(layer): np.concatenate([o.attn_carrier for o in outs]),
            block(layer): np.concatenate([o.carrier for o in outs])}


def sorted_ids(outs: Sequence[LayerOutput]) -> np.ndarray:
    return np.sort(np.concatenate([o.diag.expert_ids for o in outs]), axis=1)


def sorted_sel(outs: Sequence[LayerOutput]) -> np.ndarray | None:
    if outs[0].diag.index_sel is None:
        return None
    return np.sort(np.concatenate([o.diag.index_sel for o in outs]), axis=1)


def layer_nulls(engine: Engine, cand: Sequence[ChunkResult], exact: dict[int, list[LayerOutput]],
                n: int = N_TWINS, on_layer: Callable[[int], None] | None = None) -> dict[int, LayerNull]:
    """The round-off ensembles of every layer of `exact` (engine's teacher-forced runs on the candidate's
    inputs): n twins of `engine` (`RoundoffTwins`), n layer-runs per layer. Layer-major: a layer's n twins run
    one after another, so its weights are dequantized once for all of them (a reference whose cache holds one
    layer of a 43-layer model would dequantize every layer n times in twin-major order). `on_layer(k)` after the
    k-th layer."""
    if not isinstance(engine, RoundoffTwins):
        raise ParityError(f"engine {engine.name} has no round-off twins (RoundoffTwins): no measured null")
    layers = sorted(exact)
    pooled = parallel.for_engine(engine)
    if pooled is None:
        nulls = (twin_null(engine, parallel.layer_inputs(cand, l), exact[l], l, n) for l in layers)
    else:
        d, ref = pooled
        nulls = d.twin_nulls(ref, layers, n, cand, {l: carriers(exact[l], l) for l in layers})
    out = {}
    for k, (l, null) in enumerate(zip(layers, nulls, strict=True), 1):
        out[l] = null
        if on_layer:
            on_layer(k)
    return out


def twin_null(engine: Engine, inputs: parallel.Inputs, exact: Sequence[LayerOutput] | dict[str, np.ndarray],
              layer: int, n: int) -> LayerNull:
    """One layer's null: twins 1..n of `engine` over `inputs` (per chunk (start_pos, tokens, carrier entering
    the layer)), each reduced to its distances from `exact` (the exact run's outputs, or their `carriers`) as it
    finishes. A pure function of its arguments, so a worker process computes the same null."""
    base = exact if isinstance(exact, dict) else carriers(exact, layer)
    dist: dict[str, list[np.ndarray]] = {q: [] for q in base}
    ids: list[np.ndarray] = []
    sel: list[np.ndarray] = []
    for seed in range(1, n + 1):
        runs = parallel.layer_run(engine.roundoff_twin(seed), layer, inputs)   # type: ignore[attr-defined]
        for q, arr in carriers(runs, layer).items():
            dist[q].append(rel_l2(base[q], arr))
        ids.append(sorted_ids(runs))
        picks = sorted_sel(runs)
        if picks is not None:
            sel.append(picks)
    return LayerNull({q: np.stack(v) for q, v in dist.items()}, np.stack(ids), np.stack(sel) if sel else None)
