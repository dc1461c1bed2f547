"""The attention sub-layer (spec v4-attention) as a batched, cached torch computation.

One code path serves prefill and decode: a call processes n new positions on top of the layer's cache.
Raw KV rows, the compressors' pending tokens and the emitted rows live in `LayerCache`. Queries run in
chunks; a chunk's keys are its band of raw rows ⊕ all compressed rows, with a boolean mask combining the
raw window, the compressed-row visibility rule and the indexer selection. Scores are materialised one
(query chunk x head chunk) at a time, within SCORE_BUDGET elements.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from gpu_engine.ops import fp4_roundtrip, fp8_nope, hadamard_matrix, rms_norm, rope

SCORE_BUDGET = 1 << 22  # max attention scores materialised at once (elements of one head/query chunk)


@dataclass
class CompressorCache:
    """Streaming state of one compressor: pending per-token (κ, σ) from `start` on, and all emitted rows."""

    start: int
    kv: torch.Tensor          # [pending, c*d_c]
    score: torch.Tensor       # [pending, c*d_c] (gate + ape)
    rows: torch.Tensor        # [emitted, d_c] after post-processing


@dataclass
class LayerCache:
    pos: int                  # next position this layer expects
    raw: torch.Tensor         # [<= window-1, hd] last raw KV rows (RoPE'd, FP8-simulated)
    main: CompressorCache | None = None
    index: CompressorCache | None = None


@dataclass
class AttnResult:
    out: torch.Tensor                          # [n, D]
    n_comp_visible: torch.Tensor               # int [n] rows visible by the causal rule (before selection)
    index_sel: torch.Tensor | None             # int [n, top_k], -1 padded; None off CSA layers
    captures: dict[str, torch.Tensor] = field(default_factory=dict)


def n_visible(t: torch.Tensor, m: int, late: bool) -> torch.Tensor:
    """Compressed rows visible to query t: ⌊(t+1)/m⌋ ((j+1)·m <= t+1).  `late`: the compressed-row-visible-late
    fault, ⌊t/m⌋.  t int [n] -> int [n]."""
    return torch.div(t if late else t + 1, m, rounding_mode="floor")


def compress(cache: CompressorCache, kv: torch.Tensor, score: torch.Tensor, start_pos: int, m: int, d_c: int,
             emit: bool, halves_swapped: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Append n tokens' (κ, σ) and pool every block completed by them: softmax over the block's slots per channel.
    HCA (no overlap): slots = the m tokens of block j.  CSA (overlap, c = 2): slots = A halves of block j-1
    (κ=0, σ=-inf for j = 0) and B halves of block j.  kv, score [n, c*d_c] -> (rows pre-norm [nb, d_c], block ids [nb]).
    `emit=False` (the no-decode-compression fault in a decode call) pools nothing; `halves_swapped` is the
    csa-halves-swapped fault."""
    device = kv.device
    end = start_pos + kv.shape[0]
    seq_kv, seq_sc = torch.cat([cache.kv, kv]), torch.cat([cache.score, score])
    j = torch.arange(start_pos // m, end // m, device=device)
    if not emit:
        j = j[:0]
    overlap = kv.shape[1] == 2 * d_c
    slots = j[:, None] * m + torch.arange(m, device=device)[None, :] - cache.start        # [nb, m]
    if overlap:
        a_half, b_half = (slice(d_c, None), slice(0, d_c)) if halves_swapped else (slice(0, d_c), slice(d_c, None))
        prev = (slots - m).clamp(min=0)
        has_prev = (j > 0)[:, None, None]
        k = torch.cat([torch.where(has_prev, seq_kv[prev][..., a_half], 0.0), seq_kv[slots][..., b_half]], dim=1)
        s = torch.cat([torch.where(has_prev, seq_sc[prev][..., a_half], -math.inf), seq_sc[slots][..., b_half]],
                      dim=1)
    else:
        k, s = seq_kv[slots], seq_sc[slots]
    rows = (torch.softmax(s, dim=1) * k).sum(dim=1)
    keep_from = max(0, m * (end // m - (1 if overlap else 0)))
    cache.kv, cache.score = seq_kv[keep_from - cache.start :], seq_sc[keep_from - cache.start :]
    cache.start = keep_from
    return rows, j


def select_rows(scores: torch.Tensor, n_vis: torch.Tensor, top_k: int, ties_highest: bool) -> torch.Tensor:
    """Sel_t = all j < n_vis(t) if n_vis(t) <= K, else the K best scores among them (ties: lowest j).
    scores [n, R], n_vis int [n] -> bool mask [n, R].  `ties_highest` is the indexer-ties-highest fault."""
    n, R = scores.shape
    j = torch.arange(R, device=scores.device)
    valid = j[None, :] < n_vis[:, None]
    keyed = torch.where(valid, scores, -math.inf)
    if ties_highest:
        keyed = keyed.flip(-1)
    order = torch.sort(keyed, dim=-1, descending=True, stable=True).indices[:, :top_k]
    if ties_highest:
        order = R - 1 - order
    chosen = torch.zeros(n, R, dtype=torch.bool, device=scores.device)
    chosen.scatter_(1, order, True)
    return chosen & valid


def sink_attention(q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, sinks: torch.Tensor,
                   drop_sink: bool) -> torch.Tensor:
    """o_h = Σ_s exp(z_hs) k_s / (exp(sink_h) + Σ_s exp(z_hs)), z = q·k/√d over the allowed keys (K = V).
    q [n, nh, d], keys [nk, d], mask bool [n, nk], sinks [nh] -> [n, nh, d].
    Scores are materialised one (query chunk x head chunk) at a time, at most SCORE_BUDGET elements.
    `drop_sink` is the sink-dropped fault (plain softmax)."""
    n, nh, d = q.shape
    nk = keys.shape[0]
    scale = 1.0 / math.sqrt(d)
    out = torch.empty_like(q)
    q_chunk = max(1, min(n, SCORE_BUDGET // max(nk, 1)))
    for q0 in range(0, n, q_chunk):
        qs = slice(q0, min(n, q0 + q_chunk))
        nq = qs.stop - qs.start
        h_chunk = max(1, min(nh, SCORE_BUDGET // max(nq * nk, 1)))
        for h0 in range(0, nh, h_chunk):
            hs = slice(h0, min(nh, h0 + h_chunk))
            z = torch.einsum("nhd,kd->hnk", q[qs, hs], keys) * scale
            z = z.masked_fill(~mask[qs][None], -math.inf)
            if not drop_sink:
                sink = sinks[hs].reshape(-1, 1, 1).expand(-1, nq, 1)
                z = torch.cat([z, sink], dim=-1)
            p = torch.softmax(z, dim=-1)[..., :nk]
            out[qs, hs] = torch.einsum("hnk,kd->nhd", p, keys)
    return out


class AttentionLayer:
    """Attention of one layer: projections, RoPE, compressors, indexer, masked sink attention, grouped output.

    `ctx` is the engine (weights `ctx.w`, `ctx.linear`, config `ctx.cfg`, `ctx.faults`, precision switches).
    """

    def __init__(self, ctx, layer: int, ratio: int, freqs: torch.Tensor) -> None:
        self.ctx, self.layer, self.ratio, self.freqs = ctx, layer, ratio, freqs
        self.p = f"blk.{layer}."
        cfg = ctx.cfg
        self.indexer = ratio == 4
        self.had = hadamard_matrix(cfg.index_head_dim, ctx.act, ctx.device) if self.indexer else None

    # -- caches --------------------------------------------------------------------------------------
    def new_cache(self) -> LayerCache:
        cfg, dev, act = self.ctx.cfg, self.ctx.device, self.ctx.act
        hd = cfg.head_dim

        def empty(width: int) -> torch.Tensor:
            return torch.zeros(0, width, device=dev, dtype=act)

        def comp(width: int, d_c: int) -> CompressorCache:
            return CompressorCache(0, empty(width), empty(width), empty(d_c))

        cache = LayerCache(0, empty(hd))
        if self.ratio > 0:
            cache.main = comp((2 if self.indexer else 1) * hd, hd)
        if self.indexer:
            cache.index = comp(2 * cfg.index_head_dim, cfg.index_head_dim)
        return cache

    # -- pieces ----------------------------------------------------------------------------------------
    @property
    def fp8_on(self) -> bool:
        return self.ctx.options.fp8_kv and not self.ctx.switches.fp8_kv_off

    def _rope(self, x: torch.Tensor, pos: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        return rope(x, pos, self.freqs, inverse, split_halves=self.ctx.switches.rope_split_halves)

    def _fp8(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_nope(x, self.ctx.cfg.nope_dim) if self.fp8_on else x

    def _fp4_had(self, x: torch.Tensor) -> torch.Tensor:
        return fp4_roundtrip(x @ self.had) if self.ctx.options.fp4_indexer else x

    def _compressor(self, cache: CompressorCache, prefix: str, x: torch.Tensor, start_pos: int, d_c: int,
                    m: int, emit: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Project x, add ape by within-block index, pool completed blocks, RMSNorm.  -> (rows [nb, d_c], j [nb])"""
        ctx = self.ctx
        pos = torch.arange(start_pos, start_pos + x.shape[0], device=x.device)
        kv = ctx.linear(x, self.p + prefix + "_kv.weight")
        score = ctx.linear(x, self.p + prefix + "_gate.weight") + ctx.w.mat(self.p + prefix + "_ape.weight",
                                                                           ctx.act)[pos % m]
        rows, j = compress(cache, kv, score, start_pos, m, d_c, emit, ctx.switches.csa_halves_swapped)
        return rms_norm(rows, ctx.w.v(self.p + prefix + "_norm.weight"), ctx.cfg.norm_eps), j

    # -- forward ---------------------------------------------------------------------------------------
    def forward(self, cache: LayerCache, x: torch.Tensor, start_pos: int, capture: bool) -> AttnResult:
        """x [n, D] attention inputs at positions start_pos.. -> AttnResult (a [n, D], diagnostics, captures)."""
        ctx, cfg, p = self.ctx, self.ctx.cfg, self.p
        n, dev = x.shape[0], x.device
        nh, hd, eps, m = cfg.n_heads, cfg.head_dim, cfg.norm_eps, self.ratio
        pos = torch.arange(start_pos, start_pos + n, device=dev)
        cap: dict[str, torch.Tensor] = {}

        qr = rms_norm(ctx.linear(x, p + "attn_q_a.weight"), ctx.w.v(p + "attn_q_a_norm.weight"), eps)
        q = rms_norm(ctx.linear(qr, p + "attn_q_b.weight").reshape(n, nh, hd), None, eps)
        kv = rms_norm(ctx.linear(x, p + "attn_kv.weight"), ctx.w.v(p + "attn_kv_a_norm.weight"), eps)
        if capture:
            cap["q_path"], cap["kv_latent"] = q, kv
        q = self._rope(q, pos)
        kv = self._fp8(self._rope(kv, pos))
        if capture:
            cap["rope_q"], cap["rope_kv"] = q, kv

        raw = torch.cat([cache.raw, kv])
        raw0 = start_pos - cache.raw.shape[0]  # position of raw[0]

        emit = not (ctx.switches.no_decode_compression and n == 1)
        comp = torch.zeros(0, hd, device=dev, dtype=x.dtype)
        n_vis = torch.zeros(n, dtype=torch.int64, device=dev)
        index_sel = None
        if m > 0:
            rows, j = self._compressor(cache.main, "attn_compressor", x, start_pos, hd, m, emit)
            rows = self._fp8(self._rope(rows, j * m))
            cache.main.rows = comp = torch.cat([cache.main.rows, rows])
            n_vis = torch.clamp(n_visible(pos, m, ctx.switches.compressed_row_visible_late), max=comp.shape[0])
            if self.indexer:
                index_sel = self._indexer(cache, x, qr, pos, start_pos, n_vis, emit, cap if capture else None)
            if capture:
                cap["comp_rows"] = comp
        o = torch.empty_like(q)
        sinks = ctx.w.v(p + "attn_sinks.weight")
        W, R = cfg.window_size, comp.shape[0]
        step = max(1, SCORE_BUDGET // (2 * W + R))
        for a in range(0, n, step):
            b = min(n, a + step)
            t = pos[a:b]
            lo = max(0, start_pos + a - W + 1 - raw0)           # banded raw keys of this query chunk
            band_pos = torch.arange(raw0 + lo, start_pos + b, device=dev)
            raw_mask = (band_pos[None, :] <= t[:, None]) & (band_pos[None, :] > t[:, None] - W)
            comp_mask = torch.arange(R, device=dev)[None, :] < n_vis[a:b, None]
            if index_sel is not None:
                chosen = torch.zeros(b - a, R + 1, dtype=torch.bool, device=dev)
                chosen.scatter_(1, torch.where(index_sel[a:b] >= 0, index_sel[a:b], R), True)
                comp_mask = comp_mask & chosen[:, :R]
            o[a:b] = sink_attention(q[a:b], torch.cat([raw[lo : start_pos + b - raw0], comp]),
                                    torch.cat([raw_mask, comp_mask], dim=1), sinks, ctx.switches.sink_dropped)
        if capture:
            cap["attn_heads"] = o
        o = self._rope(o, pos, inverse=True).reshape(n, cfg.o_groups, cfg.o_group_width)
        w_oa = ctx.w.mat(p + "attn_output_a.weight", ctx.mm).reshape(cfg.o_groups, cfg.o_lora_rank, -1)
        z = torch.einsum("ngw,grw->ngr", o.to(ctx.mm), w_oa).reshape(n, -1).to(ctx.act)
        out = ctx.linear(z, p + "attn_output_b.weight")

        keep = cfg.window_size - 1
        cache.raw = raw[raw.shape[0] - min(keep, raw.shape[0]) :] if keep > 0 else raw[:0]
        cache.pos = start_pos + n
        return AttnResult(out, n_vis, index_sel, cap)

    def _indexer(self, cache: LayerCache, x: torch.Tensor, qr: torch.Tensor, pos: torch.Tensor, start_pos: int,
                 n_vis: torch.Tensor, emit: bool, cap: dict | None) -> torch.Tensor:
        """Indexer compressor rows, then score(t, j) = Σ_h ω_th ReLU(qI_th · kI_j) and top-k selection.
        -> int [n, top_k] selected row ids ascending, -1 padded (all visible rows when at most top_k are visible)."""
        ctx, cfg, p = self.ctx, self.ctx.cfg, self.p
        n, hi, di = x.shape[0], cfg.index_n_heads, cfg.index_head_dim
        rows, j = self._compressor(cache.index, "indexer_compressor", x, start_pos, di, 4, emit)
        rows = self._fp4_had(self._rope(rows, j * 4))
        cache.index.rows = krows = torch.cat([cache.index.rows, rows])
        if cap is not None:
            cap["index_rows"] = krows
        qi = self._fp4_had(self._rope(ctx.linear(qr, p + "indexer.attn_q_b.weight").reshape(n, hi, di), pos))
        w = ctx.linear(x, p + "indexer.proj.weight") / math.sqrt(di * hi)
        n_vis = torch.clamp(n_vis, max=krows.shape[0])
        table = torch.empty(n, cfg.index_topk, dtype=torch.int64, device=x.device)
        step = max(1, SCORE_BUDGET // max(hi * krows.shape[0], 1))
        for a in range(0, n, step):  # scores of one query chunk at a time
            b = min(n, a + step)
            scores = torch.einsum("nh,nhr->nr", w[a:b], torch.relu(torch.einsum("nhd,rd->nhr", qi[a:b], krows)))
            table[a:b] = self._sel_table(select_rows(scores, n_vis[a:b], cfg.index_topk,
                                                     ctx.switches.indexer_ties_highest))
        return table

    def _sel_table(self, sel: torch.Tensor) -> torch.Tensor:
        """bool [n, R] -> selected row ids ascending, -1 padded to top_k: int [n, top_k]."""
        k = self.ctx.cfg.index_topk
        j = torch.arange(sel.shape[1], device=sel.device).expand_as(sel)
        ids = torch.where(sel, j, sel.shape[1] + j)
        ids = torch.sort(ids, dim=1).values[:, :k]
        ids = torch.where(ids < sel.shape[1], ids, -1)
        if ids.shape[1] < k:
            ids = torch.cat([ids, torch.full((sel.shape[0], k - ids.shape[1]), -1, device=sel.device,
                                             dtype=ids.dtype)], dim=1)
        return ids
