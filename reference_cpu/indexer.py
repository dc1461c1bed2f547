"""Lightning indexer of CSA layers: which compressed rows each query attends to (spec attention §8).

score_t(j) = Σ_h ω_h · ReLU(qI_h · kI_j) over visible rows j < ⌊(t+1)/m⌋; the top-k (lowest index wins
ties) is shared by all heads. With at most k visible rows every visible row is selected.
"""

from __future__ import annotations

import math

import numpy as np

from reference_cpu.linear import Weight, linear
from reference_cpu.quant_sim import fp4_e2m1_roundtrip, hadamard
from reference_cpu.rope import RopeTable, apply_rope
from reference_cpu.roundoff import uniform_hash
from reference_cpu.threads import Workers


def indexer_queries(qr: np.ndarray, wq_b: Weight, pos: np.ndarray, rope: RopeTable, n_heads: int,
                    fp4: bool) -> np.ndarray:
    """qI_h = FP4SIM(Had(RoPE((W_Iqb qr)_h, t))), no per-head norm; Had+FP4 only with the simulation on (§8.2).

    qr [n, q_lora_rank], wq_b [n_heads·d_I, q_lora_rank], pos [n] -> [n, n_heads, d_I].
    """
    q = linear(qr, wq_b).reshape(qr.shape[0], n_heads, -1)
    q = apply_rope(q, pos, rope)
    return fp4_e2m1_roundtrip(hadamard(q)) if fp4 else q


def indexer_weights(x: np.ndarray, w_proj: Weight, head_dim: int) -> np.ndarray:
    """ω = (W_Iw x) / √(d_I · n_heads): signed head weights, never ReLU'd (§8.2).

    x [n, D], w_proj [n_heads, D], head_dim d_I -> [n, n_heads].
    """
    w = linear(x, w_proj)
    return w * (1.0 / math.sqrt(head_dim * w.shape[-1]))


def indexer_scores(q: np.ndarray, w: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """score(j) = Σ_h ω_h · ReLU(q_h · kI_j): ReLU per head before the weighted sum (§8.3).

    q [n_heads, d_I], w [n_heads] (already scaled), rows [N, d_I] -> [N].
    """
    return w @ np.maximum(q @ rows.T, 0)


def topk_lowest_index(scores: np.ndarray, k: int, tie_key: np.ndarray | None = None) -> np.ndarray:
    """Indices of the k largest scores, equal scores ordered by lowest index first (or by `tie_key`, a round-off
    twin's random order of exact ties), returned ascending.

    scores [N], tie_key [N] or None -> int [min(k, N)].
    """
    order = np.argsort(-scores, kind="stable") if tie_key is None else np.lexsort((tie_key, -scores))
    return np.sort(order[:k])


def select_one(q: np.ndarray, w: np.ndarray, rows: np.ndarray, t: int, ratio: int, topk: int,
               tie_seed: int | None = None) -> np.ndarray:
    """Sel_t = all j < n_t if n_t ≤ k else top-k of score_t over j < n_t, n_t = ⌊(t+1)/m⌋ (§8.3, §9); exact
    ties by lowest index, or in a seeded random order (`tie_seed`: a round-off twin, for which the order of
    exactly equal scores is as implementation-defined as for any other engine).

    q [n_heads, d_I], w [n_heads] scaled, rows [N, d_I] -> int [topk] ascending, -1 padded.
    """
    sel = np.full(topk, -1, dtype=np.int64)
    n_t = (t + 1) // ratio
    if n_t <= topk:
        sel[:n_t] = np.arange(n_t)
    else:
        key = None if tie_seed is None else uniform_hash(np.arange(n_t, dtype=np.uint32), tie_seed, t)
        sel[:] = topk_lowest_index(indexer_scores(q, w, rows[:n_t]), topk, key)
    return sel


def select_rows(q: np.ndarray, w: np.ndarray, rows: np.ndarray, pos: np.ndarray, ratio: int,
                topk: int, workers: Workers, tie_seed: int | None = None) -> np.ndarray:
    """`select_one` for every query (independent queries, split over `workers`).

    q [n, n_heads, d_I], w [n, n_heads] scaled, rows [N, d_I], pos [n] -> int [n, topk] ascending, -1 padded.
    """
    def queries(idx: range) -> np.ndarray:
        return np.stack([select_one(q[i], w[i], rows, int(pos[i]), ratio, topk, tie_seed) for i in idx])

    return np.concatenate(workers.map(queries, workers.split(len(pos))))
