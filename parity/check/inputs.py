"""What `check` is given: a candidate (a trace file, or dumps imported on the fly), the model it must belong to
(preflight), and the model's stored noise envelope (found by model identity, never by file name).

Where a stored envelope is looked for, in this order (`envelope_sources`), after an explicit `--envelope` file:
1. the user cache, `$XDG_CACHE_HOME/v4parity/envelopes` (default `~/.cache/v4parity/envelopes`), where `check`,
   `bisect` and `spec` keep every envelope they measure, one file per model identity, engine and QAT flags
   (`cache_path`);
2. the model's own directory;
3. the repository's committed `traces/` (the tiny models' envelopes; only in a source checkout).
The working directory is never searched. In every place a file counts only when it was measured on this model
(size + header hash, `same_model`), holds a section for the run's dtype and was calibrated with its QAT flags (for
`bisect` and `spec`, also on the candidate engine: an engine is judged by its own noise; `check` takes any)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from parity.check.envelope import Envelope, load_envelope, read_envelope
from parity.contract.errors import ParityError, TraceError
from parity.gguf.config import ModelConfig
from parity.gguf.weights import same_model
from parity.tracing.importers import LCP_RE, has_ds4_dumps, import_ds4, import_llamacpp, llamacpp_chunks
from parity.tracing.io import read_trace
from parity.tracing.records import Trace
from parity.tracing.runner import ChunkResult
from parity.tracing.subops import subop_chunks

CACHE_SUBDIR = ("v4parity", "envelopes")
COMMITTED_TRACES = Path(__file__).resolve().parents[2] / "traces"   # the repository's traces/ (source checkout)


def cache_dir() -> Path:
    """The user's envelope cache: `$XDG_CACHE_HOME/v4parity/envelopes`, or `~/.cache/v4parity/envelopes` when
    XDG_CACHE_HOME is unset or empty (the XDG base-directory default). A relative XDG_CACHE_HOME is refused."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    if base and not Path(base).is_absolute():
        raise ParityError(f"XDG_CACHE_HOME={base!r} is not an absolute path (the XDG base-directory rule): set it to "
                          "an absolute directory or unset it (default ~/.cache)")
    return (Path(base) if base else Path.home() / ".cache").joinpath(*CACHE_SUBDIR)


def cache_path(identity: dict[str, Any], qat: dict[str, bool], engine: str) -> Path:
    """The cache file of one model identity, QAT flags and measuring engine (each dtype a section of it)."""
    flags = "-".join(f"{k.replace('_', '')}{int(bool(v))}" for k, v in sorted(qat.items()))
    return cache_dir() / f"{identity['header_sha256'][:16]}-{identity['size']}-{engine}-{flags}.envelope.json"


def envelope_sources(model: str | os.PathLike) -> list[Path]:
    """Where a stored envelope of `model` is looked for, in order: the user cache, the model's directory, the
    repository's committed traces/ (when this is a source checkout). Never the working directory."""
    places = [cache_dir(), Path(model).resolve().parent, COMMITTED_TRACES]
    unique = [p for i, p in enumerate(places) if p not in places[:i]]
    return [p for p in unique if p != COMMITTED_TRACES or p.is_dir()]


class CheckPreflightError(ParityError):
    """The candidate cannot be judged against this model (exit status 2)."""


def load_candidate(source: str | os.PathLike, config: ModelConfig, identity: dict[str, Any],
                   tokens: Sequence[int] | None) -> Trace:
    """A trace file (text or binary) as is; a llama.cpp capture `.npz` (its `input_ids` are the tokens) or dump
    directory, or a ds4 dump prefix (`dir/run` for `dir/run_<name>-<layer>_pos<pos>.bin`, or `dir/`), imported with
    `tokens` (dump directories and ds4 dumps carry none)."""
    path = Path(source)
    if path.is_file():
        try:
            return read_trace(path)
        except TraceError:
            if path.suffix != ".npz":
                raise
        return import_llamacpp(path, tokens=None if tokens is None else [int(t) for t in tokens], config=config,
                               model=identity)
    if path.is_dir() and any(LCP_RE.match(f.name) for f in path.iterdir()):
        return _imported(import_llamacpp, path, config, identity, tokens, "llama.cpp dump directory")
    if not path.exists() and not has_ds4_dumps(source):
        raise CheckPreflightError(f"{source}: no such file or directory (nor a ds4 dump prefix: no "
                                  f"{path.name}_<name>-<layer>_pos<pos>.bin files beside it)")
    return _imported(import_ds4, source, config, identity, tokens, "ds4 dump prefix")


def candidate_subops(source: Any, trace: Trace, config: ModelConfig,
                     tokens: Sequence[int] | None) -> tuple[list[ChunkResult] | None, list[str]]:
    """The candidate's own sub-op captures, chunk by chunk on its own chunking: from the trace's sub-op records
    (`v4parity trace --subops`, or a C engine's side file) or from a complete llama.cpp capture file (every mapped
    tensor, all logits); else None and, for incomplete records or capture, a note saying why."""
    if trace.header.subops:
        try:
            return subop_chunks(trace, config), []
        except TraceError as e:
            return None, [f"no op-level verdict from the trace's sub-op records: {e}"]
    if trace.header.flags.get("imported") != "llama.cpp capture" or not isinstance(source, (str, os.PathLike)):
        return None, []
    try:
        return llamacpp_chunks(source, config, None if tokens is None else [int(t) for t in tokens]), []
    except TraceError as e:
        return None, [f"no sub-op drill-down from the capture: {e}"]


def _imported(importer: Any, path: str | os.PathLike, config: ModelConfig, identity: dict[str, Any],
              tokens: Sequence[int] | None, what: str) -> Trace:
    if tokens is None:
        raise CheckPreflightError(f"{path}: {what}; the dumps carry no token ids: pass --tokens or --tokens-file")
    return importer(path, tokens=[int(t) for t in tokens], config=config, model=identity)


def preflight(trace: Trace, config: ModelConfig, identity: dict[str, Any], names: str = "") -> None:
    """Refuse a candidate of another model (size + header hash), shape, or with token ids outside the vocabulary;
    `names` ('candidate X, model Y') goes into the message."""
    h = trace.header
    problems = []
    if not same_model(h.model, identity):
        problems.append(f"model identity differs: candidate {h.model['size']} bytes, header {h.model['header_sha256']}"
                        f" vs model {identity['size']} bytes, header {identity['header_sha256']}")
    if (h.n_hc, h.dim) != (config.hc_mult, config.dim):
        problems.append(f"carrier shape differs: candidate {h.n_hc} x {h.dim}, model {config.hc_mult} x {config.dim}")
    if trace.n_layers > config.n_layers:
        problems.append(f"candidate has checkpoints of {trace.n_layers} layers, the model {config.n_layers}")
    toks = np.asarray(h.tokens)
    bad = toks[(toks < 0) | (toks >= config.vocab_size)]
    if len(bad):
        problems.append(f"token id {int(bad[0])} outside the vocabulary [0, {config.vocab_size})")
    if problems:
        raise CheckPreflightError(f"preflight{f' ({names})' if names else ''}: " + "; ".join(problems))


def find_envelope(identity: dict[str, Any], dtype: str, search: Sequence[str | os.PathLike],
                  qat: dict[str, bool], engine: str | None = None) -> Path | None:
    """The first `*.envelope.json` in the `search` directories measured on this model (`same_model`) with a
    `dtype` section calibrated with the QAT flags `qat` ({"fp8_kv": .., "fp4_indexer": ..}) and, when `engine` is
    given, on that engine (`bisect` / `spec` judge an engine by its own noise; `check` takes any), or None. A file
    of another model, without that section or calibrated otherwise is passed over; an unreadable or malformed one
    is an error naming it (never skipped: it may be the envelope meant for this model)."""
    for d in search:
        for p in sorted(Path(d).glob("*.envelope.json")) if Path(d).is_dir() else ():
            doc = read_envelope(p)
            try:
                model, sections = doc["model"], doc["dtypes"]
                if not {"size", "header_sha256"} <= set(model):
                    raise KeyError("model size / header_sha256")
                calibration = {k: sections[dtype]["calibration"][k] for k in qat} if dtype in sections else None
                measured_on = sections[dtype]["calibration"].get("engine") if dtype in sections else None
            except (KeyError, TypeError) as e:
                raise ParityError(f"{p}: malformed envelope (missing or mistyped {e}); regenerate it with "
                                  "`v4parity envelope` or move it out of the search directory") from None
            if calibration == qat and engine in (None, measured_on) and same_model(model, identity):
                return p
    return None


def envelope_for(identity: dict[str, Any], dtype: str, path: str | os.PathLike | None,
                 search: Sequence[str | os.PathLike], qat: dict[str, bool],
                 engine: str | None = None) -> tuple[Envelope, Path] | None:
    """The envelope at `path` (refused when measured on another model), else the one found by model identity
    (`find_envelope`: with `engine`, only one measured on that engine)."""
    found = Path(path) if path is not None else find_envelope(identity, dtype, search, qat, engine)
    return None if found is None else (load_envelope(found, dtype, identity), found)
