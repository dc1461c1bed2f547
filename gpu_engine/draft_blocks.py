"""The DSpark stage in torch (spec v4-mtp-dspark §3.4): a ratio-0 block whose attention keys are the stage's ring of
committed main rows ⊕ the block's own rows, and the main KV rows that ring stores. The MTP block is
`model.block_forward` itself; the draft heads' small ops are in `gpu_engine.draft`, reached through `Ops`.
"""

from __future__ import annotations

import torch

from gpu_engine.draft import Ring
from gpu_engine.hc import hc_pre
from gpu_engine.layer_weights import attn_weights, layer_weights
from gpu_engine.model import (
    SCORE_BUDGET,
    LayerPlan,
    Ops,
    Routing,
    grouped_output,
    kv_latent,
    layer_moe,
    layer_route,
    q_path,
)
from gpu_engine.ops import rms_norm
from gpu_engine.weights import DeviceWeights
from parity.contract.errors import ParityError
from parity.gguf.config import ModelConfig

Tensor = torch.Tensor


def main_kv(w: DeviceWeights, cfg: ModelConfig, ops: Ops, plan: LayerPlan, M: Tensor, pos: Tensor) -> Tensor:
    """K_M = FP8SIM(RoPE(RMSNorm_kv_norm(W_kv M), pos)) of a stage, as its ring stores it.  M [c, D] -> [c, hd]."""
    a = attn_weights(w, plan.layer, 0)
    return ops.kv_round(ops.rope(kv_latent(M, a.wkv, a.kv_norm, cfg.norm_eps), pos, plan.freqs))


def dspark_stage(w: DeviceWeights, cfg: ModelConfig, ops: Ops, plan: LayerPlan, ring: Ring, X: Tensor,
                 tokens: Tensor, p: int) -> tuple[Tensor, Tensor, Routing]:
    """One DSpark stage on the B block slots at positions p+1..p+B: a ratio-0 block whose attention keys are the
    ring (committed rows <= p) ⊕ the block's own rows, bidirectional; nothing is stored.
    X [B, H, D], tokens [B] -> attention half-carrier Y, carrier X' [B, H, D], the routing."""
    lw, B, eps = layer_weights(w, cfg, plan.layer, 0), X.shape[0], cfg.norm_eps
    a, hc = lw.attn, (cfg.norm_eps, cfg.hc_eps, cfg.hc_sinkhorn_iters)
    pos = torch.arange(p + 1, p + 1 + B, device=X.device)
    u, _, post_a, C_a = hc_pre(X, lw.hc_attn.fn, lw.hc_attn.scale, lw.hc_attn.base, *hc)
    x = rms_norm(u, lw.attn_norm, eps)
    q = ops.rope(q_path(x, a.wq_a, a.q_norm, a.wq_b, cfg.n_heads, eps)[1], pos, plan.freqs)
    block_k = ops.kv_round(ops.rope(kv_latent(x, a.wkv, a.kv_norm, eps), pos, plan.freqs))
    o = ops.attention(q, torch.cat([ring.rows, block_k]), ops.dspark_mask(ring.pos, p, cfg.window_size, B),
                      a.sinks, SCORE_BUDGET)
    o = grouped_output(ops.rope(o, pos, plan.freqs, inverse=True), a.wo_a, a.wo_b, cfg.o_groups)
    Y = ops.hc_post(o, X, post_a, C_a)
    v, _, post_f, C_f = hc_pre(Y, lw.hc_ffn.fn, lw.hc_ffn.scale, lw.hc_ffn.base, *hc)
    xf = rms_norm(v, lw.ffn_norm, eps)
    r = layer_route(lw.ffn, cfg, ops, plan.layer, xf, tokens, p + 1, None)
    routed, shared = layer_moe(lw.ffn, cfg, ops, plan.layer, xf, r)
    X_out = ops.hc_post(routed + shared, Y, post_f, C_f)
    if not torch.isfinite(X_out).all():
        raise ParityError(f"DSpark stage layer {plan.layer}: non-finite carrier (block at positions {p + 1}..{p + B})")
    return Y, X_out, r
