"""The DSpark stage in torch (spec v4-mtp-dspark §3.4): a ratio-0 block whose attention keys are the stage's ring of
committed main rows ⊕ the block's own rows, and the main KV rows that ring stores. The MTP block is
`model.block_forward` itself; the draft heads' small ops are in `gpu_engine.draft`, reached through `Ops`.
"""

from __future__ import annotations

import torch

from gpu_engine.draft import Ring
from gpu_engine.hc import hc_pre
from gpu_engine.model import (
    SCORE_BUDGET,
    LayerPlan,
    Ops,
    Routing,
    ffn_weights,
    hc_weights,
    layer_grouped_output,
    layer_kv_latent,
    layer_moe,
    layer_q_path,
    layer_route,
)
from gpu_engine.ops import rms_norm
from gpu_engine.weights import DeviceWeights
from parity.contract.errors import ParityError
from parity.gguf.config import ModelConfig

Tensor = torch.Tensor


def main_kv(w: DeviceWeights, cfg: ModelConfig, ops: Ops, plan: LayerPlan, M: Tensor, pos: Tensor) -> Tensor:
    """K_M = FP8SIM(RoPE(RMSNorm_kv_norm(W_kv M), pos)) of a stage, as its ring stores it.  M [c, D] -> [c, hd]."""
    return ops.kv_round(ops.rope(layer_kv_latent(w, cfg, plan.prefix, M), pos, plan.freqs))


def dspark_stage(w: DeviceWeights, cfg: ModelConfig, ops: Ops, plan: LayerPlan, ring: Ring, X: Tensor,
                 tokens: Tensor, p: int) -> tuple[Tensor, Tensor, Routing]:
    """One DSpark stage on the B block slots at positions p+1..p+B: a ratio-0 block whose attention keys are the
    ring (committed rows <= p) ⊕ the block's own rows, bidirectional; nothing is stored.
    X [B, H, D], tokens [B] -> attention half-carrier Y, carrier X' [B, H, D], the routing."""
    pre, B, eps = plan.prefix, X.shape[0], cfg.norm_eps
    pos = torch.arange(p + 1, p + 1 + B, device=X.device)
    hc = (cfg.norm_eps, cfg.hc_eps, cfg.hc_sinkhorn_iters)
    u, _, post_a, C_a = hc_pre(X, *hc_weights(w, pre + "hc_attn_"), *hc)
    x = rms_norm(u, w.vector(pre + "attn_norm.weight"), eps)
    q = ops.rope(layer_q_path(w, cfg, pre, x)[1], pos, plan.freqs)
    block_k = ops.kv_round(ops.rope(layer_kv_latent(w, cfg, pre, x), pos, plan.freqs))
    o = ops.attention(q, torch.cat([ring.rows, block_k]), ops.dspark_mask(ring.pos, p, cfg.window_size, B),
                      w.vector(pre + "attn_sinks.weight"), SCORE_BUDGET)
    Y = ops.hc_post(layer_grouped_output(w, cfg, pre, ops.rope(o, pos, plan.freqs, inverse=True)), X, post_a, C_a)
    v, _, post_f, C_f = hc_pre(Y, *hc_weights(w, pre + "hc_ffn_"), *hc)
    xf = rms_norm(v, w.vector(pre + "ffn_norm.weight"), eps)
    f = ffn_weights(w, cfg, plan.layer)
    r = layer_route(f, cfg, ops, plan.layer, xf, tokens, p + 1, None)
    routed, shared = layer_moe(f, cfg, ops, plan.layer, xf, r)
    X_out = ops.hc_post(routed + shared, Y, post_f, C_f)
    if not torch.isfinite(X_out).all():
        raise ParityError(f"DSpark stage layer {plan.layer}: non-finite carrier (block at positions {p + 1}..{p + B})")
    return Y, X_out, r
