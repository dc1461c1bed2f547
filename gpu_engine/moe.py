"""MoE FFN in torch (spec residual-ffn §9): sqrt-softplus router, hash or biased top-k selection,
routed experts run grouped by expert (each selected expert dequantized once per call), shared expert."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from gpu_engine.ops import swiglu
from parity.contract.errors import ParityError


@dataclass
class Routing:
    ids: torch.Tensor       # int64 [n, K] selection order
    weights: torch.Tensor   # [n, K] final weights (renormalised, x route_scale)
    margin: torch.Tensor    # [n] router's K-th minus (K+1)-th selection key; nan on hash layers


def route(ctx, layer: int, x: torch.Tensor, tokens: torch.Tensor, start_pos: int) -> Routing:
    """s = sqrt(softplus(G x)); ids = tid2eid[token] (hash layer) or top-K of s + b (ties: lowest id), or the
    replayed ids; w = route_scale · s_ids / Σ s_ids.  x [n, D], tokens [n] -> Routing."""
    cfg, p = ctx.cfg, f"blk.{layer}."
    n, K = x.shape[0], cfg.n_activated_experts
    s = torch.sqrt(torch.nn.functional.softplus(ctx.linear(x, p + "ffn_gate_inp.weight")))
    bias = None if cfg.is_hash_layer(layer) else ctx.w.v(p + "exp_probs_b.bias")
    margin = torch.full((n,), math.nan, dtype=s.dtype, device=s.device)
    if bias is not None:
        key = s + bias
        order = torch.sort(key, dim=-1, descending=True, stable=True)
        ids = order.indices[:, :K]
        if key.shape[1] > K:
            margin = order.values[:, K - 1] - order.values[:, K]
    else:
        ids = ctx.w.ints[p + "ffn_gate_tid2eid.weight"][tokens]
    if ctx.options.expert_override is not None:
        ids = _replayed(ctx, layer, start_pos, n, s.device)  # the margin stays the router's own
    src = s + bias if (ctx.switches.router_bias_in_weights and bias is not None) else s
    w = torch.gather(src, 1, ids)
    return Routing(ids, w / w.sum(dim=-1, keepdim=True) * cfg.route_scale, margin)


def _replayed(ctx, layer: int, start_pos: int, n: int, device: torch.device) -> torch.Tensor:
    cfg = ctx.cfg
    ids = np.asarray(ctx.options.expert_override(layer, start_pos, n))
    want = (n, cfg.n_activated_experts)
    if ids.shape != want or ids.dtype.kind not in "iu":
        raise ParityError(f"expert_override(layer={layer}, start_pos={start_pos}, n={n}) returned "
                          f"{ids.dtype} {ids.shape}, expected int {want}")
    if ids.size and (ids.min() < 0 or ids.max() >= cfg.n_routed_experts):
        raise ParityError(f"expert_override at layer {layer}: expert id out of range [0, {cfg.n_routed_experts})")
    return torch.from_numpy(ids.astype(np.int64)).to(device)


def routed_experts(ctx, layer: int, x: torch.Tensor, r: Routing) -> torch.Tensor:
    """R = Σ_k W_down[e_k](w_k · swiglu(W_gate[e_k] x, W_up[e_k] x)), computed per expert over its tokens.
    x [n, D] -> [n, D]."""
    p, limit = f"blk.{layer}.", ctx.cfg.swiglu_limit[layer]
    gate_w, up_w, down_w = (p + f"ffn_{k}_exps.weight" for k in ("gate", "up", "down"))
    flat_ids = r.ids.reshape(-1)
    order = torch.sort(flat_ids, stable=True).indices
    tok = torch.div(order, r.ids.shape[1], rounding_mode="floor")
    experts, counts = torch.unique_consecutive(flat_ids[order], return_counts=True)
    out = torch.zeros_like(x)
    start = 0
    for e, c in zip(experts.tolist(), counts.tolist(), strict=True):
        t = tok[start : start + c]
        wk = r.weights.reshape(-1)[order[start : start + c]]
        xe = x[t].to(ctx.mm)
        g = ctx.w.expert_linear(gate_w, e, xe).to(ctx.act)
        u = ctx.w.expert_linear(up_w, e, xe).to(ctx.act)
        h = swiglu(g, u, limit, ctx.switches.swiglu_symmetric_clamp) * wk[:, None]
        out.index_add_(0, t, ctx.w.expert_linear(down_w, e, h.to(ctx.mm)).to(ctx.act))
        start += c
    return out


def shared_expert(ctx, layer: int, x: torch.Tensor) -> torch.Tensor:
    """S = W_down swiglu(W_gate x, W_up x) with the shared-expert clamp, no routing weight.  [n, D] -> [n, D]"""
    p = f"blk.{layer}."
    h = swiglu(ctx.linear(x, p + "ffn_gate_shexp.weight"), ctx.linear(x, p + "ffn_up_shexp.weight"),
               ctx.cfg.swiglu_limit_shexp[layer], ctx.switches.swiglu_symmetric_clamp)
    return ctx.linear(h, p + "ffn_down_shexp.weight")
