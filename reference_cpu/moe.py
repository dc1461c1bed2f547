"""MoE FFN: sqrt-softplus router, biased top-k or hash selection, clamped SwiGLU experts, shared expert (spec §9).

The selection bias only chooses experts; the weights come from the unbiased scores of the chosen ids,
renormalised and multiplied by route_scale.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from reference_cpu.hc import sigmoid
from reference_cpu.linear import Matrix, MinTerm, Weight, linear
from reference_cpu.threads import Workers


def softplus(z: np.ndarray) -> np.ndarray:
    """softplus(z) = log(1 + e^z), identity above 20 as in torch (§9.1).

    z [...] -> [...].
    """
    return np.where(z > 20, z, np.log1p(np.exp(np.minimum(z, 20))))


def router_scores(x: np.ndarray, gate: Weight) -> np.ndarray:
    """s_e = sqrt(softplus(G x)_e) > 0 (§9.1).

    x [n, D], gate [E, D] -> [n, E].
    """
    return np.sqrt(softplus(linear(x, gate)))


def select_topk(keys: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """ids = the k largest selection keys in descending order (lowest index wins ties); margin = key_(k) - key_(k+1).

    keys [n, E] (scores + bias) -> ids int [n, k], margin [n] (nan when k = E).
    """
    order = np.argsort(-keys, axis=-1, kind="stable")
    ranked = np.take_along_axis(keys, order, axis=-1)
    margin = ranked[:, k - 1] - ranked[:, k] if keys.shape[1] > k else np.full(len(keys), np.nan, keys.dtype)
    return order[:, :k], margin


def hash_select(tid2eid: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """ids = tid2eid[token]: hash layers route by the current input token id, not by score (§9.2).

    tid2eid [V, k] int, tokens [n] -> int [n, k].
    """
    return tid2eid[tokens].astype(np.int64)


def routing_weights(scores: np.ndarray, ids: np.ndarray, route_scale: float) -> np.ndarray:
    """w_k = λ · s_{id_k} / Σ_j s_{id_j} from the unbiased scores (§9.3).

    scores [n, E], ids [n, k] -> [n, k].
    """
    s = np.take_along_axis(scores, ids, axis=-1)
    return s / s.sum(axis=-1, keepdims=True) * route_scale


def swiglu_clamped(g: np.ndarray, u: np.ndarray, limit: float) -> np.ndarray:
    """h = silu(min(g, c)) · clip(u, -c, c): upper clamp on the gate, two-sided on up; no clamp when c ≤ 0 (§9.4).

    g, u [n, F] -> [n, F].
    """
    if limit > 0:
        g = np.minimum(g, limit)
        u = np.clip(u, -limit, limit)
    return g * sigmoid(g) * u


def weighted_down_input(h: np.ndarray, weight: np.ndarray, w_down: Weight) -> tuple[np.ndarray, Weight]:
    """(w · h, W_down): the routing weight multiplies before the down projection (§9.5).

    An engine that rounds the down input rounds the unweighted h (llama.cpp multiplies the routing weight after
    its down matmul), so a rounding W_down gives (w · round(h), W_down without the rounding), and one with a Q8_1
    min term keeps that term, weighted: (w · h', W_down with M (w · c)). h [n, F], weight [n].
    """
    if isinstance(w_down, Matrix) and w_down.min_term is not None:   # Q4_1 / Q5_1 x Q8_1: y = w·(W x' + M c)
        xq, c = w_down.min_term.quantize(h)
        wc = c * weight[:, None]
        return xq * weight[:, None], Matrix(w_down.w, None, MinTerm(w_down.min_term.mins, lambda x: (x, wc)))
    if isinstance(w_down, Matrix) and w_down.round_input is not None:
        return w_down.round_input(h) * weight[:, None], w_down.w
    return h * weight[:, None], w_down


def expert_ffn(x: np.ndarray, w_gate: Weight, w_up: Weight, w_down: Weight, limit: float,
               weight: np.ndarray | None = None) -> np.ndarray:
    """y = W_down (w · swiglu_c(W_gate x, W_up x)); the routing weight multiplies before the down projection (§9.4-9.5).

    x [n, D], w_gate / w_up [F, D], w_down [D, F], weight [n] or None (shared expert) -> [n, D].
    """
    h = swiglu_clamped(linear(x, w_gate), linear(x, w_up), limit)
    if weight is not None:
        h, w_down = weighted_down_input(h, weight, w_down)
    return linear(h, w_down)


ExpertWeights = Callable[[int], tuple[Weight, Weight, Weight]]


def routed_experts(x: np.ndarray, ids: np.ndarray, weights: np.ndarray, expert: ExpertWeights,
                   limit: float, workers: Workers) -> np.ndarray:
    """R = Σ_k y_{id_k}: tokens grouped by expert, each selected expert's weights fetched once (§9.4).

    x [n, D], ids [n, k], weights [n, k], expert(e) -> (w_gate [F, D], w_up [F, D], w_down [D, F]) -> [n, D].
    Experts run concurrently over `workers` (dequantization and BLAS release the GIL); contributions are added
    in ascending expert id, for a chunk and for single tokens alike, whatever the thread count.
    """
    def one(e: int) -> tuple[np.ndarray, np.ndarray]:
        rows, slot = np.nonzero(ids == e)
        w_gate, w_up, w_down = expert(int(e))
        return rows, expert_ffn(x[rows], w_gate, w_up, w_down, limit, weights[rows, slot])

    out = np.zeros_like(x)
    for rows, y in workers.map(one, np.unique(ids)):  # results in ascending expert id
        np.add.at(out, rows, y)
    return out
