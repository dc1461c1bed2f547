"""Attention sub-layer ops: q path, shared KV latent, sink attention over the key set, grouped output (spec attention).

One KV head of width hd serves as key and value for every query head (MQA, K = V). A query at position t
attends to the raw rows of the last `window` tokens (itself included) plus the visible compressed rows.
"""

from __future__ import annotations

import numpy as np

from reference_cpu.linear import Weight, linear, split_rows
from reference_cpu.norms import rms_norm, rms_norm_unweighted
from reference_cpu.threads import Workers


def q_path(x: np.ndarray, wq_a: Weight, q_norm: np.ndarray, wq_b: Weight, n_heads: int,
           eps: float) -> tuple[np.ndarray, np.ndarray]:
    """qr = RMSNorm_{q_norm}(W_qa x); q_h = RMSNorm((W_qb qr)_h) per head, unweighted, before RoPE (§2).

    x [n, D], wq_a [R_q, D], q_norm [R_q], wq_b [n_heads·hd, R_q] -> qr [n, R_q], q [n, n_heads, hd].
    """
    qr = rms_norm(linear(x, wq_a), q_norm, eps)
    q = linear(qr, wq_b).reshape(x.shape[0], n_heads, -1)
    return qr, rms_norm_unweighted(q, eps)


def kv_latent(x: np.ndarray, wkv: Weight, kv_norm: np.ndarray, eps: float) -> np.ndarray:
    """kv = RMSNorm_{kv_norm}(W_kv x), before RoPE and the FP8 round trip (§3).

    x [n, D], wkv [hd, D], kv_norm [hd] -> [n, hd].
    """
    return rms_norm(linear(x, wkv), kv_norm, eps)


def sink_attention(q: np.ndarray, keys: np.ndarray, sink: np.ndarray, scale: float) -> np.ndarray:
    """o_h = Σ_s exp(z_hs - M) k_s / (exp(sink_h - M) + Σ_s exp(z_hs - M)), z = scale·q_h·k_s; sink unscaled (§5).

    q [n_heads, hd], keys [nk, hd] (values = keys), sink [n_heads] -> [n_heads, hd].
    """
    z = (q @ keys.T) * scale
    M = np.maximum(z.max(axis=-1), sink)[:, None]
    e = np.exp(z - M)
    den = np.exp(sink[:, None] - M) + e.sum(axis=-1, keepdims=True)
    return (e / den) @ keys


def key_set(t: int, raw: np.ndarray, raw_start: int, window: int, comp: np.ndarray, ratio: int,
            sel: np.ndarray | None) -> np.ndarray:
    """S_t = raw rows of positions max(0, t-W+1)..t ⊕ compressed rows (HCA: all j < ⌊(t+1)/m⌋; CSA: Sel_t) (§9).

    raw [nr, hd] holds positions raw_start.., comp [N, hd], sel [top_k] (-1 padded) or None -> [nk, hd].
    """
    lo = max(0, t - window + 1)
    if lo < raw_start or t - raw_start >= len(raw):
        raise ValueError(f"raw rows cover positions {raw_start}..{raw_start + len(raw) - 1}, query {t} needs {lo}..{t}")
    keys = raw[lo - raw_start : t - raw_start + 1]
    if ratio == 0:
        return keys
    visible = comp[: (t + 1) // ratio] if sel is None else comp[sel[sel >= 0]]
    return np.concatenate([keys, visible])


def attend(q: np.ndarray, pos: np.ndarray, raw: np.ndarray, raw_start: int, window: int, comp: np.ndarray,
           ratio: int, sel: np.ndarray | None, sink: np.ndarray, scale: float, workers: Workers) -> np.ndarray:
    """Sink attention of every query over its own key set S_t; one query at a time, vectorized over heads (§5, §9).

    q [n, n_heads, hd] (after RoPE), pos [n], raw [nr, hd] from raw_start, comp [N, hd], sel [n, top_k] or None
    -> [n, n_heads, hd] (before inverse RoPE). Each query's arithmetic depends only on its own keys, so a chunk
    and single-token calls with the same rows give identical outputs, and so does any split over `workers`.
    """
    def queries(idx: range) -> np.ndarray:
        return np.stack([sink_attention(q[i], key_set(int(pos[i]), raw, raw_start, window, comp, ratio,
                                                      None if sel is None else sel[i]), sink, scale) for i in idx])

    return np.concatenate(workers.map(queries, workers.split(len(pos))))


def grouped_output(o: np.ndarray, wo_a: Weight, wo_b: Weight, groups: int, workers: Workers) -> np.ndarray:
    """a = W_ob · (z_0 ⊕ … ⊕ z_{G-1}), z_g = W_oa[g-th R_o rows] · (heads of group g concatenated) (§10).

    o [n, n_heads, hd] (after inverse RoPE), wo_a [G·R_o, n_heads·hd/G], wo_b [D, G·R_o] -> [n, D].
    Block-diagonal: group g uses only its own R_o rows of W_oa; the groups run over `workers`.
    """
    n = o.shape[0]
    u = o.reshape(n, groups, -1).transpose(1, 0, 2)                  # [G, n, gw]
    w = split_rows(wo_a, groups)                                     # G x [R_o, gw]
    z = np.stack(workers.map(lambda g: linear(u[g], w[g]), range(groups)), axis=1)  # [n, G, R_o]
    return linear(z.reshape(n, -1), wo_b)
