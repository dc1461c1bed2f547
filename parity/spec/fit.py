"""Tiny MTP drafters fitted to their trunk's own greedy continuations (spec v4-mtp-dspark §6.6).

A random drafter never agrees with the trunk, so speculative acceptance on a tiny model would mean nothing. Here the
reference engine decodes seeded random prompts greedily; every prev pair (X^(L)_i, t_{i+1}) of those trajectories
is a training row whose target is the trunk's own argmax at row i+1 (the token a draft from that pair must equal).
The torch engine's `fit_mtp` capability runs Adam through its own MTP ops (the trunk's embedding and output head
stay fixed), `synthesize_drafter` writes the fitted tensors in the requested layout, and the REFERENCE engine opened
with the written file measures the agreement: on the fitted trajectories and on held-out prompts, next to the seeded
random drafter's. Agreement counts the pairs a speculative round drafts from, i >= prompt length - 1 (the anchor is
a generated token). QAT simulations are off throughout (the fitted forward has none).
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from parity.contract.checkpoints import block
from parity.contract.engine import Engine, RunOptions, engine_class
from parity.contract.errors import ParityError
from parity.gguf.drafter import LAYOUTS, extend_config
from parity.gguf.synth_draft import random_drafter_weights, synthesize_drafter, tiny_drafter_config
from parity.gguf.weights import Weights
from parity.tracing.runner import all_tokens, run_sequence, stack

FIT_OPTIONS = RunOptions(fp8_kv=False, fp4_indexer=False)
TRUNK_TENSORS = ("token_embd.weight", "output.weight")   # the head shares them with the trunk
FIRST_TOKEN = 2                                           # prompts avoid the tiny vocabulary's BOS 0 / EOS 1


@dataclass(frozen=True)
class Trajectory:
    """A prompt and the trunk's greedy continuation: tokens [n], final carriers X^(L) [n, H, D], the trunk's
    first argmax at every row [n] (argmax[i] = tokens[i+1] past the prompt)."""

    tokens: np.ndarray
    carriers: np.ndarray
    argmax: np.ndarray
    n_prompt: int


@dataclass(frozen=True)
class FitReport:
    """What `fit_mtp_drafter` wrote and measured (agreements: fractions of drafted pairs, reference engine)."""

    path: Path
    layout: str
    seed: int
    steps: int
    fitted: float          # the fitted drafter on its training trajectories
    heldout: float         # the fitted drafter on held-out prompts
    random_fitted: float   # the seeded random drafter on the training trajectories
    random_heldout: float  # ... and on the held-out prompts
    pairs: tuple[int, int]  # drafted pairs counted (training, held-out)
    seconds: dict[str, float]


def seeded_prompts(seed: int, count: int, length: int, vocab: int, stream: int) -> list[np.ndarray]:
    """`count` prompts of `length` tokens uniform in [FIRST_TOKEN, vocab), from the stream (seed, stream)."""
    rng = np.random.default_rng([seed, stream])
    return [rng.integers(FIRST_TOKEN, vocab, length) for _ in range(count)]


def greedy_trajectory(engine: Engine, prompt: np.ndarray, decode: int) -> Trajectory:
    """Prefill `prompt`, decode `decode` greedy tokens; keep the final carriers and argmaxes of every row."""
    results = run_sequence(engine, prompt, decode)
    carriers = stack(results, block(engine.config.n_layers - 1))
    return Trajectory(all_tokens(results), carriers, stack(results, "logits").argmax(axis=1), len(prompt))


def training_rows(t: Trajectory) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(carriers [n, H, D], tokens [n], targets [n-1]): prev pair i = (X_i, t_{i+1}) must predict argmax[i+1]."""
    return t.carriers, t.tokens, t.argmax[1:]


def agreement(engine: Engine, trajectories: Sequence[Trajectory]) -> tuple[float, int]:
    """The fraction of drafted prev pairs i >= n_prompt - 1 whose MTP first argmax equals the trunk's argmax at
    row i+1, over `trajectories`, by `engine`'s `mtp_forward` (opened with the drafter); and the pair count."""
    hits = total = 0
    for t in trajectories:
        out = engine.mtp_forward(engine.new_mtp_state(), t.carriers, t.tokens, 0, "prev")
        drafted = slice(t.n_prompt - 1, None)
        hits += int((out.logits.argmax(axis=1)[drafted] == t.argmax[1:][drafted]).sum())
        total += len(t.argmax[1:][drafted])
    return hits / total, total


def fit_mtp_drafter(trunk: str | Path, out: str | Path, *, layout: str = "ds4-mtp", seed: int = 0,
                    steps: int = 40, quant: str = "f32", prompts: int = 4, prompt_len: int = 8, decode: int = 32,
                    heldout: int = 2, train_prompts: Sequence[Sequence[int]] | None = None,
                    log: Callable[[int, float], None] | None = None) -> FitReport:
    """Fit the tiny MTP drafter of `trunk` (`steps` Adam steps, seeded) and write it to `out` in `layout`.

    Training trajectories: `prompts` seeded random prompts of `prompt_len` tokens, or `train_prompts` when given
    (e.g. the prompts a speculative test will decode), each continued greedily for `decode` tokens; `heldout` more
    seeded prompts (another stream) only measure."""
    if LAYOUTS.get(layout) != "mtp":
        raise ParityError(f"fit: {layout!r} is not an MTP layout; choose from "
                          f"{', '.join(k for k, v in LAYOUTS.items() if v == 'mtp')}")
    if min(steps, prompts, prompt_len, decode, heldout) < 1:
        raise ParityError(f"fit: steps ({steps}), prompts ({prompts}), prompt_len ({prompt_len}), decode ({decode}) "
                          f"and heldout ({heldout}) must all be >= 1")
    if train_prompts is not None and (not train_prompts or min(len(p) for p in train_prompts) < 1):
        raise ParityError("fit: train_prompts must hold at least one prompt, each of at least one token")
    seconds, t0 = {}, time.perf_counter()
    weights = Weights(trunk)
    cfg = weights.config
    reference = engine_class("reference")(str(trunk), FIT_OPTIONS)
    chosen = ([np.asarray(p, dtype=np.int64) for p in train_prompts] if train_prompts is not None
              else seeded_prompts(seed, prompts, prompt_len, cfg.vocab_size, 1))
    train = [greedy_trajectory(reference, p, decode) for p in chosen]
    held = [greedy_trajectory(reference, p, decode) for p in seeded_prompts(seed, heldout, prompt_len,
                                                                            cfg.vocab_size, 2)]
    seconds["trajectories"], t0 = time.perf_counter() - t0, time.perf_counter()
    dc = tiny_drafter_config("mtp", layout, cfg)
    model_cfg = extend_config(cfg, dc.n_blocks)
    init = {k: a for k, (a, _) in random_drafter_weights(dc, model_cfg, seed).items()}
    init |= {k: weights.tensor(k) for k in TRUNK_TENSORS}
    fitted = engine_class("torch").fit_mtp(init, model_cfg, cfg.n_layers, [training_rows(t) for t in train],
                                           steps, seed, log=log)
    path = synthesize_drafter(out, trunk, "mtp", layout, seed, quant, weights=fitted)
    seconds["fit"], t0 = time.perf_counter() - t0, time.perf_counter()
    scores = {}
    with tempfile.TemporaryDirectory() as tmp:
        rand = synthesize_drafter(Path(tmp) / "random.gguf", trunk, "mtp", layout, seed, quant)
        for name, drafter in (("fitted", path), ("random", rand)):
            engine = engine_class("reference")(str(trunk), FIT_OPTIONS, draft=str(drafter))
            scores[name] = agreement(engine, train), agreement(engine, held)
    seconds["measure"] = time.perf_counter() - t0
    (fit_train, n_train), (fit_held, n_held) = scores["fitted"]
    return FitReport(Path(path), layout, seed, steps, fit_train, fit_held, scores["random"][0][0],
                     scores["random"][1][0], (n_train, n_held), seconds)
