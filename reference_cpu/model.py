"""One transformer layer of DeepSeek-V4, reading like the official `Block.forward` (spec residual-ffn §5).

    u, pre, post, C = HC_pre(X);  a = Attention(attn_norm(u));  Y  = HC_post(a, X, post, C)
    v, pre', post', C' = HC_pre(Y);  f = MoE(ffn_norm(v), tokens);  X' = HC_post(f, Y, post', C')

Weights come from a `WeightStore`; caches from the layer's `LayerState`. Every sub-op output named in
`parity.contract.checkpoints.SUBOPS` passes through a `Tap`: stored when captures are asked for, replaced by the
candidate's value in op-level teacher forcing (`Tap.given`: each op then runs on the candidate's own input to
it), perturbed in a Monte-Carlo round-off twin (`Tap.jitter`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

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
    tie_seed: int | None = None   # round-off twin: exact indexer-score ties in a seeded random order


@dataclass
class Tap:
    """Where one layer call's sub-op outputs go and what replaces them.

    capture: dict filled with every sub-op output (None: no captures); given: the candidate's values by capture
    name (and `hc_attn.post`, `hc_attn.comb`, `hc_ffn.post`, `hc_ffn.comb` for its HC mixes), consumed downstream
    instead of the reference's own; jitter(y, name, k): a round-off twin's perturbation (None: exact).
    """

    capture: dict | None = None
    given: Mapping[str, np.ndarray] = field(default_factory=dict)
    jitter: Callable[[np.ndarray, str, int], np.ndarray] | None = None

    def out(self, name: str, y: np.ndarray, k: int = 1) -> np.ndarray:
        """The op's own output y (jittered with reduction length k in a twin) is captured; downstream gets the
        candidate's value when given (jittered by one ulp in a twin: the next op's own rounding of it)."""
        if self.jitter is not None:
            y = self.jitter(y, name, k)
        if self.capture is not None:
            self.capture[name] = y
        if name not in self.given:
            return y
        return self.given[name] if self.jitter is None else self.jitter(self.given[name], name + "<", 1)

    def rows(self, name: str, rows: np.ndarray) -> np.ndarray:
        """Emitted rows so far: the candidate's when given with the same count (else the reference's own, a
        structural difference the caller's comparison reports)."""
        if self.capture is not None:
            self.capture[name] = rows
        got = self.given.get(name)
        return got if got is not None and got.shape == rows.shape else rows

    def pooled(self, name: str, rows: np.ndarray, k: int) -> np.ndarray:
        """A compressor's freshly pooled rows (before their norm, RoPE and QAT sim), perturbed in a twin like an op
        output of reduction length k (the projection's); exact otherwise."""
        return rows if self.jitter is None else self.jitter(rows, name, k)

    def mix(self, which: str, post: np.ndarray, comb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The HC post/comb mixes hc_post uses: the candidate's when given."""
        return self.given.get(which + ".post", post), self.given.get(which + ".comb", comb)

    def own(self, name: str, y: np.ndarray) -> np.ndarray:
        """The reference's own output of sub-op `name` (what `out` captured), else y."""
        return self.capture[name] if self.capture is not None and name in self.capture else y


def stored(rows: np.ndarray, num: Numerics) -> np.ndarray:
    """Rows as the KV store holds them: unchanged, or rounded by `num.kv_round`.  [r, d] -> [r, d]."""
    return rows if num.kv_round is None else num.kv_round(rows)


def run_compressor(state: CompressorState, x: np.ndarray, pos: np.ndarray, store: WeightStore, prefix: str,
                   post: Callable[[np.ndarray, np.ndarray], np.ndarray], num: Numerics, tap: Tap, name: str) -> None:
    """Project the chunk, emit every completed block's row, post-process it at j·m and append it to state.rows.

    x [n, D], pos [n]; `prefix` is 'blk.l.attn_compressor' or 'blk.l.indexer_compressor'; `name` the rows' capture.
    """
    kv, score = compressor_project(x, store.matrix(prefix + "_kv.weight"), store.matrix(prefix + "_gate.weight"),
                                   store.dense(prefix + "_ape.weight"), pos)
    rows, first = compressor_update(state, kv, score)
    if len(rows):
        rows = tap.pooled(name, rows, x.shape[1])
        j_pos = (first + np.arange(len(rows))) * state.ratio
        state.rows = np.concatenate([state.rows, stored(post(rows, j_pos), num)])


def project_qkv(store: WeightStore, cfg: ModelConfig, p: str, x: np.ndarray, pos: np.ndarray, rope: RopeTable,
                num: Numerics, tap: Tap) -> tuple[np.ndarray, ...]:
    """qr, q (before RoPE), kv latent, q after RoPE, k = the stored raw KV row (RoPE, FP8 sim, store rounding).

    x [n, D], pos [n] -> qr [n, R_q], q / q_rot [n, n_heads, hd], kv / k [n, hd] (spec attention §2-§3, §6.1).
    """
    qr, q = q_path(x, store.matrix(p + "attn_q_a.weight"), store.dense(p + "attn_q_a_norm.weight"),
                   store.matrix(p + "attn_q_b.weight"), cfg.n_heads, cfg.norm_eps)
    q = tap.out("q_path", q, cfg.dim)
    kv = tap.out("kv_latent", kv_latent(x, store.matrix(p + "attn_kv.weight"),
                                        store.dense(p + "attn_kv_a_norm.weight"), cfg.norm_eps), cfg.dim)
    k = apply_rope(kv, pos, rope)
    if num.fp8_kv:
        k = fp8_sim_nope(k, cfg.nope_dim)
    return qr, q, kv, tap.out("rope_q", apply_rope(q, pos, rope), 2), tap.out("rope_kv", stored(k, num), 2)


def compress_and_select(store: WeightStore, cfg: ModelConfig, layer: int, st: LayerState, x: np.ndarray,
                        qr: np.ndarray, pos: np.ndarray, rope: RopeTable, num: Numerics, tap: Tap,
                        workers: Workers) -> np.ndarray | None:
    """Emit this chunk's compressed rows (main and indexer) and, on CSA layers, the indexer's selection (§7-§8).

    x [n, D], qr [n, R_q], pos [n] -> Sel int [n, top_k] (-1 padded), or None off CSA layers.
    """
    p, eps = f"blk.{layer}.", cfg.norm_eps
    if cfg.ratio(layer) > 0:
        norm = store.dense(p + "attn_compressor_norm.weight")
        run_compressor(st.comp, x, pos, store, p + "attn_compressor",
                       lambda r, jp: main_row_post(r, jp, norm, eps, rope, num.fp8_kv, cfg.nope_dim), num, tap,
                       "comp_rows")
        st.comp.rows = tap.rows("comp_rows", st.comp.rows)
    if not cfg.has_indexer(layer):
        tap.rows("index_rows", np.zeros((0, cfg.index_head_dim), x.dtype))
        return None
    norm_i = store.dense(p + "indexer_compressor_norm.weight")
    run_compressor(st.index, x, pos, store, p + "indexer_compressor",
                   lambda r, jp: index_row_post(r, jp, norm_i, eps, rope, num.fp4_indexer), num, tap, "index_rows")
    q_idx = indexer_queries(qr, store.matrix(p + "indexer.attn_q_b.weight"), pos, rope, cfg.index_n_heads,
                            num.fp4_indexer)
    w_idx = indexer_weights(x, store.matrix(p + "indexer.proj.weight"), cfg.index_head_dim)
    st.index.rows = tap.rows("index_rows", st.index.rows)
    return tap.out("index_sel", select_rows(q_idx, w_idx, st.index.rows, pos, cfg.ratio(layer), cfg.index_topk,
                                            workers, num.tie_seed))


def attention(store: WeightStore, cfg: ModelConfig, layer: int, st: LayerState, x: np.ndarray, pos: np.ndarray,
              rope: RopeTable, num: Numerics, tap: Tap,
              workers: Workers) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """a = Attention(x) for n new positions through the layer's caches (spec attention §11-§12, §16).

    x [n, D] (attn_norm output), pos [n] -> a [n, D], n_comp_visible int [n], index_sel int [n, top_k] (-1 pad).
    """
    p, m, n = f"blk.{layer}.", cfg.ratio(layer), len(pos)
    # the row arrays are never written in place (each emission concatenates a new array): captures need no copies
    qr, _q, _kv, q_rot, k = project_qkv(store, cfg, p, x, pos, rope, num, tap)
    if m == 0:
        tap.rows("comp_rows", np.zeros((0, cfg.head_dim), x.dtype))
    sel = compress_and_select(store, cfg, layer, st, x, qr, pos, rope, num, tap, workers)
    raw = np.concatenate([st.raw, k])
    comp = st.comp.rows if m > 0 else np.zeros((0, cfg.head_dim), x.dtype)
    o = tap.out("attn_heads", attend(q_rot, pos, raw, int(pos[0]) - len(st.raw), cfg.window_size, comp, m, sel,
                                     store.dense(p + "attn_sinks.weight"), 1.0 / math.sqrt(cfg.head_dim), workers),
                cfg.window_size + cfg.index_topk)
    a = tap.out("attn_out", grouped_output(apply_rope(o, pos, rope, inverse=True),
                                           store.matrix(p + "attn_output_a.weight"),
                                           store.matrix(p + "attn_output_b.weight"), cfg.o_groups, workers),
                cfg.n_heads * cfg.head_dim // cfg.o_groups)
    st.raw = raw[max(0, len(raw) - (cfg.window_size - 1)) :]
    st.next_pos += n
    n_vis = (pos + 1) // m if m > 0 else np.zeros(n, np.int64)
    index_sel = sel if sel is not None else np.full((n, cfg.index_topk), -1, np.int64)
    if sel is None:
        tap.out("index_sel", index_sel)
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
        num: Numerics, tap: Tap, workers: Workers) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
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
    weights = tap.out("expert_weights", routing_weights(scores, ids, cfg.route_scale), 1)
    ids = tap.out("expert_ids", ids)
    if tap.given:
        ids = expert_id_table(ids, n, cfg, layer, "the candidate's expert ids")

    def expert(e: int) -> tuple[Matrix, Matrix, Matrix]:
        return (store.expert_matrix(p + "ffn_gate_exps.weight", e), store.expert_matrix(p + "ffn_up_exps.weight", e),
                store.expert_matrix(p + "ffn_down_exps.weight", e))

    inner = store.dense(p + "ffn_down_shexp.weight").shape[1]
    routed = tap.out("routed_out", routed_experts(x, ids, weights, expert, cfg.swiglu_limit[layer], workers),
                     inner)
    shared = tap.out("shared_out", expert_ffn(x, store.matrix(p + "ffn_gate_shexp.weight"),
                                              store.matrix(p + "ffn_up_shexp.weight"),
                                              store.matrix(p + "ffn_down_shexp.weight"), cfg.swiglu_limit_shexp[layer]),
                     inner)
    return routed + shared, tap.own("expert_ids", ids), tap.own("expert_weights", weights), margin


def block_forward(store: WeightStore, cfg: ModelConfig, layer: int, st: LayerState, X: np.ndarray,
                  tokens: np.ndarray, start_pos: int, rope: RopeTable, num: Numerics, tap: Tap,
                  workers: Workers) -> LayerOutput:
    """X' = layer(X) for n positions start_pos.. (spec residual-ffn §5); sub-ops through `tap`.

    X [n, H, D], tokens [n] -> LayerOutput (attention half-carrier, carrier, diagnostics, captures): the
    reference's own outputs, also in op-level teacher forcing.
    """
    if start_pos != st.next_pos:
        raise ParityError(f"layer {layer}: chunk starts at position {start_pos} but the state expects "
                          f"{st.next_pos} (feed positions in order through one state)")
    p, H = f"blk.{layer}.", cfg.hc_mult
    pos = start_pos + np.arange(len(X))
    hc_args = (cfg.norm_eps, cfg.hc_eps, cfg.hc_sinkhorn_iters)
    if tap.jitter is not None:
        X = tap.jitter(X, "carrier", 1)

    u, pre_a, post_a, comb_a = hc_pre(X, store.matrix(p + "hc_attn_fn.weight"), store.dense(p + "hc_attn_scale.weight"),
                                      store.dense(p + "hc_attn_base.weight"), *hc_args)
    u = tap.out("hc_attn_pre", u, H)
    x = tap.out("attn_norm", rms_norm(u, store.dense(p + "attn_norm.weight"), cfg.norm_eps))
    a, n_vis, index_sel = attention(store, cfg, layer, st, x, pos, rope, num, tap, workers)
    Y = tap.out("hc_attn_post", hc_post(a, X, *tap.mix("hc_attn", post_a, comb_a)), H + 1)

    v, pre_f, post_f, comb_f = hc_pre(Y, store.matrix(p + "hc_ffn_fn.weight"), store.dense(p + "hc_ffn_scale.weight"),
                                      store.dense(p + "hc_ffn_base.weight"), *hc_args)
    v = tap.out("hc_ffn_pre", v, H)
    xf = tap.out("ffn_norm", rms_norm(v, store.dense(p + "ffn_norm.weight"), cfg.norm_eps))
    f, ids, weights, margin = moe(store, cfg, layer, xf, tokens, start_pos, num, tap, workers)
    X_out = tap.out("hc_ffn_post", hc_post(f, Y, *tap.mix("hc_ffn", post_f, comb_f)), H + 1)
    Y, X_out = tap.own("hc_attn_post", Y), tap.own("hc_ffn_post", X_out)

    for name, arr in ((f"blk.{layer}.attn", Y), (f"blk.{layer}", X_out)):
        if not np.isfinite(arr).all():
            raise ParityError(f"non-finite carrier at checkpoint {name} (positions {pos[0]}..{pos[-1]})")
    diag = LayerDiag(hc_attn=(pre_a, post_a, comb_a), hc_ffn=(pre_f, post_f, comb_f), expert_ids=ids,
                     expert_weights=weights, router_margin=margin, n_comp_visible=n_vis,
                     index_sel=index_sel if cfg.has_indexer(layer) else None)
    return LayerOutput(attn_carrier=Y, carrier=X_out, diag=diag, captures=tap.capture or {})
