"""The Python API mirroring the CLI: `trace`, `follow`, `load_trace`, `save_trace`, `diff`, `gate`, `export`, `plot`,
`envelope`, `bisect`, `check` (among others).

Everything here returns data (Trace, DiffReport with a pandas `.table`, GateResult, BisectReport, CheckReport); the CLI
commands only parse options, call one of these and print (one call per command: tests/test_code_shape.py). A function
that runs an engine on tokens takes them as the command parsed them (`Tokens`: ids, or a `TokenSource`, with
--follow / --decode / --chunk as keywords) and builds its run with `plan_run` (a frozen
`parity.tracing.plan.RunPlan`: token sources, --follow, default positions, the token-range check); `trace` itself
validates through the same plan. Importing this module does not import torch; engines are loaded through
`parity.contract.engine.load_engine` only when a trace is run.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from parity.compare.verdict import Verdict
from parity.contract.checkpoints import block, draft_positions, trace_checkpoints
from parity.contract.engine import Engine, RunOptions, load_engine
from parity.contract.errors import ParityError, TraceError
from parity.contract.progress import SILENT, Note, ProgressSink
from parity.tracing.drafts import draft_header, draft_names, draft_records, tapped_layers, trunk_identity
from parity.tracing.io import read_trace, write_trace
from parity.tracing.plan import (
    RunPlan,
    TokenSource,
    check_token_range,
    follow_plan,
    refuse_with_follow,
    resolve_tokens,
    run_plan,
)
from parity.tracing.recorder import Recorder, resolve_full
from parity.tracing.records import Trace, TraceHeader
from parity.tracing.runner import ChunkResult, chunk_schedule, run_sequence
from parity.tracing.subops import RECORD_NAMES, SubopRecorder
from parity.validate.result import ValidateReport

TraceLike = Trace | str | os.PathLike
Tokens = Sequence[int] | TokenSource | None
"""A run's prompt as the API takes it: token ids, or the sources a command was given (`TokenSource`, resolved by
`plan_run`), or None (a command's default: the built-in prompt where there is one)."""


def load_trace(path: str | os.PathLike, load_vectors: bool = True) -> Trace:
    """Read a trace in either form (text or .npz), with its full vectors when it has a side file."""
    return read_trace(path, load_vectors)


def save_trace(trace: Trace, path: str | os.PathLike, form: str | None = None) -> Path:
    """Write a trace atomically: text unless `form='npz'` or the path ends in .npz."""
    return write_trace(trace, path, form)


def _as_trace(t: TraceLike) -> Trace:
    return t if isinstance(t, Trace) else read_trace(t)


def convert(source: str | os.PathLike, dest: str | os.PathLike) -> Path:
    """`v4parity convert`: the trace `source` re-encoded at `dest` (text or .npz by its extension, full vectors
    copied to its side file)."""
    return save_trace(load_trace(source), dest)


def import_trace(kind: str, source: str | os.PathLike, model: str | os.PathLike, output: str | os.PathLike, *,
                 tokens: Tokens = None, start_pos: int = 0, top_k: int = 20) -> dict[str, Any]:
    """`v4parity import`: another engine's tensor dumps as a trace of `model`, written to `output`. `kind` ds4
    (`source`: the dump prefix) or llama.cpp (`source`: a capture file, which carries its token ids, or a directory
    of eval-callback tensors whose first row is at `start_pos`); `tokens`: the run's ids or a TokenSource of them
    (exactly one source; none only for a capture file). Returns {wrote, checkpoints, positions, dropped}."""
    from parity.contract.errors import ParityError
    from parity.gguf.weights import Weights
    from parity.tracing.importers import import_ds4, import_llamacpp

    if kind not in ("ds4", "llama.cpp"):
        raise ParityError(f"import kind {kind!r}: ds4 or llama.cpp")
    capture_file = kind == "llama.cpp" and Path(source).is_file()  # a capture carries its input_ids
    ids = ([int(t) for t in tokens] if tokens is not None and not isinstance(tokens, TokenSource)
           else resolve_tokens(model, tokens or TokenSource(), required=not capture_file))
    cfg, ident = Weights(model).config, model_identity(model)
    if kind == "ds4":
        t = import_ds4(source, tokens=ids, config=cfg, model=ident, top_k=top_k)
    else:
        t = import_llamacpp(source, tokens=ids, config=cfg, model=ident, start_pos=start_pos, top_k=top_k)
    path = save_trace(t, output)
    return {"wrote": str(path), "checkpoints": t.header.checkpoints, "positions": t.header.positions,
            "dropped": t.header.flags["import_dropped"]}


def model_identity(model: str | os.PathLike) -> dict[str, Any]:
    """Size + header hash of a GGUF (all shards), as stored in trace headers."""
    from parity.gguf.weights import Weights

    return Weights(model).identity()


def trace(engine: str | Engine, model: str | os.PathLike, tokens: Sequence[int], *,
          positions: str | Sequence[int] | None = None,
          full: str | Sequence[str] | None = None, decode: int = 0, chunk: int | None = None, top_k: int = 20,
          options: RunOptions | None = None, forced: Sequence[int] | None = None,
          on_chunk: Callable[[ChunkResult], None] | None = None, subops: bool = False,
          draft: str | os.PathLike | None = None, mtp_depth: int = 1, mtp_pairing: str = "prev") -> Trace:
    """Run `engine` (a registered name or an Engine instance) on `tokens` (+ `decode` greedy steps) and record.

    positions: 'last' | 'all' | list of positions of the whole run (default: `parity.tracing.plan.default_positions`,
    as the CLI's: the last position, with decode the prompt's last and every decode position); full: 'all' | list
    of checkpoints (and 'logits') whose full vectors go to the side file; `forced`: the decode tokens to feed instead
    of the engine's own argmax (teacher forcing, e.g. another trace's generated tokens); `on_chunk` sees
    every chunk result as it comes (progress bars, logit dumps); `subops`: also record every layer's sub-op
    outputs (`parity.tracing.subops`, for op-level checks; needs positions 'all'); `draft`: a drafter GGUF whose
    head runs on the run's trunk carriers and fills the draft checkpoints (`parity.tracing.drafts`; MTP chained to
    `mtp_depth` with `mtp_pairing`) — an Engine instance records them when it was opened with a drafter.
    """
    eng = _traced_engine(engine, model, options or RunOptions(), draft)
    plan = run_plan(tokens, decode, forced=forced, chunk=chunk, positions=positions, vocab=eng.config.vocab_size)
    dh = draft_header(eng, mtp_pairing, mtp_depth) if getattr(eng, "drafter", None) is not None else {}
    dnames = draft_names(dh) if dh else []
    pos = list(plan.positions)
    _check_traceable(plan, dh, dnames, subops)
    full_names = resolve_full(full, eng.config.n_layers, dnames)
    names = [*trace_checkpoints(eng.config.n_layers), *dnames]
    rec = Recorder(names, pos, full_names, top_k, eng.config.hc_mult)
    taps = {l: [] for l in (tapped_layers(eng, dh) if dh else [])}
    sub = SubopRecorder(pos) if subops else None

    def each(r: ChunkResult) -> None:
        rec.add(r)
        for l, rows in taps.items():
            rows.append(r.checkpoints[block(l)])
        if sub:
            sub.add(r)
        if on_chunk:
            on_chunk(r)

    results = run_sequence(eng, list(plan.tokens), decode_steps=plan.decode, chunk=plan.chunk, forced=plan.forced,
                           capture=subops, on_chunk=each, keep=False)
    all_tokens = np.concatenate([r.tokens for r in results]).tolist()
    if dh:
        carriers = {l: np.concatenate(rows) for l, rows in taps.items()}
        got = draft_records(eng, dh, carriers, all_tokens, pos, int(np.argmax(results[-1].logits[-1])))
        for name in dnames:
            at = draft_positions(name, pos, dh.get("pairing"))
            rec.add_draft(name, at, np.asarray(all_tokens)[at], got[name])
    header = TraceHeader(
        engine=eng.name, engine_version=eng.version, model=trunk_identity(eng.identity), dtype=eng.options.dtype,
        n_hc=eng.config.hc_mult, dim=eng.config.dim, top_k=top_k, tokens=all_tokens, n_prompt=len(plan.tokens),
        chunks=[len(r.tokens) for r in results], decode=plan.decode, positions=pos,
        checkpoints=names, full=full_names,
        flags=eng.options.flags(), subops=list(RECORD_NAMES) if subops else [], draft=dh,
    )
    return Trace(header, **rec.tables(), vectors=rec.vectors(), subops=sub.arrays() if sub else None)


def trace_to_file(engine: str, model: str | os.PathLike, tokens: RunPlan | Tokens, output: str | os.PathLike, *,
                  follow: TraceLike | None = None, decode: int | None = None, chunk: int | None = None,
                  positions: str | Sequence[int] | None = None, note: Note | None = None,
                  options: RunOptions | None = None, full: str | Sequence[str] | None = None, top_k: int = 20,
                  subops: bool = False, draft: str | os.PathLike | None = None, mtp_depth: int = 1,
                  mtp_pairing: str = "prev", dump_logprobs: tuple[str | os.PathLike, int] | None = None,
                  progress: ProgressSink = SILENT) -> dict[str, Any]:
    """`v4parity trace`: run `engine` on a plan, write the trace to `output` and, with
    `dump_logprobs` = (path, ctx), a ds4 --dump-logprobs JSON recording that ctx (ds4 semantics: step 0 = the last
    prompt row, step i = the row after feeding step i-1's token); `progress.count(stage, done, total)` counts the
    chunks.
    The plan: `tokens` when it is a RunPlan, else `plan_run` of `tokens` (ids or a TokenSource), `follow`, `decode`,
    `chunk` and `positions` (the token range is checked against the engine's vocabulary by `trace`; `note` hears a
    tokenizer disagreement).
    Returns {wrote, checkpoint_records, positions, tokens, n_prompt, decode[, logprobs: {wrote, steps, top_k, ctx}]}."""
    plan = _plan_of(model, tokens, follow=follow, decode=decode, chunk=chunk, positions=positions, note=note)
    n_prompt, rows, done = len(plan.tokens), [], [0]
    total = n_chunks(n_prompt, plan.decode, plan.chunk)
    stage = f"trace {engine}: {n_prompt} tokens + {plan.decode} decode"

    def on_chunk(r: ChunkResult) -> None:
        if dump_logprobs is not None:
            rows.extend(r.logits[max(0, n_prompt - 1 - r.start_pos):])
        done[0] += 1
        progress.count(stage, done[0], total)

    progress.count(stage, 0, total)
    t = trace(engine, model, full=full, top_k=top_k, options=options, on_chunk=on_chunk, subops=subops, draft=draft,
              mtp_depth=mtp_depth, mtp_pairing=mtp_pairing, **plan.kwargs())
    if dump_logprobs is not None:  # an older dump never stays beside the new trace (a killed run leaves none)
        Path(dump_logprobs[0]).unlink(missing_ok=True)
    path = save_trace(t, output)
    report = {"wrote": str(path), "checkpoint_records": len(t.ckpt), "positions": t.header.positions,
              "tokens": len(t.header.tokens), "n_prompt": t.header.n_prompt, "decode": t.header.decode}
    if dump_logprobs is not None:
        report["logprobs"] = _dump_logprobs(*dump_logprobs, model, rows, t.header.n_prompt, top_k)
    return report


def _plan_of(model: str | os.PathLike, tokens: RunPlan | Tokens, **run: Any) -> RunPlan:
    """`tokens` when it is a RunPlan (then no other run option in `run` may be set), else `plan_run` of `tokens` and
    `run` without the range check (`trace` checks it against the engine's vocabulary)."""
    if not isinstance(tokens, RunPlan):
        return plan_run(model, tokens, check_range=False, **run)
    given = [k for k, v in run.items() if v is not None and k != "note"]
    if given:
        raise TraceError(f"a RunPlan is the whole run: drop {', '.join(given)}")
    return tokens


def _dump_logprobs(path: str | os.PathLike, ctx: int, model: str | os.PathLike, rows: list, n_prompt: int,
                   top_k: int) -> dict[str, Any]:
    """Write the logit rows as a ds4 --dump-logprobs JSON -> {wrote, steps, top_k, ctx}."""
    from parity.gguf.tokenizer import load_tokenizer
    from parity.logprobs.io import ds4_argmax, write_ds4_dump

    logits = np.stack(rows).astype(np.float32)
    write_ds4_dump(path, logits=logits, selected=[ds4_argmax(r) for r in logits], prompt_tokens=n_prompt,
                   ctx=ctx, top_k=top_k, vocab_tokens=load_tokenizer(model).tokens)
    return {"wrote": str(path), "steps": len(logits), "top_k": top_k, "ctx": ctx}


def _traced_engine(engine: str | Engine, model: str | os.PathLike, options: RunOptions,
                   draft: str | os.PathLike | None) -> Engine:
    """`engine` loaded by name (with its drafter `draft`), or the Engine instance given (which brings its own)."""
    if not isinstance(engine, str):
        if draft is not None:
            raise TraceError("draft=FILE opens a named engine with its drafter; an Engine instance brings its own")
        return engine
    return load_engine(engine, str(model), options, draft=None if draft is None else str(draft))


def _check_traceable(plan: RunPlan, dh: dict, dnames: Sequence[str], subops: bool) -> None:
    """The plan's positions hold every draft checkpoint `dnames` (of the drafter header `dh`), and all of them
    when sub-ops are recorded."""
    pos = list(plan.positions)
    empty = [n for n in dnames if not draft_positions(n, pos, dh.get("pairing"))]
    if empty:
        raise TraceError(f"no traced position holds {empty[0]} (MTP prev pairs and DSpark rounds start at position 1; "
                         f"docs/trace-format.md), positions {pos}")
    n_total = len(plan.tokens) + plan.decode
    if subops and pos != list(range(n_total)):
        raise TraceError(f"sub-op records need every position (op-level forcing runs each op on all of them): "
                         f"trace with --positions all, not {len(pos)} of {n_total} positions")


def plan_run(model: str | os.PathLike, source: Tokens = None, *, follow: TraceLike | None = None,
             decode: int | None = None, chunk: int | None = None, positions: str | Sequence[int] | None = None,
             default_decode: int = 0, builtin: bool = False, check_range: bool = True,
             note: Note | None = None) -> RunPlan:
    """The frozen plan of a command's run: with `follow` (a trace or its path) the followed run, and then no token
    source, `decode`, `chunk` or `positions` may be given (refused by flag name); else the tokens of `source`
    (token ids, or a `TokenSource`: exactly one of its sources; with `builtin`, none means the built-in prompt of
    `parity.bisect.search`),
    `decode` (None: `default_decode`) and `positions` (None: `parity.tracing.plan.default_positions`), ids checked
    against the model's vocabulary when `check_range`. `note` hears a tokenizer disagreement on a prompt.
    Raises PlanError (a usage error) on contradicting or missing options."""
    ids_given = source is not None and not isinstance(source, TokenSource)
    if follow is not None:
        flags = {"--decode": decode, "--chunk": chunk, "--positions": positions}
        given = ["--tokens"] if ids_given else (source or TokenSource()).given()
        refuse_with_follow([*given, *(f for f, v in flags.items() if v is not None)])
        return follow_plan((follow if isinstance(follow, Trace) else read_trace(follow, False)).header)
    ids = [int(t) for t in source] if ids_given else resolve_tokens(model, source or TokenSource(), note,
                                                                     required=not builtin)
    vocab = None
    if ids is None or check_range:
        from parity.gguf.weights import Weights

        config = Weights(model).config
        vocab = config.vocab_size if check_range else None
        if ids is None:
            from parity.bisect.search import builtin_prompt

            ids = builtin_prompt(config.vocab_size, config.bos_token_id)
    return run_plan(ids, default_decode if decode is None else decode, chunk=chunk, positions=positions, vocab=vocab)


def follow(path_or_trace: TraceLike) -> dict[str, Any]:
    """Keyword arguments that make a new run token-identical to an existing trace: same prompt, same
    decode length, decode tokens forced to the trace's generated ones, same positions and chunk size
    (`parity.tracing.plan.follow_plan`)."""
    return follow_plan(_as_trace(path_or_trace).header).kwargs()


# Golden traces of the built-in tiny models: a 15-token prompt + 6 greedy decode steps, so the trace covers
# the first compressed row (pos 3), a decode step completing a CSA block (15) and more CSA rows than the
# indexer keeps (19, 20); fingerprints only.
GOLDEN_PROMPT = [0, *((7 * i + 3) % 280 + 2 for i in range(14))]
GOLDEN_DECODE = 6
GOLDEN_POSITIONS = [0, 3, 7, 15, 19, 20]
GOLDEN_MODELS = ("f32", "real-mix", "mxfp4")


def golden(out: str | os.PathLike, echo: Callable[[str], None] = print) -> list[Path]:
    """Regenerate traces/tiny-<quant>.trace with the reference engine on freshly synthesized tiny models."""
    import tempfile

    from parity.gguf.synth import synthesize

    paths = []
    with tempfile.TemporaryDirectory() as tmp:
        for quant in GOLDEN_MODELS:
            model = synthesize(Path(tmp) / f"tiny-{quant}.gguf", "tiny", quant, 0)
            echo(f"tracing reference on {model.name} ...")
            t = trace("reference", model, GOLDEN_PROMPT, positions=GOLDEN_POSITIONS, decode=GOLDEN_DECODE)
            paths.append(save_trace(t, Path(out) / f"tiny-{quant}.trace"))
    return paths


DEMO_FAULT = "compress-ratios-u32"  # the paper's root cause 1: the ratio array read with the wrong width
DEMO_EXPECTED_LAYER = 2             # the first compressed layer of the tiny schedule (0, 0, 4, 128, 4, 128)


def demo(out: str | os.PathLike, echo: Callable[[str], None] = print) -> bool:
    """`v4parity demo` into the directory `out`: synthesize the tiny model, trace reference and torch, diff (agree),
    trace torch with `DEMO_FAULT`, diff (drift at `DEMO_EXPECTED_LAYER`), plot; the steps and both reports go to
    `echo`. Returns True when both verdicts are the expected ones."""
    import time

    from parity.compare.printers import print_report
    from parity.gguf.synth import synthesize

    t0, out = time.perf_counter(), Path(out)
    model = synthesize(out / "tiny-f32.gguf", "tiny", "f32", 0)
    echo(f"[1/5] synthesized {model} (tiny preset: 6 layers, compress ratios 0,0,4,128,4,128)")
    ref = trace("reference", model, GOLDEN_PROMPT, positions="all", decode=GOLDEN_DECODE)
    save_trace(ref, out / "reference.trace")
    echo(f"[2/5] traced the NumPy reference: {len(ref.header.tokens)} tokens -> {out / 'reference.trace'}")
    run = follow(ref)
    torch_ok = trace("torch", model, **run)
    save_trace(torch_ok, out / "torch.trace")
    echo(f"[3/5] traced the torch engine on the same tokens -> {out / 'torch.trace'}\n")
    clean = diff(ref, torch_ok)
    print_report(clean, echo=echo)
    faulty = trace("torch", model, options=RunOptions(inject=(DEMO_FAULT,)), **run)
    save_trace(faulty, out / "torch-fault.trace")
    echo(f"\n[4/5] traced the torch engine with --inject {DEMO_FAULT} -> {out / 'torch-fault.trace'}\n")
    bad = diff(ref, faulty)
    print_report(bad, echo=echo)
    figure = plot(bad, out / "drift.png")
    echo(f"\n[5/5] drift profile written to {figure}  ({time.perf_counter() - t0:.1f} s total)")
    ok = bool(clean) and bad.first_drift is not None and bad.first_drift["layer"] == DEMO_EXPECTED_LAYER
    echo("demo verdict: " + ("OK: the clean engines agree and the fault is located at its first compressed layer "
                             f"(blk.{DEMO_EXPECTED_LAYER})" if ok else "UNEXPECTED: see the reports above"))
    return ok


def n_chunks(n_prompt: int, decode: int, chunk: int | None) -> int:
    """How many forward chunks a run takes (for progress bars)."""
    return len(chunk_schedule(n_prompt, chunk)) + decode


def diff(a: TraceLike, b: TraceLike, *, force: bool = False, rel_tol: float | None = None,
         norm_tol: float | None = None) -> Any:
    """Compare trace `a` (reference) with `b` (candidate): preflight, metrics, first drift -> DiffReport."""
    from parity.compare.differ import Thresholds, diff_traces

    th = Thresholds().with_overrides(rel_tol=rel_tol, norm_tol=norm_tol)
    ta, tb = _both_traces(a, b)
    return diff_traces(ta, tb, thresholds=th, force=force)


def _both_traces(a: TraceLike, b: TraceLike) -> tuple[Trace, Trace]:
    """Two traces read concurrently (the zip CRC checks and validation release the GIL for most of the time)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        fa, fb = pool.submit(_as_trace, a), pool.submit(_as_trace, b)
        return fa.result(), fb.result()


def gate(golden: TraceLike, candidate: TraceLike, tolerances: str | os.PathLike | dict | None = None,
         force: bool = False) -> Any:
    """CI gate of `candidate` against `golden` with a tolerance table -> GateResult (bool = passed)."""
    from parity.compare.gate import run_gate

    return run_gate(*_both_traces(golden, candidate), tolerances, force=force)


@dataclass(frozen=True)
class Compared:
    """What `compare` and `gate_checked` return: `report` (the DiffReport, or the GateResult), `checked` (`check`'s
    CheckReport of the candidate against a model; None when none was given) and `figure` (the drift plot's path;
    None when none was asked for)."""

    report: Any
    checked: Any = None
    figure: Path | None = None


def compare(a: TraceLike, b: TraceLike, *, force: bool = False, rel_tol: float | None = None,
            norm_tol: float | None = None, figure: str | os.PathLike | None = None,
            check_model: str | os.PathLike | None = None, envelope: str | os.PathLike | None = None,
            progress: ProgressSink = SILENT) -> Compared:
    """`v4parity diff | plot | report`: `diff` of `a` and `b` (its PreflightError first, before anything runs), the
    drift plot at `figure` when given, and with `check_model` `check`'s verdict on `b` against that model (`envelope`:
    the one `check` uses; refused without `check_model`: no judgement by K x the envelope's floor)."""
    _envelope_needs_model(envelope, check_model)
    report = diff(a, b, force=force, rel_tol=rel_tol, norm_tol=norm_tol)
    path = None if figure is None else plot(report, figure)
    checked = None if check_model is None else check(b, check_model, envelope=envelope, progress=progress)
    return Compared(report, checked, path)


def gate_checked(golden: TraceLike, candidate: TraceLike, tolerances: str | os.PathLike | dict | None = None, *,
                 force: bool = False, names: tuple[str, str] | None = None,
                 check_model: str | os.PathLike | None = None, envelope: str | os.PathLike | None = None,
                 progress: ProgressSink = SILENT) -> Compared:
    """`v4parity gate`: the GateResult of `candidate` against `golden` (`names`: how its cases name the two; default
    golden, candidate) and, with `check_model`, `check`'s verdict on the candidate, which then decides
    (`parity.compare.gate.with_verdict`; the tolerance cases stay as evidence). `envelope` as in `compare`."""
    from parity.check.check_report import headline
    from parity.compare.gate import run_gate, with_verdict

    _envelope_needs_model(envelope, check_model)
    result = run_gate(*_both_traces(golden, candidate), tolerances, force=force, names=names or ("golden", "candidate"))
    if check_model is None:
        return Compared(result)
    checked = check(candidate, check_model, envelope=envelope, progress=progress)
    return Compared(with_verdict(result, checked.verdict, headline(checked)), checked)


def _envelope_needs_model(envelope: str | os.PathLike | None, check_model: str | os.PathLike | None) -> None:
    """An envelope only chooses the one `check` uses: without a model to check against it is refused."""
    if envelope is not None and check_model is None:
        from parity.contract.errors import ParityError

        raise ParityError("an envelope is only the one `check` uses: give check_model (the verdict is check's "
                          "round-off null on the candidate's own prompt, never K x the envelope's floor)")


def export(t: TraceLike, out: str | os.PathLike) -> Path:
    """Write every full vector of a trace as plain arrays named by checkpoint to an .npz."""
    from parity.tracing.export import export_npz

    return export_npz(_as_trace(t), out)


def plot(report: Any, out: str | os.PathLike) -> Path:
    """Drift-profile figure of a DiffReport to `out` (PNG/PDF/SVG by extension)."""
    from parity.compare.plot import plot_drift

    return plot_drift(report, out)


def validate(out: str | os.PathLike, *, model: str | os.PathLike | None = None, exact: str = "torch",
             approx: str | None = None, n: int = 200, decode: int = 64, seed: int = 0,
             prompts: str | os.PathLike | None = None, boundary: bool = False, top_k: int = 20,
             tie_margin: float | None = None, drift_tol: float | None = None, pins: int = 4,
             budget: str | os.PathLike | None = None, workers: int = 1, ray: str | None = None,
             resume: bool = False, progress: ProgressSink = SILENT) -> ValidateReport:
    """Validate the approximate path `approx` (ENGINE[:key=value,...]) against `exact` over n prompts into `out`
    (results.jsonl as they arrive, report.json / report.md / validate.png at the end); `resume=True` continues the
    run stored in `out` (the other run settings come from there). `ray`: None, 'local' or a cluster address.
    `progress.count` counts the finished tasks (`parity.validate.driver.run_validation`).
    Returns the frozen `parity.validate.result.ValidateReport` (`report.passed`, `report.findings`; report.json is
    its `to_dict()`)."""
    from parity.logprobs.compare import DRIFT_TOL, TIE_MARGIN
    from parity.validate.driver import Executor, new_config, run_validation

    if resume:
        config = None
    else:
        if model is None or approx is None:
            from parity.contract.errors import ParityError

            raise ParityError("validate needs model and approx (or resume=True)")
        config = new_config(str(model), exact, approx, n, decode, seed, None if prompts is None else str(prompts),
                            boundary, top_k, TIE_MARGIN if tie_margin is None else tie_margin,
                            DRIFT_TOL if drift_tol is None else drift_tol, pins,
                            None if budget is None else str(budget))
    return run_validation(out, config, Executor(workers, ray), progress)


# ---------------------------------------------------------------- envelope, bisect, check

def envelope(model: str | os.PathLike, *, engine: str = "torch", options: RunOptions | None = None,
             output: str | os.PathLike | None = None, progress: ProgressSink = SILENT) -> Any:
    """Measure the noise envelope of `engine` on `model` (benign pairs, never with faults) and store it as a
    section of `output` (default: this model's entry in the user cache, `parity.check.inputs.cache_path`, where
    `check`, `bisect` and `spec` find it). Returns (Envelope, path)."""
    from parity.check.envelope import save_envelope
    from parity.check.inputs import cache_path

    options = options or RunOptions()
    identity = model_identity(model)
    env = measure_envelope(model, engine, options, progress)
    qat = {"fp8_kv": options.fp8_kv, "fp4_indexer": options.fp4_indexer}
    return env, save_envelope(output or cache_path(identity, qat, engine), env, identity)


def _envelope_search(model: str | os.PathLike) -> list[Path]:
    """Where `bisect`, `check` and `spec` look for a stored envelope (`parity.check.inputs.envelope_sources`)."""
    from parity.check.inputs import envelope_sources

    return envelope_sources(model)


def _cached(env: Any, identity: dict, qat: dict[str, bool], engine: str, seconds: float,
            say: Note) -> Any:
    """Keep an envelope just measured on `engine` in the user cache (announced through `say`) for the next run."""
    from parity.check.envelope import save_envelope
    from parity.check.inputs import cache_path

    path = save_envelope(cache_path(identity, qat, engine), env, identity)
    say(f"envelope: measured in {seconds:.1f} s; cached at {path}")
    return env


def measure_envelope(model: str | os.PathLike, engine: str, options: RunOptions,
                     progress: ProgressSink = SILENT) -> Any:
    """Benign pairs for the envelope of `engine` with `options` (faults and routing replay dropped)."""
    from dataclasses import replace

    from parity.check.envelope import CALIBRATION_DECODE, calibration_prompt
    from parity.check.envelope import measure_envelope as measure
    from parity.contract.engine import Variants

    clean = replace(options, inject=(), expert_override=None)
    qat = {"fp8_kv": clean.fp8_kv, "fp4_indexer": clean.fp4_indexer}
    ref = load_engine("reference", str(model), RunOptions(**qat))
    ref64 = load_engine("reference", str(model), RunOptions(dtype="float64", **qat))
    # the reference as its own candidate shares the float32 reference's weight cache (one copy less in memory)
    same = engine == "reference" and isinstance(ref, Variants) and clean.dtype == "float32" and not clean.engine_args
    cand = ref.variant(clean) if same else load_engine(engine, str(model), clean)
    cand32 = load_engine(engine, str(model), replace(clean, dtype="float32")) if clean.dtype != "float32" else None
    prompt = calibration_prompt(ref.config.vocab_size, ref.config.bos_token_id)
    return measure(ref, ref64, cand, prompt, CALIBRATION_DECODE, cand_f32=cand32, progress=progress)


def bisect(model: str | os.PathLike, *, engine: str = "torch", tokens: Tokens = None,
           decode: int | None = None, chunk: int | None = None, follow: TraceLike | None = None,
           note: Note | None = None, options: RunOptions | None = None,
           envelope: str | os.PathLike | None = None, routing_replay: bool = False,
           progress: ProgressSink = SILENT, draft: str | os.PathLike | None = None, mtp_depth: int = 1,
           mtp_pairing: str = "prev", workers: int = 1, ray: str | None = None) -> Any:
    """Localise where `engine` departs from the reference on `model`; the run is `plan_run`'s of `tokens` (ids or a
    TokenSource; none: the built-in prompt), `decode` (None: 4), `chunk` or `follow` (a trace whose run is replayed;
    `note` hears a tokenizer disagreement);
    the verdict is `check`'s on the candidate's run, recorded as a trace (`parity.bisect.by_check`: one judgement).
    `draft`: a drafter GGUF both engines open; when the trunk has no defect its head is judged as one more layer
    (both heads on the reference's trunk carriers, MTP chained to `mtp_depth` with `mtp_pairing`;
    `parity.bisect.search`).
    `progress.note(message)` announces the stages, `progress.count(stage, done, total)` counts the long passes'
    chunks. `envelope`: a file (refused when measured on another model); default the stored envelope of this model
    (found by model identity, not file name: `parity.check.inputs.envelope_sources`), else measured now and
    cached. `workers` / `ray` (None, 'local' or a cluster address): the teacher-forced pass and its round-off
    twins on worker processes or Ray tasks (`parity.check.parallel`; the same result as serial)."""
    from dataclasses import replace

    from parity.bisect.by_check import judged_by_check
    from parity.bisect.search import ReplayRouter
    from parity.bisect.search import bisect as run_bisect
    from parity.check import parallel
    from parity.contract.workpool import WorkPool

    say = progress.note
    options = options or RunOptions()
    if envelope is not None and not Path(envelope).exists():
        raise TraceError(f"envelope file {envelope} does not exist")
    plan = plan_run(model, tokens, follow=follow, decode=decode, chunk=chunk, default_decode=4, builtin=True,
                    note=note)
    prompt, decode, chunk = list(plan.tokens), plan.decode, plan.chunk
    _check_injectable(engine, options.inject, draft is not None)  # before any work: a misspelt name costs nothing
    if draft is not None and routing_replay:
        raise TraceError("--routing-replay replays trunk layers; the draft heads do not take it: drop one")
    drafter = None if draft is None else str(draft)
    qat = {"fp8_kv": options.fp8_kv, "fp4_indexer": options.fp4_indexer}
    ref = load_engine("reference", str(model), RunOptions(**qat), draft=drafter)  # the GGUF is hashed once here
    router = ReplayRouter() if routing_replay else None
    # before the envelope: the engine refuses its options (an --inject layer list, FAULT@LAYERS) at no cost
    cand = load_engine(engine, str(model), replace(options, expert_override=router), draft=drafter)
    env = _stored_or_measured(model, ref.identity, engine, options, envelope, progress)
    dh = draft_header(cand, mtp_pairing, mtp_depth) if drafter is not None else None
    with WorkPool(workers, ray) as pool, parallel.active(pool) as d:
        if d is not None:
            d.register(ref, parallel.EngineLoader("reference", str(model), drafter), ref.options)
            d.register(cand, parallel.EngineLoader(engine, str(model), drafter), cand.options)
        report = run_bisect(ref, cand, prompt, decode, env, chunk=chunk, progress=progress, replay=router, draft=dh)
    say(f"check: {cand.name}'s run recorded as a trace and judged by `check` (the verdict is check's)")
    run = trace(cand, model, prompt, decode=decode, chunk=chunk, forced=report.tokens[len(prompt):],
                positions="all", full="all", mtp_pairing=mtp_pairing, mtp_depth=mtp_depth)
    checked = check(run, model, envelope=envelope, progress=progress, draft=draft, workers=workers, ray=ray)
    return judged_by_check(report, checked)


def _stored_or_measured(model: str | os.PathLike, identity: dict, engine: str, options: RunOptions,
                        envelope: str | os.PathLike | None, progress: ProgressSink) -> Any:
    """The envelope at `envelope`, else the one stored for this model's identity and QAT flags (user cache, model
    directory, committed traces/), else one measured now for `engine` with `options` and cached; the choice is
    announced through `progress.note`."""
    import time

    from parity.check.inputs import envelope_for

    qat = {"fp8_kv": options.fp8_kv, "fp4_indexer": options.fp4_indexer}
    search = _envelope_search(model)
    found = envelope_for(identity, options.dtype, envelope, search, qat, engine)
    if found is not None:
        env, path = found
        progress.note(f"envelope: {path} ({options.dtype})")
        return env
    progress.note(f"envelope: none stored for this model, engine and QAT flags (searched by model identity in "
        f"{', '.join(map(str, search))}); measuring it now")
    t0 = time.perf_counter()
    env = measure_envelope(model, engine, options, progress)
    return _cached(env, identity, qat, engine, time.perf_counter() - t0, progress.note)


def _check_injectable(engine: str, inject: Sequence[str], drafted: bool = False) -> None:
    """`engine` is registered and offers every fault in `inject` (ParityError naming the first that is not); with a
    drafter (`drafted`) its drafter faults (`draft_faults`) count too."""
    from parity.contract.engine import engine_class, engine_faults
    from parity.contract.errors import ParityError

    known = engine_faults(engine)  # raises for an unregistered engine, naming the registered ones
    if drafted:
        known = (*known, *getattr(engine_class(engine), "draft_faults", ()))
    unknown = [f for f in inject if f.split("@", 1)[0] not in known]   # FAULT@LAYERS: the engine checks the layers
    if unknown:
        offers = f"it offers: {', '.join(known)}" if known else "it offers no fault switches"
        raise ParityError(f"--inject {unknown[0]!r}: engine {engine!r} has no such fault ({offers})")


def check(candidate: TraceLike, model: str | os.PathLike, *, envelope: str | os.PathLike | None = None,
          tokens: Tokens = None, envelope_search: Sequence[str | os.PathLike] | None = None,
          fault_engines: Sequence[str] = ("torch",), progress: ProgressSink = SILENT,
          draft: str | os.PathLike | None = None, workers: int = 1, ray: str | None = None) -> Any:
    """The full verdict (MATCH / NOISE / DEFECT) for a candidate trace, or dumps imported on the fly (`tokens`
    then gives their token ids, or a TokenSource of them). The envelope: `envelope`, else the first stored one
    measured on this model (by
    size + header hash) in `envelope_search` (default `parity.check.inputs.envelope_sources`: the user cache, the
    model's directory, the committed traces/), else measured now from the reference alone and cached (its time and
    source are the report's `envelope_seconds` / `envelope_source`). `fault_engines`: engines whose fault
    switches form the defect library;
    `progress.note(message)` announces stages, `progress.count(stage, done, total)` counts the long passes' chunks;
    `draft`: the
    candidate's drafter GGUF, whose draft checkpoints are then judged (`parity.check.draft_check`).
    `workers` / `ray` (None, 'local' or a cluster address): the per-layer runs on worker processes or Ray tasks
    (`parity.check.parallel`; the report is the serial one byte for byte, but for its times).
    Raises CheckPreflightError (a ParityError) when the candidate cannot be judged."""
    import time
    from dataclasses import replace

    from parity.check.check import check as run_check
    from parity.check.inputs import candidate_subops, load_candidate, preflight
    from parity.check.parallel import EngineLoader, warm
    from parity.contract.workpool import WorkPool
    from parity.gguf.inventory import validate
    from parity.gguf.weights import Weights

    if isinstance(tokens, TokenSource):   # imported dumps' token ids, at most one source (a trace has its own)
        tokens = resolve_tokens(model, tokens, required=False)
    w = Weights(model)
    identity, config = w.identity(), w.config
    trace_ = candidate if isinstance(candidate, Trace) else load_candidate(candidate, config, identity, tokens)
    subops, notes = candidate_subops(candidate, trace_, config, tokens)
    named = f"a {trace_.header.engine} trace" if isinstance(candidate, Trace) else str(candidate)
    preflight(trace_, config, identity, f"candidate {named}, model {model}")
    if draft is not None:   # before any run: the drafter must be the one the candidate's header names
        from parity.check.draft_check import check_drafter
        from parity.gguf.drafter import open_drafter

        check_drafter(trace_, open_drafter(draft, config).weights.identity(), Path(draft).name)
    problems = validate(w.tensor_infos(), config).problems
    if problems:   # judged all the same (both engines read it), but the user is told, as `inspect` tells them
        notes = [*notes, f"`v4parity inspect` reports {len(problems)} contract problem(s) with this file, first: "
                 f"{problems[0]}"]
    t0 = time.perf_counter()
    env, source = _check_envelope(model, identity, trace_, config, envelope, envelope_search, progress)
    env_cost = {"envelope_seconds": round(time.perf_counter() - t0, 3), "envelope_source": source}
    library, draft_library = _fault_libraries(model, fault_engines, draft)
    drafter = None if draft is None else str(draft)
    with WorkPool(workers, ray, warm=(warm, (("reference", *fault_engines),))) as pool:
        report = run_check(trace_, EngineLoader("reference", str(model), drafter), env,
                           fault_engines=library, draft_fault_engines=draft_library,
                           subops=subops, notes=notes, progress=progress, config=config, pool=pool)
    return replace(report, **env_cost)


def _check_envelope(model: str | os.PathLike, identity: dict, trace_: Trace, config: Any,
                    envelope: str | os.PathLike | None, envelope_search: Sequence[str | os.PathLike] | None,
                    progress: ProgressSink) -> tuple[Any, str]:
    """`check`'s envelope for `trace_` and where it came from ('measured' or its path): `envelope`, else the stored
    one of this model with the trace's dtype and QAT flags in `envelope_search` (default `_envelope_search`), else,
    for a float32 trace, the reference's own measured now and cached (CheckPreflightError for another dtype)."""
    import time

    from parity.check.check import reference_options
    from parity.check.inputs import CheckPreflightError, envelope_for

    search = envelope_search if envelope_search is not None else _envelope_search(model)
    ref_options, _ = reference_options(trace_, config)
    qat = {"fp8_kv": ref_options.fp8_kv, "fp4_indexer": ref_options.fp4_indexer}
    t0 = time.perf_counter()
    found = envelope_for(identity, trace_.header.dtype, envelope, search, qat)
    if found is None and trace_.header.dtype != "float32":
        raise CheckPreflightError(f"no stored {trace_.header.dtype} envelope for this model in "
                                  f"{', '.join(map(str, search))}: measure one with `v4parity envelope --dtype "
                                  f"{trace_.header.dtype}` or pass --envelope")
    if found is not None:
        progress.note(f"envelope: {found[1]} ({trace_.header.dtype})")
        return found[0], str(found[1])
    progress.note("envelope: none stored for this model; measuring the reference's own (float32 vs float64, rechunked, "
        "19 round-off twins)")
    env = _cached(measure_envelope(model, "reference", RunOptions(**qat), progress), identity, qat, "reference",
                  time.perf_counter() - t0, progress.note)
    return env, "measured"


def _fault_libraries(model: str | os.PathLike, fault_engines: Sequence[str],
                     draft: str | os.PathLike | None) -> tuple[list, list]:
    """`check`'s defect libraries: (engine, loader, faults) for every engine in `fault_engines` (each must offer
    fault switches: CheckPreflightError naming those that do not), and with `draft` their drafter faults."""
    from parity.check.inputs import CheckPreflightError
    from parity.check.parallel import EngineLoader
    from parity.contract.engine import engine_class, engine_faults

    library = [(n, EngineLoader(n, str(model)), engine_faults(n)) for n in fault_engines]
    empty = [n for n, _, faults in library if not faults]
    if empty:
        raise CheckPreflightError(f"engine(s) {', '.join(empty)} offer no fault switches for the defect library")
    drafter = None if draft is None else str(draft)
    draft_library = [] if drafter is None else [
        (n, EngineLoader(n, str(model), drafter), faults)
        for n in fault_engines if (faults := tuple(getattr(engine_class(n), "draft_faults", ())))]
    return library, draft_library


@dataclass(frozen=True)
class CommitVerdict:
    """One commit's answer to `git bisect run`: `outcome` good | bad | skip, its `exit_code` (0, 1, 125), the
    `reason` in one line, and the check report behind it (None when the engine did not load or was not judged)."""

    outcome: str
    exit_code: int
    reason: str
    report: Any = None


def bisect_run(model: str | os.PathLike, engine: str, *, tokens: Tokens = None, decode: int = 0,
               options: RunOptions | None = None, envelope: str | os.PathLike | None = None,
               envelope_search: Sequence[str | os.PathLike] | None = None,
               progress: ProgressSink = SILENT) -> CommitVerdict:
    """`git bisect run`'s predicate for the engine registered as `engine`, as installed now (the working tree
    under bisection): trace it on `tokens` (ids or a TokenSource, `plan_run`; none: the built-in prompt) + `decode`
    greedy steps at every position
    with full vectors, and judge the trace with `check` (its envelope rules, `envelope` / `envelope_search`).

    good (0): MATCH or NOISE; bad (1): DEFECT, or the engine raised during its run; skip (125): the engine did not
    import or construct, or `check`'s preflight refused the trace (not comparable). A problem that is the same on
    every commit (no such model, an unregistered engine name, token ids outside the vocabulary, an unreadable
    envelope) raises ParityError instead: the caller aborts the bisection rather than mark commits."""
    from parity.check.inputs import CheckPreflightError
    from parity.contract.engine import available_engines
    from parity.contract.errors import ParityError

    say = progress.note
    # the model, the token sources and the one token-range check, before any commit is marked
    ids = list(plan_run(model, tokens, decode=decode, builtin=True).tokens)
    if engine not in available_engines():
        raise ParityError(f"unknown engine {engine!r}; registered: {', '.join(sorted(available_engines()))} "
                          "(entry points are read from the installed metadata, not from the commit)")
    try:
        eng = load_engine(engine, str(model), options or RunOptions())
    except Exception as e:  # any failure to import or construct: this commit cannot be tested
        return CommitVerdict("skip", 125, f"engine {engine!r} did not load: {type(e).__name__}: {e}")
    say(f"trace {engine}: {len(ids)} tokens + {decode} decode, every position, full vectors")
    try:
        t = trace(eng, model, ids, positions="all", full="all", decode=decode)
    except Exception as e:  # the engine loaded but its run failed: a broken commit, not an untestable one
        return CommitVerdict("bad", 1, f"engine {engine!r} raised during its run: {type(e).__name__}: {e}")
    try:
        report = check(t, model, envelope=envelope, envelope_search=envelope_search, progress=progress)
    except CheckPreflightError as e:
        return CommitVerdict("skip", 125, f"not comparable (check preflight): {e}")
    from parity.check.check_report import headline

    if report.verdict == Verdict.DEFECT:
        return CommitVerdict("bad", 1, headline(report), report)
    return CommitVerdict("good", 0, headline(report), report)


# ---------------------------------------------------------------- peers: llama.cpp capture, arbitration

def capture_llamacpp(model: str | os.PathLike, tokens: Tokens, out: str | os.PathLike, *, decode: int = 0,
                     chunk: int | None = None, options: RunOptions | None = None,
                     draft: str | os.PathLike | None = None, mtp_depth: int = 1,
                     mtp_pairing: str = "prev", note: Note | None = None) -> dict[str, Any]:
    """Run llama.cpp (engine `llamacpp`) greedily on `tokens` (+ `decode` steps, prefill in pieces of `chunk`) and
    write its capture file (`parity.tracing.importers`). `draft`: llama.cpp's MTP file; its graph then runs on the
    run's carriers as `trace --engine llamacpp --draft` runs it and the draft checkpoints are stored too
    (`parity.tracing.capture_draft`). The run is `plan_run`'s of `tokens` (ids or a TokenSource; `note` hears a
    tokenizer disagreement), `decode` and `chunk`, its ids checked against the engine's vocabulary.
    Returns {path, n_tensors, n_draft, tokens (prompt + decode), n_prompt, decode, flags, draft}."""
    from parity.contract.errors import ParityError
    from parity.gguf.llamacpp import Capturer
    from parity.tracing.capture_draft import capture_draft_arrays
    from parity.tracing.importers import write_llamacpp_capture

    plan = plan_run(model, tokens, decode=decode, chunk=chunk, check_range=False, note=note)
    options = options or RunOptions(fp8_kv=False, fp4_indexer=False)
    eng = load_engine("llamacpp", str(model), options, draft=None if draft is None else str(draft))
    if not isinstance(eng, Capturer):
        raise ParityError("the registered llamacpp engine offers no capture capability")
    dh = draft_header(eng, mtp_pairing, mtp_depth) if draft is not None else {}
    check_token_range(plan.tokens, eng.config.vocab_size)
    arrays = eng.capture(list(plan.tokens), chunk_schedule(len(plan.tokens), plan.chunk), plan.decode)
    n_tensors = len(arrays) - 4
    extra = capture_draft_arrays(eng, dh, arrays) if dh else {}
    meta = {"engine": eng.name, "engine_version": eng.version, "flags": eng.options.flags(),
            "model": model_identity(model), **({"draft": dh} if dh else {})}
    path = write_llamacpp_capture(out, {**arrays, **extra}, meta)
    return {"path": path, "n_tensors": n_tensors, "n_draft": len(extra) // 2, "tokens": arrays["input_ids"].tolist(),
            "n_prompt": len(plan.tokens), "decode": plan.decode, "flags": meta["flags"], "draft": dh or None}


def llamacpp_quantizer() -> Any:
    """The registered `llamacpp` engine class as a `parity.gguf.llamacpp.Quantizer` (llama.cpp's own quantizer)."""
    from parity.contract.engine import engine_class
    from parity.contract.errors import ParityError
    from parity.gguf.llamacpp import Quantizer

    cls = engine_class("llamacpp")
    if not isinstance(cls, Quantizer):
        raise ParityError("the registered llamacpp engine offers no quantize capability")
    return cls


class UnknownFileTypeError(ParityError):
    """A llama.cpp file type the quantizer does not offer (the message lists the ones it does): a usage error."""


def quantize_llamacpp(model: str | os.PathLike, out: str | os.PathLike, file_type: str, *,
                      threads: int | None = None) -> dict[str, Any]:
    """Quantize `model` to `out` with llama.cpp's own quantizer (`llama_model_quantize`, default parameters) at
    llama.cpp file type `file_type` (`Q4_K_M`, `MXFP4_MOE`, ...; `llamacpp_quantizer().file_types()` lists
    them; another name is refused with UnknownFileTypeError, listing them). Returns {path, file_type, ftype, seconds,
    bytes, type_mix, problems} (problems: the written file's contract problems, `parity.gguf.inventory.validate`)."""
    from parity.gguf.inventory import type_mix, validate
    from parity.gguf.weights import Weights

    quantizer = llamacpp_quantizer()
    types = quantizer.file_types()
    if file_type not in types:
        raise UnknownFileTypeError(f"unknown --type {file_type!r}; valid: {', '.join(types)}")
    info = quantizer.quantize(str(model), str(out), file_type, threads)
    w = Weights(info["path"])
    tensors = w.tensor_infos()
    return {"path": Path(info["path"]), "file_type": info["file_type"], "ftype": info["ftype"],
            "seconds": info["seconds"], "bytes": Path(info["path"]).stat().st_size, "type_mix": type_mix(tensors),
            "problems": list(validate(tensors, w.config).problems)}


def arbitrate(model: str | os.PathLike, tokens: Tokens, engines: Sequence[str], *, decode: int = 0,
              chunk: int | None = None, qat_sims: bool = False, rel_tol: float = 1e-4,
              envelope: str | os.PathLike | None = None, progress: ProgressSink = SILENT,
              check_each: bool = False, note: Note | None = None) -> Any:
    """Run every engine in `engines` on `tokens` (ids or a TokenSource: `plan_run`; `note` hears a tokenizer
    disagreement) (+ `decode` steps: the first engine's greedy tokens, fed to the others) with the same chunks and
    QAT simulations, and cluster them per checkpoint -> Arbitration.
    An engine spelled `NAME+FAULT[+FAULT...]` runs with those faults injected (labelled as spelled).
    Two engines agree where their largest per-position rel-L2 is <= `rel_tol`. `check_each`: each engine's run is
    also recorded as a trace (every position, full vectors) and judged by `check` against `model` (with `envelope`
    when given; an `envelope` without `check_each` is refused: no judgement by K x floor) -> `Arbitration.checks`,
    label -> CheckReport, and the clusters are then those verdicts' (`parity.compare.arbitration.judged_by_checks`:
    one judgement, never the tolerance's)."""
    from parity.compare.arbitration import arbitrate_runs, judged_by_checks
    from parity.contract.errors import ParityError

    engines = list(dict.fromkeys(engines))
    if len(engines) < 2:
        raise ParityError(f"arbitration needs at least two distinct engines, got {engines}")
    spelled = {label: (label.split("+")[0], tuple(label.split("+")[1:])) for label in engines}
    for name, faults in spelled.values():
        _check_injectable(name, faults)
    if envelope is not None and not check_each:
        raise ParityError("an envelope is only the one each `check` uses: pass check_each=True (the engines are "
                          "never judged by K x the envelope's floor)")
    say = progress.note
    plan = plan_run(model, tokens, decode=decode, chunk=chunk, note=note)
    tokens, decode, chunk = list(plan.tokens), plan.decode, plan.chunk
    runs: dict[str, list[ChunkResult]] = {}
    traces: dict[str, Trace] = {}
    forced = None
    for label, (name, faults) in spelled.items():
        say(f"arbitrate: {label} on {len(tokens)} tokens + {decode} decode")
        eng = load_engine(name, str(model), RunOptions(fp8_kv=qat_sims, fp4_indexer=qat_sims, inject=faults))
        if check_each:   # the same run, also recorded as a trace for `check` (every position, full vectors)
            runs[label] = []
            traces[label] = trace(eng, model, tokens, positions="all", full="all", decode=decode, chunk=chunk,
                                  forced=forced, on_chunk=runs[label].append)
        else:
            runs[label] = run_sequence(eng, tokens, decode, chunk=chunk, forced=forced)
        if forced is None:
            forced = [int(t) for t in np.concatenate([r.tokens for r in runs[label]])[len(tokens):]]
    report = arbitrate_runs(runs, len(tokens), lambda _name: rel_tol)
    checks = {}
    for label, t in traces.items():
        say(f"arbitrate: check {label}")
        checks[label] = check(t, model, envelope=envelope, progress=progress)
    return judged_by_checks(report, checks) if check_each else report


def logprobs(a: str | os.PathLike, b: str | os.PathLike, *, tie_margin: float | None = None,
             drift_tol: float | None = None, force: bool = False) -> Any:
    """`v4parity logprobs`: the top-k logprobs of `a` (reference) and `b` (candidate), each a ds4 --dump-logprobs JSON,
    an official vector JSON or an official.vec case (FILE#CASE), compared step by step
    (`parity.logprobs.compare.compare_runs`; None: its TIE_MARGIN / DRIFT_TOL) -> Comparison. Raises
    LogprobPreflightError for two files of different runs unless `force`."""
    from parity.logprobs.compare import DRIFT_TOL, TIE_MARGIN, compare_runs
    from parity.logprobs.io import read_run

    return compare_runs(read_run(a), read_run(b), TIE_MARGIN if tie_margin is None else tie_margin,
                        DRIFT_TOL if drift_tol is None else drift_tol, force=force)


@dataclass(frozen=True)
class Tokenized:
    """A prompt's token ids under one tokenizer mode (`tokenizer`: model | ds4), each id's vocab string and piece
    bytes, and where the other mode's ids differ (`modes_disagree`: one line, None when they agree)."""

    ids: tuple[int, ...]
    tokenizer: str
    tokens: tuple[str, ...]
    pieces: tuple[bytes, ...]
    modes_disagree: str | None


def tokenize(model: str | os.PathLike, prompt: str, *, tokenizer: str = "model", chat: bool = True, system: str = "",
             thinking: bool = False, think_max: bool = False) -> Tokenized:
    """`v4parity tokenize`: `prompt` as token ids of `model`'s tokenizer in mode `tokenizer`; `chat`: one user turn
    through the chat layout (`system`, `thinking`, `think_max`; `parity.gguf.tokenizer.chat_ids`), else the text as
    written with ds4's specials recognised. Both modes are encoded so that a disagreement is reported."""
    from parity.gguf.tokenizer import chat_ids, load_tokenizer, mode_difference

    tok = load_tokenizer(model)

    def encode(mode: str) -> list[int]:
        return chat_ids(tok, prompt, system, thinking, mode, think_max) if chat else tok.encode_rendered(prompt, mode)

    if tokenizer not in ("model", "ds4"):
        raise ParityError(f"tokenizer mode {tokenizer!r}: model or ds4")
    ids = {mode: encode(mode) for mode in ("model", "ds4")}
    chosen = ids[tokenizer]
    return Tokenized(tuple(chosen), tokenizer, tuple(tok.tokens[i] for i in chosen),
                     tuple(tok.piece(i) for i in chosen), mode_difference(tok, ids["model"], ids["ds4"]))


def inspect_drafter(model: str | os.PathLike, draft: str | os.PathLike) -> dict[str, Any]:
    """`inspect -m MODEL --draft FILE`: the drafter's head, keys and tensors and whether it fits the trunk
    (`parity.gguf.drafter_report.inspect_drafter`; `validation.ok` False names the problem)."""
    from parity.gguf.drafter_report import inspect_drafter as drafter_report

    return drafter_report(model, draft)


def fit_drafter(model: str | os.PathLike, out: str | os.PathLike, kind: str, *, layout: str | None = None,
                seed: int = 0, steps: int | None = None, depth: int = 1, quant: str = "f32",
                log: Callable[[int, float], None] | None = None) -> Any:
    """`synth --draft mtp|dspark --fit`: the tiny drafter fitted to the model's own greedy continuations, written
    to `out` (`parity.spec.fit.fit_drafter`; `log(step, loss)` per Adam step) -> its `FitReport`."""
    from parity.spec.fit import fit_drafter as fit

    return fit(model, out, kind, layout=layout, seed=seed, steps=steps, depth=depth, quant=quant, log=log)


def spec(model: str | os.PathLike, tokens: Tokens = None, *, engine: str = "torch", draft: str | None = None,
         candidate: str | os.PathLike | None = None, note: Note | None = None,
         script: str | None = None, depth: int = 1, steps: int = 32, gate: str = "none", max_draft: int | None = None,
         options: RunOptions | None = None, envelope: str | os.PathLike | None = None,
         progress: ProgressSink = SILENT, trace_out: str | os.PathLike | None = None,
         pairing: str | None = None) -> Any:
    """Speculative greedy decoding of `engine` on `model` with the drafter `draft` (MTP depth `depth` with
    `pairing` prev | same, None: prev; or one DSpark block a round), or scripted drafts (`script`: accept-all |
    reject-at:I, depth `depth`); plain decodes of the engine and the reference; every round attributed by the
    reference (parity.spec). The tie threshold comes from the envelope (`envelope`, else the stored one of this
    model with these QAT flags, else measured now).
    `trace_out`: write the run's rounds as a trace of spec records (what `spec_candidate` reads). The prompt:
    `tokens` (ids or a TokenSource, `plan_run`; `note` hears a tokenizer disagreement). `candidate`: a foreign
    engine's trace with spec records, attributed by `spec_candidate` instead of a run (it gives the prompt).
    Returns a `parity.spec.report.SpecReport`."""
    from dataclasses import replace

    from parity.gguf.drafter import open_drafter
    from parity.spec.accept import Gate
    from parity.spec.drafts import parse_script
    from parity.spec.report import spec_report

    if candidate is not None:
        _no_run_with_candidate(tokens)
        return spec_candidate(model, candidate, draft=draft, envelope=envelope, progress=progress)
    say = progress.note
    options = options or RunOptions()
    if (draft is None) == (script is None):
        raise TraceError("give exactly one of a drafter file (--draft) and scripted drafts (--script)")
    if envelope is not None and not Path(envelope).exists():
        raise TraceError(f"envelope file {envelope} does not exist")
    tokens = list(plan_run(model, tokens, note=note).tokens)
    the_gate, reject_at = Gate.parse(gate), parse_script(script) if script is not None else None
    qat = {"fp8_kv": options.fp8_kv, "fp4_indexer": options.fp4_indexer}
    env = _stored_or_measured(model, model_identity(model), engine, options, envelope, progress)
    env.check_options(options)   # an envelope calibrated with other QAT flags is refused, naming the flag
    ref = load_engine("reference", str(model), RunOptions(**qat), draft=draft)
    cand = ref if engine == "reference" and options == RunOptions(**qat) else load_engine(
        engine, str(model), replace(options, expert_override=None), draft=draft)
    drafter = open_drafter(draft, ref.config) if draft is not None else None
    kind = "script" if drafter is None else drafter.config.kind
    say(f"spec: {engine}, {kind} drafts, {steps} steps on {len(tokens)} prompt tokens")
    report = spec_report(cand, ref, kind, [int(t) for t in tokens], steps, env, depth=depth, gate=the_gate,
                         max_draft=max_draft, reject_at=reject_at, drafter=drafter.config if drafter else None,
                         progress=progress, pairing=pairing)
    if trace_out is not None:
        from parity.spec.candidate import spec_trace

        save_trace(spec_trace(report, cand), trace_out, "text")
    return report


def _no_run_with_candidate(tokens: Tokens) -> None:
    """With a candidate trace the trace gives the prompt: tokens given too are refused, naming their source."""
    given = tokens.given() if isinstance(tokens, TokenSource) else ([] if tokens is None else ["tokens"])
    if given:
        raise TraceError(f"a candidate trace gives the run's prompt: drop {', '.join(given)}")


def spec_candidate(model: str | os.PathLike, candidate: str | os.PathLike, *, draft: str | None = None,
                   envelope: str | os.PathLike | None = None, progress: ProgressSink = SILENT) -> Any:
    """`spec --candidate`: attribute the speculative run recorded in `candidate`'s spec records (a foreign
    engine's) with the reference on `model` and, with `draft`, the reference drafter (without one the recorded
    drafts are their own reference); the reference runs with the trace's QAT flags. Returns a SpecReport
    (`parity.spec.candidate`)."""
    from parity.gguf.drafter import open_drafter
    from parity.spec.candidate import candidate_report, check_candidate, qat_of, read_candidate

    say = progress.note
    if envelope is not None and not Path(envelope).exists():
        raise TraceError(f"envelope file {envelope} does not exist")
    trace_ = read_candidate(candidate)
    qat = qat_of(trace_)
    identity = model_identity(model)
    ref = load_engine("reference", str(model), RunOptions(**qat), draft=draft)
    drafter = open_drafter(draft, ref.config) if draft is not None else None
    check_candidate(trace_, candidate, identity, ref.config.vocab_size, drafter.config if drafter else None)
    env = _stored_or_measured(model, identity, "reference", RunOptions(**qat), envelope, progress)
    env.check_options(RunOptions(**qat))
    kind = "script" if drafter is None else drafter.config.kind
    say(f"spec --candidate: {trace_.header.engine}, {len(trace_.spec)} rounds, {kind} drafts")
    return candidate_report(trace_, candidate, ref, kind, env, drafter.config if drafter else None, progress)
