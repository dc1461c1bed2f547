"""Draft-head ops of DeepSeek-V4 (spec v4-mtp-dspark §2-§4): the MTP input and its (carrier, token) pairing, the
DSpark taps and main rows, the DSpark ring of committed rows and its block attention, the Markov bias chain and the
confidence logit.

The MTP block and each DSpark stage are otherwise an ordinary ratio-0 layer (`reference_cpu.model`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from parity.contract.engine import LayerDiag, LayerOutput
from parity.contract.errors import ParityError
from parity.gguf.config import ModelConfig
from reference_cpu.attention import grouped_output, kv_latent, sink_attention
from reference_cpu.hc import hc_post, hc_pre
from reference_cpu.linear import Weight, linear
from reference_cpu.model import Numerics, Tap, moe, project_qkv, stored
from reference_cpu.norms import rms_norm
from reference_cpu.quant_sim import fp8_sim_nope
from reference_cpu.rope import RopeTable, apply_rope
from reference_cpu.threads import Workers
from reference_cpu.weights_cache import WeightStore

PAIRINGS = ("prev", "same")


def mtp_pairs(carriers: np.ndarray, tokens: np.ndarray, pairing: str) -> tuple[np.ndarray, np.ndarray]:
    """The MTP's (carrier, token) pairs from trunk rows of consecutive positions (§2.3): prev pairs X^(L)_{p-1}
    with t_p (n-1 pairs), same pairs X^(L)_p with t_p (n pairs); each pair's logits predict t_{p+1}.

    carriers [n, H, D], tokens [n] -> G [n', H, D], tau [n'].
    """
    if pairing == "prev":
        return carriers[:-1], tokens[1:]
    if pairing == "same":
        return carriers, tokens
    raise ParityError(f"mtp_pairing must be one of {', '.join(PAIRINGS)}, got {pairing!r}")


def mtp_input(e_row: np.ndarray, carrier: np.ndarray, enorm_w: np.ndarray, hnorm_w: np.ndarray, e_proj: Weight,
              h_proj: Weight, eps: float) -> np.ndarray:
    """X0[s] = W_e RMSNorm_enorm(e) + W_h RMSNorm_hnorm(G[s]): hnorm per stream, not over the flat H·D vector (§2.2).

    e_row [n, D] (embedding rows E[τ]), carrier G [n, H, D], e_proj / h_proj [D, D] -> [n, H, D].
    """
    n, H, D = carrier.shape
    e = linear(rms_norm(e_row, enorm_w, eps), e_proj)
    h = linear(rms_norm(carrier, hnorm_w, eps).reshape(n * H, D), h_proj).reshape(n, H, -1)
    return e[:, None, :] + h


def dspark_taps(carriers: Sequence[np.ndarray]) -> np.ndarray:
    """T = concat over the tapped layers l of mean_s X^(l+1)[s], the stream mean of each layer's output carrier (§3.2).

    m carriers [T, H, D] -> [T, m·D].
    """
    return np.concatenate([c.mean(axis=1) for c in carriers], axis=-1)


def check_tap_carriers(carriers: Sequence[np.ndarray], layers: Sequence[int], hc: int, dim: int) -> list[np.ndarray]:
    """`dspark_taps`' input: one carrier [c >= 1, H, D] per tapped layer, all of one c; else an error naming the
    shapes.  -> the carriers as arrays."""
    arrays = [np.asarray(c) for c in carriers]
    shapes = [a.shape for a in arrays]
    if len(arrays) != len(layers) or len(set(shapes)) != 1 or shapes[0][1:] != (hc, dim) or shapes[0][0] < 1:
        raise ParityError(f"dspark_taps: carriers of shapes {shapes}, expected {len(layers)} (the output carriers "
                          f"of layers {', '.join(map(str, layers))}) of one shape (c >= 1, {hc}, {dim})")
    return arrays


def check_taps(taps: np.ndarray, m: int, dim: int) -> np.ndarray:
    """taps must be [c >= 1, m·D] (the rows `dspark_taps` makes): anything else is an error naming the shape."""
    if taps.ndim != 2 or len(taps) < 1 or taps.shape[1] != m * dim:
        raise ParityError(f"dspark_round: taps of shape {taps.shape}, expected (c >= 1, {m * dim}) = "
                          f"{m} tapped layers x D = {dim}")
    return taps


def dspark_main(taps: np.ndarray, main_proj: Weight, main_norm_w: np.ndarray, eps: float) -> np.ndarray:
    """M = RMSNorm_main_norm(W_main T) (§3.3).  taps [T, m·D], main_proj [D, m·D] -> [T, D]."""
    return rms_norm(linear(taps, main_proj), main_norm_w, eps)


def first_max(x: np.ndarray) -> int:
    """The index of the first maximum of x (§4.2: first-max ties everywhere).  x [V] -> int."""
    return int(np.argmax(x))


def markov_chain(logits: np.ndarray, anchor: int, w1: np.ndarray,
                 w2: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """o_0 = anchor; for j: u_j = W1[o_j], ℓ_j += W2 u_j, o_{j+1} = first argmax ℓ_j (temperature 0, §3.3).

    logits [B, V], w1 / w2 [V, r] -> drafts o_1..o_B int [B], biased logits [B, V], u [B, r].
    """
    B = logits.shape[0]
    drafts, biased, u = np.zeros(B, np.int64), np.empty_like(logits), np.empty((B, w1.shape[1]), logits.dtype)
    prev = int(anchor)
    for j in range(B):
        u[j] = w1[prev]
        biased[j] = logits[j] + linear(u[j : j + 1], w2)[0]
        prev = drafts[j] = first_max(biased[j])
    return drafts, biased, u


def confidence(z: np.ndarray, u: np.ndarray, w_c: np.ndarray) -> np.ndarray:
    """c_j = w_c · [z_j ; u_j]: a raw logit (no bias, no sigmoid; §3.3).

    z [B, D] (HC head output, pre-norm), u [B, r] (Markov embeddings), w_c [1, D + r] -> [B].
    """
    return linear(np.concatenate([z, u], axis=-1), w_c)[:, 0]


@dataclass(frozen=True)
class Ring:
    """A DSpark stage's W-slot ring of committed main KV rows: rows[k] holds position pos[k] (-1: empty slot)."""

    rows: np.ndarray   # [W, hd]
    pos: np.ndarray    # int [W]

    @classmethod
    def empty(cls, window: int, width: int, dtype: np.dtype) -> Ring:
        return cls(np.zeros((window, width), dtype), np.full(window, -1, np.int64))


def ring_write(ring: Ring, rows: np.ndarray, pos: np.ndarray) -> Ring:
    """Row i lands at slot pos_i mod W, in order (a later row overwrites an earlier one in its slot; §3.4-§3.5).

    ring (W slots), rows [c, hd], pos int [c] -> a new Ring (the given one is not changed).
    """
    W = len(ring.pos)
    keep = slice(max(0, len(pos) - W), None)   # of more than W rows only the last W survive
    new_rows, new_pos = ring.rows.copy(), ring.pos.copy()
    new_rows[pos[keep] % W], new_pos[pos[keep] % W] = rows[keep], pos[keep]
    return Ring(new_rows, new_pos)


def ring_visible(ring: Ring, p: int, window: int) -> np.ndarray:
    """Slots a draft block at start position p attends: committed rows of positions p-W < q <= p (§3.4).

    -> bool [W].
    """
    return (ring.pos >= 0) & (ring.pos <= p) & (ring.pos > p - window)


def dspark_attend(q: np.ndarray, block_k: np.ndarray, ring: Ring, p: int, window: int, sink: np.ndarray,
                  scale: float) -> np.ndarray:
    """Every block slot j attends the visible ring rows ⊕ all B block rows, bidirectional inside the block (§3.4).

    q [B, n_heads, hd] (after RoPE at p+1+j), block_k [B, hd] (never stored), sink [n_heads] -> [B, n_heads, hd].
    """
    keys = np.concatenate([ring.rows[ring_visible(ring, p, window)], block_k])
    return np.stack([sink_attention(q[j], keys, sink, scale) for j in range(len(q))])


def main_kv(store: WeightStore, cfg: ModelConfig, layer: int, M: np.ndarray, pos: np.ndarray, rope: RopeTable,
            num: Numerics) -> np.ndarray:
    """K_M = FP8SIM(RoPE(RMSNorm_kv_norm(W_kv M), pos)) of a stage, as its ring stores it (§3.4).

    M [c, D] main rows, pos [c] -> [c, hd].
    """
    p = f"blk.{layer}."
    k = apply_rope(kv_latent(M, store.matrix(p + "attn_kv.weight"), store.dense(p + "attn_kv_a_norm.weight"),
                             cfg.norm_eps), pos, rope)
    return stored(fp8_sim_nope(k, cfg.nope_dim) if num.fp8_kv else k, num)


def hc_pre_of(store: WeightStore, cfg: ModelConfig, X: np.ndarray,
              prefix: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """HC_pre with the weights `prefix`fn / scale / base ('blk.l.hc_attn_' or 'blk.l.hc_ffn_').  X [n, H, D]."""
    return hc_pre(X, store.matrix(prefix + "fn.weight"), store.dense(prefix + "scale.weight"),
                  store.dense(prefix + "base.weight"), cfg.norm_eps, cfg.hc_eps, cfg.hc_sinkhorn_iters)


def dspark_stage(store: WeightStore, cfg: ModelConfig, layer: int, ring: Ring, X: np.ndarray, tokens: np.ndarray,
                 p: int, rope: RopeTable, num: Numerics, workers: Workers,
                 jitter: Callable[[np.ndarray, str, int], np.ndarray] | None = None) -> LayerOutput:
    """One DSpark stage on the B block slots at positions p+1..p+B: an ordinary ratio-0 block whose attention keys
    are the stage's ring (committed rows ≤ p) ⊕ the block's own rows, bidirectional (§3.3-§3.4); nothing is stored.

    X [B, H, D], tokens [B] (anchor, noise…) -> LayerOutput (attention half-carrier, carrier, diagnostics);
    jitter: a round-off twin's perturbation of the sub-ops that go through the tap (`model.Tap`), None when exact.
    """
    pre, B, eps = f"blk.{layer}.", len(X), cfg.norm_eps
    pos, tap = p + 1 + np.arange(B), Tap(None, jitter=jitter)
    u, pre_a, post_a, comb_a = hc_pre_of(store, cfg, X, pre + "hc_attn_")
    x = rms_norm(u, store.dense(pre + "attn_norm.weight"), eps)
    _qr, _q, _kv, q_rot, block_k = project_qkv(store, cfg, pre, x, pos, rope, num, tap)
    o = dspark_attend(q_rot, block_k, ring, p, cfg.window_size, store.dense(pre + "attn_sinks.weight"),
                      1.0 / math.sqrt(cfg.head_dim))
    a = grouped_output(apply_rope(o, pos, rope, inverse=True), store.matrix(pre + "attn_output_a.weight"),
                       store.matrix(pre + "attn_output_b.weight"), cfg.o_groups, workers)
    Y = hc_post(a, X, post_a, comb_a)
    v, pre_f, post_f, comb_f = hc_pre_of(store, cfg, Y, pre + "hc_ffn_")
    xf = rms_norm(v, store.dense(pre + "ffn_norm.weight"), eps)
    f, ids, weights, margin = moe(store, cfg, layer, xf, tokens, int(pos[0]), num, tap, workers)
    X_out = hc_post(f, Y, post_f, comb_f)
    if not np.isfinite(X_out).all():
        raise ParityError(f"DSpark stage layer {layer}: non-finite carrier (block at positions {pos[0]}..{pos[-1]})")
    diag = LayerDiag(hc_attn=(pre_a, post_a, comb_a), hc_ffn=(pre_f, post_f, comb_f), expert_ids=ids,
                     expert_weights=weights, router_margin=margin, n_comp_visible=np.zeros(B, np.int64),
                     index_sel=None)
    return LayerOutput(attn_carrier=Y, carrier=X_out, diag=diag)
