"""Lightning indexer of CSA layers in torch (spec attention §8): which compressed rows each query attends to.

score_t(j) = Σ_h ω_th · ReLU(qI_th · kI_j) over the visible rows j < n_vis(t); the top-k (lowest index wins ties)
is shared by all heads, every visible row when at most k are visible. Selections are int tables [n, top_k] of
row ids ascending, -1 padded, as in `reference_cpu.indexer.select_rows`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from gpu_engine.linear import Matrix, linear

SelectOp = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]


def indexer_weights(x: torch.Tensor, w_proj: Matrix, head_dim: int) -> torch.Tensor:
    """ω = (W_Iw x) / √(d_I · n_heads), signed (never ReLU'd).  x [n, D], w_proj [n_heads, D] -> [n, n_heads]."""
    proj = linear(x, w_proj)
    return proj / math.sqrt(head_dim * proj.shape[1])


def indexer_queries(qr: torch.Tensor, wq_b: Matrix, pos: torch.Tensor, freqs: torch.Tensor, n_heads: int,
                    rope: Callable[..., torch.Tensor], index_round: Callable[[torch.Tensor], torch.Tensor]
                    ) -> torch.Tensor:
    """qI_h = round(RoPE((W_Iqb qr)_h, t)), no per-head norm; `index_round` is FP4SIM(Had(·)) with the simulation on
    (the identity off), `rope` the RoPE op (both `Ops` slots).  qr [n, R_q], wq_b [n_heads·d_I, R_q], pos [n]
    -> [n, n_heads, d_I]."""
    q = linear(qr, wq_b).reshape(qr.shape[0], n_heads, -1)
    return index_round(rope(q, pos, freqs))


def indexer_scores(q: torch.Tensor, w: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """score(t, j) = Σ_h ω_th · ReLU(q_th · kI_j).  q [n, n_heads, d_I], w [n, n_heads], rows [R, d_I] -> [n, R]."""
    return torch.einsum("nh,nhr->nr", w, torch.relu(torch.einsum("nhd,rd->nhr", q, rows)))


def _id_table(chosen: torch.Tensor, top_k: int) -> torch.Tensor:
    """bool [n, R] -> the chosen row ids ascending, -1 padded to top_k: int [n, top_k]."""
    n, R = chosen.shape
    j = torch.arange(R, device=chosen.device).expand_as(chosen)
    ids = torch.sort(torch.where(chosen, j, R + j), dim=1).values[:, :top_k]
    ids = torch.where(ids < R, ids, -1)
    if ids.shape[1] < top_k:
        ids = torch.cat([ids, torch.full((n, top_k - ids.shape[1]), -1, device=chosen.device, dtype=ids.dtype)],
                        dim=1)
    return ids


def _select(scores: torch.Tensor, n_vis: torch.Tensor, top_k: int, ties_highest: bool) -> torch.Tensor:
    n, R = scores.shape
    valid = torch.arange(R, device=scores.device)[None, :] < n_vis[:, None]
    keyed = torch.where(valid, scores, -math.inf)
    if ties_highest:
        keyed = keyed.flip(-1)
    order = torch.sort(keyed, dim=-1, descending=True, stable=True).indices[:, :top_k]
    if ties_highest:
        order = R - 1 - order
    chosen = torch.zeros(n, R, dtype=torch.bool, device=scores.device)
    chosen.scatter_(1, order, True)
    return _id_table(chosen & valid, top_k)


def select_rows(scores: torch.Tensor, n_vis: torch.Tensor, top_k: int) -> torch.Tensor:
    """Sel_t = all j < n_vis(t) if n_vis(t) <= K, else the K best scores among them (ties: lowest j).
    scores [n, R], n_vis int [n] -> int [n, top_k] row ids ascending, -1 padded."""
    return _select(scores, n_vis, top_k, False)


def select_rows_ties_highest(scores: torch.Tensor, n_vis: torch.Tensor, top_k: int) -> torch.Tensor:
    """The indexer-ties-highest fault: `select_rows` breaking ties at the cut towards the highest row id."""
    return _select(scores, n_vis, top_k, True)


def select_chunked(q: torch.Tensor, w: torch.Tensor, rows: torch.Tensor, n_vis: torch.Tensor, top_k: int,
                   select: SelectOp, budget: int) -> torch.Tensor:
    """`select` over `indexer_scores`, one query chunk at a time (at most `budget` head x row scores per chunk).
    q [n, n_heads, d_I], w [n, n_heads], rows [R, d_I], n_vis int [n] -> int [n, top_k]."""
    n, hi = w.shape
    table = torch.empty(n, top_k, dtype=torch.int64, device=q.device)
    step = max(1, budget // max(hi * rows.shape[0], 1))
    for a in range(0, n, step):
        b = min(n, a + step)
        table[a:b] = select(indexer_scores(q[a:b], w[a:b], rows), n_vis[a:b], top_k)
    return table
