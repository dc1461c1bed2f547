"""Automatic bisection: which layer, which sub-op, which step, and whether it is a defect or noise.

Algorithm (L layers, T positions, every run on the reference's chunk schedule and tokens):
1. reference greedy run (prompt + decode steps), candidate run teacher-forced on the reference's tokens
   -> per-checkpoint per-position errors over the envelope, and the step trajectory;
   nothing outside the envelope and no WRONG step -> "no defect" (2 runs in total);
2. teacher-forced pass: every candidate layer on the reference's input carrier -> local vs free error;
3. mirror-splice bisection: M(k) = candidate for layers < k (its recorded run from step 1), reference from
   k on (own state); M(k) is clean for k <= j and outside the envelope for k > j, j = the first layer where
   the candidate departs; binary search over k in 1 + ceil(log2 L) spliced runs, each costing L - k
   reference layers. The culprit must also depart locally in step 2 (a splice can see sub-envelope drift
   amplified by a QAT code flip downstream); if no layer departs locally, the verdict is noise;
4. drill-down in layer j: both engines run layer j on the reference's inputs with captures, and so do N_TWINS
   round-off twins of the reference; every sub-op is judged by `check`'s round-off null (`null_drill_down`:
   the op-level test of `parity.bisect.opforce.judge_ops`, the same binomial exceedance test, TIEs and
   structural differences), and the culprit op is named with the first position and, past the prompt, the
   decode step. A layer that departs by the null is a defect there even when no single op does (as `check`
   calls a departing layer that no benign variant explains). Only a reference without round-off twins falls
   back to the envelope's floors (`compare_subops`, K x floor).

The report (`BisectReport`, its `Culprit`, `SpliceProbe` and `SubopResult` records) and every printer of it (the
text summary, JSON, figure, HTML page) are in `parity.bisect.bisect_report`; this module holds the algorithm.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np

from parity.bisect.attribution import (
    LayerAttribution,
    LayerRouting,
    attribute,
    layer_input,
    routing,
    teacher_forced,
)
from parity.bisect.bisect_report import (
    BisectReport,
    Culprit,
    SpliceProbe,
    SubopResult,
    clean_summary,
    drafter_clean_summary,
    drafter_defect_summary,
    summarize,
)
from parity.bisect.draft_check import DraftCheck, judge_records
from parity.bisect.envelope import ROW_CAPTURES, Envelope, aligned_weights, checkpoint_errors
from parity.bisect.null import N_TWINS, judge, layer_nulls
from parity.bisect.trajectory import Trajectory, trajectory
from parity.compare.metrics import rel_l2, set_overlap
from parity.compare.verdict import BisectVerdict, LayerKind, QuantFlip, QuantFormat, SubopStatus, flip_words
from parity.contract.checkpoints import EMBED, FINAL_NORM, LOGITS, SUBOPS, block, block_attn, draft_positions
from parity.contract.engine import Engine, LayerDiag, LayerOutput, RoundoffTwins
from parity.contract.errors import ParityError
from parity.contract.progress import SILENT, Count, Note, ProgressSink
from parity.tracing.drafts import draft_names, draft_records, tapped_layers
from parity.tracing.runner import ChunkResult, all_tokens, chunk_schedule, run_sequence, stack

if TYPE_CHECKING:
    from parity.bisect.opforce import OpVerdict

# Captures that went through an FP8/FP4 round trip: mantissa bits of the format, for code-flip recognition.
QUANT_FORMAT = {"rope_kv": QuantFormat.FP8_E4M3, "comp_rows": QuantFormat.FP8_E4M3, "index_rows": QuantFormat.FP4_E2M1}
QUANT_MBITS = {name: f.mbits for name, f in QUANT_FORMAT.items()}   # 3, 3, 1
# An isolated code flip touches at most this fraction of a row's elements (at least one element).
FLIP_FRACTION = 1 / 32


# Built-in prompt: BOS + a 4-token motif repeated. The repetition makes compressed rows alike, so the indexer
# meets exactly tied scores at its top-k cut (tie-breaking gets exercised); 27 + 1 tokens put 7 CSA rows and
# 5+ candidates per indexer query in the prefill, and with 4 decode steps the last decode step (position 31)
# emits a CSA row (ratio 4).
BUILTIN_MOTIF = (243, 77, 33, 87)
BUILTIN_LEN = 28


def builtin_prompt(vocab_size: int, bos: int) -> list[int]:
    """BOS + BUILTIN_MOTIF repeated, BUILTIN_LEN tokens."""
    if vocab_size <= max(BUILTIN_MOTIF):
        raise ParityError(f"the built-in prompt needs a vocabulary above {max(BUILTIN_MOTIF)} ids "
                          f"(model has {vocab_size}); pass --tokens")
    return [bos, *(list(BUILTIN_MOTIF) * BUILTIN_LEN)[: BUILTIN_LEN - 1]]


# ---------------------------------------------------------------- splicing

def first_visibility_mismatch(ref: Sequence[ChunkResult], diags: Sequence[Sequence[LayerDiag]],
                              layers: Sequence[int]) -> tuple[int, int] | None:
    """(layer, position) of the first position whose count of visible compressed rows differs from the
    reference's. The count is structural (it depends only on positions and on which rows were emitted), so any
    difference is a defect even when the attention output happens not to change (the row was not selected).
    diags: one per chunk, each indexed by layer."""
    for l in layers:
        for chunk, d in zip(ref, diags, strict=True):
            bad = np.flatnonzero(chunk.diags[l].n_comp_visible != d[l].n_comp_visible)
            if len(bad):
                return l, int(chunk.start_pos + bad[0])
    return None


def splice_output(lower: Sequence[ChunkResult], upper: Engine, k: int,
                  ref: Sequence[ChunkResult]) -> tuple[dict[str, np.ndarray], tuple[int, int] | None]:
    """Layers < k from the recorded run `lower` (its carrier leaving layer k-1, chunk by chunk), layers >= k
    run by `upper` with its own state. Recorded runs are reused because engines are deterministic: the
    lower part of a splice is exactly the lower part of that engine's own run on the same tokens and chunks.
    Returns the per-position rel-L2 against the reference of every checkpoint from layer k on, final_norm and
    logits (name -> [T]), and the first visible-row-count mismatch of the lower layers, if any."""
    state = upper.new_state()
    got: dict[str, list[np.ndarray]] = {}
    for chunk in lower:
        x = layer_input(chunk, k)
        for l in range(k, upper.config.n_layers):
            out = upper.forward_layer(state, l, x, chunk.tokens, chunk.start_pos)
            got.setdefault(block_attn(l), []).append(out.attn_carrier)
            got.setdefault(block(l), []).append(out.carrier)
            x = out.carrier
        f, lg = upper.head(x)
        got.setdefault(FINAL_NORM, []).append(f)
        got.setdefault(LOGITS, []).append(lg)
    errs = {name: rel_l2(stack(ref, name), np.concatenate(parts)) for name, parts in got.items()}
    return errs, first_visibility_mismatch(ref, [c.diags for c in lower], range(k))


def mirror_bisect(ref_engine: Engine, free: Sequence[ChunkResult], free_errs: dict[str, np.ndarray],
                  ref: Sequence[ChunkResult], env: Envelope, say: Note) -> tuple[int, list[SpliceProbe]]:
    """Smallest k with M(k) outside the envelope, minus one: the first layer where the candidate departs.
    M(k) = the candidate's run `free` below k, the reference from k on. M(k) is outside the envelope when a
    candidate checkpoint below k is (free_errs), when a reference checkpoint from k on is (the departure
    shows downstream), or when a visible-row count below k differs. M(0) is the reference itself (clean).
    Returns (layer, probes); layer = L when M(L) is clean."""
    L = ref_engine.config.n_layers

    def probe(k: int) -> SpliceProbe:
        say(f"splice: candidate layers < {k}, reference from {k}")
        errs, mismatch = splice_output(free, ref_engine, k, ref)
        below = {n: free_errs[n] for l in range(k) for n in (block_attn(l), block(l))}
        ex = max(float(env.excess_at(n, e.max())) for n, e in (errs | below).items())
        return SpliceProbe(k, ex, ex <= 1 and mismatch is None, mismatch)

    probes = [probe(L)]
    if probes[-1].clean:
        return L, probes
    lo, hi = 0, L  # M(lo) clean, M(hi) outside
    while hi - lo > 1:
        mid = (lo + hi) // 2
        probes.append(probe(mid))
        lo, hi = (mid, hi) if probes[-1].clean else (lo, mid)
    return hi - 1, probes


# ---------------------------------------------------------------- drill-down

def _cat(outs: Sequence[LayerOutput], name: str, engine: str, layer: int) -> np.ndarray:
    for o in outs:
        if name not in o.captures:
            raise ParityError(f"{engine} engine did not fill capture {name!r} at layer {layer}; "
                              "the drill-down needs every capture of parity.contract.checkpoints.SUBOPS")
    return np.concatenate([o.captures[name] for o in outs])


def is_code_flip(ref_row: np.ndarray, got_row: np.ndarray, noise_rel: float, mbits: int) -> bool:
    """True when the rows differ only by isolated one-code steps of a float format with `mbits` mantissa
    bits: at most max(1, FLIP_FRACTION * n) elements off by more than noise_rel * rms(ref_row), each by at
    most two quanta 2^(floor(log2 max(|a|,|b|)) - mbits) (power-of-two block scales; two quanta cover
    sub-normal codes)."""
    a, b = np.asarray(ref_row, np.float64).ravel(), np.asarray(got_row, np.float64).ravel()
    d = np.abs(a - b)
    off = d > noise_rel * np.sqrt(np.mean(a * a))
    if not off.any() or off.sum() > max(1, FLIP_FRACTION * a.size):
        return False
    m = np.maximum(np.abs(a), np.abs(b))[off]
    quantum = np.exp2(np.floor(np.log2(m)) - mbits)
    return bool((d[off] <= 2 * quantum).all())


class _Judge:
    """Compares captures position by position, remembering where a legitimate flip started a cascade."""

    def __init__(self, layer: int, env: Envelope, positions: np.ndarray, ratio: int) -> None:
        self.layer, self.env, self.positions, self.ratio = layer, env, positions, ratio
        self.taint: int | None = None   # first position touched by a legitimate flip

    def excused(self, pos: int) -> bool:
        return self.taint is not None and pos >= self.taint

    def flip(self, pos: int) -> None:
        self.taint = pos if self.taint is None else min(self.taint, pos)

    def floats(self, name: str, a: np.ndarray, b: np.ndarray, pos: np.ndarray) -> SubopResult:
        floor = self.env.subop_floor(self.layer, name)
        tol = self.env.limit(floor)
        err = rel_l2(a, b) if len(a) else np.zeros(0)
        bad = [i for i in np.flatnonzero(err > tol) if not self.excused(int(pos[i]))]
        flips = [i for i in bad if name in QUANT_MBITS and is_code_flip(a[i], b[i], tol, QUANT_MBITS[name])]
        real = [i for i in bad if i not in flips]
        for i in flips:
            self.flip(int(pos[i]))
        worst = float(err.max()) if len(err) else 0.0
        if real:
            i = real[0]
            what = (f"rel-L2 {err[i]:.3g}" if np.isfinite(err[i]) else
                    f"non-finite candidate value {b[i].ravel()[~np.isfinite(b[i].ravel())][0]}")
            return SubopResult(name, SubopStatus.DEFECT, float(err[i]), floor, float(self.env.excess(err[i], floor)),
                               int(pos[i]), f"{name}: {what} at position {pos[i]}")
        status = SubopStatus.NOISE if (flips or (err > tol).any()) else SubopStatus.OK
        flip = ((QuantFlip(name, QUANT_FORMAT[name], len(flips), self.taint),)
                if flips and self.taint is not None else ())   # flips set the taint
        detail = (flip_words(flip[0]) if flip else
                  f"excess only in the cascade of a flip at position {self.taint}" if status is SubopStatus.NOISE
                  else "")
        return SubopResult(name, status, worst, floor, float(self.env.excess(worst, floor)),
                           None, detail, flip)

    def rows(self, name: str, ref_outs: Sequence[LayerOutput], cand_outs: Sequence[LayerOutput]) -> SubopResult:
        """Emitted rows: a row missing or extra at some chunk is a defect at the position that emits it."""
        for o_r, o_c in zip(ref_outs, cand_outs, strict=True):
            nr, nc = len(o_r.captures[name]), len(o_c.captures[name])
            if nr != nc:
                j = min(nr, nc)
                pos = (j + 1) * self.ratio - 1 if self.ratio else int(self.positions[0])
                return SubopResult(name, SubopStatus.DEFECT, 1.0, 0.0, np.inf, pos,
                                   f"{name}: candidate has {nc} rows, reference {nr} (row {j} missing or extra, "
                                   f"emitted at position {pos})")
        a, b = ref_outs[-1].captures[name], cand_outs[-1].captures[name]
        row_pos = (np.arange(len(a)) + 1) * max(self.ratio, 1) - 1
        return self.floats(name, a, b, row_pos)

    def sets(self, name: str, a: np.ndarray, b: np.ndarray, pos: np.ndarray,
             margin: np.ndarray | None) -> SubopResult:
        """Per-position set overlap of selected ids (-1 = padding); routing flips judged by the router margin."""
        tol = self.env.margin_tol(self.layer)
        miss = 1 - set_overlap(a, b)
        worst = float(miss.max(initial=0.0))
        for i in np.flatnonzero(miss > 0):
            p = int(pos[i])
            if self.excused(p):
                continue
            if margin is not None and np.isfinite(margin[i]) and margin[i] <= tol:
                self.flip(p)
                continue
            why = "" if margin is None else (" (hash routing is a table lookup)" if not np.isfinite(margin[i])
                                             else f" at router margin {margin[i]:.3g} > noise {tol:.3g}")
            ra, rb = (sorted(set(x[i][x[i] >= 0].tolist())) for x in (a, b))
            return SubopResult(name, SubopStatus.DEFECT, float(miss[i]), 0.0, np.inf, p,
                               f"{name} at position {p}: reference {ra}, candidate {rb}{why}")
        status = SubopStatus.NOISE if worst > 0 else SubopStatus.OK
        detail = f"near-tie flips (margin <= {tol:.3g}) or cascade from position {self.taint}" if worst else ""
        return SubopResult(name, status, worst, 0.0, 0.0, None, detail)


def _worst(results: list[SubopResult], name: str) -> SubopResult:
    """Combine the captures of one sub-op: the first defect, else the worst status."""
    for r in results:
        if r.status is SubopStatus.DEFECT:
            return replace(r, name=name)
    best = max(results, key=lambda r: (r.status is SubopStatus.NOISE, r.excess))
    return SubopResult(name, best.status, best.err, best.floor, best.excess, best.position,
                       "; ".join(r.detail for r in results if r.detail), tuple(f for r in results for f in r.flips))


def drill_down(ref_engine: Engine, cand: Engine, ref: Sequence[ChunkResult], layer: int,
               env: Envelope) -> list[SubopResult]:
    """Every sub-op of `layer`, in SUBOPS order, both engines fed the reference's inputs, judged by the round-off
    null (N_TWINS twins of the reference on the same inputs: 2 + N_TWINS layer-runs); by the envelope's floors
    only when the reference has no twins."""
    r_outs = teacher_forced(ref_engine, ref, [layer], capture=True)[layer]
    c_outs = teacher_forced(cand, ref, [layer], capture=True)[layer]
    for name in (n for _sub, caps in SUBOPS for n in caps):   # every capture filled, on both sides
        _cat(r_outs, name, ref_engine.name, layer)
        _cat(c_outs, name, cand.name, layer)
    if not isinstance(ref_engine, RoundoffTwins):
        return compare_subops(r_outs, c_outs, ref, layer, cand.config.ratio(layer), env,
                              (ref_engine.name, cand.name))
    from parity.bisect.opforce import judge_ops  # opforce -> hypotheses -> this module

    twins = [teacher_forced(ref_engine.roundoff_twin(s), ref, [layer], capture=True)[layer]
             for s in range(1, N_TWINS + 1)]
    return null_drill_down(judge_ops(r_outs, twins, as_dumps(ref, c_outs, layer), layer, cand.config.ratio(layer)))


def as_dumps(chunks: Sequence[ChunkResult], outs: Sequence[LayerOutput], layer: int) -> list[ChunkResult]:
    """One engine's captured run of `layer` (one LayerOutput per chunk) as the per-chunk dumps `judge_ops` reads:
    that layer's carriers, diagnostics and sub-op captures (the other layers' slots are empty)."""
    pad = [None] * layer
    return [ChunkResult(c.start_pos, c.tokens, {block_attn(layer): o.attn_carrier, block(layer): o.carrier},
                        c.logits, [*pad, o.diag], [*([{}] * layer), o.captures])  # type: ignore[list-item]
            for c, o in zip(chunks, outs, strict=True)]


def null_drill_down(v: OpVerdict) -> list[SubopResult]:
    """`judge_ops`'s verdict of one layer as SubopResults in SUBOPS order. Both engines ran the whole layer on the
    same inputs, so an op inherits the departures of the ops before it: the culprit ('defect') is the first op, in
    execution order, that departs by the null (its test significant, or the structural difference), else, when
    only the pooled cells depart, judge_ops' culprit. An op with TIEs or with cells outside every twin short of
    significance is 'noise'; else 'ok'. floor: the largest twin at the op's worst cell; excess: that cell's
    distance over it."""
    struct_op = v.fit.subop if v.fit.structural else None
    departs = [sub for sub, _ in SUBOPS if sub == struct_op or (sub in v.ops and v.ops[sub].significant)]
    culprit = departs[0] if departs else None if v.fit.explains else v.fit.subop
    out = []
    for sub, _caps in SUBOPS:
        t = v.ops.get(sub)
        ties = [d for s, d in v.fit.ties if s == sub]
        worst = t.worst if t is not None else None
        err = t.err if t is not None else 0.0
        floor, excess = (worst.twin_max, worst.ratio) if worst is not None else (0.0, 0.0)
        if sub == culprit:
            own = t is not None and t.significant and sub != struct_op
            detail = v.fit.structural if sub == struct_op else t.summary() if own else v.fit.test.summary()
            pos = t.first.position if own and t.first is not None else v.fit.position
            out.append(SubopResult(sub, SubopStatus.DEFECT, err, floor, excess, pos, f"{sub}: {detail}"))
        elif ties or (t is not None and t.exceed):
            out.append(SubopResult(sub, SubopStatus.NOISE, err, floor, excess, None,
                                   "; ".join([*ties, *([t.summary()] if t is not None and t.exceed else [])])))
        else:
            out.append(SubopResult(sub, SubopStatus.OK, err, floor, excess, None))
    return out


def compare_subops(r_outs: Sequence[LayerOutput], c_outs: Sequence[LayerOutput], chunks: Sequence[ChunkResult],
                   layer: int, ratio: int, env: Envelope, names: tuple[str, str]) -> list[SubopResult]:
    """Judge every sub-op capture of two runs of `layer` over the chunk schedule `chunks` (one LayerOutput per
    chunk on each side, captured), in SUBOPS order; `names` are the two sides' names for error messages."""
    pos = np.concatenate([c.start_pos + np.arange(len(c.tokens)) for c in chunks])
    judge = _Judge(layer, env, pos, ratio)
    margin = np.concatenate([o.diag.router_margin for o in r_outs])
    results = []
    for sub, caps in SUBOPS:
        parts = []
        for name in caps:
            if name in ROW_CAPTURES:
                _cat(r_outs, name, names[0], layer)
                _cat(c_outs, name, names[1], layer)
                parts.append(judge.rows(name, r_outs, c_outs))
                continue
            a, b = _cat(r_outs, name, names[0], layer), _cat(c_outs, name, names[1], layer)
            if name == "index_sel":
                parts.append(judge.sets(name, a, b, pos, None))
            elif name == "expert_ids":
                parts.append(judge.sets(name, a, b, pos, margin))
            elif name == "expert_weights":
                wa, wb, same = aligned_weights(_cat(r_outs, "expert_ids", names[0], layer), a,
                                               _cat(c_outs, "expert_ids", names[1], layer), b)
                parts.append(judge.floats(name, wa[same], wb[same], pos[same]))
            else:
                parts.append(judge.floats(name, a, b, pos))
        results.append(_worst(parts, sub))
    return results


def inherited_flips(ref_engine: Engine, ref: Sequence[ChunkResult], inputs: Sequence[ChunkResult], layer: int,
                    env: Envelope) -> list[SubopResult]:
    """The reference's `layer` run on its own inputs and on another run's inputs (`inputs`: chunks whose carrier
    entering `layer` is taken), both captured and judged sub-op by sub-op. When the other run's input drift is
    inside the envelope, an excess at this layer is either a legitimate QAT code flip the drift tipped over
    (named in the sub-op's detail) or a defect-like amplification (status 'defect'). 2 layer-runs."""
    own = teacher_forced(ref_engine, ref, [layer], capture=True)[layer]
    other = teacher_forced(ref_engine, inputs, [layer], capture=True)[layer]
    return compare_subops(own, other, ref, layer, ref_engine.config.ratio(layer), env,
                          (ref_engine.name, f"{ref_engine.name} on the other run's inputs"))


# ---------------------------------------------------------------- orchestration

class ReplayRouter:
    """Routing replay: an `expert_override` that hands the candidate the reference's expert ids, so routing
    amplification is separated from arithmetic error. Filled by `bisect(..., replay=router)` after the
    reference run; construct the candidate with RunOptions(expert_override=router)."""

    def __init__(self) -> None:
        self.ids: list[np.ndarray] | None = None   # per layer [T, K]

    def fill(self, ref: Sequence[ChunkResult]) -> None:
        self.ids = [np.concatenate([c.diags[l].expert_ids for c in ref]) for l in range(len(ref[0].diags))]

    def __call__(self, layer: int, start_pos: int, n: int) -> np.ndarray:
        """ids [n, K] of the reference at positions start_pos..start_pos+n-1."""
        if self.ids is None:
            raise ParityError("routing replay used before the reference run filled it")
        if start_pos + n > len(self.ids[layer]):
            raise ParityError(f"routing replay: position {start_pos + n - 1} is past the reference run "
                              f"({len(self.ids[layer])} positions)")
        return self.ids[layer][start_pos : start_pos + n]


@dataclass(frozen=True)
class FreeStage:
    """Step 1: the reference's greedy run and the candidate teacher-forced on its tokens, judged per checkpoint."""

    ref: list[ChunkResult]
    free: list[ChunkResult]
    tokens: list[int]
    errs: dict[str, np.ndarray]    # checkpoint -> per-position rel-L2
    max_excess: dict[str, float]   # checkpoint -> max excess over the envelope
    trajectory: Trajectory
    row_mismatch: tuple[int, int] | None
    routing: list[LayerRouting]

    @property
    def clean(self) -> bool:
        return (max(self.max_excess.values()) <= 1 and self.trajectory.first_wrong is None
                and self.row_mismatch is None)


@dataclass(frozen=True)
class LocalStage:
    """Steps 2-4: what localisation found (verdict 'defect' or 'noise')."""

    verdict: BisectVerdict
    culprit: Culprit
    attribution: list[LayerAttribution]
    probes: list[SpliceProbe] = field(default_factory=list)
    subops: list[SubopResult] = field(default_factory=list)
    runs: dict[str, int] = field(default_factory=dict)


def _where(pos: int | None, n_prompt: int) -> tuple[int | None, str]:
    if pos is None:
        return None, "position unknown"
    if pos >= n_prompt:
        return pos - n_prompt, f"decode step {pos - n_prompt} (position {pos})"
    return None, f"prefill position {pos}"


class _Clock:
    """Seconds per stage."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.t0 = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = round(now - self.t0, 3)
        self.t0 = now


def free_stage(ref_engine: Engine, cand: Engine, prompt: Sequence[int], decode: int, env: Envelope,
               chunk: int | None, say: Note, replay: ReplayRouter | None = None,
               count: Count | None = None) -> FreeStage:
    """Step 1 (2 full runs): reference greedy, candidate teacher-forced on the reference's tokens."""
    L, P = cand.config.n_layers, len(prompt)
    total = len(chunk_schedule(P, chunk)) + decode

    def counting(stage: str) -> Callable[[ChunkResult], None] | None:
        done = [0]

        def tick(_r: ChunkResult) -> None:
            done[0] += 1
            count(stage, done[0], total)  # type: ignore[misc]
        return tick if count is not None else None

    say(f"reference: {P} prompt tokens + {decode} greedy decode steps")
    ref = run_sequence(ref_engine, prompt, decode, chunk=chunk, on_chunk=counting("reference run"))
    tokens = [int(t) for t in all_tokens(ref)]
    if replay is not None:
        replay.fill(ref)
    say(f"{cand.name}: same tokens (teacher-forced)")
    free = run_sequence(cand, prompt, decode, chunk=chunk, forced=tokens[P:], on_chunk=counting(f"{cand.name} run"))
    errs = checkpoint_errors(ref, free)
    excess = {n: float(env.excess_at(n, e.max())) for n, e in errs.items()}
    logits = [np.concatenate([c.logits for c in run]) for run in (ref, free)]
    return FreeStage(ref, free, tokens, errs, excess, trajectory(*logits, errs, P, L, env),
                     first_visibility_mismatch(ref, [c.diags for c in free], range(L)), routing(ref, free, env))


def bisect(ref_engine: Engine, cand: Engine, prompt: Sequence[int], decode: int, env: Envelope,
           chunk: int | None = None, progress: ProgressSink = SILENT, replay: ReplayRouter | None = None,
           draft: dict | None = None) -> BisectReport:
    """Localise the first place where `cand` departs from `ref_engine` beyond the noise envelope.
    `replay`: the candidate's expert_override, filled here with the reference's expert choices;
    `progress.note(message)` announces the stages, `progress.count(stage, done, total)` counts the chunks of the two
    full runs and of the teacher-forced pass;
    `draft`: a trace header's draft entry (`parity.tracing.drafts.draft_header`) when both engines were opened with
    that drafter: when the trunk has no defect (clean or noise), the drafter is judged as one more layer
    (`drafter_stage`)."""
    say = progress.note
    env.check_options(cand.options)
    clock = _Clock()
    fs = free_stage(ref_engine, cand, prompt, decode, env, chunk, say, replay, progress.count)
    clock.lap("full_runs")
    runs = {"full": 2, "teacher_forced": 0, "splice": 0, "drill_down_layers": 0, "flip_check_layers": 0}
    envelope = {"k": env.k, "eps": env.eps, "dtype": env.dtype, "calibration": env.calibration}
    base = dict(n_prompt=len(prompt), decode=decode, tokens=fs.tokens, envelope=envelope, max_excess=fs.max_excess,
                row_mismatch=fs.row_mismatch, routing=fs.routing, trajectory=fs.trajectory)
    if fs.clean:
        report = BisectReport(BisectVerdict.NO_DEFECT, "", None, runs=runs, seconds=clock.seconds, **base)
        worst = max(fs.max_excess, key=fs.max_excess.get)
        report = replace(report, summary=clean_summary(report, int(fs.errs[worst].argmax())))
    else:
        ls = localise(ref_engine, cand, fs, len(prompt), env, say, clock, progress.count)
        report = BisectReport(ls.verdict, "", ls.culprit, attribution=ls.attribution, probes=ls.probes,
                              subops=ls.subops, runs=runs | ls.runs, seconds=clock.seconds, **base)
        report = replace(report, summary=summarize(report))
    if draft and report.verdict is not BisectVerdict.DEFECT:   # the drafter: one more layer after a trunk, no defect
        report = _drafter_verdict(report, drafter_stage(ref_engine, cand, fs, draft, say), cand.name, len(prompt))
        clock.lap("drafter")
    clock.lap("verdict")
    return replace(report, seconds=clock.seconds)


def _drafter_verdict(report: BisectReport, dc: DraftCheck, cand: str, n_prompt: int) -> BisectReport:
    """The report with the drafter stage's outcome: a DEFECT at the first departing draft checkpoint (the trunk's
    verdict kept in the summary), else a line saying every draft checkpoint is within its twins."""
    runs = {**report.runs, "drafter": 2 + N_TWINS}
    first = dc.first
    if first is None or first.test.first is None:
        return replace(report, runs=runs, summary=drafter_clean_summary(report.summary, N_TWINS))
    pos = first.test.first.position
    step, where = _where(pos, n_prompt)
    detail = f"{cand}'s draft head on the reference's trunk carriers: {first.test.summary()} (rel-L2 {first.err:.3g})"
    culprit = Culprit(f"drafter {first.checkpoint}", None, pos, step, detail)
    return replace(report, verdict=BisectVerdict.DEFECT, culprit=culprit, runs=runs,
                   summary=drafter_defect_summary(culprit, where, report.summary))


def drafter_stage(ref_engine: Engine, cand: Engine, fs: FreeStage, draft: dict, say: Note) -> DraftCheck:
    """The drafter as one more layer: both engines' draft heads on the reference's trunk carriers (every position,
    `parity.tracing.drafts.draft_records`), the candidate's records judged by the reference's round-off twins
    (`parity.bisect.draft_check.judge_records`). 2 + N_TWINS draft-head runs."""
    say(f"drafter: both {draft['kind']} heads on the reference's trunk carriers, {N_TWINS} round-off twins")
    positions = list(range(len(fs.tokens)))
    carriers = {l: stack(fs.ref, block(l)) for l in tapped_layers(ref_engine, draft)}
    last = int(np.argmax(fs.ref[-1].logits[-1]))

    def run(engine: Engine) -> dict[str, np.ndarray]:
        return draft_records(engine, draft, carriers, fs.tokens, positions, last)

    return judge_records(ref_engine, draft_names(draft), run, run(cand),
                         lambda name: draft_positions(name, positions, draft.get("pairing")))


def local_departures(ref_engine: Engine, ref: Sequence[ChunkResult], tf: dict[int, list[LayerOutput]],
                     say: Note) -> dict[int, bool] | None:
    """Per layer, whether the candidate's layer on the reference's inputs departs by the round-off null (the
    reference's twins on the same inputs; `check`'s test), or None when the reference has no twins."""
    if not isinstance(ref_engine, RoundoffTwins):
        return None
    say(f"round-off null: {N_TWINS} twins of the reference on its own inputs")
    own = {l: [LayerOutput(c.checkpoints[block_attn(l)], c.checkpoints[block(l)], c.diags[l]) for c in ref]
           for l in tf}
    nulls = layer_nulls(ref_engine, ref, own)
    out = {}
    for l, outs in tf.items():
        base = {q: np.concatenate([o.checkpoints[q] for o in ref]) for q in (block_attn(l), block(l))}
        errs = {block_attn(l): rel_l2(base[block_attn(l)], np.concatenate([o.attn_carrier for o in outs])),
                block(l): rel_l2(base[block(l)], np.concatenate([o.carrier for o in outs]))}
        T = len(errs[block(l)])
        out[l] = judge(errs, nulls[l].dist, {q: np.arange(T) for q in errs}).significant
    return out


def localise(ref_engine: Engine, cand: Engine, fs: FreeStage, n_prompt: int, env: Envelope, say: Note,
             clock: _Clock, counter: Count | None = None) -> LocalStage:
    """Steps 2-4: teacher-forced attribution, mirror-splice bisection, drill-down (see the module doc)."""
    L, P = ref_engine.config.n_layers, n_prompt
    say("teacher-forced pass: every candidate layer on the reference's inputs")
    tick = (lambda i: counter("teacher-forced pass", i + 1, len(fs.ref))) if counter is not None else None
    tf = teacher_forced(cand, fs.ref, list(range(L)), on_chunk=tick)
    attribution = attribute(fs.ref, tf, fs.errs, env, local_departures(ref_engine, fs.ref, tf, say))
    runs = {"teacher_forced": 1}
    clock.lap("teacher_forced")
    if fs.max_excess[EMBED] > 1:
        pos = int(np.argmax(fs.errs[EMBED] > env.limit(env.floor(EMBED))))
        return LocalStage(BisectVerdict.DEFECT,
                          Culprit("embed", None, pos, *_step_detail(pos, P, "embedding lookup differs")), attribution,
                          runs=runs)
    layer, probes = mirror_bisect(ref_engine, fs.free, fs.errs, fs.ref, env, say)
    runs["splice"] = len(probes)
    clock.lap("splice")
    if layer == L:
        return LocalStage(BisectVerdict.DEFECT,
                          Culprit("head", None, None, None, "layers clean; final norm / output head differ"),
                          attribution, probes, runs=runs)
    local = [a.layer for a in attribution if a.kind is LayerKind.LOCAL]
    if not local:
        return replace(_inherited_noise(ref_engine, fs, layer, env, say), attribution=attribution, probes=probes,
                       runs=runs | {"flip_check_layers": 2})
    if layer not in local:  # the splice saw amplified sub-envelope drift: trust the local evidence
        say(f"splice points at layer {layer}, which does not depart locally; using layer {local[0]}")
        layer = local[0]
    runs["drill_down_layers"] = 0
    subops: list[SubopResult] = []
    for cand_layer in [layer, *(l for l in local if l != layer)]:
        say(f"drill-down: layer {cand_layer}, {len(SUBOPS)} sub-ops")
        subs = drill_down(ref_engine, cand, fs.ref, cand_layer, env)
        runs["drill_down_layers"] += 1
        hit = next((s for s in subs if s.status is SubopStatus.DEFECT), None)
        if hit or cand_layer == layer:
            subops = subs
        if hit:
            step, where = _where(hit.position, P)
            clock.lap("drill_down")
            return LocalStage(BisectVerdict.DEFECT,
                              Culprit(cand_layer, hit.name, hit.position, step, f"{where}; {hit.detail}"),
                              attribution, probes, subops, runs)
    clock.lap("drill_down")
    by_null = isinstance(ref_engine, RoundoffTwins)   # `local` and the drill-down judged by the round-off null
    if by_null or not any(s.status is SubopStatus.NOISE for s in subops):
        pos = attribution[layer].worst_position
        step, where = _where(pos, P)
        why = ("the layer departs by the round-off null on the reference's inputs, no single captured sub-op does"
               if by_null else "no captured sub-op differs: the defect is between captures")
        return LocalStage(BisectVerdict.DEFECT, Culprit(layer, None, pos, step, f"{where}; {why}"), attribution, probes,
                          subops, runs)
    noisy = next(s for s in subops if s.status is SubopStatus.NOISE)
    return LocalStage(BisectVerdict.NOISE, Culprit(layer, noisy.name, None, None, noisy.detail), attribution, probes,
                      subops, runs)


def _inherited_noise(ref_engine: Engine, fs: FreeStage, splice_layer: int, env: Envelope,
                     say: Note) -> LocalStage:
    """No candidate layer departs locally: the excess is amplified sub-envelope drift; name the QAT code flip
    the drift tips over in the first layer outside the envelope (2 layer-runs)."""
    worst = max(fs.max_excess, key=fs.max_excess.get)
    first = _first_free_departure(fs.max_excess, ref_engine.config.n_layers)
    say(f"no local departure; naming the QAT code flip the drift tips over at layer {first}")
    flips = inherited_flips(ref_engine, fs.ref, fs.free, first, env)
    named = [s for s in flips if s.status is SubopStatus.NOISE and s.flips]
    why = (f"{named[0].name}: {named[0].detail}" if named else
           "no isolated QAT code flip found there (near-ties or amplification downstream)")
    return LocalStage(BisectVerdict.NOISE, Culprit(first, named[0].name if named else None, None, None, (
        f"no candidate layer departs on the reference's inputs; the excess ({fs.max_excess[worst]:.3g} at {worst}; "
        f"the splice first departs after layer {splice_layer}) is amplified sub-envelope drift; the reference's "
        f"layer {first} on the candidate's inputs shows {why}")), [])


def _first_free_departure(excess: dict[str, float], n_layers: int) -> int:
    """The first layer (depth order) with a free-running checkpoint outside the envelope; the last layer when
    only final_norm / logits are out."""
    return next((l for l in range(n_layers) if max(excess[block_attn(l)], excess[block(l)]) > 1), n_layers - 1)


def _step_detail(pos: int, n_prompt: int, what: str) -> tuple[int | None, str]:
    step, where = _where(pos, n_prompt)
    return step, f"{where}; {what}"
