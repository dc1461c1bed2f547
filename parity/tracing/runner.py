"""Drive any `Engine` over a token sequence: chunked prefill, then decode one token at a time.

This is the single forward loop of the harness (engines only provide embed / forward_layer / head):
a chunk of n tokens at positions start..start+n-1 runs embed -> every layer through the state's
caches -> head. `run_sequence` feeds the prompt in chunks (`chunk=None`: one batched prefill;
`chunk=1`: pure decode path) and then generates `decode_steps` tokens greedily (or takes them
from `forced`, for teacher-forced trajectories).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from parity.contract.checkpoints import EMBED, FINAL_NORM, block, block_attn
from parity.contract.engine import Engine, LayerDiag
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
                 on_chunk: Callable[[ChunkResult], None] | None = None) -> list[ChunkResult]:
    """Prefill `prompt` (chunked), then `decode_steps` single-token steps.

    Each decode step feeds the argmax of the previous position's logits, or `forced[i]` when given
    (teacher forcing). Returns the chunk results in order (also passed to `on_chunk` as they come,
    e.g. to drive a progress bar or stream records to disk).
    """
    if forced is not None and len(forced) < decode_steps:
        raise TraceError(f"forced has {len(forced)} tokens, {decode_steps} decode steps requested")
    state = engine.new_state()
    results: list[ChunkResult] = []
    pos = 0
    prompt = np.asarray(prompt, dtype=np.int64)
    for n in chunk_schedule(len(prompt), chunk):
        results.append(forward_chunk(engine, state, prompt[pos : pos + n], pos, capture))
        pos += n
        if on_chunk:
            on_chunk(results[-1])
    for i in range(decode_steps):
        nxt = int(forced[i]) if forced is not None else int(np.argmax(results[-1].logits[-1]))
        results.append(forward_chunk(engine, state, np.array([nxt]), pos, capture))
        pos += 1
        if on_chunk:
            on_chunk(results[-1])
    return results


def stack(results: list[ChunkResult], name: str) -> np.ndarray:
    """Concatenate one checkpoint (or 'logits') over all chunks: [T, ...]."""
    if name == "logits":
        return np.concatenate([r.logits for r in results])
    return np.concatenate([r.checkpoints[name] for r in results])


def all_tokens(results: list[ChunkResult]) -> np.ndarray:
    return np.concatenate([r.tokens for r in results])
