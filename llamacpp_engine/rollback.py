"""Snapshot and restore of a llama.cpp sequence through llama.cpp's own rollback (capability `StateSnapshots`).

Nothing is copied: `snapshot` notes where the sequence stands (`Mark`: next position, chunks fed), and `restore`
takes the rows fed since then back out of llama.cpp's memory with `llama_memory_seq_rm`. llama.cpp's DSV4 cache
(`llama_kv_cache_dsv4`) accepts a removal inside the fed positions only when the context keeps rollback planes
(`n_rs_seq`, engine argument `lcp_rs_seq`) and at most that many positions go: the raw window cells are freed and
the compressor / indexer accumulators come back from the plane of the last kept position; otherwise llama.cpp
refuses and so does `restore`, naming the setting.

As llama.cpp's own speculative loop does, only the rejected rows are removed. The speculative driver restores and
then runs the accepted prefix of the verify chunk again; `restore` therefore waits (`LlamaState.pending`) for that
next chunk: when it is a prefix of the chunk fed after the mark, llama.cpp removes the rows after it and the
prefix's rows are served from the verify run's tensors (what llama.cpp computed for them in the batch); any other
next chunk removes everything fed after the mark first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from parity.contract.errors import ParityError
from parity.gguf.llamacpp import CACHE_ROWS, base_name

if TYPE_CHECKING:
    from llamacpp_engine.engine import Chunk, LlamaState


@dataclass(frozen=True)
class Mark:
    """Where a sequence stood at `snapshot`: its next position and the number of chunks it had fed."""

    pos: int
    chunks: int


def fed(state: LlamaState) -> list[Chunk]:
    """Every chunk the sequence has fed, in order (the current one last)."""
    return [*state.done, *([state.current] if state.current is not None else [])]


def mark(state: LlamaState) -> Mark:
    """The sequence's position now (a pending rollback is carried out first: it has no replay then)."""
    if state.pending is not None:
        settle(state, None, -1)
    return Mark(state.next_pos, len(fed(state)))


def request(state: LlamaState, saved: Mark) -> None:
    """`restore`: roll back to `saved`; with exactly one chunk fed since, wait for its replay (module docstring)."""
    chunks = fed(state)
    if saved.chunks > len(chunks) or (saved.chunks < len(chunks) and chunks[saved.chunks].start != saved.pos):
        raise ParityError(f"llamacpp: this sequence has no snapshot at position {saved.pos} (it was taken from another "
                         "sequence, or restored past already)")
    state.pending = None
    if len(chunks) - saved.chunks == 1:
        state.pending = saved
    elif len(chunks) > saved.chunks:
        cut(state, saved, 0)


def settle(state: LlamaState, tokens: np.ndarray | None, start: int) -> None:
    """Carry out a pending rollback before the chunk (`tokens` at `start`) is fed: keep the verify chunk's rows
    that this chunk repeats when it is a prefix of it, else remove every row fed after the mark."""
    saved, state.pending = state.pending, None
    if saved is None:
        return
    verify = fed(state)[saved.chunks]
    n = 0 if tokens is None else len(tokens)
    prefix = start == saved.pos and 0 < n <= len(verify.tokens) and np.array_equal(verify.tokens[:n], tokens)
    cut(state, saved, n if prefix else 0)


def cut(state: LlamaState, saved: Mark, keep: int) -> None:
    """Remove the rows after the first `keep` of the chunk fed at the mark (`llama_memory_seq_rm` from position
    saved.pos + keep; nothing to remove when all are kept) and drop the chunks after it."""
    chunks = fed(state)
    verify = chunks[saved.chunks] if len(chunks) > saved.chunks else None
    if verify is None:
        return
    if keep < len(verify.tokens) or len(chunks) > saved.chunks + 1:
        state.ctx.truncate(saved.pos + keep)
    kept = chunks[: saved.chunks] + ([sliced(verify, keep)] if keep else [])
    state.done, state.current = kept[:-1], (kept[-1] if kept else None)


def sliced(chunk: Chunk, n: int) -> Chunk:
    """The first n rows of a chunk that has run: per-token tensors and written inputs cut to n rows, the cache views
    kept whole (readers cut them at the chunk's end position)."""
    from llamacpp_engine.engine import Chunk

    if n == len(chunk.tokens):
        return chunk
    tensors = None if chunk.tensors is None else {
        k: v if base_name(k) in CACHE_ROWS else v[:n] for k, v in chunk.tensors.items()}
    return Chunk(chunk.start, chunk.tokens[:n], {k: v[:n] for k, v in chunk.overrides.items()}, tensors)
