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
