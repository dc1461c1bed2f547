"""One transformer layer of DeepSeek-V4, reading like the official `Block.forward` (spec residual-ffn §5).

    u, pre, post, C = HC_pre(X);  a = Attention(attn_norm(u));  Y  = HC_post(a, X, post, C)
    v, pre', post', C' = HC_pre(Y);  f = MoE(ffn_norm(v), tokens);  X' = HC_post(f, Y, post', C')

Weights come from a `WeightStore`; caches from the layer's `LayerState`. When `cap` is a dict, every
sub-op output named in `parity.contract.checkpoints.SUBOPS` is stored in it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from parity.contract.engine import LayerDiag, LayerOutput, check_expert_ids
from parity.contract.errors import ParityError
from parity.gguf.config import ModelConfig
from reference_cpu.attention import attend, grouped_output, kv_latent, q_path
from reference_cpu.compressor import compressor_project, compressor_update, index_row_post, main_row_post
from reference_cpu.hc import hc_post, hc_pre
from reference_cpu.indexer import indexer_queries, indexer_weights, select_rows
from reference_cpu.linear import Matrix
from reference_cpu.moe import (
    expert_ffn,
    hash_select,
    routed_experts,
    router_scores,
    routing_weights,
    select_topk,
)
from reference_cpu.norms import rms_norm
from reference_cpu.quant_sim import fp8_sim_nope
from reference_cpu.rope import RopeTable, apply_rope
from reference_cpu.state import CompressorState, LayerState
from reference_cpu.threads import Workers
from reference_cpu.weights_cache import WeightStore


@dataclass(frozen=True)
class Numerics:
    """Which QAT round trips run, the routing replay hook, and the KV store rounding (from `RunOptions`).

    `kv_round` (kv_cache=f16) rounds every row as it is stored: raw KV rows and compressed rows; None = exact.
    """

    fp8_kv: bool
    fp4_indexer: bool
    expert_override: Callable[[int, int, int], np.ndarray] | None
    kv_round: Callable[[np.ndarray], np.ndarray] | None


def stored(rows: np.ndarray, num: Numerics) -> np.ndarray:
    """Rows as the KV store holds them: unchanged, or rounded by `num.kv_round`.  [r, d] -> [r, d]."""
    return rows if num.kv_round is None else num.kv_round(rows)


def run_compressor(state: CompressorState, x: np.ndarray, pos: np.ndarray, store: WeightStore, prefix: str,
                   post: Callable[[np.ndarray, np.ndarray], np.ndarray], num: Numerics) -> None:
    """Project the chunk, emit every completed block's row, post-process it at j·m and append it to state.rows.

    x [n, D], pos [n]; `prefix` is 'blk.l.attn_compressor' or 'blk.l.indexer_compressor'.
    """
    kv, score = compressor_project(x, store.matrix(prefix + "_kv.weight"), store.matrix(prefix + "_gate.weight"),
                                   store.dense(prefix + "_ape.weight"), pos)
    rows, first = compressor_update(state, kv, score)
    if len(rows):
        j_pos = (first + np.arange(len(rows))) * state.ratio
        state.rows = np.concatenate([state.rows, stored(post(rows, j_pos), num)])


def project_qkv(store: WeightStore, cfg: ModelConfig, p: str, x: np.ndarray, pos: np.ndarray, rope: RopeTable,
                num: Numerics) -> tuple[np.ndarray, ...]:
    """qr, q (before RoPE), kv latent, q after RoPE, k = the stored raw KV row (RoPE, FP8 sim, store rounding).

    x [n, D], pos [n] -> qr [n, R_q], q / q_rot [n, n_heads, hd], kv / k [n, hd] (spec attention §2-§3, §6.1).
    """
    qr, q = q_path(x, store.matrix(p + "attn_q_a.weight"), store.dense(p + "attn_q_a_norm.weight"),
                   store.matrix(p + "attn_q_b.weight"), cfg.n_heads, cfg.norm_eps)
    kv = kv_latent(x, store.matrix(p + "attn_kv.weight"), store.dense(p + "attn_kv_a_norm.weight"), cfg.norm_eps)
    k = apply_rope(kv, pos, rope)
    if num.fp8_kv:
        k = fp8_sim_nope(k, cfg.nope_dim)
    return qr, q, kv, apply_rope(q, pos, rope), stored(k, num)


def compress_and_select(store: WeightStore, cfg: ModelConfig, layer: int, st: LayerState, x: np.ndarray,
                        qr: np.ndarray, pos: np.ndarray, rope: RopeTable, num: Numerics,
                        workers: Workers) -> np.ndarray | None:
    """Emit this chunk's compressed rows (main and indexer) and, on CSA layers, the indexer's selection (§7-§8).

    x [n, D], qr [n, R_q], pos [n] -> Sel int [n, top_k] (-1 padded), or None off CSA layers.
    """
    p, eps = f"blk.{layer}.", cfg.norm_eps
    if cfg.ratio(layer) > 0:
        norm = store.dense(p + "attn_compressor_norm.weight")
        run_compressor(st.comp, x, pos, store, p + "attn_compressor",
                       lambda r, jp: main_row_post(r, jp, norm, eps, rope, num.fp8_kv, cfg.nope_dim), num)
    if not cfg.has_indexer(layer):
        return None
    norm_i = store.dense(p + "indexer_compressor_norm.weight")
    run_compressor(st.index, x, pos, store, p + "indexer_compressor",
                   lambda r, jp: index_row_post(r, jp, norm_i, eps, rope, num.fp4_indexer), num)
    q_idx = indexer_queries(qr, store.matrix(p + "indexer.attn_q_b.weight"), pos, rope, cfg.index_n_heads,
                            num.fp4_indexer)
    w_idx = indexer_weights(x, store.matrix(p + "indexer.proj.weight"), cfg.index_head_dim)
    return select_rows(q_idx, w_idx, st.index.rows, pos, cfg.ratio(layer), cfg.index_topk, workers)


def attention(store: WeightStore, cfg: ModelConfig, layer: int, st: LayerState, x: np.ndarray, pos: np.ndarray,
              rope: RopeTable, num: Numerics, cap: dict | None,
              workers: Workers) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """a = Attention(x) for n new positions through the layer's caches (spec attention §11-§12, §16).

    x [n, D] (attn_norm output), pos [n] -> a [n, D], n_comp_visible int [n], index_sel int [n, top_k] (-1 pad).
    """
    p, m, n = f"blk.{layer}.", cfg.ratio(layer), len(pos)
    qr, q, kv, q_rot, k = project_qkv(store, cfg, p, x, pos, rope, num)
    sel = compress_and_select(store, cfg, layer, st, x, qr, pos, rope, num, workers)
    raw = np.concatenate([st.raw, k])
    comp = st.comp.rows if m > 0 else np.zeros((0, cfg.head_dim), x.dtype)
    o = attend(q_rot, pos, raw, int(pos[0]) - len(st.raw), cfg.window_size, comp, m, sel,
               store.dense(p + "attn_sinks.weight"), 1.0 / math.sqrt(cfg.head_dim), workers)
    a = grouped_output(apply_rope(o, pos, rope, inverse=True), store.matrix(p + "attn_output_a.weight"),
                       store.matrix(p + "attn_output_b.weight"), cfg.o_groups, workers)
    st.raw = raw[max(0, len(raw) - (cfg.window_size - 1)) :]
    st.next_pos += n
    n_vis = (pos + 1) // m if m > 0 else np.zeros(n, np.int64)
    index_sel = sel if sel is not None else np.full((n, cfg.index_topk), -1, np.int64)
    if cap is not None:
        # the row arrays are never written in place (each emission concatenates a new array): no copies needed
        cap.update(q_path=q, kv_latent=kv, rope_q=q_rot, rope_kv=k, comp_rows=comp,
                   index_rows=(st.index.rows if st.index is not None
                               else np.zeros((0, cfg.index_head_dim), x.dtype)),
                   index_sel=index_sel, attn_heads=o, attn_out=a)
    return a, n_vis.astype(np.int64), index_sel


def expert_id_table(ids: np.ndarray, n: int, cfg: ModelConfig, layer: int, source: str) -> np.ndarray:
    """ids must be int [n, K] in [0, E): a bad table or replay is an error, not a guess.

    A repeated id is legal (the official code would run that expert once per slot) and is summed per slot.
    """
    ids = np.asarray(ids)
    K = cfg.n_activated_experts
    if ids.shape != (n, K) or ids.dtype.kind not in "iu":
        raise ParityError(f"layer {layer}: {source} gave expert ids of shape {ids.shape} {ids.dtype}, expected "
                          f"integers of shape ({n}, {K})")
    check_expert_ids(ids, cfg.n_routed_experts, f"layer {layer}: {source}")
    return ids.astype(np.int64)


def moe(store: WeightStore, cfg: ModelConfig, layer: int, x: np.ndarray, tokens: np.ndarray, start_pos: int,
        num: Numerics, cap: dict | None, workers: Workers) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """f = Σ_k w_k Expert_{id_k}(x) + Shared(x) (spec residual-ffn §9).

    x [n, D] (ffn_norm output), tokens [n] -> f [n, D], ids int [n, K] (selection order), weights [n, K],
    router margin [n] (nan on hash layers).
    """
    p, n, K = f"blk.{layer}.", len(x), cfg.n_activated_experts
    scores = router_scores(x, store.matrix(p + "ffn_gate_inp.weight"))
    if cfg.is_hash_layer(layer):
        table = store.table(p + "ffn_gate_tid2eid.weight")
        if tokens.min() < 0 or tokens.max() >= len(table):
            raise ParityError(f"layer {layer}: token id outside [0, {len(table)}) for hash routing")
        ids = expert_id_table(hash_select(table, tokens), n, cfg, layer, "ffn_gate_tid2eid")
        margin = np.full(n, np.nan, x.dtype)
    else:
        ids, margin = select_topk(scores + store.dense(p + "exp_probs_b.bias"), K)
    if num.expert_override is not None:
        ids = expert_id_table(num.expert_override(layer, start_pos, n), n, cfg, layer, "expert_override")
    weights = routing_weights(scores, ids, cfg.route_scale)

    def expert(e: int) -> tuple[Matrix, Matrix, Matrix]:
        return (store.expert_matrix(p + "ffn_gate_exps.weight", e), store.expert_matrix(p + "ffn_up_exps.weight", e),
                store.expert_matrix(p + "ffn_down_exps.weight", e))

    routed = routed_experts(x, ids, weights, expert, cfg.swiglu_limit[layer], workers)
    shared = expert_ffn(x, store.matrix(p + "ffn_gate_shexp.weight"), store.matrix(p + "ffn_up_shexp.weight"),
                        store.matrix(p + "ffn_down_shexp.weight"), cfg.swiglu_limit_shexp[layer])
    if cap is not None:
        cap.update(expert_ids=ids, expert_weights=weights, routed_out=routed, shared_out=shared)
    return routed + shared, ids, weights, margin


def block_forward(store: WeightStore, cfg: ModelConfig, layer: int, st: LayerState, X: np.ndarray,
                  tokens: np.ndarray, start_pos: int, rope: RopeTable, num: Numerics, capture: bool,
                  workers: Workers) -> LayerOutput:
    """X' = layer(X) for n positions start_pos.. (spec residual-ffn §5).

    X [n, H, D], tokens [n] -> LayerOutput (attention half-carrier, carrier, diagnostics, captures).
    """
    if start_pos != st.next_pos:
        raise ParityError(f"layer {layer}: chunk starts at position {start_pos} but the state expects "
                          f"{st.next_pos} (feed positions in order through one state)")
    p, cap = f"blk.{layer}.", ({} if capture else None)
    pos = start_pos + np.arange(len(X))
    hc_args = (cfg.norm_eps, cfg.hc_eps, cfg.hc_sinkhorn_iters)

    u, pre_a, post_a, comb_a = hc_pre(X, store.matrix(p + "hc_attn_fn.weight"), store.dense(p + "hc_attn_scale.weight"),
                                      store.dense(p + "hc_attn_base.weight"), *hc_args)
    x = rms_norm(u, store.dense(p + "attn_norm.weight"), cfg.norm_eps)
    a, n_vis, index_sel = attention(store, cfg, layer, st, x, pos, rope, num, cap, workers)
    Y = hc_post(a, X, post_a, comb_a)

    v, pre_f, post_f, comb_f = hc_pre(Y, store.matrix(p + "hc_ffn_fn.weight"), store.dense(p + "hc_ffn_scale.weight"),
                                      store.dense(p + "hc_ffn_base.weight"), *hc_args)
    xf = rms_norm(v, store.dense(p + "ffn_norm.weight"), cfg.norm_eps)
    f, ids, weights, margin = moe(store, cfg, layer, xf, tokens, start_pos, num, cap, workers)
    X_out = hc_post(f, Y, post_f, comb_f)

    for name, arr in ((f"blk.{layer}.attn", Y), (f"blk.{layer}", X_out)):
        if not np.isfinite(arr).all():
            raise ParityError(f"non-finite carrier at checkpoint {name} (positions {pos[0]}..{pos[-1]})")
    if cap is not None:
        cap.update(hc_attn_pre=u, attn_norm=x, hc_attn_post=Y, hc_ffn_pre=v, ffn_norm=xf, hc_ffn_post=X_out)
    diag = LayerDiag(hc_attn=(pre_a, post_a, comb_a), hc_ffn=(pre_f, post_f, comb_f), expert_ids=ids,
                     expert_weights=weights, router_margin=margin, n_comp_visible=n_vis,
                     index_sel=index_sel if cfg.has_indexer(layer) else None)
    return LayerOutput(attn_carrier=Y, carrier=X_out, diag=diag, captures=cap or {})
