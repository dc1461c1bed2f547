"""Drive any `Engine` over a token sequence: chunked prefill, then decode one token at a time.

This is the single forward loop of the harness (engines only provide embed / forward_layer / head):
a chunk of n tokens at positions start..start+n-1 runs embed -> every layer through the state's
caches -> head. `run_sequence` feeds the prompt in chunks (`chunk=None`: one batched prefill;
`chunk=1`: pure decode path) and then generates `decode_steps` tokens greedily (or takes them
from `forced`, for teacher-forced trajectories).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from parity.contract.checkpoints import EMBED, FINAL_NORM, block, block_attn
from parity.contract.engine import Engine, LayerDiag, LayerOutput, LayerwiseState
from parity.contract.errors import TraceError


@dataclass
class ChunkResult:
    """Everything one chunk produced. Carrier arrays [n, H, D]; final_norm [n, D]; logits [n, V]."""

    start_pos: int
    tokens: np.ndarray
    checkpoints: dict[str, np.ndarray]          # embed, blk.l.attn, blk.l, final_norm
    logits: np.ndarray
    diags: list[LayerDiag]                      # one per layer
    captures: list[dict[str, np.ndarray]] = field(default_factory=list)  # one per layer when captured


def forward_chunk(engine: Engine, state: object, tokens: np.ndarray, start_pos: int,
                  capture: bool = False) -> ChunkResult:
    """One chunk through every layer (n = len(tokens) new positions)."""
    tokens = np.asarray(tokens, dtype=np.int64)
    carrier = engine.embed(tokens)
    ckpts = {EMBED: carrier}
    diags, captures = [], []
    for l in range(engine.config.n_layers):
        out = engine.forward_layer(state, l, carrier, tokens, start_pos, capture=capture)
        ckpts[block_attn(l)] = out.attn_carrier
        ckpts[block(l)] = out.carrier
        diags.append(out.diag)
        captures.append(out.captures)
        carrier = out.carrier
    final, logits = engine.head(carrier)
    ckpts[FINAL_NORM] = final
    return ChunkResult(start_pos, tokens, ckpts, logits, diags, captures if capture else [])


def chunk_schedule(n_prompt: int, chunk: int | None) -> list[int]:
    """Chunk sizes that cover the prompt: [n] for one prefill, else pieces of `chunk`."""
    if n_prompt < 1:
        raise TraceError("the prompt needs at least one token")
    if chunk is None:
        return [n_prompt]
    if chunk < 1:
        raise TraceError(f"chunk must be >= 1, got {chunk}")
    return [min(chunk, n_prompt - s) for s in range(0, n_prompt, chunk)]


def run_sequence(engine: Engine, prompt: Sequence[int], decode_steps: int = 0, chunk: int | None = None,
                 forced: Sequence[int] | None = None, capture: bool = False,
                 on_chunk: Callable[[ChunkResult], None] | None = None, keep: bool = True) -> list[ChunkResult]:
    """Prefill `prompt` (chunked), then `decode_steps` single-token steps.

    Each decode step feeds the argmax of the previous position's logits, or `forced[i]` when given
    (teacher forcing). Returns the chunk results in order (also passed to `on_chunk` as they come,
    e.g. to drive a progress bar or stream records to disk). keep=False: once `on_chunk` has seen a
    result, only its start, tokens and last logits row are kept (a caller that records as it goes
    need not hold every chunk's checkpoints: 88 of them at 2000 positions of V4-Flash are 11.5 GiB).
    """
    if forced is not None and len(forced) < decode_steps:
        raise TraceError(f"forced has {len(forced)} tokens, {decode_steps} decode steps requested")
    state = engine.new_state()
    results: list[ChunkResult] = []
    pos = 0
    prompt = np.asarray(prompt, dtype=np.int64)
    def done(r: ChunkResult) -> None:
        if on_chunk:
            on_chunk(r)
        results.append(r if keep else replace(r, checkpoints={}, logits=np.array(r.logits[-1:]), diags=[], captures=[]))

    for n in chunk_schedule(len(prompt), chunk):
        done(forward_chunk(engine, state, prompt[pos : pos + n], pos, capture))
        pos += n
    for i in range(decode_steps):
        nxt = int(forced[i]) if forced is not None else int(np.argmax(results[-1].logits[-1]))
        done(forward_chunk(engine, state, np.array([nxt]), pos, capture))
        pos += 1
    return results


def run_lockstep(runs: Sequence[tuple[Engine, Sequence[int]]], tokens: Sequence[int], capture: bool,
                 on_layer: Callable[[int, list[list[LayerOutput]]], None]) -> list[list[ChunkResult]]:
    """Several runs of known `tokens` (each its engine and chunk sizes covering them), layer after layer: every
    run's layer l over all its chunks before any run's layer l + 1, so engines that share a weight cache which
    holds one layer (round-off twins, variants) dequantize each layer once instead of once per run and chunk.
    Each run's outputs equal `run_sequence` with the same chunks and forced tokens: an engine without
    `LayerwiseState` (caches per sequence) runs chunk by chunk first and hands its layers over from memory.
    `on_layer(l, outs)` gets layer l's outputs, outs[run][chunk], and may drop them. Returns per run its chunks
    holding the embed and final_norm checkpoints and the logits (no per-layer data)."""
    tokens = np.asarray(tokens, dtype=np.int64)
    plans, whole = [], {}
    for r, (engine, sizes) in enumerate(runs):
        if not sizes or sum(sizes) != len(tokens) or min(sizes) < 1:
            raise TraceError(f"chunk sizes {list(sizes)} do not cover the {len(tokens)} tokens")
        starts = np.cumsum([0, *sizes[:-1]])
        chunks = [(int(s), tokens[s : s + n]) for s, n in zip(starts, sizes, strict=True)]
        plans.append((engine, engine.new_state(), chunks))
        if not isinstance(engine, LayerwiseState):
            state = plans[-1][1]
            whole[r] = [forward_chunk(engine, state, t, s, capture) for s, t in chunks]
    embeds = [[engine.embed(t) for _, t in chunks] for engine, _, chunks in plans]
    carriers = [list(e) for e in embeds]
    for l in range(plans[0][0].config.n_layers):
        outs = [layer_outputs(whole[r], l) if r in whole else
                [engine.forward_layer(state, l, carriers[r][i], t, s, capture=capture)
                 for i, (s, t) in enumerate(chunks)] for r, (engine, state, chunks) in enumerate(plans)]
        carriers = [[o.carrier for o in run] for run in outs]
        on_layer(l, outs)
    results = []
    for r, (engine, _, chunks) in enumerate(plans):
        heads = ([(c.checkpoints[FINAL_NORM], c.logits) for c in whole[r]] if r in whole else
                 [engine.head(c) for c in carriers[r]])
        results.append([ChunkResult(s, t, {EMBED: e, FINAL_NORM: f}, logits, [])
                        for (s, t), e, (f, logits) in zip(chunks, embeds[r], heads, strict=True)])
    return results


def layer_outputs(results: Sequence[ChunkResult], layer: int) -> list[LayerOutput]:
    """One layer's outputs per chunk, as `Engine.forward_layer` returned them, from whole-model chunk results."""
    return [LayerOutput(r.checkpoints[block_attn(layer)], r.checkpoints[block(layer)], r.diags[layer],
                        r.captures[layer] if r.captures else {}) for r in results]


def stack(results: list[ChunkResult], name: str) -> np.ndarray:
    """Concatenate one checkpoint (or 'logits') over all chunks: [T, ...]."""
    if name == "logits":
        return np.concatenate([r.logits for r in results])
    return np.concatenate([r.checkpoints[name] for r in results])


def all_tokens(results: list[ChunkResult]) -> np.ndarray:
    return np.concatenate([r.tokens for r in results])
