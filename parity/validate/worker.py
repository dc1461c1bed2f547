"""One validation task in a worker process: a prompt through the exact and the approximate path, or a pin run.

Engines are loaded once per process (`engine`, keyed by the spec string) whatever executor runs the task, and
everything they print on stderr while loading and running is captured (file descriptor 2 and `sys.stderr`,
then passed on to stderr), so the announce pin can check what the engine said. A task returns a JSON-ready
record; nothing in it depends on which process ran it, except `seconds` and `cpu_seconds` (wall and CPU time of
its engine runs).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import re
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from parity.bisect.trajectory import TOP, top_entries
from parity.compare.metrics import rel_l2
from parity.compare.verdict import StepVerdict, classify_step
from parity.contract.checkpoints import block
from parity.contract.engine import Engine, load_engine
from parity.logprobs.compare import truncated_divergence
from parity.tracing.runner import ChunkResult, all_tokens, run_sequence, stack
from parity.tracing.stats import top_k
from parity.validate.prompts import Prompt
from parity.validate.spec import EngineSpec, approx_keys

MAIN, PIN = "main", "pin"


@dataclass(frozen=True)
class Job:
    """What every task of one validation shares."""

    model: str
    exact: EngineSpec
    approx: EngineSpec
    explicit: EngineSpec | None    # the approx spec with its approximate options at their exact values
    decode: int
    top_k: int
    tie_margin: float
    drift_tol: float


@dataclass(frozen=True)
class Task:
    kind: str                      # MAIN | PIN
    prompt: Prompt


_ENGINES: dict[str, tuple[Engine, str]] = {}


@contextlib.contextmanager
def captured_stderr() -> Iterator[list[str]]:
    """Everything written to fd 2 or sys.stderr inside the block: appended to the yielded list, then written on
    to the real stderr."""
    sys.stderr.flush()
    saved = os.dup(2)
    text = io.StringIO()
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        out: list[str] = []
        try:
            with contextlib.redirect_stderr(text):
                yield out
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            out.append(tmp.read().decode("utf-8", "replace") + text.getvalue())
            sys.stderr.write(out[0])  # passed on: the user sees what the engine said
            sys.stderr.flush()


def engine(spec: EngineSpec, model: str) -> tuple[Engine, str]:
    """The process's engine for `spec` (loaded on first use) and what it printed on stderr while loading."""
    key = f"{spec.text()}@{model}"
    if key not in _ENGINES:
        with captured_stderr() as said:
            eng = load_engine(spec.engine, model, spec.options)
        _ENGINES[key] = (eng, said[0])
    return _ENGINES[key]


def digest(results: Sequence[ChunkResult]) -> str:
    """sha256 of every token, checkpoint vector and logit of a run, in run order (dtype and shape included):
    two runs have the same digest exactly when they agree in every bit."""
    h = hashlib.sha256()
    for r in results:
        for name, a in (("tokens", r.tokens), *sorted(r.checkpoints.items()), ("logits", r.logits)):
            a = np.ascontiguousarray(a)
            h.update(f"{name}|{a.dtype.str}|{a.shape}|".encode())
            h.update(a.tobytes())
    return h.hexdigest()


def announced(text: str, modes: dict[str, str]) -> dict[str, bool]:
    """Per declared mode (option -> value): did a line of `text` name the value (as a whole word)?"""
    return {k: re.search(rf"(?<![A-Za-z0-9_]){re.escape(v)}(?![A-Za-z0-9_])", text, re.IGNORECASE) is not None
            for k, v in modes.items()}


def _run(spec: EngineSpec, job: Job, prompt: Prompt, forced: Sequence[int] | None = None
         ) -> tuple[list[ChunkResult], Engine, str]:
    eng, load_text = engine(spec, job.model)
    with captured_stderr() as said:
        res = run_sequence(eng, prompt.tokens, decode_steps=job.decode, chunk=prompt.chunk, forced=forced)
    return res, eng, load_text + said[0]


def _logprobs(logits: np.ndarray) -> np.ndarray:
    """log-softmax rows in float64 (not `logprobs.io.ds4_top`, which rounds to float32 as ds4 writes its dumps:
    that rounding, ~6e-8 relative, would swamp the KL of a close approximation)."""
    x = np.asarray(logits, np.float64)
    m = x.max(axis=1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=1, keepdims=True))


def step_metrics(ref_logits: np.ndarray, cand_logits: np.ndarray, k: int, tie_margin: float,
                 drift_tol: float) -> dict[str, list]:
    """Per greedy step (rows of [S, V] logits): the tie-aware verdict on logprobs, the reference's logprob gap
    to the candidate's pick, and the top-k KL(ref || cand) bounds (upper bound None where unbounded)."""
    lp_r, lp_c = _logprobs(ref_logits), _logprobs(cand_logits)
    ids_r, _ = top_k(lp_r, k)
    ids_c, _ = top_k(lp_c, k)
    out: dict[str, list] = {"verdict": [], "margin": [], "kl": [], "kl_upper": []}
    for s in range(len(lp_r)):
        verdict, margin = classify_step(top_entries(lp_r[s], TOP), top_entries(lp_c[s], TOP), tie_margin, drift_tol)
        div = truncated_divergence({int(i): float(lp_r[s, i]) for i in ids_r[s]},
                                   {int(i): float(lp_c[s, i]) for i in ids_c[s]})
        out["verdict"].append(verdict.value)
        out["margin"].append(float(margin))
        out["kl"].append(float(div.kl_lower))
        out["kl_upper"].append(float(div.kl_upper) if np.isfinite(div.kl_upper) else None)
    return out


def run_main(job: Job, prompt: Prompt) -> dict:
    """Both paths on one prompt: the exact path greedy, the approximate path fed the exact path's tokens
    (teacher forcing), so every step is judged on the same prefix and the first divergent step is the one a
    free-running greedy decode of the approximate path would diverge at."""
    t0, c0 = time.perf_counter(), time.process_time()
    ex, ex_eng, _ = _run(job.exact, job, prompt)
    generated = [int(t) for t in all_tokens(ex)[len(prompt.tokens):]]
    ap, ap_eng, ap_text = _run(job.approx, job, prompt, forced=generated)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    P = len(prompt.tokens)
    steps = step_metrics(stack(ex, "logits")[P - 1:], stack(ap, "logits")[P - 1:], job.top_k, job.tie_margin,
                         job.drift_tol)
    layers = [float(rel_l2(stack(ex, block(l))[P - 1:P], stack(ap, block(l))[P - 1:P])[0])
              for l in range(ex_eng.config.n_layers)]
    first = next((s for s, v in enumerate(steps["verdict"])
                  if v in (StepVerdict.TIE_FLIP.value, StepVerdict.WRONG.value)), None)
    modes = approx_keys(job.exact, job.approx)
    return {"kind": MAIN, "index": prompt.index, "source": prompt.source, "prompt_sha": prompt.sha,
            "n_prompt": P, "chunk": prompt.chunk, "generated": generated,
            "first_divergent_step": first, "first_divergent_class": None if first is None else steps["verdict"][first],
            **steps, "layer_rel_l2": layers,
            "digest_exact": digest(ex), "digest_approx": digest(ap),
            "flags_exact": ex_eng.options.flags(), "flags_approx": ap_eng.options.flags(),
            "announced": announced(ap_text, modes), "seconds": seconds, "cpu_seconds": cpu}


def run_pin(job: Job, prompt: Prompt) -> dict:
    """The exact path again (same process-cached engine) and the explicit-exact spec, as digests."""
    t0, c0 = time.perf_counter(), time.process_time()
    again, _, _ = _run(job.exact, job, prompt)
    explicit = digest(_run(job.explicit, job, prompt)[0]) if job.explicit is not None else None
    return {"kind": PIN, "index": prompt.index, "prompt_sha": prompt.sha, "digest_exact_again": digest(again),
            "digest_explicit": explicit, "seconds": time.perf_counter() - t0,
            "cpu_seconds": time.process_time() - c0}


def run_task(job: Job, task: Task) -> dict:
    return run_main(job, task.prompt) if task.kind == MAIN else run_pin(job, task.prompt)
