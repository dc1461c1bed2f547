"""One transformer layer of DeepSeek-V4 in torch, reading like the official `Block.forward` (spec residual-ffn §5).

    u, pre, post, C = HC_pre(X);  a = Attention(attn_norm(u));  Y  = HC_post(a, X, post, C)
    v, pre', post', C' = HC_pre(Y);  f = MoE(ffn_norm(v), tokens);  X' = HC_post(f, Y, post', C')

The ops (`q_path`, `kv_latent`, `grouped_output`, `route`, `moe`) take tensors and weight handles
(`gpu_engine.linear.Matrix`) like their `reference_cpu` twins. The steps take their inputs explicitly: the layer's
weights by role (`gpu_engine.layer_weights`, the one place that knows the tensor names; `block_forward` reads them
from the `DeviceWeights` it is given), the config, the layer's `LayerPlan` and cache, and `Ops`, the op each step
runs. `Ops()` is the model; a fault is an
alternative op put in its place (`faults.compose`), the QAT round trips are ops the engine puts in when enabled.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from gpu_engine.attention import AttentionOp, LayerCache, attend, n_visible, sink_attention
from gpu_engine.compressor import (
    CompressorCache,
    PoolOp,
    SlotsOp,
    completed_blocks,
    compressor_project,
    compressor_update,
    csa_slots,
    hca_slots,
    pool_blocks,
)
from gpu_engine.draft import (
    Ring,
    dspark_mask,
    dspark_taps,
    markov_chain,
    mtp_carrier,
    mtp_hc_head,
    mtp_input,
    mtp_pairs,
    ring_write,
)
from gpu_engine.hc import hc_post, hc_pre
from gpu_engine.indexer import SelectOp, indexer_queries, indexer_weights, select_chunked, select_rows
from gpu_engine.layer_weights import AttnWeights, CompressorWeights, FfnWeights, layer_weights
from gpu_engine.linear import Matrix, expert_of, grouped_linear, linear
from gpu_engine.moe import (
    MapOp,
    expert_ffn,
    hash_select,
    replayed_ids,
    routed_experts,
    router_scores,
    routing_weights,
    select_topk,
    unbiased_scores,
)
from gpu_engine.ops import apply_rope, identity, rms_norm, swiglu_clamped
from gpu_engine.verify import accepted_row, first_max_rows
from gpu_engine.weights import DeviceWeights
from parity.contract.errors import ParityError
from parity.gguf.config import ModelConfig

SCORE_BUDGET = 1 << 22  # max attention / indexer scores materialised at once (elements of one head/query chunk)
Tensor = torch.Tensor


@dataclass(frozen=True)
class Ops:
    """The op run at each step; the defaults are the model's (QAT round trips off)."""

    rope: Callable[..., Tensor] = apply_rope                 # (x, pos, freqs, inverse=False)
    kv_round: Callable[[Tensor], Tensor] = identity          # FP8SIM_nope of raw and main compressed rows
    index_round: Callable[[Tensor], Tensor] = identity       # FP4SIM(Had(·)) of indexer queries and rows
    completed_blocks: Callable[[int, int, int, torch.device], Tensor] = completed_blocks
    csa_slots: SlotsOp = csa_slots
    pool: PoolOp = pool_blocks                               # (κ, σ [nb, S, d_c], start_pos, n) -> block rows
    n_visible: Callable[[Tensor, int], Tensor] = n_visible
    select_rows: SelectOp = select_rows
    attention: AttentionOp = sink_attention
    attend: Callable[..., Tensor] = attend                   # every query over its keys (gpu_engine.attention.attend)
    hc_post: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor] = hc_post
    swiglu: Callable[[Tensor, Tensor, float], Tensor] = swiglu_clamped
    weight_scores: Callable[[Tensor, Tensor], Tensor] = unbiased_scores
    expert_map: MapOp = map  # how the independent routed experts are run (serially, or a thread pool's map)
    # the draft heads (gpu_engine.draft; the MTP block and the DSpark stages use the ops above too)
    mtp_pairs: Callable[[Tensor, Tensor, str], tuple[Tensor, Tensor]] = mtp_pairs   # (carriers, tokens, pairing)
    mtp_input: Callable[..., Tensor] = mtp_input             # (e_row, carrier, enorm_w, hnorm_w, e_proj, h_proj, eps)
    mtp_carrier: Callable[[Tensor, Tensor], Tensor] = mtp_carrier   # (Y, X') -> X1 the MTP block hands on
    mtp_hc_head: Callable[[DeviceWeights, ModelConfig, Tensor], Tensor] = mtp_hc_head
    dspark_taps: Callable[[Sequence[Tensor]], Tensor] = dspark_taps
    dspark_mask: Callable[[Tensor, int, int, int], Tensor] = dspark_mask   # (ring_pos, p, window, block)
    markov_chain: Callable[[Tensor, int, Tensor, Tensor], tuple[Tensor, Tensor, Tensor]] = markov_chain
    ring_write: Callable[[Ring, Tensor, Tensor], Ring] = ring_write        # (ring, rows, pos)
    # the speculative round's own picks (gpu_engine.verify; numpy logits [q, V] of a verify batch)
    verify_argmax: Callable[[np.ndarray], np.ndarray] = first_max_rows    # logits -> int [q]
    next_row: Callable[[int, int], int] = accepted_row                     # (accepted, verified) -> row


@dataclass(frozen=True)
class LayerPlan:
    """What one layer runs with: its index, the compress ratio the engine schedules (0 SWA, 4 CSA with the
    indexer, else HCA) and its RoPE table (compute dtype, on the device)."""

    layer: int
    ratio: int
    freqs: Tensor


@dataclass
class AttnResult:
    out: Tensor                          # [n, D]
    n_comp_visible: Tensor               # int [n] rows visible by the causal rule (before selection)
    index_sel: Tensor | None             # int [n, top_k], -1 padded; None off CSA layers
    captures: dict[str, Tensor] = field(default_factory=dict)


@dataclass
class Routing:
    ids: Tensor       # int64 [n, K] selection order
    weights: Tensor   # [n, K] final weights (renormalised, x route_scale)
    margin: Tensor    # [n] router's K-th minus (K+1)-th selection key; nan on hash layers


@dataclass
class BlockResult:
    attn_carrier: Tensor                           # Y [n, H, D]
    carrier: Tensor                                # X' [n, H, D]
    hc_attn: tuple[Tensor, Tensor, Tensor]         # pre, post, comb
    hc_ffn: tuple[Tensor, Tensor, Tensor]
    attn: AttnResult
    routing: Routing
    captures: dict[str, Tensor]                    # sub-op outputs when captured (attention's included)


# -- attention ---------------------------------------------------------------------------------------------------

def q_path(x: Tensor, wq_a: Matrix, q_norm: Tensor, wq_b: Matrix, n_heads: int, eps: float) -> tuple[Tensor, Tensor]:
    """qr = RMSNorm_{q_norm}(W_qa x); q_h = RMSNorm((W_qb qr)_h) per head, unweighted, before RoPE.
    x [n, D], wq_a [R_q, D], q_norm [R_q], wq_b [n_heads·hd, R_q] -> qr [n, R_q], q [n, n_heads, hd]."""
    qr = rms_norm(linear(x, wq_a), q_norm, eps)
    q = linear(qr, wq_b).reshape(x.shape[0], n_heads, -1)
    return qr, rms_norm(q, None, eps)


def kv_latent(x: Tensor, wkv: Matrix, kv_norm: Tensor, eps: float) -> Tensor:
    """kv = RMSNorm_{kv_norm}(W_kv x), before RoPE and the FP8 round trip.  x [n, D], wkv [hd, D] -> [n, hd]."""
    return rms_norm(linear(x, wkv), kv_norm, eps)


def run_compressor(c: CompressorWeights, cfg: ModelConfig, cache: CompressorCache, x: Tensor, start_pos: int,
                   m: int, j: Tensor, slots_of: SlotsOp, pool: PoolOp = pool_blocks) -> Tensor:
    """κ = W_kv x, σ = W_gate x + ape[t mod m]; pool blocks j; RMSNorm.  -> rows [nb, d_c] before RoPE."""
    pos = torch.arange(start_pos, start_pos + x.shape[0], device=x.device)
    kv, score = compressor_project(x, c.kv, c.gate, c.ape, pos)
    rows = compressor_update(cache, kv, score, start_pos, m, j, slots_of, pool)
    return rms_norm(rows, c.norm, cfg.norm_eps)


def indexer_selection(a: AttnWeights, cfg: ModelConfig, ops: Ops, plan: LayerPlan, cache: LayerCache, x: Tensor,
                      qr: Tensor, start_pos: int, n_vis: Tensor, cap: dict | None) -> Tensor:
    """Indexer rows kI_j = FP4SIM(Had(RoPE(norm(c̃_j), 4j))), queries qI likewise, then top-k of
    Σ_h ω_h ReLU(qI_h · kI_j).  -> int [n, top_k] row ids ascending, -1 padded."""
    n = x.shape[0]
    j = ops.completed_blocks(start_pos, n, 4, x.device)
    rows = run_compressor(a.index_compressor, cfg, cache.index, x, start_pos, 4, j, ops.csa_slots, ops.pool)
    cache.index.rows = krows = torch.cat([cache.index.rows, ops.index_round(ops.rope(rows, j * 4, plan.freqs))])
    if cap is not None:
        cap["index_rows"] = krows
    pos = torch.arange(start_pos, start_pos + n, device=x.device)
    qi = indexer_queries(qr, a.index_q_b, pos, plan.freqs, cfg.index_n_heads, ops.rope, ops.index_round)
    weights = indexer_weights(x, a.index_proj, cfg.index_head_dim)
    n_vis = torch.clamp(n_vis, max=krows.shape[0])
    return select_chunked(qi, weights, krows, n_vis, cfg.index_topk, ops.select_rows, SCORE_BUDGET)


def compressed_keys(a: AttnWeights, cfg: ModelConfig, ops: Ops, plan: LayerPlan, cache: LayerCache, x: Tensor,
                    qr: Tensor, start_pos: int, cap: dict | None) -> tuple[Tensor, Tensor, Tensor | None]:
    """Emit the rows the call completes (c_j = FP8SIM_nope(RoPE(norm(c̃_j), j·m))) and the indexer selection.
    -> all main rows [R, hd], visible counts int [n], selection int [n, top_k] (None off CSA layers)."""
    n, m, dev = x.shape[0], plan.ratio, x.device
    if m == 0:
        return torch.zeros(0, cfg.head_dim, device=dev, dtype=x.dtype), torch.zeros(n, dtype=torch.int64,
                                                                                     device=dev), None
    j = ops.completed_blocks(start_pos, n, m, dev)
    slots_of = ops.csa_slots if m == 4 else hca_slots
    rows = run_compressor(a.compressor, cfg, cache.main, x, start_pos, m, j, slots_of, ops.pool)
    cache.main.rows = comp = torch.cat([cache.main.rows, ops.kv_round(ops.rope(rows, j * m, plan.freqs))])
    pos = torch.arange(start_pos, start_pos + n, device=dev)
    n_vis = torch.clamp(ops.n_visible(pos, m), max=comp.shape[0])
    sel = indexer_selection(a, cfg, ops, plan, cache, x, qr, start_pos, n_vis, cap) if m == 4 else None
    if cap is not None:
        cap["comp_rows"] = comp
    return comp, n_vis, sel


def grouped_output(o: Tensor, wo_a: Matrix, wo_b: Matrix, groups: int) -> Tensor:
    """a = W_ob · (z_0 ⊕ … ⊕ z_{G-1}), z_g = W_oa[g-th R_o rows] · (heads of group g concatenated).
    o [n, nh, hd] (after inverse RoPE), wo_a [G·R_o, nh·hd/G], wo_b [D, G·R_o] -> [n, D]."""
    n = o.shape[0]
    z = grouped_linear(o.reshape(n, groups, -1), wo_a)
    return linear(z.reshape(n, -1), wo_b)


def keep_window(cache: LayerCache, raw: Tensor, window: int, next_pos: int) -> None:
    """The raw cache keeps the last window - 1 rows (with the next token: exactly `window` raw keys)."""
    keep = window - 1
    cache.raw = raw[raw.shape[0] - min(keep, raw.shape[0]) :] if keep > 0 else raw[:0]
    cache.pos = next_pos


def attention(a: AttnWeights, cfg: ModelConfig, ops: Ops, plan: LayerPlan, cache: LayerCache, x: Tensor,
              start_pos: int, capture: bool) -> AttnResult:
    """a = Attention(x) for n new positions start_pos.. through the layer's cache.  x [n, D] -> AttnResult."""
    n, cap = x.shape[0], {}
    pos = torch.arange(start_pos, start_pos + n, device=x.device)
    qr, q = q_path(x, a.wq_a, a.q_norm, a.wq_b, cfg.n_heads, cfg.norm_eps)
    kv = kv_latent(x, a.wkv, a.kv_norm, cfg.norm_eps)
    q_rot, k = ops.rope(q, pos, plan.freqs), ops.kv_round(ops.rope(kv, pos, plan.freqs))
    comp, n_vis, sel = compressed_keys(a, cfg, ops, plan, cache, x, qr, start_pos, cap if capture else None)
    raw = torch.cat([cache.raw, k])
    o = ops.attend(q_rot, start_pos, raw, start_pos - cache.raw.shape[0], cfg.window_size, comp, n_vis, sel,
               a.sinks, ops.attention, SCORE_BUDGET)
    out = grouped_output(ops.rope(o, pos, plan.freqs, inverse=True), a.wo_a, a.wo_b, cfg.o_groups)
    keep_window(cache, raw, cfg.window_size, start_pos + n)
    if capture:
        cap.update(q_path=q, kv_latent=kv, rope_q=q_rot, rope_kv=k, attn_heads=o)
    return AttnResult(out, n_vis, sel, cap)


# -- MoE FFN -----------------------------------------------------------------------------------------------------

def route(x: Tensor, gate: Matrix, bias: Tensor | None, tid2eid: Tensor | None, tokens: Tensor, k: int,
          route_scale: float, weight_scores: Callable[[Tensor, Tensor], Tensor], replay: Tensor | None) -> Routing:
    """s = sqrt(softplus(G x)); ids = tid2eid[token] (hash layer: tid2eid given), top-k of s + b, or the replayed
    ids; w = route_scale · s_ids / Σ s_ids (`weight_scores`: the `Ops` slot choosing s).
    x [n, D], gate [E, D], bias [E] or None, tid2eid [V, k] or None, tokens [n], replay int64 [n, k] or None
    -> Routing (the margin stays the router's own under replay)."""
    s = router_scores(x, gate)
    if tid2eid is not None:
        keys, ids = s, hash_select(tid2eid, tokens)
        margin = torch.full((x.shape[0],), float("nan"), dtype=s.dtype, device=s.device)
    else:
        keys = s + bias
        ids, margin = select_topk(keys, k)
    if replay is not None:
        ids = replay
    return Routing(ids, routing_weights(weight_scores(s, keys), ids, route_scale), margin)


def layer_route(f: FfnWeights, cfg: ModelConfig, ops: Ops, layer: int, x: Tensor, tokens: Tensor, start_pos: int,
                override: Callable[[int, int, int], np.ndarray] | None) -> Routing:
    """`route` on layer `layer` with its weights, replaying `override`'s ids when given."""
    n, K = x.shape[0], cfg.n_activated_experts
    replay = None if override is None else replayed_ids(override(layer, start_pos, n), layer, start_pos, n, K,
                                                        cfg.n_routed_experts, x.device)
    return route(x, f.gate, f.bias, f.tid2eid, tokens, K, cfg.route_scale, ops.weight_scores, replay)


def moe(x: Tensor, r: Routing, experts: tuple[Matrix, Matrix, Matrix], shared: tuple[Matrix, Matrix, Matrix],
        limit: float, shared_limit: float, swiglu: Callable[[Tensor, Tensor, float], Tensor],
        run: MapOp = map) -> tuple[Tensor, Tensor]:
    """Routed R = Σ_k W_down[e_k](w_k · swiglu(W_gate[e_k] x, W_up[e_k] x)) and shared
    S = W_down swiglu(W_gate x, W_up x) (its own clamp, no routing weight); the experts run over `run`.
    x [n, D], experts (W_gate, W_up [E, F, D], W_down [E, D, F]), shared ([F, D], [F, D], [D, F]) -> R, S [n, D]."""
    gate, up, down = experts

    def expert(e: int, xe: Tensor, we: Tensor) -> Tensor:
        return expert_ffn(xe, expert_of(gate, e), expert_of(up, e), expert_of(down, e), limit, we, swiglu)

    return routed_experts(x, r.ids, r.weights, expert, run), expert_ffn(x, *shared, shared_limit, None, swiglu)


def layer_moe(f: FfnWeights, cfg: ModelConfig, ops: Ops, layer: int, x: Tensor, r: Routing) -> tuple[Tensor, Tensor]:
    """`moe` on layer `layer` with its weights, limits and the ops' swiglu and expert map."""
    return moe(x, r, f.experts, f.shared, cfg.swiglu_limit[layer], cfg.swiglu_limit_shexp[layer], ops.swiglu,
               ops.expert_map)


# -- the block ---------------------------------------------------------------------------------------------------

def block_forward(w: DeviceWeights, cfg: ModelConfig, ops: Ops, plan: LayerPlan, cache: LayerCache, X: Tensor,
                  tokens: Tensor, start_pos: int, override: Callable | None, capture: bool) -> BlockResult:
    """X' = layer(X) for n positions start_pos.. through the layer's cache, with the layer's weights
    (`layer_weights`).  X [n, H, D], tokens [n]."""
    lw, eps = layer_weights(w, cfg, plan.layer, plan.ratio), cfg.norm_eps
    hc = (cfg.norm_eps, cfg.hc_eps, cfg.hc_sinkhorn_iters)
    u, pre_a, post_a, C_a = hc_pre(X, lw.hc_attn.fn, lw.hc_attn.scale, lw.hc_attn.base, *hc)
    x = rms_norm(u, lw.attn_norm, eps)
    att = attention(lw.attn, cfg, ops, plan, cache, x, start_pos, capture)
    Y = ops.hc_post(att.out, X, post_a, C_a)
    v, pre_f, post_f, C_f = hc_pre(Y, lw.hc_ffn.fn, lw.hc_ffn.scale, lw.hc_ffn.base, *hc)
    xf = rms_norm(v, lw.ffn_norm, eps)
    r = layer_route(lw.ffn, cfg, ops, plan.layer, xf, tokens, start_pos, override)
    routed, shared = layer_moe(lw.ffn, cfg, ops, plan.layer, xf, r)
    X_out = ops.hc_post(routed + shared, Y, post_f, C_f)
    if not torch.isfinite(X_out).all():
        raise ParityError(f"layer {plan.layer}: non-finite values in the carrier at positions {start_pos}.."
                          f"{start_pos + X.shape[0] - 1}")
    cap = {}
    if capture:
        cap = {**att.captures, "hc_attn_pre": u, "attn_norm": x, "attn_out": att.out, "hc_attn_post": Y,
               "hc_ffn_pre": v, "ffn_norm": xf, "routed_out": routed, "shared_out": shared, "hc_ffn_post": X_out}
    return BlockResult(Y, X_out, (pre_a, post_a, C_a), (pre_f, post_f, C_f), att, r, cap)
