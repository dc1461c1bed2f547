"""Draft-head ops in torch (spec v4-mtp-dspark §2-§4), the twins of `reference_cpu.draft`: the MTP input and its
(carrier, token) pairing, DSpark taps and main rows, the DSpark ring of committed rows and the block's key mask, the
Markov bias chain and the confidence logit.

The MTP block and each DSpark stage are otherwise an ordinary ratio-0 layer (`gpu_engine.model`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from gpu_engine.model import (
    SCORE_BUDGET,
    LayerPlan,
    Ops,
    Routing,
    grouped_output,
    hc_pre_of,
    kv_latent,
    moe,
    q_path,
    route,
)
from gpu_engine.ops import rms_norm
from gpu_engine.weights import DeviceWeights
from parity.contract.errors import ParityError
from parity.gguf.config import ModelConfig

PAIRINGS = ("prev", "same")
Tensor = torch.Tensor


def mtp_pairs(carriers: Tensor, tokens: Tensor, pairing: str) -> tuple[Tensor, Tensor]:
    """prev pairs X^(L)_{p-1} with t_p (n-1 pairs), same pairs X^(L)_p with t_p (n pairs).
    carriers [n, H, D], tokens [n] -> G [n', H, D], tau [n']."""
    if pairing == "prev":
        return carriers[:-1], tokens[1:]
    if pairing == "same":
        return carriers, tokens
    raise ParityError(f"mtp_pairing must be one of {', '.join(PAIRINGS)}, got {pairing!r}")


def mtp_input(e_row: Tensor, carrier: Tensor, enorm_w: Tensor, hnorm_w: Tensor, e_proj: Tensor, h_proj: Tensor,
              eps: float) -> Tensor:
    """X0[s] = W_e RMSNorm_enorm(e) + W_h RMSNorm_hnorm(G[s]), hnorm per stream.
    e_row [n, D], carrier [n, H, D], e_proj / h_proj [D, D] -> [n, H, D]."""
    e = rms_norm(e_row, enorm_w, eps) @ e_proj.T
    return e[:, None, :] + rms_norm(carrier, hnorm_w, eps) @ h_proj.T


def dspark_taps(carriers: Sequence[Tensor]) -> Tensor:
    """T = concat_l mean_s X^(l+1)[s] (stream mean of each tapped layer's output).  m x [T, H, D] -> [T, m·D]."""
    return torch.cat([c.mean(dim=1) for c in carriers], dim=-1)


def check_taps(taps: np.ndarray, m: int, dim: int) -> np.ndarray:
    """taps must be [c >= 1, m·D] (the rows `dspark_taps` makes): anything else is an error naming the shape."""
    if taps.ndim != 2 or len(taps) < 1 or taps.shape[1] != m * dim:
        raise ParityError(f"dspark_round: taps of shape {taps.shape}, expected (c >= 1, {m * dim}) = "
                          f"{m} tapped layers x D = {dim}")
    return taps


def dspark_main(taps: Tensor, main_proj: Tensor, main_norm_w: Tensor, eps: float) -> Tensor:
    """M = RMSNorm_main_norm(W_main T).  taps [T, m·D], main_proj [D, m·D] -> [T, D]."""
    return rms_norm(taps @ main_proj.T, main_norm_w, eps)


def markov_chain(logits: Tensor, anchor: int, w1: Tensor, w2: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """o_0 = anchor; u_j = W1[o_j], ℓ_j += W2 u_j, o_{j+1} = first argmax ℓ_j.
    logits [B, V], w1 / w2 [V, r] -> drafts int64 [B], biased logits [B, V], u [B, r]."""
    drafts, biased, u = [], [], []
    prev = int(anchor)
    for j in range(logits.shape[0]):
        u.append(w1[prev])
        biased.append(logits[j] + w2 @ u[-1])
        prev = int(torch.argmax(biased[-1]))   # torch.argmax returns the first maximal index
        drafts.append(prev)
    return torch.tensor(drafts, dtype=torch.int64), torch.stack(biased), torch.stack(u)


def confidence(z: Tensor, u: Tensor, w_c: Tensor) -> Tensor:
    """c_j = w_c · [z_j ; u_j], a raw logit.  z [B, D], u [B, r], w_c [1, D + r] -> [B]."""
    return (torch.cat([z, u], dim=-1) @ w_c.T)[:, 0]


@dataclass
class Ring:
    """A DSpark stage's W-slot ring of committed main KV rows: rows[k] holds position pos[k] (-1: empty)."""

    rows: Tensor   # [W, hd]
    pos: Tensor    # int64 [W]

    @classmethod
    def empty(cls, window: int, width: int, device: torch.device, dtype: torch.dtype) -> Ring:
        return cls(torch.zeros(window, width, device=device, dtype=dtype),
                   torch.full((window,), -1, dtype=torch.int64, device=device))


def ring_write(ring: Ring, rows: Tensor, pos: Tensor) -> Ring:
    """Row i lands at slot pos_i mod W, in order (of more than W rows the last W survive).
    rows [c, hd], pos int [c] -> a new Ring."""
    W = ring.pos.shape[0]
    keep = slice(max(0, pos.shape[0] - W), None)
    new_rows, new_pos = ring.rows.clone(), ring.pos.clone()
    new_rows[pos[keep] % W], new_pos[pos[keep] % W] = rows[keep], pos[keep]
    return Ring(new_rows, new_pos)


def dspark_mask(ring_pos: Tensor, p: int, window: int, block: int) -> Tensor:
    """Keys of the B block slots: ring slots holding positions p-W < q <= p, then all B block rows (bidirectional).
    ring_pos int [W] -> bool [B, W + B]."""
    ring_ok = (ring_pos >= 0) & (ring_pos <= p) & (ring_pos > p - window)
    both = torch.cat([ring_ok, torch.ones(block, dtype=torch.bool, device=ring_pos.device)])
    return both[None, :].expand(block, -1)


def main_kv(w: DeviceWeights, cfg: ModelConfig, ops: Ops, plan: LayerPlan, M: Tensor, pos: Tensor) -> Tensor:
    """K_M = FP8SIM(RoPE(RMSNorm_kv_norm(W_kv M), pos)) of a stage, as its ring stores it.  M [c, D] -> [c, hd]."""
    return ops.kv_round(ops.rope(kv_latent(w, cfg, plan.prefix, M), pos, plan.freqs))


def dspark_stage(w: DeviceWeights, cfg: ModelConfig, ops: Ops, plan: LayerPlan, ring: Ring, X: Tensor,
                 tokens: Tensor, p: int) -> tuple[Tensor, Tensor, Routing]:
    """One DSpark stage on the B block slots at positions p+1..p+B: a ratio-0 block whose attention keys are the
    ring (committed rows <= p) ⊕ the block's own rows, bidirectional; nothing is stored.
    X [B, H, D], tokens [B] -> attention half-carrier Y, carrier X' [B, H, D], the routing."""
    pre, B, eps = plan.prefix, X.shape[0], cfg.norm_eps
    pos = torch.arange(p + 1, p + 1 + B, device=X.device)
    u, _, post_a, C_a = hc_pre_of(w, cfg, X, pre + "hc_attn_")
    x = rms_norm(u, w.vector(pre + "attn_norm.weight"), eps)
    q = ops.rope(q_path(w, cfg, pre, x)[1], pos, plan.freqs)
    block_k = ops.kv_round(ops.rope(kv_latent(w, cfg, pre, x), pos, plan.freqs))
    o = ops.attention(q, torch.cat([ring.rows, block_k]), dspark_mask(ring.pos, p, cfg.window_size, B),
                      w.vector(pre + "attn_sinks.weight"), SCORE_BUDGET)
    Y = ops.hc_post(grouped_output(w, cfg, pre, ops.rope(o, pos, plan.freqs, inverse=True)), X, post_a, C_a)
    v, _, post_f, C_f = hc_pre_of(w, cfg, Y, pre + "hc_ffn_")
    xf = rms_norm(v, w.vector(pre + "ffn_norm.weight"), eps)
    r = route(w, cfg, ops, plan.layer, xf, tokens, p + 1, None)
    routed, shared = moe(w, cfg, ops, plan.layer, xf, r)
    X_out = ops.hc_post(routed + shared, Y, post_f, C_f)
    if not torch.isfinite(X_out).all():
        raise ParityError(f"DSpark stage layer {plan.layer}: non-finite carrier (block at positions {p + 1}..{p + B})")
    return Y, X_out, r
