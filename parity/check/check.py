"""`check`: the full verdict for a trace written by any engine — MATCH, NOISE (explained) or DEFECT (where, why).

The candidate is only a trace (text/binary, or imported from ds4 / llama.cpp dumps): the harness cannot call
its engine. Stages, each a pure function of the ones before (costs in reference layer-runs: one layer over
every position of the run, L = layers):
1. follow: the reference runs the candidate's tokens on the candidate's chunk schedule with the QAT flags the
   header declares (L layer-runs + head). This free-running pass is computed once and reused by every stage;
2. free-running profile per checkpoint (candidate's full vectors vs the reference), judged by the envelope;
   structural check: the candidate's visible compressed-row counts vs the reference's;
3. teacher-forced local error: where the candidate recorded full vectors at every position, the reference runs
   layer l on the candidate's own carrier entering l (its caches built from the candidate's earlier inputs)
   and is compared with the candidate's blk.l.attn / blk.l (layer-level); with the candidate's dumped sub-ops,
   every op on the candidate's own input to it instead (op-level, `parity.check.opforce`). Either is judged
   by the round-off null of `parity.check.null` (19 twins of the same run: 19 layer-runs a layer);
4. each layer that departs is explained by the hypotheses of `parity.check.hypotheses` (benign numerics, each
   judged by its own twins, then the defect library); ties are named; a free-running excess without any local
   departure is amplified sub-envelope drift, and the QAT code flip it tips over is named (2 layer-runs).
"""

from __future__ import annotations

import contextlib
import io
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from parity.check import parallel
from parity.check.attribution import teacher_forced
from parity.check.draft_check import check_drafter, draft_check, draft_library, unjudged
from parity.check.envelope import Envelope
from parity.check.evidence import (
    EVIDENCE,
    DrafterDefect,
    Drift,
    EmbeddingDiffers,
    Evidence,
    LayerDefect,
    Library,
    Reproduced,
    Tie,
    TieRule,
)
from parity.check.hypotheses import (
    Fit,
    LayerNull,
    VariantTester,
    defect_library,
    fit,
    layer_judge,
    layer_nulls,
    name_subop,
    routing_replay,
    table_rows,
)
from parity.check.null import N_TWINS
from parity.check.opforce import op_verdict
from parity.check.parallel import EngineLoader
from parity.check.subops import inherited_flips
from parity.check.words import discrete_words, null_words
from parity.compare.metrics import rel_l2, set_overlap
from parity.compare.verdict import CauseKind, Judged, QuantFlip, QuantFormat, RowStatus, SubopStatus, Verdict
from parity.contract.checkpoints import EMBED, FINAL_NORM, LOGITS, block, block_attn, checkpoint_layer, is_draft
from parity.contract.engine import Engine, LayerOutput, RunOptions, Variants
from parity.contract.errors import ParityError, TraceError
from parity.contract.progress import SILENT, Count, Note, ProgressSink
from parity.contract.workpool import WorkPool
from parity.gguf.config import ModelConfig
from parity.tracing.drafts import draft_names
from parity.tracing.records import Trace
from parity.tracing.runner import ChunkResult, forward_chunk

EngineFactory = Callable[[RunOptions], Engine]


@dataclass(frozen=True)
class Cause:
    """One finding of `check`: its kind, name and place, and its evidence as data (`parity.check.evidence`; in
    words only by the printer `parity.check.check_report.cause_words`)."""

    kind: CauseKind        # benign | defect
    name: str              # hypothesis or fault name, or "unexplained"
    layer: int | str | None  # a trunk layer, or "drafter <checkpoint>" (the draft head after the trunk)
    subop: str | None
    evidence: Evidence

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", CauseKind(self.kind))   # a mistyped kind is an error naming it
        if not isinstance(self.evidence, EVIDENCE):
            raise TypeError(f"cause {self.name!r}: evidence must be a record of parity.check.evidence, not "
                            f"{type(self.evidence).__name__}")

    @property
    def flips(self) -> tuple[QuantFlip, ...]:
        """A code-flip cause's flips as numbers (those of the sub-op result its drift tips over); () otherwise."""
        ev = self.evidence
        return ev.flip.flips if isinstance(ev, Drift) and ev.flip is not None else ()


@dataclass(frozen=True)
class CheckCulprit:
    layer: int | str | None
    subop: str | None
    position: int | None
    decode_step: int | None


@dataclass(frozen=True)
class CheckRow:
    """One checkpoint: worst free-running and local (teacher-forced) error over the traced positions."""

    checkpoint: str
    free: float | None          # None: the candidate recorded no full vectors here
    free_excess: float | None
    local: float | None         # None: no teacher-forced run for this checkpoint
    local_twins: float | None   # the layer's worst cell over the largest round-off twin there (0: none outside)
    floor: float
    position: int | None        # first position outside the envelope (local first, else free)
    status: RowStatus           # ok | outside (free only: inherited) | local | structural | not judged

    def __post_init__(self) -> None:
        object.__setattr__(self, "status", RowStatus(self.status))


@dataclass(frozen=True)
class CheckReport:
    """`check`'s findings as data; its words (the headline, text, JSON, HTML) are the printers' of
    `parity.check.check_report`."""

    verdict: Verdict                  # MATCH | NOISE | DEFECT
    culprit: CheckCulprit | None
    causes: tuple[Cause, ...]
    table: tuple[CheckRow, ...]
    layer_runs: dict[str, int]        # reference (and fault-engine) layer-runs by stage
    notes: tuple[str, ...]
    n_prompt: int
    seconds: float = 0.0
    judged: Judged = Judged.LAYER_LEVEL  # op-level | layer-level | free-running: what the local verdict rests on
    envelope_seconds: float = 0.0     # finding (or measuring) the envelope, before `seconds` started
    envelope_source: str = ""         # the stored envelope's path, or "measured" (then cached)

    def __post_init__(self) -> None:
        object.__setattr__(self, "verdict", Verdict(self.verdict))
        object.__setattr__(self, "judged", Judged(self.judged))

    def to_dict(self) -> dict[str, object]:
        """The JSON document (`parity.check.check_report.json_document`: the causes' evidence in words)."""
        from parity.check.check_report import json_document

        return json_document(self)


@dataclass(frozen=True)
class LayerLocal:
    """Local comparison of one layer (the exact reference on the candidate's inputs), judged by its null."""

    layer: int
    fit: Fit

    @property
    def departs(self) -> bool:
        return not self.fit.explains

    @property
    def twin_ratio(self) -> float:
        """The worst cell's distance over the largest twin distance there (0 when no cell exceeds)."""
        return self.fit.test.worst.ratio if self.fit.test.worst is not None else 0.0


# ---------------------------------------------------------------- follow

def replay(engine: Engine, tokens: Sequence[int], chunks: Sequence[int],
           on_chunk: Callable[[int], None] | None = None) -> list[ChunkResult]:
    """Run `tokens` through `engine` on exactly the chunk schedule `chunks` (a followed trace's: prefill pieces,
    then one token per decode step; tokens are taken from the trace, never generated)."""
    if sum(chunks) != len(tokens):
        raise TraceError(f"chunk schedule {list(chunks)} covers {sum(chunks)} tokens, the trace has {len(tokens)}")
    state, out, pos = engine.new_state(), [], 0
    toks = np.asarray(tokens, dtype=np.int64)
    for i, n in enumerate(chunks):
        out.append(forward_chunk(engine, state, toks[pos : pos + n], pos))
        pos += n
        if on_chunk:
            on_chunk(i)
    return out


def reference_options(trace: Trace, config: ModelConfig) -> tuple[RunOptions, list[str]]:
    """The reference's options for a followed trace: float32, the QAT flags the header declares (on when it
    declares none, as the model defines them; said in the notes) — off, with the reason, when the model's shape
    has no whole FP8 / FP4 blocks (head_dim - rope_dim not a multiple of 64, indexer head dim not a multiple of
    32, as in transformers' tiny test configs). Declared approximations are not followed:
    they are the first hypotheses tested."""
    flags, notes = trace.header.flags, []
    blocks = {"fp8_kv": (config.nope_dim, 64, "head_dim - rope_head_dim"),
              "fp4_indexer": (config.index_head_dim, 32, "the indexer head dim")}
    qat = {}
    for name in ("fp8_kv", "fp4_indexer"):
        if name in flags:
            qat[name] = bool(flags[name])
        elif blocks[name][0] % blocks[name][1]:
            dim, block, what = blocks[name]
            qat[name] = False
            notes.append(f"the header declares no {name} and the model has no whole {name} blocks ({what} = {dim}, "
                         f"not a multiple of {block}): the reference runs it off")
        else:
            qat[name] = True
            notes.append(f"the header declares no {name}; the reference runs it on (the model's definition)")
    return RunOptions(dtype="float32", **qat), notes


# ---------------------------------------------------------------- candidate as chunk results

def candidate_chunks(trace: Trace, ref: Sequence[ChunkResult]) -> tuple[list[ChunkResult] | None, list[str]]:
    """The candidate's recorded carriers cut into the reference's chunks, for teacher forcing; None when the
    trace lacks full vectors at every position (the local error needs each layer's whole input)."""
    h, vec = trace.header, trace.vectors or {}
    n_total = len(h.tokens)
    if h.positions != list(range(n_total)):
        return None, [f"the candidate traced {len(h.positions)} of {n_total} positions: no teacher-forced local "
                      "error (record every position with full vectors: --positions all --full all)"]
    carriers = [n for n in vec if n not in (FINAL_NORM, LOGITS) and not is_draft(n)]
    notes = []
    if EMBED not in carriers:
        notes.append("the candidate recorded no embed: its layer 0 is fed the reference's embedding")
    chunks = []
    for c in ref:
        sl = slice(c.start_pos, c.start_pos + len(c.tokens))
        cks = {n: np.asarray(vec[n][sl], np.float32) for n in carriers}
        cks.setdefault(EMBED, c.checkpoints[EMBED])
        chunks.append(ChunkResult(c.start_pos, c.tokens, cks, c.logits, []))
    return chunks, notes


# ---------------------------------------------------------------- profile and local error

def free_profile(trace: Trace, ref: Sequence[ChunkResult]) -> dict[str, np.ndarray]:
    """Per-position rel-L2 of every checkpoint (and logits) the candidate recorded full vectors of: name -> [P]."""
    pos = np.asarray(trace.header.positions)
    out = {}
    for name, got in (trace.vectors or {}).items():
        if is_draft(name):  # judged teacher-forced only (`parity.check.draft_check`)
            continue
        want = np.concatenate([c.logits if name == LOGITS else c.checkpoints[name] for c in ref])[pos]
        out[name] = rel_l2(want, got)
    return out


def routing_flips(trace: Trace, outs: Sequence[LayerOutput], layer: int) -> np.ndarray:
    """Positions where the candidate's expert set differs from the reference's on the candidate's inputs."""
    moe = table_rows(trace, "moe", layer)
    if not len(moe["pos"]):
        return np.zeros(0, dtype=np.int64)
    ids = np.concatenate([o.diag.expert_ids for o in outs])[moe["pos"]]
    return moe["pos"][set_overlap(ids, moe["ids"]) < 1]


def local_errors(trace: Trace, outs: dict[int, list[LayerOutput]], nulls: dict[int, LayerNull]) -> list[LayerLocal]:
    """One LayerLocal per teacher-forced layer: the candidate's recorded output vs the reference's layer run on
    the candidate's input, judged by that run's round-off ensemble."""
    return [LayerLocal(layer, fit(trace, o, layer, nulls[layer])) for layer, o in sorted(outs.items())]


# ---------------------------------------------------------------- the verdict

@dataclass
class _Stages:
    """What the stages found (assembled into the frozen report at the end)."""

    causes: list[Cause] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    runs: dict[str, int] = field(default_factory=dict)
    culprit: CheckCulprit | None = None


@dataclass(frozen=True)
class _Quiet:
    """The factory with the engine's own stderr announcements ("APPROXIMATE ...", "FAULTS INJECTED ...") captured
    into `announced` instead of printed: check's internal variant and fault runs are summarised in one note.
    `loader`: the picklable factory that rebuilds its engines in a worker (`parity.check.parallel`); engines made
    while a work pool is active are registered with it."""

    factory: EngineFactory
    announced: list[str]
    loader: EngineLoader | None = None

    def __call__(self, options: RunOptions) -> Engine:
        buf = io.StringIO()
        with contextlib.redirect_stderr(buf):
            engine = self.factory(options)
        self.announced.extend(line for line in buf.getvalue().splitlines() if line)
        d = parallel.current()
        if d is not None and self.loader is not None:
            d.register(engine, self.loader, options)
        return engine


def _quiet(factory: EngineFactory, announced: list[str], loader: EngineLoader | None = None) -> EngineFactory:
    return _Quiet(factory, announced, loader or parallel.loader_of(factory))


def _decode_step(pos: int | None, n_prompt: int) -> int | None:
    return None if pos is None or pos < n_prompt else pos - n_prompt


def check(trace: Trace, make_reference: EngineFactory, env: Envelope, *, config: ModelConfig,
          fault_engines: Sequence[tuple[str, EngineFactory, tuple[str, ...]]] = (),
          subops: Sequence[ChunkResult] | None = None, notes: Sequence[str] = (),
          progress: ProgressSink = SILENT, n_twins: int = N_TWINS,
          draft_fault_engines: Sequence[tuple[str, EngineFactory, tuple[str, ...]]] = (),
          pool: WorkPool | None = None) -> CheckReport:
    """Judge `trace` against the reference built by `make_reference(options)` (see the module doc).
    fault_engines: (engine name, factory(options), fault names) for the defect library; subops: the candidate's
    own run as chunk results with sub-op captures (a complete llama.cpp capture), for the drill-down;
    draft_fault_engines: as fault_engines, opened with the candidate's drafter, for its drafter faults.
    progress.note(message) announces the stages; progress.count(stage, done, total) counts the chunks of the two
    long passes.
    pool: where the per-layer runs go (`parity.check.parallel`: worker processes or Ray; factories that are
    `EngineLoader`s can be rebuilt there); the report is the serial one, byte for byte."""
    if pool is not None and not pool.serial:   # a factory a worker cannot rebuild would silently run here
        unbuildable = [name for name, f in [("reference", make_reference), *((n, f) for n, f, _ in fault_engines),
                                            *((n, f) for n, f, _ in draft_fault_engines)]
                       if parallel.loader_of(f) is None]
        if unbuildable:
            raise ParityError(f"check on {pool.describe()}: the engine factory of {', '.join(unbuildable)} cannot be "
                              "rebuilt in a worker (pass a parity.check.parallel.EngineLoader), or run serially")
    announced: list[str] = []
    with parallel.active(pool or WorkPool(), announced):
        return _check(trace, make_reference, env, config, fault_engines, subops, notes, progress, n_twins,
                      draft_fault_engines, announced)


def _check(trace: Trace, make_reference: EngineFactory, env: Envelope, config: ModelConfig,
           fault_engines: Sequence[tuple[str, EngineFactory, tuple[str, ...]]],
           subops: Sequence[ChunkResult] | None, notes: Sequence[str], progress: ProgressSink, n_twins: int,
           draft_fault_engines: Sequence[tuple[str, EngineFactory, tuple[str, ...]]],
           announced: list[str]) -> CheckReport:
    say, count = progress.note, progress.count
    t0 = time.perf_counter()
    ref_engine, make_reference, notes = _open_reference(trace, make_reference, env, config, notes, announced)
    fault_engines = [(n, _quiet(f, announced), faults) for n, f, faults in fault_engines]
    h = trace.header
    st = _Stages(notes=list(notes), runs={"free": ref_engine.config.n_layers})
    say(f"reference: following {len(h.tokens)} tokens on the candidate's schedule ({len(h.chunks)} chunks)")
    ref = replay(ref_engine, h.tokens, h.chunks, lambda i: count("reference (follow)", i + 1, len(h.chunks)))
    free = free_profile(trace, ref)
    if not free:
        raise TraceError(f"{h.engine} trace has no full vectors: check needs them (trace with --full all, or "
                         "import the dumps)")
    cand, more = candidate_chunks(trace, ref)
    st.notes += more
    op_level = subops is not None and cand is not None
    local, tf, nulls = _local_stage(trace, ref_engine, cand, free, subops, n_twins, st, say, count)
    _cause_stage(trace, ref_engine, make_reference, ref, cand, free, tf, nulls, n_twins, local, env, fault_engines,
                 subops, st, say)
    names = [*(n for n in h.checkpoints if not is_draft(n)), *([LOGITS] if LOGITS in free else [])]
    table = _table(names, free, local, env, h.positions)
    if h.draft:
        table += _drafts(trace, ref_engine, n_twins, st, say, count,
                         [(n, _quiet(f, announced), faults) for n, f, faults in draft_fault_engines])
    if announced:
        st.notes.append(f"{len(announced)} internal variant / fault engine runs (their announcements silenced)")
    judged = Judged.OP_LEVEL if op_level else Judged.LAYER_LEVEL if cand is not None else Judged.FREE_RUNNING
    return _report(trace, st, table, judged, t0)


def _open_reference(trace: Trace, make_reference: EngineFactory, env: Envelope, config: ModelConfig,
                    notes: Sequence[str], announced: list[str]) -> tuple[Engine, EngineFactory, list[str]]:
    """The reference engine opened with the options the trace's header declares (checked against the envelope),
    the quiet factory of its variants (sharing its weights when it offers them), and the notes with the QAT
    notes added."""
    loader = parallel.loader_of(make_reference)
    make_reference = _quiet(make_reference, announced)
    opts, qat_notes = reference_options(trace, config)
    env.check_options(opts)
    ref_engine = make_reference(opts)
    if isinstance(ref_engine, Variants):   # variants share the reference's weights and cache (no second copy)
        make_reference = _quiet(ref_engine.variant, announced, loader)
    return ref_engine, make_reference, [*notes, *qat_notes]


def _local_stage(trace: Trace, ref_engine: Engine, cand: list[ChunkResult] | None, free: dict[str, np.ndarray],
                 subops: Sequence[ChunkResult] | None, n_twins: int, st: _Stages, say: Note, count: Count
                 ) -> tuple[list[LayerLocal], dict[int, list[LayerOutput]], dict[int, LayerNull]]:
    """Stage 3: the teacher-forced local error of every layer whose input and output the candidate recorded,
    judged op by op (with the candidate's sub-ops) or by the layer's round-off null; records its runs and the
    evidence note in `st`."""
    L = ref_engine.config.n_layers
    layers = [] if cand is None else [l for l in range(L) if (EMBED if l == 0 else block(l - 1)) in cand[0].checkpoints
                                      and (block(l) in free or block_attn(l) in free)]
    say(f"teacher-forced: {len(layers)} reference layers on the candidate's inputs")
    tf = (teacher_forced(ref_engine, cand, layers, on_chunk=lambda i: count("local error", i + 1, len(cand)))
          if cand is not None else {})
    st.runs["local"] = len(layers)
    nulls: dict[int, LayerNull] = {}
    if subops is not None and cand is not None:
        say(f"op-level: every sub-op of {len(layers)} layers on the candidate's own dumped inputs, and "
            f"{n_twins} round-off twins of each ({(1 + n_twins) * len(layers)} layer-runs)")
        local = []
        for k, l in enumerate(layers, 1):
            local.append(LayerLocal(l, op_verdict(ref_engine, cand, subops, l, n_twins).fit))
            count("op-level layers", k, len(layers))
        st.runs["op_level"] = (1 + n_twins) * len(layers)
    else:
        say(f"round-off null: {n_twins} twins of the reference on the candidate's inputs "
            f"({n_twins * len(layers)} layer-runs)")
        if cand is not None and layers:
            nulls = layer_nulls(ref_engine, cand, tf, n_twins, lambda i: count("round-off twins", i, len(layers)))
        local = local_errors(trace, tf, nulls)
        st.runs["null"] = n_twins * len(layers)
    st.notes.append(_evidence_note(subops is not None and cand is not None, cand is not None))
    return local, tf, nulls


def _cause_stage(trace: Trace, ref_engine: Engine, make_reference: EngineFactory, ref: Sequence[ChunkResult],
                 cand: list[ChunkResult] | None, free: dict[str, np.ndarray], tf: dict[int, list[LayerOutput]],
                 nulls: dict[int, LayerNull], n_twins: int, local: Sequence[LayerLocal], env: Envelope,
                 fault_engines: Sequence[tuple[str, EngineFactory, tuple[str, ...]]],
                 subops: Sequence[ChunkResult] | None, st: _Stages, say: Note) -> None:
    """Stage 4: the ties of every layer, then the departing layers explained (or, with none, the tie rule and
    the free-running excess explained as amplified drift); the causes go to `st`."""
    for r in local:
        st.causes += [Cause(CauseKind.BENIGN, "tie", r.layer, t.subop, Tie(t)) for t in r.fit.ties]
    departing = [r for r in local if r.departs]
    tied = [r for r in local if not r.departs and len(r.fit.ties) >= TIE_RULE_MIN]
    if not departing and tied and cand is not None:
        _tie_rule(trace, ref_engine, cand, tf, tied, nulls, n_twins, fault_engines, st, say)
    if departing:
        _explain(trace, ref_engine, make_reference, cand, tf, nulls, n_twins, departing, env, fault_engines, st,
                 say, subops)
    else:
        _explain_free(trace, ref_engine, ref, cand, free, env, st, say)


def _report(trace: Trace, st: _Stages, table: Sequence[CheckRow], judged: Judged, t0: float) -> CheckReport:
    """The frozen report of what the stages found, and its verdict."""
    verdict = Verdict.of_causes(c.kind for c in st.causes)
    return CheckReport(verdict, st.culprit, tuple(st.causes), tuple(table), st.runs, tuple(st.notes),
                       trace.header.n_prompt, round(time.perf_counter() - t0, 3), judged)


def _drafts(trace: Trace, ref_engine: Engine, n_twins: int, st: _Stages, say: Note, count: Count,
            fault_engines: Sequence[tuple[str, EngineFactory, tuple[str, ...]]]) -> list[CheckRow]:
    """The draft checkpoints, teacher-forced on the candidate's trunk carriers (`parity.check.draft_check`): a
    row each; the first outside the round-off null is a defect (the culprit when the trunk has none), matched
    against the drafter faults of `fault_engines`."""
    h = trace.header
    names = draft_names(h.draft)
    drafter = getattr(ref_engine, "drafter", None)
    why = ("the reference was opened without a drafter (give check --draft FILE, the candidate's drafter)"
           if drafter is None else unjudged(trace))
    if why is None:
        check_drafter(trace, drafter.weights.identity(), drafter.path.name)
    if why is not None:
        st.notes.append(f"draft checkpoints not judged: {why}")
        return [CheckRow(n, None, None, None, None, 0.0, None, RowStatus.NOT_JUDGED) for n in names]
    say(f"drafter: the reference's {h.draft['kind']} head on the candidate's trunk carriers, and {n_twins} "
        "round-off twins of it")
    dc = draft_check(trace, ref_engine, n_twins, lambda i: count("drafter twins", i, n_twins))
    st.runs["drafter"] = 1 + n_twins
    st.notes += list(dc.notes)
    first = dc.first
    if first is not None and first.test.first is not None:
        pos = first.test.first.position
        say(f"drafter: {first.checkpoint} departs; running the drafter faults")
        opts = ref_engine.options
        best, runs = draft_library(trace, dc, RunOptions(fp8_kv=opts.fp8_kv, fp4_indexer=opts.fp4_indexer),
                                   fault_engines)
        st.runs["drafter_library"] = runs
        library = ((Library.NONE_OFFERED if not fault_engines else Library.NONE_TRIED) if best is None else
                   Library.MATCHED if best.explains else Library.PARTIAL)
        name = best.name if best is not None and library is Library.MATCHED else "unexplained"
        st.causes.append(Cause(CauseKind.DEFECT, name, f"drafter {first.checkpoint}", None,
                               DrafterDefect(first.test, first.err, library, best)))
        if st.culprit is None:
            st.culprit = CheckCulprit(f"drafter {first.checkpoint}", None, pos, _decode_step(pos, h.n_prompt))
    return [CheckRow(r.checkpoint, None, None, r.err, r.test.worst.ratio if r.test.worst else 0.0, r.twin_max,
                     r.test.first.position if r.departs and r.test.first else None,
                     RowStatus.LOCAL if r.departs else RowStatus.OK) for r in dc.rows]


def _explain_free(trace: Trace, ref_engine: Engine, ref: Sequence[ChunkResult], cand: list[ChunkResult] | None,
                  free: dict[str, np.ndarray], env: Envelope, st: _Stages, say: Note) -> None:
    """No layer departs locally: a free-running excess is amplified sub-envelope drift; name its QAT flip."""
    out = [n for n in trace.header.checkpoints if n in free
           and float(env.excess_at(n, free[n].max())) > 1]
    if not out:
        return
    if EMBED in out:   # a table lookup: no round-off to amplify, so a difference there is the embedding's own
        pos = int(trace.header.positions[int(np.argmax(free[EMBED] > env.limit(env.floor(EMBED))))])
        st.causes.append(Cause(CauseKind.DEFECT, "embedding-differs", None, None, EmbeddingDiffers(
            float(free[EMBED].max()), float(env.excess_at(EMBED, free[EMBED].max())), pos)))
        st.culprit = CheckCulprit(None, None, pos, _decode_step(pos, trace.header.n_prompt))
        return
    first = next((checkpoint_layer(n) for n in out if checkpoint_layer(n) is not None), None)
    worst = max(out, key=lambda n: float(env.excess_at(n, free[n].max())))
    ex = float(env.excess_at(worst, free[worst].max()))
    if cand is None or first is None:
        st.causes.append(Cause(CauseKind.BENIGN, "amplified-drift", first, None, Drift(ex, worst, first, False)))
        return
    say(f"free-running excess from layer {first}: looking for the QAT code flip the drift tips over")
    subs = inherited_flips(ref_engine, ref, cand, first, env)
    st.runs["flip_check"] = 2
    flip = next((s for s in subs if s.status is SubopStatus.NOISE and s.flips), None)
    if flip is None:
        st.causes.append(Cause(CauseKind.BENIGN, "amplified-drift", first, None, Drift(ex, worst, first, True)))
        return
    fp8 = any(f.format is QuantFormat.FP8_E4M3 for f in flip.flips)
    st.causes.append(Cause(CauseKind.BENIGN, "fp8-code-flip" if fp8 else "fp4-code-flip", first, flip.name,
                           Drift(ex, worst, first, True, flip)))


def _explain(trace: Trace, ref_engine: Engine, make_reference: EngineFactory, cand: list[ChunkResult],
             tf: dict[int, list[LayerOutput]], nulls: dict[int, LayerNull], n_twins: int,
             departing: list[LayerLocal], env: Envelope,
             fault_engines: Sequence[tuple[str, EngineFactory, tuple[str, ...]]], st: _Stages, say: Note,
             subops: Sequence[ChunkResult] | None = None) -> None:
    """Every locally departing layer, in order, gets the first hypothesis that explains it; the first layer
    nothing benign explains is the culprit, matched against the defect library."""
    st.runs.update(hypotheses=0, defect_library=0, drill_down=0)

    def judge_ops(engine: Engine, layer: int) -> Fit:
        return op_verdict(engine, cand, subops, layer, n_twins).fit

    tester = VariantTester(trace, ref_engine, make_reference,
                           judge_ops if subops is not None else layer_judge(trace, cand, n_twins),
                           st.notes, st.runs, n_twins)
    for d in departing:
        say(f"layer {d.layer}: {null_words(d.fit.test)}"
            + (f", {discrete_words(d.fit.structural)}" if d.fit.structural is not None else ""))
        _layer_null(ref_engine, cand, tf, nulls, d.layer, n_twins, st)
        if subops is None and len(routing_flips(trace, tf[d.layer], d.layer)) and d.fit.structural is None:
            st.runs["hypotheses"] += 1
            flip = routing_replay(trace, make_reference, ref_engine.options, cand, d.layer, nulls[d.layer])
            if flip is not None:
                st.causes.append(Cause(CauseKind.BENIGN, "routing-flip", d.layer, "router",
                                       Reproduced(d.fit, flip[2], routing=True)))
                continue
        hit = tester.explain(d.layer)
        if hit is None:
            closest = tester.closest.get(d.layer)
            if closest is not None and closest.subop is not None and d.fit.subop is not None:
                d = replace(d, fit=replace(d.fit, subop=closest.subop, position=closest.position))
            _defect(trace, ref_engine, cand, d, nulls[d.layer], env, fault_engines, st, say)
            return
        v, f = hit
        for part in v.parts or (v.name,):
            sub = d.fit.subop or name_subop(ref_engine, tester.engine_of(part), cand, d.layer, env)
            st.runs["drill_down"] += 0 if d.fit.subop else 2
            st.causes.append(Cause(CauseKind.BENIGN, part, d.layer, sub,
                                   Reproduced(d.fit, f, v.name if v.parts else None)))


def _layer_null(ref_engine: Engine, cand: list[ChunkResult], tf: dict[int, list[LayerOutput]],
                nulls: dict[int, LayerNull], layer: int, n_twins: int, st: _Stages) -> LayerNull:
    """The layer-level null of `layer`, measured when first needed (op-level checks measure none up front)."""
    if layer not in nulls:
        nulls[layer] = layer_nulls(ref_engine, cand, {layer: tf[layer]}, n_twins)[layer]
        st.runs["null"] = st.runs.get("null", 0) + n_twins
    return nulls[layer]


TIE_RULE_MIN = 2   # ties a known fault must break exactly as the candidate does before they are its tie rule


def _tie_rule(trace: Trace, ref_engine: Engine, cand: list[ChunkResult], tf: dict[int, list[LayerOutput]],
              tied: list[LayerLocal], nulls: dict[int, LayerNull], n_twins: int,
              fault_engines: Sequence[tuple[str, EngineFactory, tuple[str, ...]]], st: _Stages,
              say: Note) -> None:
    """Ties are not defects, unless a known fault's rule breaks every one of them exactly as the candidate does
    (where the round-off twins break them either way): then the candidate follows that wrong rule."""
    st.runs.setdefault("defect_library", 0)
    for r in tied:
        say(f"layer {r.layer}: {len(r.fit.ties)} ties; does a known fault's tie rule make every pick?")
        null = _layer_null(ref_engine, cand, tf, nulls, r.layer, n_twins, st)
        best, n = defect_library(trace, ref_engine, cand, r.layer, null, fault_engines)
        st.runs["defect_library"] += n
        if best is not None and best.fit.explains and not best.fit.ties:
            sub = r.fit.ties[0].subop
            st.causes.append(Cause(CauseKind.DEFECT, best.name, r.layer, sub, TieRule(best.name, len(r.fit.ties))))
            pos = r.fit.position
            st.culprit = CheckCulprit(r.layer, sub, pos, _decode_step(pos, trace.header.n_prompt))
            return


def _evidence_note(op_level: bool, forced: bool) -> str:
    """What the local verdict rests on, and how to get a stronger one."""
    if op_level:
        return "judged op-level: every sub-op on the candidate's own dumped inputs"
    if forced:
        return ("judged layer-level: each layer on the candidate's own carrier (for an op-level verdict, record its "
                "sub-ops: `v4parity trace --subops`, sub-op records from C (docs/trace-format.md), or a complete "
                "`v4parity capture llamacpp` file)")
    return ("judged free-running only: record every position with full vectors (--positions all --full all) for a "
            "layer-level verdict")


def _defect(trace: Trace, ref_engine: Engine, cand: list[ChunkResult], d: LayerLocal, null: LayerNull,
            env: Envelope, fault_engines: Sequence[tuple[str, EngineFactory, tuple[str, ...]]], st: _Stages,
            say: Note) -> None:
    say(f"layer {d.layer}: no benign hypothesis explains it; running the defect library")
    best, n = defect_library(trace, ref_engine, cand, d.layer, null, fault_engines)
    st.runs["defect_library"] += n
    own = d.fit.subop
    position = d.fit.position
    if best is not None and best.fit.explains:
        sub = own if own is not None else name_subop(ref_engine, best.engine, cand, d.layer, env)
        st.runs["drill_down"] += 2 if own is None else 0
        st.causes.append(Cause(CauseKind.DEFECT, best.name, d.layer, sub,
                               LayerDefect(d.fit, Library.MATCHED, best.name, best.fit)))
    else:
        sub = own
        partial = best is not None and best.fit.test.exceed < d.fit.test.exceed and best.fit.worst < d.fit.worst
        library = Library.PARTIAL if partial else Library.NO_MATCH if best is not None else Library.NONE_OFFERED
        st.causes.append(Cause(CauseKind.DEFECT, "unexplained", d.layer, sub, LayerDefect(
            d.fit, library, best.name if best is not None else None, best.fit if best is not None else None)))
    st.culprit = CheckCulprit(d.layer, sub, position, _decode_step(position, trace.header.n_prompt))


def _table(names: Sequence[str], free: dict[str, np.ndarray], local: Sequence[LayerLocal], env: Envelope,
           positions: Sequence[int]) -> list[CheckRow]:
    by_layer = {r.layer: r for r in local}
    rows = []
    for n in names:
        floor = env.floor(n)
        fe = free.get(n)
        f = None if fe is None else float(fe.max())
        fx = None if fe is None else float(env.excess(f, floor))
        lr = by_layer.get(checkpoint_layer(n)) if checkpoint_layer(n) is not None else None
        lo = None if lr is None else (lr.fit.err_attn if n.endswith(".attn") else lr.fit.err)
        lx = None if lo is None or lr is None else lr.twin_ratio
        departs = lr is not None and lr.departs
        pos = None
        if fe is not None and fx is not None and fx > 1:
            pos = int(positions[int(np.argmax(fe > env.limit(floor)))])
        if departs and lr is not None:
            pos = lr.fit.position
        status = (RowStatus.NOT_JUDGED if fe is None else RowStatus.STRUCTURAL if lr is not None
                  and lr.fit.structural is not None and not n.endswith(".attn") else RowStatus.LOCAL if departs else
                  RowStatus.OUTSIDE if fx is not None and fx > 1 else RowStatus.OK)
        rows.append(CheckRow(n, f, fx, lo, lx, floor, pos, status))
    return rows
