"""`v4parity spec --candidate TRACE`: a foreign engine's speculative run, read from the `spec` records of its trace
(parity.tracing.specrecords), attributed as a live run is (docs/spec.md "Foreign engines").

The trace gives the committed tokens (header `tokens`, the prompt its first `n_prompt`) and per round the drafts,
γ, the cut, the verify argmaxes and a'. The reference decodes the prompt plainly, re-runs every verify batch on the
candidate's own committed prefix and drafts (restored and replayed as the driver does) and drafts with the
reference drafter on its own trunk rows of that prefix (the trace holds no drafter inputs), so the labels, the
committed-token verdicts and the acceptance are those of a live run. Not available from a trace: the candidate's
plain decode (exactness is speculative vs reference; `spec_induced` is None) and its states (`state_divergence`
is None and `state_note` says why). `spec_trace` writes a live run's rounds as such a trace (`--trace-out`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from parity.check.envelope import Envelope
from parity.contract.engine import Engine
from parity.contract.errors import TraceError
from parity.contract.progress import SILENT, ProgressSink
from parity.gguf.drafter import DrafterConfig
from parity.spec.attribution import attribute
from parity.spec.drafts import DSparkSource, MTPSource
from parity.spec.driver import Round, SpecRun
from parity.spec.report import SpecReport, assemble, reference_decode
from parity.tracing.drafts import trunk_identity
from parity.tracing.io import read_trace
from parity.tracing.records import TABLES, Trace, TraceHeader, make_table
from parity.tracing.specrecords import SpecRecord
from parity.tracing.stats import FP_DIM

STATE_NOTE = ("not checked: a trace records no engine state (ring rows, compressor and indexer accumulators, drafter "
              "rings); run the engine under `v4parity spec --engine` for state parity")
QAT_FLAGS = ("fp8_kv", "fp4_indexer")
TOP_K = 20    # the header's top_k of a spec-only trace (no final_norm records use it), as `v4parity trace` writes


def read_candidate(path: str | Path) -> Trace:
    """The candidate's trace (text form), which must hold spec records and give the QAT flags as booleans."""
    trace = read_trace(path, load_vectors=False, allow_spec_only=True)
    h = trace.header
    if h.decode < 1:
        raise TraceError(f"{path}: field 'decode': a speculative run generates at least one token, got {h.decode}")
    if not trace.spec and h.decode > 1:
        raise TraceError(f"{path}: field 'spec': the trace holds no spec records (docs/trace-format.md "
                         "\"Spec records\")")
    bad = [k for k in QAT_FLAGS if not isinstance(h.flags.get(k), bool)]
    if bad:
        raise TraceError(f"{path}: field 'flags': {bad[0]} must be true or false (the reference runs with the "
                         f"candidate's QAT simulations), got {h.flags.get(bad[0])!r}")
    return trace


def qat_of(trace: Trace) -> dict[str, bool]:
    """The candidate's QAT simulation flags (checked by `read_candidate`)."""
    return {k: bool(trace.header.flags[k]) for k in QAT_FLAGS}


def check_candidate(trace: Trace, path: str | Path, identity: dict[str, Any], vocab: int,
                    drafter: DrafterConfig | None) -> None:
    """The trace against the model (identity, token ids < vocab) and the drafter (MTP: one depth in every round;
    DSpark: B drafts and B confidences a round)."""
    m = trace.header.model
    keys = [k for k in ("size", "header_sha256", "data_sha256") if k in m and k in identity]
    differ = [k for k in keys if m[k] != identity[k]]
    if differ:
        raise TraceError(f"{path}: field 'model': {differ[0]} {m[differ[0]]} is not the model's "
                         f"({identity[differ[0]]}): the trace was written with another model")
    bad = [t for t in trace.header.tokens if t >= vocab]
    if bad:
        raise TraceError(f"{path}: field 'tokens': token {bad[0]} outside the model's vocabulary of {vocab}")
    depths = {len(r.drafts) for r in trace.spec}
    for r in trace.spec:
        ids = [t for t in (*r.drafts, *r.verify) if t >= vocab]
        if ids:
            raise TraceError(f"{r.where}: field '{'drafts' if ids[0] in r.drafts else 'verify'}': token {ids[0]} "
                             f"outside the model's vocabulary of {vocab}")
        if drafter is not None and drafter.kind == "mtp" and len(depths) > 1:
            raise TraceError(f"{r.where}: field 'drafts': {len(r.drafts)} drafts, but an MTP run drafts its depth "
                             f"in every round (the rounds draft {sorted(depths)})")
        if drafter is not None and drafter.kind == "dspark" and (len(r.drafts) != drafter.block_size
                                                                  or r.conf is None):
            raise TraceError(f"{r.where}: field 'drafts': a DSpark round of this drafter drafts B = "
                             f"{drafter.block_size} tokens with their confidences, got {len(r.drafts)} drafts, conf "
                             f"{'-' if r.conf is None else len(r.conf)}")


def records_to_run(trace: Trace) -> SpecRun:
    """The trace's rounds as the driver's `SpecRun` (no drafter inputs, no states; replayed rows as the greedy
    rule implies: a' + 1 after a rejection)."""
    h = trace.header
    run = SpecRun(list(h.tokens[: h.n_prompt]), list(h.tokens))
    first = 0
    for r in trace.spec:
        run.rounds.append(Round(r.start_pos, h.tokens[r.start_pos], r.drafts, r.conf, r.verified, r.cut, r.verify,
                                r.accepted, r.accepted + 1 if r.accepted < r.verified else 0, {}))
        run.feed_first.append(first)
        first = r.start_pos
    return run


def records_of(rounds: tuple[Round, ...] | list[Round]) -> list[SpecRecord]:
    """A run's rounds as spec records."""
    return [SpecRecord(i, r.start_pos, r.drafts, r.verified, r.cut, r.verify, r.accepted, r.confidence)
            for i, r in enumerate(rounds)]


def spec_trace(report: SpecReport, engine: Engine) -> Trace:
    """A live run's rounds as a trace of spec records alone (`v4parity spec --trace-out`): header tokens = prompt +
    the speculative tokens, chunks the prompt then 1 per generated token, no checkpoints, no positions."""
    tokens = [*report.prompt, *report.spec_tokens]
    h = TraceHeader(engine=engine.name, engine_version=engine.version, model=trunk_identity(engine.identity),
                    dtype=engine.options.dtype, n_hc=engine.config.hc_mult, dim=engine.config.dim, top_k=TOP_K,
                    tokens=tokens, n_prompt=len(report.prompt), chunks=[len(report.prompt)] + [1] * len(
                        report.spec_tokens), decode=len(report.spec_tokens), positions=[], checkpoints=[], full=[],
                    flags=engine.options.flags())
    widths = {"H": h.n_hc, "F": FP_DIM, "K": TOP_K, "E": 0, "S": 0}
    tables = {kind: make_table(kind, {c: [] for c in TABLES[kind]}, widths) for kind in TABLES}
    return Trace(h, **tables, spec=records_of(report.rounds))


def candidate_report(trace: Trace, path: str | Path, ref: Engine, kind: str, env: Envelope,
                     drafter: DrafterConfig | None,
                     progress: ProgressSink = SILENT) -> SpecReport:
    """Attribute the trace's run with `ref` (`kind`: mtp | dspark with the drafter's config, or script: the
    recorded drafts are their own reference) and report it as `spec_report` does (`progress.count` counts)."""
    h = trace.header
    run = records_to_run(trace)
    width = max((len(r.drafts) for r in run.rounds), default=0)
    t0 = time.perf_counter()
    ref_tokens, ref_logits = reference_decode(ref, run.prompt, h.decode)
    t1 = time.perf_counter()
    progress.count("reference plain decode", h.decode, h.decode)
    source = (None if kind == "script" or not run.rounds else MTPSource(ref, width) if kind == "mtp"
              else DSparkSource(ref, drafter))
    attrs, _ = attribute(ref, source, run, env, progress, own_inputs=True)
    t2 = time.perf_counter()
    cuts = sorted({r.cut for r in run.rounds if r.cut})
    options = {"engine": f"{h.engine} {h.engine_version}", "candidate": str(path), "flags": h.flags,
               "drafter": kind, "depth": width, "pairing": None, "ring_policy": None,
               "gate": "as recorded" + (f" (cuts: {', '.join(cuts)})" if cuts else ""), "max_draft": None,
               "temperature": 0, "tie_break": "first-max", "reject_at": None, "envelope_logit_rel": env.logit_rel}
    return assemble(options, run, None, ref_tokens, np.asarray(ref_logits), attrs, None, env,
                    {"reference_plain": t1 - t0, "attribution": t2 - t1}, STATE_NOTE)
