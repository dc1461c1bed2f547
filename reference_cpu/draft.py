"""Draft-head ops of DeepSeek-V4 (spec v4-mtp-dspark §2-§4): the MTP input and its (carrier, token) pairing, the
DSpark taps and main rows, the DSpark ring of committed rows and its block attention, the Markov bias chain and the
confidence logit.

The MTP block and each DSpark stage are otherwise an ordinary ratio-0 layer (`reference_cpu.model`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from parity.contract.errors import ParityError
from reference_cpu.attention import sink_attention
from reference_cpu.linear import Weight, linear
from reference_cpu.norms import rms_norm

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
