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
   the op-level test of `parity.check.opforce.judge_ops`, the same binomial exceedance test, TIEs and
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

from parity.bisect.bisect_report import BisectReport, SpliceProbe
from parity.bisect.findings import (
    Culprit,
    DraftDeparts,
    DrafterOutcome,
    EmbedDiffers,
    HeadDiffers,
    InheritedDrift,
    LayerDeparts,
    SubopDeparts,
    SubopNoise,
)
from parity.bisect.trajectory import Trajectory, trajectory
from parity.check.attribution import (
    LayerAttribution,
    LayerRouting,
    attribute,
    layer_input,
    routing,
    teacher_forced,
)
from parity.check.draft_check import DraftCheck, judge_records
from parity.check.envelope import Envelope, checkpoint_errors
from parity.check.null import N_TWINS, judge, layer_nulls
from parity.check.subops import SubopResult, drill_down, inherited_flips
from parity.compare.metrics import rel_l2
from parity.compare.verdict import LayerKind, SubopStatus, Verdict
from parity.contract.checkpoints import EMBED, FINAL_NORM, LOGITS, SUBOPS, block, block_attn, draft_positions
from parity.contract.engine import Engine, LayerDiag, LayerOutput, RoundoffTwins
from parity.contract.errors import ParityError
from parity.contract.progress import SILENT, Count, Note, ProgressSink
from parity.tracing.drafts import draft_names, draft_records, tapped_layers
from parity.tracing.runner import ChunkResult, all_tokens, chunk_schedule, run_sequence, stack

if TYPE_CHECKING:
    pass



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

    verdict: Verdict
    culprit: Culprit
    attribution: list[LayerAttribution]
    probes: list[SpliceProbe] = field(default_factory=list)
    subops: list[SubopResult] = field(default_factory=list)
    runs: dict[str, int] = field(default_factory=dict)


def _step(pos: int | None, n_prompt: int) -> int | None:
    """The 0-based decode step of a position past the prompt, else None."""
    return pos - n_prompt if pos is not None and pos >= n_prompt else None


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
        worst = max(fs.max_excess, key=fs.max_excess.get)
        report = BisectReport(Verdict.MATCH, None, runs=runs, seconds=clock.seconds,
                              worst_position=int(fs.errs[worst].argmax()), **base)
    else:
        ls = localise(ref_engine, cand, fs, len(prompt), env, say, clock, progress.count)
        report = BisectReport(ls.verdict, ls.culprit, attribution=ls.attribution, probes=ls.probes,
                              subops=ls.subops, runs=runs | ls.runs, seconds=clock.seconds, **base)
    if draft and report.verdict is not Verdict.DEFECT:   # the drafter: one more layer after a trunk, no defect
        report = _drafter_verdict(report, drafter_stage(ref_engine, cand, fs, draft, say), cand.name, len(prompt))
        clock.lap("drafter")
    clock.lap("verdict")
    return replace(report, seconds=clock.seconds)


def _drafter_verdict(report: BisectReport, dc: DraftCheck, cand: str, n_prompt: int) -> BisectReport:
    """The report with the drafter stage's outcome: a DEFECT at the first departing draft checkpoint (the trunk's
    verdict kept in the summary), else a line saying every draft checkpoint is within its twins."""
    runs = {**report.runs, "drafter": 2 + N_TWINS}
    outcome = DrafterOutcome(N_TWINS, report.verdict, report.culprit)
    first = dc.first
    if first is None or first.test.first is None:
        return replace(report, runs=runs, drafter=outcome)
    pos = first.test.first.position
    culprit = Culprit(f"drafter {first.checkpoint}", None, pos, _step(pos, n_prompt),
                      DraftDeparts(cand, first.test, first.err))
    return replace(report, verdict=Verdict.DEFECT, culprit=culprit, runs=runs, drafter=outcome)


def drafter_stage(ref_engine: Engine, cand: Engine, fs: FreeStage, draft: dict, say: Note) -> DraftCheck:
    """The drafter as one more layer: both engines' draft heads on the reference's trunk carriers (every position,
    `parity.tracing.drafts.draft_records`), the candidate's records judged by the reference's round-off twins
    (`parity.check.draft_check.judge_records`). 2 + N_TWINS draft-head runs."""
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
        return LocalStage(Verdict.DEFECT, Culprit("embed", None, pos, _step(pos, P), EmbedDiffers()), attribution,
                          runs=runs)
    layer, probes = mirror_bisect(ref_engine, fs.free, fs.errs, fs.ref, env, say)
    runs["splice"] = len(probes)
    clock.lap("splice")
    if layer == L:
        return LocalStage(Verdict.DEFECT,
                          Culprit("head", None, None, None, HeadDiffers()),
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
            clock.lap("drill_down")
            return LocalStage(Verdict.DEFECT,
                              Culprit(cand_layer, hit.name, hit.position, _step(hit.position, P), SubopDeparts(hit)),
                              attribution, probes, subops, runs)
    clock.lap("drill_down")
    by_null = isinstance(ref_engine, RoundoffTwins)   # `local` and the drill-down judged by the round-off null
    if by_null or not any(s.status is SubopStatus.NOISE for s in subops):
        pos = attribution[layer].worst_position
        return LocalStage(Verdict.DEFECT, Culprit(layer, None, pos, _step(pos, P), LayerDeparts(by_null)),
                          attribution, probes, subops, runs)
    noisy = next(s for s in subops if s.status is SubopStatus.NOISE)
    return LocalStage(Verdict.NOISE, Culprit(layer, noisy.name, None, None, SubopNoise(noisy)), attribution,
                      probes, subops, runs)


def _inherited_noise(ref_engine: Engine, fs: FreeStage, splice_layer: int, env: Envelope,
                     say: Note) -> LocalStage:
    """No candidate layer departs locally: the excess is amplified sub-envelope drift; name the QAT code flip
    the drift tips over in the first layer outside the envelope (2 layer-runs)."""
    worst = max(fs.max_excess, key=fs.max_excess.get)
    first = _first_free_departure(fs.max_excess, ref_engine.config.n_layers)
    say(f"no local departure; naming the QAT code flip the drift tips over at layer {first}")
    flips = inherited_flips(ref_engine, fs.ref, fs.free, first, env)
    named = next((s for s in flips if s.status is SubopStatus.NOISE and s.flips), None)
    drift = InheritedDrift(fs.max_excess[worst], worst, splice_layer, named)
    return LocalStage(Verdict.NOISE, Culprit(first, named.name if named else None, None, None, drift), [])


def _first_free_departure(excess: dict[str, float], n_layers: int) -> int:
    """The first layer (depth order) with a free-running checkpoint outside the envelope; the last layer when
    only final_norm / logits are out."""
    return next((l for l in range(n_layers) if max(excess[block_attn(l)], excess[block(l)]) > 1), n_layers - 1)
