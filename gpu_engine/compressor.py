"""KV compressors in torch (spec attention §7): HCA (ratio m, no overlap) and CSA (ratio 4, overlapping halves).

A compressor keeps the per-token (κ, σ) it still needs and pools every block a call completes in one batched
softmax per channel. `compressor_update` takes the blocks to pool (`completed_blocks`) and how a block's slots are
gathered (`hca_slots` / `csa_slots`) as inputs: the faults that change either are alternative ops of the same
signature (`completed_blocks_multi_token`, `csa_slots_halves_swapped`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from gpu_engine.linear import Matrix, linear


def compressor_project(x: torch.Tensor, w_kv: Matrix, w_gate: Matrix, ape: torch.Tensor,
                       pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """κ_t = W_kv x_t, σ_t = W_gate x_t + ape[t mod m]; ape biases the gate only.
    x [n, D], w_kv / w_gate [c·d_c, D], ape [m, c·d_c], pos [n] -> κ [n, c·d_c], σ [n, c·d_c]."""
    return linear(x, w_kv), linear(x, w_gate) + ape[pos % ape.shape[0]]


@dataclass
class CompressorCache:
    """Streaming state of one compressor: pending per-token (κ, σ) from `start` on, and all emitted rows."""

    start: int
    kv: torch.Tensor          # [pending, c*d_c]
    score: torch.Tensor       # [pending, c*d_c] (gate + ape)
    rows: torch.Tensor        # [emitted, d_c] after post-processing


def new_compressor_cache(width: int, d_c: int, device: torch.device, dtype: torch.dtype) -> CompressorCache:
    """An empty compressor: no pending tokens, no rows.  width = c*d_c (c = 2 with overlap)."""
    return CompressorCache(0, torch.zeros(0, width, device=device, dtype=dtype),
                           torch.zeros(0, width, device=device, dtype=dtype),
                           torch.zeros(0, d_c, device=device, dtype=dtype))


def completed_blocks(start_pos: int, n: int, m: int, device: torch.device) -> torch.Tensor:
    """Ids j of the blocks that the n tokens from start_pos complete ((j+1)·m - 1 among them).  -> int [nb]"""
    return torch.arange(start_pos // m, (start_pos + n) // m, device=device)


def completed_blocks_multi_token(start_pos: int, n: int, m: int, device: torch.device) -> torch.Tensor:
    """The no-decode-compression fault: `completed_blocks`, but a 1-token call completes none (its block is lost)."""
    j = completed_blocks(start_pos, n, m, device)
    return j[:0] if n == 1 else j


SlotsOp = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int],
                   tuple[torch.Tensor, torch.Tensor]]


def hca_slots(seq_kv: torch.Tensor, seq_sc: torch.Tensor, slots: torch.Tensor, j: torch.Tensor,
              d_c: int) -> tuple[torch.Tensor, torch.Tensor]:
    """HCA: block j's slots are its m tokens.  seq_* [T, d_c], slots int [nb, m] -> κ, σ [nb, m, d_c]."""
    return seq_kv[slots], seq_sc[slots]


def _csa_slots(seq_kv: torch.Tensor, seq_sc: torch.Tensor, slots: torch.Tensor, j: torch.Tensor, a_half: slice,
               b_half: slice) -> tuple[torch.Tensor, torch.Tensor]:
    prev = (slots - slots.shape[1]).clamp(min=0)
    has_prev = (j > 0)[:, None, None]
    k = torch.cat([torch.where(has_prev, seq_kv[prev][..., a_half], 0.0), seq_kv[slots][..., b_half]], dim=1)
    s = torch.cat([torch.where(has_prev, seq_sc[prev][..., a_half], -math.inf), seq_sc[slots][..., b_half]], dim=1)
    return k, s


def csa_slots(seq_kv: torch.Tensor, seq_sc: torch.Tensor, slots: torch.Tensor, j: torch.Tensor,
              d_c: int) -> tuple[torch.Tensor, torch.Tensor]:
    """CSA: block j pools 2m slots, the A halves [0, d_c) of block j-1 (κ=0, σ=-inf for j = 0) and the B halves
    [d_c, 2d_c) of block j (§7.3).  seq_* [T, 2d_c], slots int [nb, m] -> κ, σ [nb, 2m, d_c]."""
    return _csa_slots(seq_kv, seq_sc, slots, j, slice(0, d_c), slice(d_c, None))


def csa_slots_halves_swapped(seq_kv: torch.Tensor, seq_sc: torch.Tensor, slots: torch.Tensor, j: torch.Tensor,
                             d_c: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The csa-halves-swapped fault: `csa_slots` with the A (overlap) and B (current) halves exchanged."""
    return _csa_slots(seq_kv, seq_sc, slots, j, slice(d_c, None), slice(0, d_c))


def softmax_pool(kv: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
    """c̃[e] = Σ_s softmax_s(σ[s, e]) · κ[s, e] per channel over the slot axis (§7.2).  [nb, S, d_c] -> [nb, d_c]"""
    return (torch.softmax(score, dim=1) * kv).sum(dim=1)


PoolOp = Callable[[torch.Tensor, torch.Tensor, int, int], torch.Tensor]


def pool_blocks(kv: torch.Tensor, score: torch.Tensor, start_pos: int, n: int) -> torch.Tensor:
    """The rows of the blocks a call of n tokens from start_pos completes: `softmax_pool` whatever the call.
    κ, σ [nb, S, d_c] -> [nb, d_c]."""
    return softmax_pool(kv, score)


def pool_blocks_verify_frontier(kv: torch.Tensor, score: torch.Tensor, start_pos: int, n: int) -> torch.Tensor:
    """The spec-commit-verify-frontier fault (spec v4-mtp-dspark §4.4, D3): a multi-token call after the prompt (a
    verify batch, or the replay of >= 2 accepted rows) pools the blocks it completes in its own batched path, here
    rounded to bfloat16, and that frontier is what the engine keeps, not the one sequential decode reaches."""
    rows = softmax_pool(kv, score)
    return rows.to(torch.bfloat16).to(rows.dtype) if n > 1 and start_pos > 0 else rows


def compressor_update(cache: CompressorCache, kv: torch.Tensor, score: torch.Tensor, start_pos: int, m: int,
                      j: torch.Tensor, slots_of: SlotsOp, pool: PoolOp = pool_blocks) -> torch.Tensor:
    """Append n tokens' (κ, σ), pool blocks j (`completed_blocks`) with their slots from `slots_of` by `pool`, keep
    what a later block still needs (CSA: the last complete block for its A halves).  kv, score [n, c*d_c] -> rows
    [nb, d_c] before post-processing.  Mutates `cache` (pending tokens); the caller appends the post-processed
    rows."""
    d_c = cache.rows.shape[1]
    end = start_pos + kv.shape[0]
    seq_kv, seq_sc = torch.cat([cache.kv, kv]), torch.cat([cache.score, score])
    slots = j[:, None] * m + torch.arange(m, device=kv.device)[None, :] - cache.start        # [nb, m]
    rows = pool(*slots_of(seq_kv, seq_sc, slots, j, d_c), start_pos, kv.shape[0])
    overlap = kv.shape[1] == 2 * d_c
    keep_from = max(0, m * (end // m - (1 if overlap else 0)))
    cache.kv, cache.score = seq_kv[keep_from - cache.start :], seq_sc[keep_from - cache.start :]
    cache.start = keep_from
    return rows


def compressor_arrays(name: str, cache: CompressorCache, m: int, T: int) -> dict[str, torch.Tensor]:
    """One compressor after T tokens in the common state layout (the `StateView` capability): rows, the (κ, σ) of
    the incomplete block's T mod m tokens, and with overlap once a block completed the last complete block's."""
    p, n = T % m, cache.kv.shape[0]
    out = {f"{name}.rows": cache.rows, f"{name}.pending_kv": cache.kv[n - p :], f"{name}.pending_score":
           cache.score[n - p :]}
    if cache.kv.shape[1] == 2 * cache.rows.shape[1] and m <= T:
        out |= {f"{name}.previous_kv": cache.kv[n - p - m : n - p],
                f"{name}.previous_score": cache.score[n - p - m : n - p]}
    return out
