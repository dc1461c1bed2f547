"""What llama.cpp's captures show of a sequence's caches after each commit (state parity as far as it goes).

llama.cpp's eval callback sees the compressed-row caches (`csa_comp_k`, `hca_comp_k`, `lid_k`: every row emitted
so far, read by the graph) but neither the raw window cells nor the compressors' pending accumulators, so the
full `StateView` layout cannot be filled. What can be shown, per committed chunk (the prompt, then each round's
accepted prefix of its verify batch), is every compressed row emitted up to the chunk's end, in the `StateView`
names: `blk.l.comp.rows` [⌊T/m⌋, head_dim] and `blk.l.index.rows` [⌊T/4⌋, index_head_dim] (de-rotated, as
`parity.gguf.llamacpp.layer_output` does). Rows emitted inside a chunk come from the compressor state that the
previous commit left, restored or not by llama.cpp's rollback planes, so a bad rollback shows as a row that differs
from sequential decode's at the next block boundary.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from llamacpp_engine.rollback import fed
from parity.contract.errors import ParityError
from parity.gguf.config import ModelConfig
from parity.gguf.llamacpp import layer_output

if TYPE_CHECKING:
    from llamacpp_engine.engine import Chunk, LlamaState


def committed_rows(state: LlamaState, cfg: ModelConfig) -> list[tuple[int, dict[str, np.ndarray]]]:
    """(T, rows) per committed chunk, T = its end position: the compressed rows emitted at positions < T, by
    `StateView` name, for every compressed layer (the ratio-0 layers have none)."""
    return [chunk_rows(chunk, cfg) for chunk in settled_chunks(state)]


def last_committed_rows(state: LlamaState, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """The rows of `committed_rows`'s last entry (the state after the latest commit), computed alone."""
    chunks = settled_chunks(state)
    if not chunks:
        raise ParityError("llamacpp: the sequence has fed nothing; it has no committed caches")
    return chunk_rows(chunks[-1], cfg)[1]


def settled_chunks(state: LlamaState) -> list[Chunk]:
    """The chunks fed, refused while a rollback waits for its replay."""
    if state.pending is not None:
        raise ParityError("llamacpp: a rollback is pending (restore without the replay that settles it); the "
                          "committed caches are not defined yet")
    return fed(state)


def chunk_rows(chunk: Chunk, cfg: ModelConfig) -> tuple[int, dict[str, np.ndarray]]:
    """(T, rows) of one committed chunk (see `committed_rows`)."""
    if chunk.tensors is None:
        raise ParityError(f"llamacpp: the chunk at position {chunk.start} has not run")
    positions = chunk.start + np.arange(len(chunk.tokens))
    rows: dict[str, np.ndarray] = {}
    for l in range(cfg.n_layers):
        if cfg.ratio(l):
            caps = layer_output(chunk.tensors, cfg, l, positions, capture=True).captures
            rows[f"blk.{l}.comp.rows"] = caps["comp_rows"]
            if cfg.has_indexer(l):
                rows[f"blk.{l}.index.rows"] = caps["index_rows"]
    return int(positions[-1]) + 1, rows
