"""Per-sequence caches of every layer, as explicit dataclasses (spec attention §7.6, §12).

The caller owns the state; ops receive and return arrays. A fresh state is empty: no raw rows, no
compressed rows, CSA "previous block" slots at κ = 0, σ = -∞ (so row 0 pools only its own block).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from parity.gguf.config import ModelConfig


@dataclass
class CompressorState:
    """Streaming state of one compressor (HCA main, CSA main, or CSA indexer).

    pend_kv / pend_score [p, c·d_c]: κ and σ (σ already + ape) of the p < m tokens of the incomplete block.
    prev_kv / prev_score [m, c·d_c]: the last completed block (overlap only; read for its A halves).
    rows [N, d_c]: every emitted row after post-processing (norm, RoPE at j·m, quantization sim), N = ⌊T/m⌋.
    """

    ratio: int
    overlap: bool
    d_c: int
    pend_kv: np.ndarray
    pend_score: np.ndarray
    prev_kv: np.ndarray | None
    prev_score: np.ndarray | None
    rows: np.ndarray

    @classmethod
    def empty(cls, ratio: int, d_c: int, dtype: np.dtype) -> CompressorState:
        overlap = ratio == 4
        width = (2 if overlap else 1) * d_c
        prev_kv = np.zeros((ratio, width), dtype) if overlap else None
        prev_score = np.full((ratio, width), -np.inf, dtype) if overlap else None
        return cls(ratio, overlap, d_c, np.zeros((0, width), dtype), np.zeros((0, width), dtype),
                   prev_kv, prev_score, np.zeros((0, d_c), dtype))


@dataclass
class LayerState:
    """Caches of one layer: the last window-1 raw KV rows, and the compressors of compressed layers.

    raw [r, hd] holds positions next_pos - r .. next_pos - 1 (r ≤ window - 1: with the current token
    that makes exactly `window` raw keys).
    """

    next_pos: int
    raw: np.ndarray
    comp: CompressorState | None = None
    index: CompressorState | None = None


@dataclass
class SequenceState:
    """Every layer's caches for one sequence."""

    layers: list[LayerState] = field(default_factory=list)

    @classmethod
    def empty(cls, cfg: ModelConfig, dtype: np.dtype) -> SequenceState:
        layers = []
        for l in range(cfg.n_layers):
            m = cfg.ratio(l)
            layers.append(LayerState(
                next_pos=0,
                raw=np.zeros((0, cfg.head_dim), dtype),
                comp=CompressorState.empty(m, cfg.head_dim, dtype) if m > 0 else None,
                index=CompressorState.empty(m, cfg.index_head_dim, dtype) if cfg.has_indexer(l) else None,
            ))
        return cls(layers)


def compressor_arrays(name: str, c: CompressorState) -> dict[str, np.ndarray]:
    """One compressor in the common state layout (`StateView`): rows, the incomplete block's (κ, σ), and with
    overlap once a block completed the last complete block's."""
    out = {f"{name}.rows": c.rows, f"{name}.pending_kv": c.pend_kv, f"{name}.pending_score": c.pend_score}
    if c.overlap and len(c.rows):
        out |= {f"{name}.previous_kv": c.prev_kv, f"{name}.previous_score": c.prev_score}
    return out


def state_arrays(state: SequenceState) -> dict[str, np.ndarray]:
    """Every layer that has run, in the common state layout of the `StateView` capability (blk.l.raw, blk.l.comp.*,
    blk.l.index.*)."""
    out: dict[str, np.ndarray] = {}
    for l, layer in enumerate(state.layers):
        if layer.next_pos == 0:
            continue
        out[f"blk.{l}.raw"] = layer.raw
        for name, c in (("comp", layer.comp), ("index", layer.index)):
            if c is not None:
                out |= compressor_arrays(f"blk.{l}.{name}", c)
    return out
