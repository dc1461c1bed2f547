"""Hypotheses that explain a layer's local departure, tested on the reference side on the candidate's inputs.

* benign numerics: named, opt-in reference variants (`RunOptions` approximate modes) that reproduce known
  engine behaviours; the approximations a trace header declares come first;
* routing flips within the router-margin noise: the reference replays the candidate's expert ids;
* defects: the library of known porting bugs, each a fault switch of an engine that offers them through the
  protocol (`FaultSwitches`), run as a mutation of the culprit layer.
A hypothesis explains a layer when its run of that layer on the candidate's inputs reproduces the candidate's
recorded output inside the envelope, structure (visible rows, expert sets) included. Each costs one layer-run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from parity.bisect.attribution import teacher_forced
from parity.bisect.envelope import Envelope
from parity.bisect.search import FLIP_FRACTION, compare_subops
from parity.compare.metrics import rel_l2, set_overlap
from parity.contract.checkpoints import block, block_attn
from parity.contract.engine import Engine, LayerOutput, RunOptions
from parity.contract.errors import ParityError
from parity.tracing.records import Trace
from parity.tracing.runner import ChunkResult

EngineFactory = Callable[[RunOptions], Engine]
# A rounding flip leaves at most this fraction of the exact path's error at its position. Measured: isolated Q8_0
# activation-rounding flips between the torch engine and the reference's q8_0 variant leave 22 % and 43 % of the
# exact path's error (tiny mxfp4 model, 13-token prompt, layers 1 and 2); a variant that explains less is no flip.
FLIP_RESIDUAL = 0.5

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
    """How well one run of a layer reproduces the candidate's recorded output of that layer."""

    err_attn: float | None     # max rel-L2 of blk.l.attn (None: not recorded)
    err: float | None          # max rel-L2 of blk.l
    excess: float              # max excess over the envelope of the two
    position: int | None       # first position outside the envelope, or of the structural difference
    structural: str | None
    pos_excess: np.ndarray = field(default_factory=lambda: np.zeros(0))  # [T] max excess of the two halves
    pos_err: np.ndarray = field(default_factory=lambda: np.zeros(0))     # [T] max rel-L2 of the two halves

    @property
    def explains(self) -> bool:
        return self.excess <= 1 and self.structural is None

    def flips_left(self, exact: Fit) -> np.ndarray | None:
        """Positions a rounding variant leaves outside the envelope when it otherwise explains the layer, or None.
        A variant that rounds (Q8_0 / bf16 / f16 activations, f16 KV, FP8/FP4) flips a code where the
        candidate's input and the reference's differ by round-off near a rounding boundary, as the QAT
        simulations do: accepted are at most max(1, FLIP_FRACTION * T) such positions, each with a residual
        <= FLIP_RESIDUAL of the exact path's error there (the variant explains >= 90% of it)."""
        out = np.flatnonzero(self.pos_excess > 1)
        if self.structural is not None or not len(out) or len(out) > max(1, FLIP_FRACTION * len(self.pos_excess)):
            return None
        return out if bool((self.pos_err[out] <= FLIP_RESIDUAL * exact.pos_err[out]).all()) else None


def table_rows(trace: Trace, kind: str, layer: int) -> dict[str, np.ndarray]:
    t = getattr(trace, kind)
    sel = t["layer"] == layer
    return {k: v[sel] for k, v in t.cols.items()}


def structural_difference(trace: Trace, outs: Sequence[LayerOutput], layer: int,
                          env: Envelope) -> tuple[str, int] | None:
    """(what, position) of the first structural difference at `layer` between the candidate's recorded tables
    and a run of that layer on the candidate's inputs: visible compressed-row count, or an expert set that
    differs at a router margin above the noise. None when the candidate recorded neither or both agree."""
    vis = np.concatenate([o.diag.n_comp_visible for o in outs])
    attn = table_rows(trace, "attn", layer)
    if len(attn["pos"]):
        bad = np.flatnonzero(attn["n_comp"] != vis[attn["pos"]])
        if len(bad):
            p = int(attn["pos"][bad[0]])
            return f"visible compressed rows {int(attn['n_comp'][bad[0]])} vs reference {int(vis[p])}", p
    moe = table_rows(trace, "moe", layer)
    if len(moe["pos"]):
        ids = np.concatenate([o.diag.expert_ids for o in outs])[moe["pos"]]
        margin = np.concatenate([o.diag.router_margin for o in outs])[moe["pos"]]
        ov = set_overlap(ids, moe["ids"])
        tol = env.margin_tol(layer)
        bad = np.flatnonzero((ov < 1) & ~(np.isfinite(margin) & (margin <= tol)))
        if len(bad):
            p = int(moe["pos"][bad[0]])
            return f"expert set differs at router margin {margin[bad[0]]:.3g} > noise {tol:.3g}", p
    return None


def fit(trace: Trace, outs: Sequence[LayerOutput], layer: int, env: Envelope) -> Fit:
    """Compare a run of `layer` (one LayerOutput per chunk, every position) with the candidate's vectors."""
    vec = trace.vectors or {}
    errs, first = {}, []
    for name, got in ((block_attn(layer), np.concatenate([o.attn_carrier for o in outs])),
                      (block(layer), np.concatenate([o.carrier for o in outs]))):
        if name not in vec:
            continue
        e = rel_l2(got, vec[name])
        errs[name] = e
        out = np.flatnonzero(e > env.limit(env.floor(name)))
        if len(out):
            first.append(int(out[0]))
    struct = structural_difference(trace, outs, layer, env)
    if struct is not None:
        first.append(struct[1])
    excess = max((float(env.excess_at(n, e.max())) for n, e in errs.items()), default=0.0)
    pick = (lambda n: float(errs[n].max()) if n in errs else None)  # noqa: E731
    pos_excess = np.max([env.excess_at(n, e) for n, e in errs.items()], axis=0)
    pos_err = np.max(list(errs.values()), axis=0)
    return Fit(pick(block_attn(layer)), pick(block(layer)), excess, min(first) if first else None,
               struct[0] if struct else None, pos_excess, pos_err)


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


class VariantTester:
    """Runs benign variants of the culprit layer on the candidate's inputs, one engine per variant, reused across
    layers: single variants first (those already accepted first), then pairs built on the closest ones."""

    def __init__(self, trace: Trace, ref_engine: Engine, make_reference: EngineFactory, cand: Sequence[ChunkResult],
                 env: Envelope, notes: list[str], runs: dict[str, int]) -> None:
        self.trace, self.ref, self.make, self.cand, self.env = trace, ref_engine, make_reference, cand, env
        self.notes, self.runs = notes, runs
        self.variants = benign_variants(trace, ref_engine.options)
        self.changes = {v.name: v.changes for v in self.variants}
        self.engines: dict[str, Engine | None] = {}
        self.accepted: list[Variant] = []

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
        self.runs["hypotheses"] = self.runs.get("hypotheses", 0) + 1
        return fit(self.trace, teacher_forced(engine, self.cand, [layer])[layer], layer, self.env)

    def explain(self, layer: int, exact: Fit) -> tuple[Variant, Fit, np.ndarray | None] | None:
        """The first variant (or pair) that explains `layer`: inside the envelope everywhere, or but for isolated
        rounding flips (`Fit.flips_left` against the exact path's fit `exact`; the positions are returned)."""
        done = {v.name for v in self.accepted}
        order = [*self.accepted, *(v for v in self.variants if v.name not in done)]
        tried: list[tuple[float, Variant]] = []
        for v in order:
            f = self._fit(v, layer)
            if f is None:
                continue
            if f.explains or f.flips_left(exact) is not None:
                return self._accept(v, f, exact)
            tried.append((f.excess, v))
        tried.sort(key=lambda t: t[0])
        for _, best in tried[:2]:
            for _, other in tried:
                if (other.name == best.name or set(other.parts or (other.name,)) & set(best.parts or (best.name,))
                        or set(other.changes) & set(best.changes)):  # two values of one option do not stack
                    continue
                pair = best.plus(other)
                f = self._fit(pair, layer)
                if f is not None and (f.explains or f.flips_left(exact) is not None):
                    return self._accept(pair, f, exact)
        return None

    def _accept(self, v: Variant, f: Fit, exact: Fit) -> tuple[Variant, Fit, np.ndarray | None]:
        if v.name not in {a.name for a in self.accepted}:
            self.accepted.insert(0, v)
        return v, f, (None if f.explains else f.flips_left(exact))


def routing_replay(trace: Trace, make_reference: EngineFactory, base: RunOptions, cand: Sequence[ChunkResult],
                   layer: int, env: Envelope) -> tuple[str, None, Fit] | None:
    """Routing flips within the margin noise: the reference's layer with the candidate's expert ids (from its
    `moe` table, every position needed). Returns ('routing-flip', None, fit) when that reproduces the output."""
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
    f = fit(trace, teacher_forced(engine, cand, [layer])[layer], layer, env)
    return ("routing-flip", None, f) if f.explains else None


@dataclass(frozen=True)
class FaultMatch:
    name: str
    engine: Engine
    fit: Fit


def defect_library(trace: Trace, ref_engine: Engine, cand: Sequence[ChunkResult], layer: int, env: Envelope,
                   fault_engines: Sequence[tuple[str, EngineFactory, tuple[str, ...]]],
                   ) -> tuple[FaultMatch | None, int]:
    """Every known fault as a mutation of `layer` on the candidate's inputs; the best reproduction (structure
    first, then the residual excess) and the number of layer-runs spent."""
    base = ref_engine.options
    best, runs = None, 0
    for _name, factory, faults in fault_engines:
        for fault in faults:
            engine = factory(RunOptions(fp8_kv=base.fp8_kv, fp4_indexer=base.fp4_indexer, inject=(fault,)))
            f = fit(trace, teacher_forced(engine, cand, [layer])[layer], layer, env)
            runs += 1
            if best is None or (f.structural is not None, f.excess) < (best.fit.structural is not None,
                                                                       best.fit.excess):
                best = FaultMatch(fault, engine, f)
    return best, runs


def name_subop(exact: Engine, other: Engine, cand: Sequence[ChunkResult], layer: int, env: Envelope) -> str | None:
    """The first sub-op (SUBOPS order) where `other` departs from `exact`, both run on the candidate's inputs
    with captures: where a matched hypothesis or fault acts. 2 layer-runs."""
    a = teacher_forced(exact, cand, [layer], capture=True)[layer]
    b = teacher_forced(other, cand, [layer], capture=True)[layer]
    subs = compare_subops(a, b, cand, layer, exact.config.ratio(layer), env, (exact.name, other.name))
    hit = next((s for s in subs if s.status == "defect"), None) or next((s for s in subs if s.status == "noise"),
                                                                        None)
    return hit.name if hit else None
