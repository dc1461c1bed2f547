"""Attention sub-layer ops in torch (spec attention): the layer cache, visibility rule, masked sink attention over
banded raw keys ⊕ compressed rows, grouped output.

One KV head of width hd serves as key and value for every query head (MQA, K = V). A query chunk's keys are its
band of raw rows ⊕ all compressed rows, with a boolean mask combining the raw window, the compressed-row visibility
rule and the indexer selection. Scores are materialised one (query chunk x head chunk) at a time, within `budget`
elements.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from gpu_engine.compressor import CompressorCache, new_compressor_cache
from parity.gguf.config import ModelConfig


@dataclass
class LayerCache:
    pos: int                  # next position this layer expects
    raw: torch.Tensor         # [<= window-1, hd] last raw KV rows (RoPE'd, FP8-simulated)
    main: CompressorCache | None = None
    index: CompressorCache | None = None


def new_layer_cache(cfg: ModelConfig, ratio: int, device: torch.device, dtype: torch.dtype) -> LayerCache:
    """Empty caches of a layer run with compress ratio `ratio` (CSA, with the indexer, when ratio = 4)."""
    hd, di, csa = cfg.head_dim, cfg.index_head_dim, ratio == 4
    cache = LayerCache(0, torch.zeros(0, hd, device=device, dtype=dtype))
    if ratio > 0:
        cache.main = new_compressor_cache((2 if csa else 1) * hd, hd, device, dtype)
    if csa:
        cache.index = new_compressor_cache(2 * di, di, device, dtype)
    return cache


def n_visible(t: torch.Tensor, m: int) -> torch.Tensor:
    """Compressed rows visible to query t: ⌊(t+1)/m⌋ ((j+1)·m <= t+1).  t int [n] -> int [n]."""
    return torch.div(t + 1, m, rounding_mode="floor")


def n_visible_late(t: torch.Tensor, m: int) -> torch.Tensor:
    """The compressed-row-visible-late fault: `n_visible` one token late, ⌊t/m⌋."""
    return torch.div(t, m, rounding_mode="floor")


def _attend_chunks(q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, budget: int,
                   probs: Callable[[torch.Tensor, slice], torch.Tensor]) -> torch.Tensor:
    """o = probs(z) · keys with z = q·k/√d masked to the allowed keys, one (query chunk x head chunk) at a time.
    q [n, nh, d], keys [nk, d], mask bool [n, nk]; probs(z [h, nq, nk], heads) -> [h, nq, nk]."""
    n, nh, d = q.shape
    nk = keys.shape[0]
    scale = 1.0 / math.sqrt(d)
    out = torch.empty_like(q)
    q_chunk = max(1, min(n, budget // max(nk, 1)))
    for q0 in range(0, n, q_chunk):
        qs = slice(q0, min(n, q0 + q_chunk))
        nq = qs.stop - qs.start
        h_chunk = max(1, min(nh, budget // max(nq * nk, 1)))
        for h0 in range(0, nh, h_chunk):
            hs = slice(h0, min(nh, h0 + h_chunk))
            z = torch.einsum("nhd,kd->hnk", q[qs, hs], keys) * scale
            z = z.masked_fill(~mask[qs][None], -math.inf)
            out[qs, hs] = torch.einsum("hnk,kd->nhd", probs(z, hs), keys)
    return out


def sink_attention(q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, sinks: torch.Tensor,
                   budget: int) -> torch.Tensor:
    """o_h = Σ_s exp(z_hs) k_s / (exp(sink_h) + Σ_s exp(z_hs)), z = q·k/√d over the allowed keys (K = V).
    q [n, nh, d], keys [nk, d], mask bool [n, nk], sinks [nh] -> [n, nh, d]; at most `budget` scores at once."""
    nk = keys.shape[0]

    def probs(z: torch.Tensor, hs: slice) -> torch.Tensor:
        sink = sinks[hs].reshape(-1, 1, 1).expand(-1, z.shape[1], 1)
        return torch.softmax(torch.cat([z, sink], dim=-1), dim=-1)[..., :nk]

    return _attend_chunks(q, keys, mask, budget, probs)


def sink_attention_no_sink(q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, sinks: torch.Tensor,
                           budget: int) -> torch.Tensor:
    """The sink-dropped fault: `sink_attention` with the sink left out of the denominator (plain softmax)."""
    return _attend_chunks(q, keys, mask, budget, lambda z, hs: torch.softmax(z, dim=-1))


AttentionOp = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


def chunk_mask(t: torch.Tensor, band_pos: torch.Tensor, window: int, n_vis: torch.Tensor, n_comp: int,
               sel: torch.Tensor | None) -> torch.Tensor:
    """Keys a query chunk may see: raw rows with t - W < s <= t, then compressed rows j < n_vis(t) (and in Sel_t).
    t [q], band_pos [nb] raw positions, n_vis int [q], sel int [q, top_k] -1 padded or None -> bool [q, nb + R]."""
    raw_mask = (band_pos[None, :] <= t[:, None]) & (band_pos[None, :] > t[:, None] - window)
    comp_mask = torch.arange(n_comp, device=t.device)[None, :] < n_vis[:, None]
    if sel is not None:
        chosen = torch.zeros(t.shape[0], n_comp + 1, dtype=torch.bool, device=t.device)
        chosen.scatter_(1, torch.where(sel >= 0, sel, n_comp), True)
        comp_mask = comp_mask & chosen[:, :n_comp]
    return torch.cat([raw_mask, comp_mask], dim=1)


def attend(q: torch.Tensor, start_pos: int, raw: torch.Tensor, raw0: int, window: int, comp: torch.Tensor,
           n_vis: torch.Tensor, sel: torch.Tensor | None, sinks: torch.Tensor, attention: AttentionOp,
           budget: int) -> torch.Tensor:
    """Every query over its key set S_t: query chunks with banded raw keys ⊕ all compressed rows, masked.
    q [n, nh, hd] (after RoPE) at positions start_pos.., raw [nr, hd] holding positions raw0.., comp [R, hd],
    n_vis int [n], sel [n, top_k] or None -> [n, nh, hd] (before inverse RoPE)."""
    n, R = q.shape[0], comp.shape[0]
    pos = torch.arange(start_pos, start_pos + n, device=q.device)
    out = torch.empty_like(q)
    step = max(1, budget // (2 * window + R))
    for a in range(0, n, step):
        b = min(n, a + step)
        lo = max(0, start_pos + a - window + 1 - raw0)           # banded raw keys of this query chunk
        band_pos = torch.arange(raw0 + lo, start_pos + b, device=q.device)
        mask = chunk_mask(pos[a:b], band_pos, window, n_vis[a:b], R, None if sel is None else sel[a:b])
        out[a:b] = attention(q[a:b], torch.cat([raw[lo : start_pos + b - raw0], comp]), mask, sinks, budget)
    return out



def attend_ring_exact_window(q: torch.Tensor, start_pos: int, raw: torch.Tensor, raw0: int, window: int,
                             comp: torch.Tensor, n_vis: torch.Tensor, sel: torch.Tensor | None, sinks: torch.Tensor,
                             attention: AttentionOp, budget: int) -> torch.Tensor:
    """The spec-ring-exact-window fault (spec v4-mtp-dspark §4.4, D1): a multi-row chunk after the prompt (a verify
    batch) in a ring of exactly W slots, every row written before any attends. Query t's key of position s then holds
    the row of s + W whenever the chunk wrote s + W (s <= end - 1 - W): the earliest rows read later rows in place of
    the oldest keys of their window. One-row chunks (decode) and the prompt are `attend` itself.  Same shapes as
    `attend`."""
    n, end = q.shape[0], start_pos + q.shape[0]
    if n == 1 or start_pos == 0:
        return attend(q, start_pos, raw, raw0, window, comp, n_vis, sel, sinks, attention, budget)
    out = torch.empty_like(q)
    for a in range(n):
        t = start_pos + a
        s = torch.arange(max(raw0, t - window + 1), t + 1, device=q.device)
        src = torch.where(s <= end - 1 - window, s + window, s)
        t1 = torch.tensor([t], device=q.device)
        mask = chunk_mask(t1, s, window, n_vis[a : a + 1], comp.shape[0], None if sel is None else sel[a : a + 1])
        out[a : a + 1] = attention(q[a : a + 1], torch.cat([raw[src - raw0], comp]), mask, sinks, budget)
    return out



def restore_keeping_rows(live: list[LayerCache], saved: list[LayerCache]) -> list[LayerCache]:
    """The spec-no-compressor-restore fault (spec v4-mtp-dspark §4.4, D2): a restore that brings back the raw
    windows and the compressors' pending (κ, σ) but keeps the emitted rows (and their count) of the live state, so
    the rows of blocks a rejected verify row completed stay: phantom rows, and the replay appends them again."""
    out = []
    for now, old in zip(live, saved, strict=True):
        comp = [None if o is None else replace(o, rows=n.rows)
                for n, o in ((now.main, old.main), (now.index, old.index))]
        out.append(LayerCache(old.pos, old.raw, *comp))
    return out
