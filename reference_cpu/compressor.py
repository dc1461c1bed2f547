"""KV compressors: HCA (ratio m, no overlap) and CSA (ratio 4, overlapping A/B halves) (spec attention §7).

Each token gives κ_t = W_kv x_t and σ_t = W_gate x_t + ape[t mod m]; a block's row is the per-channel
softmax(σ)-weighted sum of κ over its slots. Row j is emitted when token (j+1)·m - 1 is processed;
`compressor_update` emits every block a chunk completes, so any chunking gives the same rows.
"""

from __future__ import annotations

import numpy as np

from reference_cpu.linear import Weight, linear
from reference_cpu.norms import rms_norm
from reference_cpu.quant_sim import fp4_e2m1_roundtrip, fp8_sim_nope, hadamard
from reference_cpu.rope import RopeTable, apply_rope
from reference_cpu.state import CompressorState


def compressor_project(x: np.ndarray, w_kv: Weight, w_gate: Weight, ape: np.ndarray,
                       pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """κ_t = W_kv x_t, σ_t = W_gate x_t + ape[t mod m]; ape biases the gate only (§7.1).

    x [n, D], w_kv / w_gate [c·d_c, D], ape [m, c·d_c], pos [n] -> κ [n, c·d_c], σ [n, c·d_c].
    """
    return linear(x, w_kv), linear(x, w_gate) + ape[pos % ape.shape[0]]


def softmax_pool(kv: np.ndarray, score: np.ndarray) -> np.ndarray:
    """c̃[e] = Σ_s softmax_s(σ[s, e]) · κ[s, e] per channel over the slot axis (§7.2); σ = -∞ slots weigh 0.

    kv, score [nb, slots, d_c] -> [nb, d_c].
    """
    w = np.exp(score - score.max(axis=1, keepdims=True))
    w = w / w.sum(axis=1, keepdims=True)
    return (w * kv).sum(axis=1)


def hca_pool(kv: np.ndarray, score: np.ndarray) -> np.ndarray:
    """HCA row j = softmax-gated pool over the m tokens of block j (§7.2).

    kv, score [nb, m, d_c] -> [nb, d_c].
    """
    return softmax_pool(kv, score)


def csa_pool(kv: np.ndarray, score: np.ndarray, prev_kv: np.ndarray, prev_score: np.ndarray) -> np.ndarray:
    """CSA row j pools 2m slots per channel: A halves [0, d_c) of block j-1 and B halves [d_c, 2d_c) of block j (§7.3).

    kv, score [nb, m, 2d_c] (blocks j0..j0+nb-1), prev_* [m, 2d_c] (block j0-1, or κ=0/σ=-∞ before row 0)
    -> [nb, d_c].
    """
    d_c = kv.shape[-1] // 2
    before_kv = np.concatenate([prev_kv[None], kv[:-1]])
    before_score = np.concatenate([prev_score[None], score[:-1]])
    slots_kv = np.concatenate([before_kv[..., :d_c], kv[..., d_c:]], axis=1)
    slots_score = np.concatenate([before_score[..., :d_c], score[..., d_c:]], axis=1)
    return softmax_pool(slots_kv, slots_score)


def compressor_update(state: CompressorState, kv: np.ndarray, score: np.ndarray) -> tuple[np.ndarray, int]:
    """Feed n consecutive tokens' (κ, σ); pool every block they complete and keep the remainder pending (§7.4, §7.6).

    kv, score [n, c·d_c] -> (pooled rows [nb, d_c] before post-processing, index j of the first new row).
    Mutates `state`'s pending / previous-block buffers; the caller post-processes and appends the rows.
    """
    m = state.ratio
    all_kv = np.concatenate([state.pend_kv, kv])
    all_score = np.concatenate([state.pend_score, score])
    nb = len(all_kv) // m
    first = len(state.rows)
    state.pend_kv, state.pend_score = all_kv[nb * m :], all_score[nb * m :]
    if nb == 0:
        return np.zeros((0, state.d_c), kv.dtype), first
    blk_kv = all_kv[: nb * m].reshape(nb, m, -1)
    blk_score = all_score[: nb * m].reshape(nb, m, -1)
    if not state.overlap:
        return hca_pool(blk_kv, blk_score), first
    rows = csa_pool(blk_kv, blk_score, state.prev_kv, state.prev_score)
    state.prev_kv, state.prev_score = blk_kv[-1], blk_score[-1]
    return rows, first


def main_row_post(rows: np.ndarray, pos: np.ndarray, norm: np.ndarray, eps: float, rope: RopeTable,
                  fp8: bool, nope_dim: int) -> np.ndarray:
    """c_j = FP8SIM_nope(RoPE(RMSNorm_{compressor_norm}(c̃_j), j·m)): same format as a raw KV row (§7.5).

    rows [nb, hd], pos [nb] = j·m -> [nb, hd].
    """
    out = apply_rope(rms_norm(rows, norm, eps), pos, rope)
    return fp8_sim_nope(out, nope_dim) if fp8 else out


def index_row_post(rows: np.ndarray, pos: np.ndarray, norm: np.ndarray, eps: float, rope: RopeTable,
                   fp4: bool) -> np.ndarray:
    """kI_j = FP4SIM(Had(RoPE(RMSNorm_{indexer_compressor_norm}(c̃_j), 4j))); Had+FP4 only with the simulation on (§7.5).

    rows [nb, d_I], pos [nb] = j·4 -> [nb, d_I].
    """
    out = apply_rope(rms_norm(rows, norm, eps), pos, rope)
    return fp4_e2m1_roundtrip(hadamard(out)) if fp4 else out
