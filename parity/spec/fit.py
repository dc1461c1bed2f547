"""Tiny drafters fitted to their trunk's own greedy continuations (spec v4-mtp-dspark §6.6).

A random drafter never agrees with the trunk, so speculative acceptance on a tiny model would mean nothing. Here the
reference engine decodes seeded random prompts greedily and the trajectories become training items whose targets
are the trunk's own argmaxes: MTP, every prev pair (X^(L)_i, t_{i+1}) must draft the argmax at row i+1; DSpark,
every round at p (taps of the rows <= p, anchor t_{p+1}) must draft the argmaxes at rows p+1..p+B in its B slots.
The torch engine's `fit_mtp` / `fit_dspark` capability runs Adam through its own draft-head ops (the trunk's
embedding and output head stay fixed), `synthesize_drafter` writes the fitted tensors in the requested layout, and
the REFERENCE engine opened with the written file measures the agreement per slot: on the fitted trajectories and
on held-out prompts, next to the seeded random drafter's. Only drafted positions count: pairs / rounds at
p >= prompt length - 1 (the anchor a generated token). QAT simulations are off throughout (the fitted forward has
none).
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
from parity.gguf.config import ModelConfig
from parity.gguf.drafter import LAYOUTS, DrafterConfig, extend_config
from parity.gguf.synth_draft import random_drafter_weights, synthesize_drafter, tiny_drafter_config
from parity.gguf.weights import Weights
from parity.tracing.runner import all_tokens, run_sequence, stack

FIT_OPTIONS = RunOptions(fp8_kv=False, fp4_indexer=False)
TRUNK_TENSORS = ("token_embd.weight", "output.weight")   # the heads share them with the trunk
FIRST_TOKEN = 2                                           # prompts avoid the tiny vocabulary's BOS 0 / EOS 1
STEPS = {"mtp": 40, "dspark": 100}                        # the CLI defaults (docs/drafters.md: measured)


@dataclass(frozen=True)
class Trajectory:
    """A prompt and the trunk's greedy continuation: tokens [n], final carriers X^(L) [n, H, D], DSpark tap rows
    [n, m·D] (None for an MTP fit), the trunk's first argmax at every row [n] (argmax[i] = tokens[i+1] past the
    prompt)."""

    tokens: np.ndarray
    carriers: np.ndarray
    taps: np.ndarray | None
    argmax: np.ndarray
    n_prompt: int


@dataclass(frozen=True)
class FitReport:
    """What `fit_drafter` wrote and measured. agreement: per slot (MTP: one), the fraction of drafted positions
    whose draft equals the trunk's argmax, by the reference engine, for "fitted" / "heldout" (the fitted drafter on
    its training / held-out prompts) and "random_fitted" / "random_heldout" (the seeded random drafter)."""

    path: Path
    kind: str
    layout: str
    seed: int
    steps: int
    agreement: dict[str, tuple[float, ...]]
    counted: tuple[int, int]   # drafted anchors (MTP) / rounds (DSpark) counted: training, held-out
    seconds: dict[str, float]


def seeded_prompts(seed: int, count: int, length: int, vocab: int, stream: int) -> list[np.ndarray]:
    """`count` prompts of `length` tokens uniform in [FIRST_TOKEN, vocab), from the stream (seed, stream)."""
    rng = np.random.default_rng([seed, stream])
    return [rng.integers(FIRST_TOKEN, vocab, length) for _ in range(count)]


def greedy_trajectory(engine: Engine, prompt: np.ndarray, decode: int,
                      tap_layers: Sequence[int] | None = None) -> Trajectory:
    """Prefill `prompt`, decode `decode` greedy tokens; keep the final carriers, the argmaxes and (`tap_layers`,
    an engine opened with a DSpark drafter) the tap rows `engine.dspark_taps` makes of every row."""
    results = run_sequence(engine, prompt, decode)
    carriers = stack(results, block(engine.config.n_layers - 1))
    taps = None if tap_layers is None else engine.dspark_taps([stack(results, block(l)) for l in tap_layers])
    return Trajectory(all_tokens(results), carriers, taps, stack(results, "logits").argmax(axis=1), len(prompt))


def mtp_rows(t: Trajectory) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """(carriers [n, H, D], tokens [n], targets [n-1], first drafted pair n_prompt-1): prev pair i = (X_i, t_{i+1})
    must predict argmax[i+1]."""
    return t.carriers, t.tokens, t.argmax[1:], t.n_prompt - 1


def dspark_rounds(t: Trajectory, dc: DrafterConfig, window: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """The drafted rounds of a trajectory, p = n_prompt-1 .. n-1-B: (taps of the rows up to p the ring keeps,
    the last W; block [anchor t_{p+1}, noise x (B-1)]; targets argmax[p+1 .. p+B])."""
    B, out = dc.block_size, []
    for p in range(t.n_prompt - 1, len(t.tokens) - B):
        block_ids = np.array([t.tokens[p + 1]] + [dc.noise_token_id] * (B - 1))
        out.append((t.taps[max(0, p - window + 1) : p + 1], block_ids, t.argmax[p + 1 : p + 1 + B]))
    return out


def mtp_agreement(engine: Engine, trajectories: Sequence[Trajectory], depth: int) -> tuple[tuple[float, ...], int]:
    """Per slot k = 1..depth, the fraction of drafted anchors c (pairs c >= n_prompt-1 with c+depth <= n-1) whose
    draft d_k equals the trunk's argmax at row c+k: d_1 the first argmax of pair c's MTP logits, d_2.. those of
    `mtp_chain` after it, by `engine` (opened with the drafter) with the MTP ring written one pair at a time as a
    speculative loop does; and the anchor count."""
    hits, total = np.zeros(depth, dtype=np.int64), 0
    for t in trajectories:
        state, first = engine.new_mtp_state(), t.n_prompt - 1
        if first > 0:
            engine.mtp_forward(state, t.carriers[: first + 1], t.tokens[: first + 1], 0, "prev")
        for c in range(first, len(t.tokens) - depth):
            last = engine.mtp_forward(state, t.carriers[c : c + 2], t.tokens[c : c + 2], c, "prev")
            chain = engine.mtp_chain(state, last, c + 1, depth) if depth > 1 else []
            drafts = [int(np.argmax(last.logits[-1]))] + [int(np.argmax(o.logits[0])) for o in chain]
            hits += np.array(drafts) == t.argmax[c + 1 : c + 1 + depth]
            total += 1
    return tuple(float(h) / total for h in hits), total


def dspark_agreement(engine: Engine, trajectories: Sequence[Trajectory], dc: DrafterConfig,
                     window: int) -> tuple[tuple[float, ...], int]:
    """Per slot j, the fraction of drafted rounds whose draft d_{j+1} equals the trunk's argmax at row p+1+j, by
    `engine`'s `dspark_round` (opened with the drafter; a fresh state gets the round's ring rows); the round count."""
    hits, total = np.zeros(dc.block_size, dtype=np.int64), 0
    for t in trajectories:
        for p, (taps, block_ids, targets) in enumerate(dspark_rounds(t, dc, window), start=t.n_prompt - 1):
            r = engine.dspark_round(engine.new_dspark_state(), taps, p + 1 - len(taps), int(block_ids[0]))
            hits += r.drafts == targets
            total += 1
    return tuple(float(h) / total for h in hits), total


def fit_drafter(trunk: str | Path, out: str | Path, kind: str, *, layout: str | None = None, seed: int = 0,
                steps: int | None = None, quant: str = "f32", prompts: int = 4, prompt_len: int = 8,
                decode: int = 32, heldout: int = 2, train_prompts: Sequence[Sequence[int]] | None = None,
                depth: int = 1, log: Callable[[int, float], None] | None = None) -> FitReport:
    """Fit the tiny `kind` drafter ("mtp" | "dspark") of `trunk` (`steps` Adam steps, None: STEPS[kind]; seeded)
    and write it to `out` in `layout` (None: ds4-mtp / ds4-dspark).

    Training trajectories: `prompts` seeded random prompts of `prompt_len` tokens, or `train_prompts` when given
    (e.g. the prompts a speculative test will decode), each continued greedily for `decode` tokens; `heldout` more
    seeded prompts (another stream) only measure. MTP `depth` > 1 also fits (and measures) the chained drafts
    d_2..d_depth."""
    if kind not in STEPS:
        raise ParityError(f"fit: unknown drafter kind {kind!r}; choose from {', '.join(STEPS)}")
    layout = layout if layout is not None else f"ds4-{kind}"
    steps = steps if steps is not None else STEPS[kind]
    _check_fit_args(kind, layout, steps, prompts, prompt_len, decode, heldout, train_prompts)
    seconds, t0 = {}, time.perf_counter()
    weights = Weights(trunk)
    cfg = weights.config
    dc = tiny_drafter_config(kind, layout, cfg)
    if kind == "dspark" and decode < dc.block_size:
        raise ParityError(f"fit: decode ({decode}) must be >= the DSpark block size {dc.block_size}")
    if depth < 1 or depth > decode or (kind == "dspark" and depth != 1):
        raise ParityError(f"fit: depth ({depth}) must be 1 for DSpark (its block has B slots), 1..decode ({decode}) "
                          f"for MTP")
    model_cfg = extend_config(cfg, dc.n_blocks)
    with tempfile.TemporaryDirectory() as tmp:
        rand = synthesize_drafter(Path(tmp) / "random.gguf", trunk, kind, layout, seed, quant)
        reference = engine_class("reference")(str(trunk), FIT_OPTIONS, draft=str(rand))
        chosen = ([np.asarray(p, dtype=np.int64) for p in train_prompts] if train_prompts is not None
                  else seeded_prompts(seed, prompts, prompt_len, cfg.vocab_size, 1))
        taps = dc.target_layer_ids if kind == "dspark" else None
        train = [greedy_trajectory(reference, p, decode, taps) for p in chosen]
        held = [greedy_trajectory(reference, p, decode, taps)
                for p in seeded_prompts(seed, heldout, prompt_len, cfg.vocab_size, 2)]
        seconds["trajectories"], t0 = time.perf_counter() - t0, time.perf_counter()
        fitted = _fit_weights(kind, weights, model_cfg, dc, train, steps, seed, depth, log)
        path = synthesize_drafter(out, trunk, kind, layout, seed, quant, weights=fitted)
        seconds["fit"], t0 = time.perf_counter() - t0, time.perf_counter()
        scores = {}
        for name, drafter in (("", path), ("random_", rand)):
            engine = engine_class("reference")(str(trunk), FIT_OPTIONS, draft=str(drafter))
            for which, trajectories in (("fitted", train), ("heldout", held)):
                scores[name + which] = (mtp_agreement(engine, trajectories, depth) if kind == "mtp"
                                        else dspark_agreement(engine, trajectories, dc, cfg.window_size))
    seconds["measure"] = time.perf_counter() - t0
    return FitReport(Path(path), kind, layout, seed, steps, {k: v[0] for k, v in scores.items()},
                     (scores["fitted"][1], scores["heldout"][1]), seconds)


def _check_fit_args(kind: str, layout: str, steps: int, prompts: int, prompt_len: int, decode: int, heldout: int,
                    train_prompts: Sequence[Sequence[int]] | None) -> None:
    """`fit_drafter`'s arguments that need no trunk: a layout of `kind`, positive counts, non-empty prompts."""
    if LAYOUTS.get(layout) != kind:
        raise ParityError(f"fit: {layout!r} is not a {kind} layout; choose from "
                          f"{', '.join(k for k, v in LAYOUTS.items() if v == kind)}")
    if min(steps, prompts, prompt_len, decode, heldout) < 1:
        raise ParityError(f"fit: steps ({steps}), prompts ({prompts}), prompt_len ({prompt_len}), decode ({decode}) "
                          f"and heldout ({heldout}) must all be >= 1")
    if train_prompts is not None and (not train_prompts or min(len(p) for p in train_prompts) < 1):
        raise ParityError("fit: train_prompts must hold at least one prompt, each of at least one token")


def _fit_weights(kind: str, weights: Weights, model_cfg: ModelConfig, dc: DrafterConfig,
                 train: Sequence[Trajectory], steps: int, seed: int, depth: int,
                 log: Callable[[int, float], None] | None) -> dict[str, np.ndarray]:
    """The drafter's tensors fitted by the torch engine's `fit_mtp` / `fit_dspark` on the training trajectories,
    from the seeded random drafter with the trunk's embedding and output head (kept fixed)."""
    cfg = weights.config
    init = {k: a for k, (a, _) in random_drafter_weights(dc, model_cfg, seed).items()}
    init |= {k: weights.tensor(k) for k in TRUNK_TENSORS}
    torch_engine = engine_class("torch")
    if kind == "mtp":
        return torch_engine.fit_mtp(init, model_cfg, cfg.n_layers, [mtp_rows(t) for t in train], steps, seed,
                                    depth=depth, log=log)
    rounds = [r for t in train for r in dspark_rounds(t, dc, cfg.window_size)]
    return torch_engine.fit_dspark(init, model_cfg, cfg.n_layers, dc.n_blocks, rounds, steps, seed, log=log)
