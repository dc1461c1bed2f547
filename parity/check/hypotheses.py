"""Hypotheses that explain a layer's local departure, tested on the reference side on the candidate's inputs.

* benign numerics: named, opt-in reference variants (`RunOptions` approximate modes) that reproduce known
  engine behaviours; the approximations a trace header declares come first;
* routing flips: the reference replays the candidate's expert ids;
* defects: the library of known porting bugs, each a fault switch of an engine that offers them through the
  protocol (`FaultSwitches`), run as a mutation of the culprit layer.
A hypothesis explains a layer when its run of that layer on the candidate's inputs reproduces the candidate's
recorded output within the round-off null (`parity.check.null`: its own twins for a reference variant, the
exact run's for a mutation), with no structural difference left (visible rows; expert sets and indexer
selections that no twin makes). A variant costs 1 + N_TWINS layer-runs, a mutation one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from parity.check import parallel
from parity.check.attribution import teacher_forced
from parity.check.discrete import (
    DiscreteTie,
    ExpertSetDiffers,
    RouterTie,
    SelectionDiffers,
    SelectionTie,
    Structural,
    VisibleRows,
    pick_change,
)
from parity.check.envelope import Envelope
from parity.check.null import N_TWINS, LayerNull, NullTest, carriers, judge, layer_nulls, sorted_ids, sorted_sel
from parity.check.subops import compare_subops
from parity.compare.metrics import rel_l2
from parity.compare.verdict import SubopStatus
from parity.contract.checkpoints import block, block_attn
from parity.contract.engine import Engine, LayerOutput, RunOptions
from parity.contract.errors import ParityError
from parity.tracing.records import Trace
from parity.tracing.runner import ChunkResult

EngineFactory = Callable[[RunOptions], Engine]

# Benign numerics: hypothesis name -> the RunOptions fields of the reference variant that reproduces it.
NUMERICS: dict[str, dict[str, str]] = {
    "act-quant-q8_0": {"act_quant": "q8_0"},     # llama.cpp CPU: activations to Q8_0 before quantized matmuls
    "act-bf16": {"act_quant": "bf16"},
    "act-f16": {"act_quant": "f16"},
    "act-quant-llamacpp": {"act_quant": "llamacpp"},  # llama.cpp CPU by weight type: Q8_K / Q8_0 / f16 / bf16
    "kv-f16": {"kv_cache": "f16"},
    "rope-angle-recurrence": {"rope_angles": "recurrence"},   # ggml: theta_i = theta_{i-1} * B^(-2/r)
}


@dataclass(frozen=True)
class Variant:
    """A reference variant: the RunOptions fields it changes; `parts` names the hypotheses it stacks."""

    name: str
    changes: dict
    parts: tuple[str, ...] = ()

    def options(self, base: RunOptions) -> RunOptions:
        return replace(base, **self.changes)

    def plus(self, other: Variant) -> Variant:
        parts = (*(self.parts or (self.name,)), *(other.parts or (other.name,)))
        return Variant(" + ".join(parts), {**self.changes, **other.changes}, parts)


@dataclass(frozen=True)
class Fit:
    """How one run of a layer reproduces the candidate's recorded output of that layer, judged by the null."""

    err_attn: float | None     # max rel-L2 of blk.l.attn (None: not recorded)
    err: float | None          # max rel-L2 of blk.l
    test: NullTest             # exceedances over the round-off twins
    structural: Structural | None   # a discrete difference no twin shows (visible rows, an expert set)
    ties: tuple[DiscreteTie, ...]   # discrete differences some twin also makes (each names its sub-op)
    position: int | None       # first exceeding cell's or structural difference's position
    subop: str | None = None   # op-level judgement: the op where the departure is (None: layer-level)

    @property
    def explains(self) -> bool:
        return not self.test.significant and self.structural is None

    @property
    def worst(self) -> float:
        """The largest distance judged (both carriers; every op's cells at op level)."""
        return max(e for e in (self.err_attn, self.err, self.test.err) if e is not None)


def table_rows(trace: Trace, kind: str, layer: int) -> dict[str, np.ndarray]:
    t = getattr(trace, kind)
    sel = t["layer"] == layer
    return {k: v[sel] for k, v in t.cols.items()}


def twins_make(members: np.ndarray | None, theirs: np.ndarray, mine: np.ndarray) -> bool:
    """A differing discrete pick is within round-off when every element the candidate picked and the reference
    did not is picked by some twin, and every element it dropped is dropped by some twin (an exact tie among
    several rows is broken every way by the twins, though no one twin need make the candidate's whole set).
    members [N, K] the twins' picks at that position, theirs / mine [K] (-1 padding ignored)."""
    if members is None:
        return False
    added = set(theirs.tolist()) - set(mine.tolist()) - {-1}
    dropped = set(mine.tolist()) - set(theirs.tolist()) - {-1}
    return (all((members == a).any(axis=1).any() for a in added)
            and all((~(members == d).any(axis=1)).any() for d in dropped))


def ulps(margin: float, scale: float) -> float:
    """A margin in float32 ulps at the size of the values it separates."""
    return margin / float(np.spacing(np.float32(max(abs(scale), 1e-30))))


def discrete_differences(trace: Trace, outs: Sequence[LayerOutput], layer: int,
                         null: LayerNull) -> tuple[Structural | None, tuple[DiscreteTie, ...]]:
    """(first structural difference or None, ties), records of `parity.check.discrete`, at `layer` between the
    candidate's recorded tables and a run of that layer on its inputs. Visible compressed-row counts must agree; an
    expert set that differs is a TIE when some round-off twin picks the candidate's set too (margin in ulps and
    absolute), else structural."""
    vis = np.concatenate([o.diag.n_comp_visible for o in outs])
    attn = table_rows(trace, "attn", layer)
    if len(attn["pos"]):
        bad = np.flatnonzero(attn["n_comp"] != vis[attn["pos"]])
        if len(bad):
            p = int(attn["pos"][bad[0]])
            return VisibleRows(p, int(attn["n_comp"][bad[0]]), int(vis[p])), ()
    moe = table_rows(trace, "moe", layer)
    ties: list[DiscreteTie] = []
    if len(moe["pos"]):
        mine = sorted_ids(outs)[moe["pos"]]
        theirs = np.sort(moe["ids"], axis=1)
        margin = np.concatenate([o.diag.router_margin for o in outs])[moe["pos"]]
        for i in np.flatnonzero((mine != theirs).any(axis=1)):
            p = int(moe["pos"][i])
            m = float(margin[i])
            if twins_make(None if null.ids is None else null.ids[:, p], theirs[i], mine[i]):
                ties.append(RouterTie(p, m, ulps(m, 1.0)))
                continue
            return ExpertSetDiffers(p, m), tuple(ties)
    mine_sel = sorted_sel(outs)
    if mine_sel is not None and len(attn["pos"]) and attn["has_sel"].any():
        rows = np.flatnonzero(attn["has_sel"])
        theirs = attn["sel"][rows]
        width = mine_sel.shape[1]
        if (theirs[:, width:] != -1).any():   # the recorded width may exceed top_k only by padding
            raise ParityError(f"layer {layer}: the candidate's indexer selection holds more than top_k = {width} rows")
        theirs = theirs[:, :width]
        if theirs.shape[1] < width:
            theirs = np.concatenate([theirs, np.full((len(rows), width - theirs.shape[1]), -1, theirs.dtype)], 1)
        theirs = np.sort(theirs, axis=1)
        for i in np.flatnonzero((mine_sel[attn["pos"][rows]] != theirs).any(axis=1)):
            p = int(attn["pos"][rows][i])
            if twins_make(None if null.sel is None else null.sel[:, p], theirs[i], mine_sel[p]):
                ties.append(SelectionTie(p, *pick_change(theirs[i], mine_sel[p])))
                continue
            return SelectionDiffers(p), tuple(ties)
    return None, tuple(ties)


def fit(trace: Trace, outs: Sequence[LayerOutput], layer: int, null: LayerNull) -> Fit:
    """Judge a run of `layer` (one LayerOutput per chunk, every position) against the candidate's vectors, with
    the round-off ensemble `null` of that run (or of the exact run, for a mutation)."""
    vec = trace.vectors or {}
    runs = carriers(outs, layer)
    errs = {q: rel_l2(runs[q], vec[q]) for q in runs if q in vec}
    T = len(next(iter(runs.values())))
    test = judge(errs, {q: null.dist[q] for q in errs}, {q: np.arange(T) for q in errs})
    struct, ties = discrete_differences(trace, outs, layer, null)
    firsts = [p for p in ((test.first.position if test.significant and test.first else None),
                          struct.position if struct is not None else None) if p is not None]
    pick = (lambda n: float(errs[n].max()) if n in errs else None)  # noqa: E731
    return Fit(pick(block_attn(layer)), pick(block(layer)), test, struct, ties,
               min(firsts) if firsts else None)


def benign_variants(trace: Trace, base: RunOptions) -> list[Variant]:
    """The benign-numerics variants in the order they are tried: the approximations the header declares, then
    the others; the QAT round trips toggled only when the header does not declare them (an engine that says it
    runs the FP8/FP4 simulations and does not is a defect, not noise)."""
    flags = trace.header.flags
    declared = [n for n, ch in NUMERICS.items() if all(flags.get(k) == v for k, v in ch.items())]
    names = [*declared, *(n for n in NUMERICS if n not in declared)]
    out = [Variant(n, dict(NUMERICS[n])) for n in names]
    if "fp8_kv" not in flags and "fp4_indexer" not in flags:
        on = base.fp8_kv and base.fp4_indexer
        out.append(Variant("qat-sims-off" if on else "qat-sims-on", {"fp8_kv": not on, "fp4_indexer": not on}))
    return out


Judge = Callable[[Engine, int], Fit]   # (engine, layer) -> that engine's run of the layer, judged by its own null


def layer_judge(trace: Trace, cand: Sequence[ChunkResult], n_twins: int = N_TWINS) -> Judge:
    """Layer-level judgement: the engine's layer on the candidate's carrier, its own twins (1 + n layer-runs)."""
    def judge_(engine: Engine, layer: int) -> Fit:
        outs = teacher_forced(engine, cand, [layer])
        return fit(trace, outs[layer], layer, layer_nulls(engine, cand, outs, n_twins)[layer])
    return judge_


class VariantTester:
    """Runs benign variants of the culprit layer on the candidate's inputs, each judged by `judge` with its own
    round-off ensemble (1 + N_TWINS layer-runs a try), one engine per variant, reused across layers: single
    variants first (those already accepted first), then pairs built on the two closest ones."""

    def __init__(self, trace: Trace, ref_engine: Engine, make_reference: EngineFactory, judge_: Judge,
                 notes: list[str], runs: dict[str, int], n_twins: int = N_TWINS) -> None:
        self.trace, self.ref, self.make, self.judge = trace, ref_engine, make_reference, judge_
        self.notes, self.runs, self.n_twins = notes, runs, n_twins
        self.variants = benign_variants(trace, ref_engine.options)
        self.changes = {v.name: v.changes for v in self.variants}
        self.engines: dict[str, Engine | None] = {}
        self.accepted: list[Variant] = []
        self.closest: dict[int, Fit] = {}   # layer -> the best fit no variant turned into an explanation

    def engine_of(self, name: str) -> Engine | None:
        return self.engine(Variant(name, self.changes[name]))

    def engine(self, v: Variant) -> Engine | None:
        if v.name not in self.engines:
            try:
                self.engines[v.name] = self.make(v.options(self.ref.options))
            except ParityError as e:
                self.notes.append(f"hypothesis {v.name} not testable: {e}")
                self.engines[v.name] = None
        return self.engines[v.name]

    def _fit(self, v: Variant, layer: int) -> Fit | None:
        engine = self.engine(v)
        if engine is None:
            return None
        self.runs["hypotheses"] = self.runs.get("hypotheses", 0) + 1 + self.n_twins
        return self.judge(engine, layer)

    def explain(self, layer: int) -> tuple[Variant, Fit] | None:
        """The first variant (or pair) whose run of `layer` reproduces the candidate within its own null."""
        done = {v.name for v in self.accepted}
        order = [*self.accepted, *(v for v in self.variants if v.name not in done)]
        tried: list[tuple[tuple[int, float], Variant]] = []
        for v in order:
            f = self._fit(v, layer)
            if f is None:
                continue
            if f.explains:
                return self._accept(v, f)
            tried.append(((f.test.exceed, f.worst), v))
            if layer not in self.closest or (f.test.exceed, f.worst) < (self.closest[layer].test.exceed,
                                                                         self.closest[layer].worst):
                self.closest[layer] = f
        tried.sort(key=lambda t: t[0])
        for _, best in tried[:2]:
            for _, other in tried:
                if (other.name == best.name or set(other.parts or (other.name,)) & set(best.parts or (best.name,))
                        or set(other.changes) & set(best.changes)):  # two values of one option do not stack
                    continue
                pair = best.plus(other)
                f = self._fit(pair, layer)
                if f is not None and f.explains:
                    return self._accept(pair, f)
        return None

    def _accept(self, v: Variant, f: Fit) -> tuple[Variant, Fit]:
        if v.name not in {a.name for a in self.accepted}:
            self.accepted.insert(0, v)
        return v, f


def routing_replay(trace: Trace, make_reference: EngineFactory, base: RunOptions, cand: Sequence[ChunkResult],
                   layer: int, null: LayerNull) -> tuple[str, None, Fit] | None:
    """Routing flips: the reference's layer with the candidate's expert ids (from its `moe` table, every
    position needed), judged by the exact run's null. Returns ('routing-flip', None, fit) when that reproduces
    the output."""
    moe = trace.moe
    sel = moe["layer"] == layer
    pos, ids = moe["pos"][sel], moe["ids"][sel]
    if not np.array_equal(np.sort(pos), np.arange(len(trace.header.tokens))):
        return None
    table = np.empty_like(ids)
    table[pos] = ids

    def override(l: int, start: int, n: int) -> np.ndarray:
        return table[start : start + n]

    engine = make_reference(replace(base, expert_override=override))
    f = fit(trace, teacher_forced(engine, cand, [layer])[layer], layer, null)
    return ("routing-flip", None, f) if f.explains else None


@dataclass(frozen=True)
class FaultMatch:
    name: str
    engine: Engine
    fit: Fit


def defect_library(trace: Trace, ref_engine: Engine, cand: Sequence[ChunkResult], layer: int, null: LayerNull,
                   fault_engines: Sequence[tuple[str, EngineFactory, tuple[str, ...]]],
                   ) -> tuple[FaultMatch | None, int]:
    """Every known fault as a mutation of `layer` on the candidate's inputs, judged by the exact run's null; the
    best reproduction (structure first, then exceeding cells, then the residual) and the layer-runs spent. An
    engine whose clean run already reproduces the candidate credits none of its faults (its own round-off, not
    the mutation, would be what matches)."""
    base = ref_engine.options
    d = parallel.current()
    if d is not None and all(parallel.loader_of(f) is not None for _, f, _ in fault_engines):
        return _pooled_library(d, trace, base, cand, layer, null, fault_engines)
    best, runs = None, 0
    for _name, factory, faults in fault_engines:
        clean = factory(RunOptions(fp8_kv=base.fp8_kv, fp4_indexer=base.fp4_indexer))
        runs += 1
        if fit(trace, teacher_forced(clean, cand, [layer])[layer], layer, null).explains:
            continue  # the fault engine reproduces the candidate without any fault: no mutation can be credited
        for fault in faults:
            engine = factory(RunOptions(fp8_kv=base.fp8_kv, fp4_indexer=base.fp4_indexer, inject=(fault,)))
            f = fit(trace, teacher_forced(engine, cand, [layer])[layer], layer, null)
            runs += 1
            key = (f.structural is not None, f.test.exceed, f.worst)
            if best is None or key < (best.fit.structural is not None, best.fit.test.exceed, best.fit.worst):
                best = FaultMatch(fault, engine, f)
    return best, runs


def _pooled_library(d: parallel.Distributor, trace: Trace, base: RunOptions, cand: Sequence[ChunkResult],
                    layer: int, null: LayerNull, fault_engines: Sequence[tuple[str, EngineFactory, tuple[str, ...]]],
                    ) -> tuple[FaultMatch | None, int]:
    """`defect_library` on the work pool: each engine's clean run, then all its faults at once (one unit each),
    judged and ranked in the serial order; the best match's engine is rebuilt here."""
    best, runs = None, 0
    clean = RunOptions(fp8_kv=base.fp8_kv, fp4_indexer=base.fp4_indexer)
    for _name, factory, faults in fault_engines:
        loader = parallel.loader_of(factory)
        assert loader is not None
        (outs, said), = d.layers([(parallel.EngineRef(loader, clean), None, layer)], cand)
        d.said(said)
        runs += 1
        if fit(trace, outs, layer, null).explains:
            continue
        refs = [parallel.EngineRef(loader, replace(clean, inject=(fault,))) for fault in faults]
        for ref, (outs, said) in zip(refs, d.layers([(r, None, layer) for r in refs], cand), strict=True):
            d.said(said)
            f = fit(trace, outs, layer, null)
            runs += 1
            key = (f.structural is not None, f.test.exceed, f.worst)
            if best is None or key < (best[2].structural is not None, best[2].test.exceed, best[2].worst):
                best = (ref.options.inject[0], ref, f)
    if best is None:
        return None, runs
    return FaultMatch(best[0], d.build(best[1]), best[2]), runs


def name_subop(exact: Engine, other: Engine, cand: Sequence[ChunkResult], layer: int, env: Envelope) -> str | None:
    """The first sub-op (SUBOPS order) where `other` departs from `exact`, both run on the candidate's inputs
    with captures: where a matched hypothesis or fault acts. 2 layer-runs."""
    a = teacher_forced(exact, cand, [layer], capture=True)[layer]
    b = teacher_forced(other, cand, [layer], capture=True)[layer]
    subs = compare_subops(a, b, cand, layer, exact.config.ratio(layer), env, (exact.name, other.name))
    hit = (next((s for s in subs if s.status == SubopStatus.DEFECT), None)
           or next((s for s in subs if s.status == SubopStatus.NOISE), None))
    return hit.name if hit else None
