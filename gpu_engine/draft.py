"""Draft-head ops in torch (spec v4-mtp-dspark §2-§4), the twins of `reference_cpu.draft`: the MTP input and its
(carrier, token) pairing, the carrier the MTP block hands on and its HC head, DSpark taps and main rows, the DSpark ring
of committed rows and the block's key mask, the Markov bias chain and the confidence logit.

The engine reaches each op through `model.Ops` (the defaults here); after each correct op comes the alternative op of
the drafter fault that replaces it (`faults.compose`), with the fault's public origin (spec §4.6). The MTP block and
each DSpark stage are otherwise an ordinary ratio-0 layer (`gpu_engine.model`, `gpu_engine.draft_blocks`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from gpu_engine.hc import hc_head
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


def mtp_pairs_same(carriers: Tensor, tokens: Tensor, pairing: str) -> tuple[Tensor, Tensor]:
    """Fault `mtp-pairing-same`: asked for `prev`, pairs X^(L)_p with t_p (p >= 1, n-1 pairs): the carrier one
    position late. Origin: the pairing is an engine convention (spec §2.3): ds4 pairs (X^(L)_p, t_p), llama.cpp,
    llama-cpp-python's MTPDraftProvider and vLLM pair (X^(L)_{p-1}, t_p); a driver of one fed to the other.
    carriers [n, H, D], tokens [n] -> G [n', H, D], tau [n']."""
    if pairing == "prev":
        return carriers[1:], tokens[1:]
    return mtp_pairs(carriers, tokens, pairing)


def mtp_input(e_row: Tensor, carrier: Tensor, enorm_w: Tensor, hnorm_w: Tensor, e_proj: Tensor, h_proj: Tensor,
              eps: float) -> Tensor:
    """X0[s] = W_e RMSNorm_enorm(e) + W_h RMSNorm_hnorm(G[s]), hnorm per stream.
    e_row [n, D], carrier [n, H, D], e_proj / h_proj [D, D] -> [n, H, D]."""
    e = rms_norm(e_row, enorm_w, eps) @ e_proj.T
    return e[:, None, :] + rms_norm(carrier, hnorm_w, eps) @ h_proj.T


def mtp_input_hnorm_flat(e_row: Tensor, carrier: Tensor, enorm_w: Tensor, hnorm_w: Tensor, e_proj: Tensor,
                         h_proj: Tensor, eps: float) -> Tensor:
    """Fault `mtp-hnorm-flat`: hnorm as one RMSNorm over the flat H·D carrier (its weight repeated per stream)
    instead of one per stream. Origin: spec §4.6 D7, the MTP input's carrier shape mishandled
    (GDzhu01/vllm-ascend-deepseekv4 PR #132, ROCm/ATOM #1742); spec §2.2 "per stream (NOT over the flat vector)".
    e_row [n, D], carrier [n, H, D], e_proj / h_proj [D, D] -> [n, H, D]."""
    n, H, D = carrier.shape
    h = rms_norm(carrier.reshape(n, H * D), hnorm_w.repeat(H), eps).reshape(n, H, D)
    return (rms_norm(e_row, enorm_w, eps) @ e_proj.T)[:, None, :] + h @ h_proj.T


def mtp_carrier(attn_carrier: Tensor, carrier: Tensor) -> Tensor:
    """X1, the carrier the MTP block hands to its HC head and to a chained depth: its output after the FFN HC_post.
    attn_carrier Y, carrier X' [n, H, D] -> X' [n, H, D]."""
    return carrier


def mtp_carrier_no_ffn_post(attn_carrier: Tensor, carrier: Tensor) -> Tensor:
    """Fault `mtp-no-hc-post`: the MTP block's FFN HC_post skipped, X1 = Y (the carrier after the attention half;
    the FFN output never mixed in). Origin: spec §4.6 D6, the MTP block missing its final `mhc_post` (vllm-project/vllm
    PR #45240, syncing #44821, #43746).  attn_carrier Y, carrier X' [n, H, D] -> Y [n, H, D]."""
    return attn_carrier


def hc_head_of(w: DeviceWeights, cfg: ModelConfig, X: Tensor, prefix: str) -> Tensor:
    """z = HC_head(X) with the weights `prefix`fn / scale / base (.weight).  X [n, H, D] -> [n, D]."""
    return hc_head(X, w.matrix(prefix + "fn.weight", w.act), w.vector(prefix + "scale.weight"),
                   w.vector(prefix + "base.weight"), cfg.norm_eps, cfg.hc_eps)


def mtp_hc_head(w: DeviceWeights, cfg: ModelConfig, X: Tensor) -> Tensor:
    """z = HC_head_mtp(X1): the MTP's own head `mtp.hc_head_*`.  X [n, H, D] -> [n, D]."""
    return hc_head_of(w, cfg, X, "mtp.hc_head_")


def trunk_hc_head(w: DeviceWeights, cfg: ModelConfig, X: Tensor) -> Tensor:
    """Fault `mtp-trunk-hc-head`: the trunk's head `output_hc_*` on the MTP carrier. Origin: spec §5.1, llama.cpp's
    MTP file stores the MTP's head under the trunk's root names `output_hc_*`, so a loader resolving them in the
    trunk gets the trunk's (a spec-derived injection; no public report of this exact bug).  X [n, H, D] -> [n, D]."""
    return hc_head_of(w, cfg, X, "output_hc_")


def dspark_taps(carriers: Sequence[Tensor]) -> Tensor:
    """T = concat_l mean_s X^(l+1)[s] (stream mean of each tapped layer's output).  m x [T, H, D] -> [T, m·D]."""
    return torch.cat([c.mean(dim=1) for c in carriers], dim=-1)


def dspark_taps_summed(carriers: Sequence[Tensor]) -> Tensor:
    """Fault `dspark-tap-sum`: T = concat_l Σ_s X^(l+1)[s], the stream sum instead of the mean (H times the taps).
    Origin: spec §3.2 (a spec-derived injection: W_main is linear and main_norm scale-invariant up to its eps, so
    the spec expects it to be nearly invisible).  m x [T, H, D] -> [T, m·D]."""
    return torch.cat([c.sum(dim=1) for c in carriers], dim=-1)


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


def markov_chain_unconditioned(logits: Tensor, anchor: int, w1: Tensor, w2: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Fault `dspark-markov-unconditioned`: u_j = W1[anchor] for every slot j, instead of W1 of the token chosen at
    slot j-1; the drafts are still the first argmax of the biased logits. Origin: spec §3.3 (the chain conditions
    on the token actually chosen; PAPER eq. 5 B(x_{k-1}, ·)), a spec-derived injection.
    logits [B, V], w1 / w2 [V, r] -> drafts int64 [B], biased logits [B, V], u [B, r]."""
    u = w1[int(anchor)]
    biased = torch.stack([logits[j] + w2 @ u for j in range(logits.shape[0])])
    drafts = [int(torch.argmax(row)) for row in biased]
    return torch.tensor(drafts, dtype=torch.int64), biased, u[None, :].expand(logits.shape[0], -1)


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


def ring_write_newest_row(ring: Ring, rows: Tensor, pos: Tensor) -> Ring:
    """Fault `dspark-stale-ring`: after the prompt (a write from position 0 fills the ring, as the official prefill
    call does), a round writes only its newest row (position p, as one official call per round), not the rows of the
    anchor and accepted drafts before it. Origin: spec §4.6 D9, stale or missing ring rows (TensorSharp
    `TS_DSV4_DSPARK_CAPTURE=0`: "drafts then go stale"); spec §3.5.  rows [c, hd], pos int [c] -> a new Ring."""
    if int(pos[0]) == 0:
        return ring_write(ring, rows, pos)
    return ring_write(ring, rows[-1:], pos[-1:])


def dspark_mask(ring_pos: Tensor, p: int, window: int, block: int) -> Tensor:
    """Keys of the B block slots: ring slots holding positions p-W < q <= p, then all B block rows (bidirectional).
    ring_pos int [W] -> bool [B, W + B]."""
    ring_ok = (ring_pos >= 0) & (ring_pos <= p) & (ring_pos > p - window)
    both = torch.cat([ring_ok, torch.ones(block, dtype=torch.bool, device=ring_pos.device)])
    return both[None, :].expand(block, -1)


def dspark_mask_causal(ring_pos: Tensor, p: int, window: int, block: int) -> Tensor:
    """Fault `dspark-causal-block`: slot j sees block rows 0..j only (causal inside the block instead of
    bidirectional); the ring keys as `dspark_mask`. Origin: spec §3.4 / §4.6 (a spec-derived injection: the block is
    bidirectional, slot 0 sees the noise slots).  ring_pos int [W] -> bool [B, W + B]."""
    mask = dspark_mask(ring_pos, p, window, block).clone()
    mask[:, ring_pos.shape[0] :] = torch.tril(torch.ones(block, block, dtype=torch.bool, device=ring_pos.device))
    return mask
