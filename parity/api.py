"""The Python API mirroring the CLI: `trace`, `follow`, `load_trace`, `save_trace`, `diff`, `gate`, `export`, `plot`.

Everything here returns data (Trace, DiffReport with a pandas `.table`, GateResult); the CLI
commands only parse options, call one of these and print. Importing this module does not import
torch; engines are loaded through `parity.contract.engine.load_engine` only when a trace is run.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from parity.contract.checkpoints import trace_checkpoints
from parity.contract.engine import Engine, RunOptions, load_engine
from parity.contract.errors import TraceError
from parity.tracing.io import read_trace, write_trace
from parity.tracing.recorder import Recorder, resolve_full, resolve_positions
from parity.tracing.records import Trace, TraceHeader
from parity.tracing.runner import ChunkResult, chunk_schedule, run_sequence

TraceLike = Trace | str | os.PathLike


def load_trace(path: str | os.PathLike, load_vectors: bool = True) -> Trace:
    """Read a trace in either form (text or .npz), with its full vectors when it has a side file."""
    return read_trace(path, load_vectors)


def save_trace(trace: Trace, path: str | os.PathLike, form: str | None = None) -> Path:
    """Write a trace atomically: text unless `form='npz'` or the path ends in .npz."""
    return write_trace(trace, path, form)


def _as_trace(t: TraceLike) -> Trace:
    return t if isinstance(t, Trace) else read_trace(t)


def model_identity(model: str | os.PathLike) -> dict[str, Any]:
    """Size + header hash of a GGUF (all shards), as stored in trace headers."""
    from parity.gguf.weights import Weights

    return Weights(model).identity()


def trace(engine: str | Engine, model: str | os.PathLike, tokens: Sequence[int], *,
          positions: str | Sequence[int] = "last",
          full: str | Sequence[str] | None = None, decode: int = 0, chunk: int | None = None, top_k: int = 20,
          options: RunOptions | None = None, forced: Sequence[int] | None = None,
          on_chunk: Callable[[ChunkResult], None] | None = None) -> Trace:
    """Run `engine` (a registered name or an Engine instance) on `tokens` (+ `decode` greedy steps) and record.

    positions: 'last' | 'all' | list of positions of the whole run; full: 'all' | list of checkpoints
    (and 'logits') whose full vectors go to the side file; `forced`: the decode tokens to feed instead of
    the engine's own argmax (teacher forcing, e.g. another trace's generated tokens); `on_chunk` sees
    every chunk result as it comes (progress bars, logit dumps).
    """
    options = options or RunOptions()
    eng = load_engine(engine, str(model), options) if isinstance(engine, str) else engine
    tokens = [int(t) for t in tokens]
    if not tokens:
        raise TraceError("no tokens to trace")
    vocab = eng.config.vocab_size
    bad = [t for t in tokens if not 0 <= t < vocab]
    if bad:
        raise TraceError(f"token id(s) {bad[:5]} out of range [0, {vocab}) for this model")
    if decode < 0:
        raise TraceError(f"decode must be >= 0, got {decode}")
    n_total = len(tokens) + decode
    pos = resolve_positions(positions, n_total)
    full_names = resolve_full(full, eng.config.n_layers)
    rec = Recorder(trace_checkpoints(eng.config.n_layers), pos, full_names, top_k, eng.config.hc_mult)

    def each(r: ChunkResult) -> None:
        rec.add(r)
        if on_chunk:
            on_chunk(r)

    if forced is not None and len(forced) != decode:
        raise TraceError(f"{len(forced)} forced decode tokens for {decode} decode steps")
    results = run_sequence(eng, tokens, decode_steps=decode, chunk=chunk, forced=forced, on_chunk=each)
    all_tokens = np.concatenate([r.tokens for r in results]).tolist()
    header = TraceHeader(
        engine=eng.name, engine_version=eng.version, model=model_identity(model), dtype=eng.options.dtype,
        n_hc=eng.config.hc_mult, dim=eng.config.dim, top_k=top_k, tokens=all_tokens, n_prompt=len(tokens),
        chunks=[len(r.tokens) for r in results], decode=decode, positions=pos,
        checkpoints=trace_checkpoints(eng.config.n_layers), full=full_names,
        flags=eng.options.flags(),
    )
    return Trace(header, **rec.tables(), vectors=rec.vectors())


def follow(path_or_trace: TraceLike) -> dict[str, Any]:
    """Keyword arguments that make a new run token-identical to an existing trace: same prompt, same
    decode length, decode tokens forced to the trace's generated ones, same positions and chunk size."""
    h = _as_trace(path_or_trace).header
    prefill = h.chunks[: len(h.chunks) - h.decode]
    chunk = None if len(prefill) == 1 else prefill[0]
    if chunk_schedule(h.n_prompt, chunk) != prefill:
        raise TraceError(f"cannot replay the prefill chunks {prefill}: a run prefills in one chunk or in equal "
                         f"pieces of --chunk (the last one shorter)")
    return {"tokens": h.tokens[: h.n_prompt], "decode": h.decode, "forced": h.tokens[h.n_prompt:],
            "positions": h.positions, "chunk": chunk}


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


def n_chunks(n_prompt: int, decode: int, chunk: int | None) -> int:
    """How many forward chunks a run takes (for progress bars)."""
    return len(chunk_schedule(n_prompt, chunk)) + decode


def diff(a: TraceLike, b: TraceLike, *, force: bool = False, rel_tol: float | None = None,
         norm_tol: float | None = None) -> Any:
    """Compare trace `a` (reference) with `b` (candidate): preflight, metrics, first drift -> DiffReport."""
    from parity.compare.differ import Thresholds, diff_traces

    th = Thresholds().with_overrides(rel_tol=rel_tol, norm_tol=norm_tol)
    return diff_traces(_as_trace(a), _as_trace(b), thresholds=th, force=force)


def gate(golden: TraceLike, candidate: TraceLike, tolerances: str | os.PathLike | dict | None = None,
         force: bool = False) -> Any:
    """CI gate of `candidate` against `golden` with a tolerance table -> GateResult (bool = passed)."""
    from parity.compare.gate import run_gate

    return run_gate(_as_trace(golden), _as_trace(candidate), tolerances, force=force)


def export(t: TraceLike, out: str | os.PathLike) -> Path:
    """Write every full vector of a trace as plain arrays named by checkpoint to an .npz."""
    from parity.tracing.export import export_npz

    return export_npz(_as_trace(t), out)


def plot(report: Any, out: str | os.PathLike) -> Path:
    """Drift-profile figure of a DiffReport to `out` (PNG/PDF/SVG by extension)."""
    from parity.compare.plot import plot_drift

    return plot_drift(report, out)
