"""MoE FFN ops in torch (spec residual-ffn §9): sqrt-softplus router, hash or biased top-k selection, routing
weights, routed experts run grouped by expert (each selected expert's weights used once per call).

The selection bias only chooses experts; the weights come from the unbiased scores of the chosen ids
(`unbiased_scores`; the router-bias-in-weights fault is the alternative `biased_keys`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import numpy as np
import torch

from gpu_engine.linear import Matrix, exact, linear
from gpu_engine.ops import swiglu_clamped
from parity.contract.engine import check_expert_ids
from parity.contract.errors import ParityError


def router_scores(x: torch.Tensor, gate: Matrix) -> torch.Tensor:
    """s = sqrt(softplus(G x)) > 0.  x [n, D], gate [E, D] -> [n, E]."""
    return torch.sqrt(torch.nn.functional.softplus(linear(x, gate)))


def select_topk(keys: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids = the k largest selection keys in descending order (lowest id wins ties); margin = key_(k) - key_(k+1).
    keys [n, E] (scores + bias) -> ids int64 [n, k], margin [n] (nan when k = E)."""
    order = torch.sort(keys, dim=-1, descending=True, stable=True)
    margin = torch.full((keys.shape[0],), math.nan, dtype=keys.dtype, device=keys.device)
    if keys.shape[1] > k:
        margin = order.values[:, k - 1] - order.values[:, k]
    return order.indices[:, :k], margin


def hash_select(tid2eid: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """ids = tid2eid[token]: hash layers route by the input token id.  tid2eid int64 [V, k], tokens [n] -> [n, k]."""
    return tid2eid[tokens]


def replayed_ids(ids: np.ndarray, layer: int, start_pos: int, n: int, k: int, n_experts: int,
                 device: torch.device) -> torch.Tensor:
    """Routing replay: the ids an `expert_override` returned, checked (int [n, k] in [0, E)).  -> int64 [n, k]"""
    ids = np.asarray(ids)
    if ids.shape != (n, k) or ids.dtype.kind not in "iu":
        raise ParityError(f"expert_override(layer={layer}, start_pos={start_pos}, n={n}) returned "
                          f"{ids.dtype} {ids.shape}, expected int {(n, k)}")
    check_expert_ids(ids, n_experts, f"expert_override at layer {layer}")
    return torch.from_numpy(ids.astype(np.int64)).to(device)


def unbiased_scores(scores: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """What the routing weights are taken from: the router's unbiased scores (keys = scores + bias choose only)."""
    return scores


def biased_keys(scores: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The router-bias-in-weights fault: routing weights from the biased selection keys."""
    return keys


def routing_weights(scores: torch.Tensor, ids: torch.Tensor, route_scale: float) -> torch.Tensor:
    """w_k = λ · s_{id_k} / Σ_j s_{id_j}.  scores [n, E], ids [n, k] -> [n, k]."""
    w = torch.gather(scores, 1, ids)
    return w / w.sum(dim=-1, keepdim=True) * route_scale


def tokens_by_expert(ids: torch.Tensor) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """The (token, slot) assignments grouped by expert, ascending expert id.
    ids [n, k] -> (expert e, token indices [c], flat (token·k + slot) indices [c]) per selected expert."""
    flat_ids = ids.reshape(-1)
    order = torch.sort(flat_ids, stable=True).indices
    tok = torch.div(order, ids.shape[1], rounding_mode="floor")
    experts, counts = torch.unique_consecutive(flat_ids[order], return_counts=True)
    start = 0
    for e, c in zip(experts.tolist(), counts.tolist(), strict=True):
        yield e, tok[start : start + c], order[start : start + c]
        start += c


def weighted_down_input(h: torch.Tensor, weight: torch.Tensor, w_down: Matrix) -> tuple[torch.Tensor, Matrix]:
    """(w · h, W_down): the routing weight multiplies before the down projection. A rounding W_down rounds the
    unweighted h (llama.cpp multiplies the routing weight after its down matmul): (w · round(h), W_down without
    the rounding).  h [n, F], weight [n]."""
    if w_down.round_input is not None:
        return w_down.round_input(h) * weight[:, None], exact(w_down)
    return h * weight[:, None], w_down


def expert_ffn(x: torch.Tensor, w_gate: Matrix, w_up: Matrix, w_down: Matrix, limit: float,
               weight: torch.Tensor | None = None,
               swiglu: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] = swiglu_clamped) -> torch.Tensor:
    """y = W_down (w · swiglu_c(W_gate x, W_up x)); the routing weight multiplies before the down projection;
    `swiglu` is the `Ops` slot.
    x [n, D], w_gate / w_up [F, D], w_down [D, F], weight [n] or None (shared expert) -> [n, D]."""
    h = swiglu(linear(x, w_gate), linear(x, w_up), limit)
    if weight is not None:
        h, w_down = weighted_down_input(h, weight, w_down)
    return linear(h, w_down)


ExpertOp = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]
MapOp = Callable[..., Iterator]  # map(fn, items) -> results in item order (builtin map, or a thread pool's map)


def routed_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, expert: ExpertOp,
                   run: MapOp = map) -> torch.Tensor:
    """R = Σ_k y_{id_k}, computed per selected expert over its tokens, added in ascending expert id.
    x [n, D], ids [n, k], weights [n, k], expert(e, x_e [c, D], w_e [c]) -> y [c, D]  ->  [n, D].
    The experts are independent: `run` may compute them concurrently; the sum order is fixed, so the result
    does not depend on it."""
    out = torch.zeros_like(x)
    flat_w = weights.reshape(-1)
    groups = list(tokens_by_expert(ids))
    for (_, tok, _), y in zip(groups, run(lambda g: expert(g[0], x[g[1]], flat_w[g[2]]), groups), strict=True):
        out.index_add_(0, tok, y)
    return out
