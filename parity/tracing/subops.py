"""Sub-op records: an engine's per-layer sub-op outputs, stored in the vectors side file, for op-level checks.

A record is one array per (layer l, capture name q) of `checkpoints.SUBOPS`, member `subop.<l>.<q>` of
`<stem>.vectors.npz`, float32:
* per-position captures (`hc_attn_pre`, `q_path`, ..., `hc_ffn_post`): one row per header position, in the
  header's position order (as full vectors are), trailing shape by `SHAPES`;
* emitted rows (`comp_rows`, `index_rows`): the rows a layer appended to its compressed / indexer cache, in
  emission order, plus member `subop.<l>.<q>.pos` (int32 [R]): for each row, the last position of the chunk
  whose forward pass emitted it. The rows visible after chunk c are the rows with pos <= that chunk's last
  position, so the candidate's own chunking (header `chunks`) is rebuilt exactly.
The HC mixes (pre, post, comb), the router's picks and weights and the indexer's selection are not repeated
here: their one home is the trace's `hc` / `moe` / `attn` records, which op-level forcing reads beside these.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from parity.contract.checkpoints import SUBOPS, block, block_attn, layers_of
from parity.contract.engine import LayerDiag
from parity.contract.errors import TraceError
from parity.gguf.config import ModelConfig
from parity.tracing.records import Trace, TraceHeader
from parity.tracing.runner import ChunkResult

Fail = Callable[[str, str], TraceError]

TABLE_HELD = ("expert_ids", "expert_weights", "index_sel")   # held by the moe / attn records
ROW_RECORDS = ("comp_rows", "index_rows")
RECORD_NAMES: tuple[str, ...] = tuple(q for _, caps in SUBOPS for q in caps if q not in TABLE_HELD)
# trailing shape by symbol: H, D from the header; nh (heads), hd (head dim), dI (indexer head dim) bound by the
# first record that has them and the same in every other record
SHAPES: dict[str, tuple[str, ...]] = {
    "hc_attn_pre": ("D",), "attn_norm": ("D",), "q_path": ("nh", "hd"), "kv_latent": ("hd",),
    "rope_q": ("nh", "hd"), "rope_kv": ("hd",), "comp_rows": ("hd",), "index_rows": ("dI",),
    "attn_heads": ("nh", "hd"), "attn_out": ("D",), "hc_attn_post": ("H", "D"), "hc_ffn_pre": ("D",),
    "ffn_norm": ("D",), "routed_out": ("D",), "shared_out": ("D",), "hc_ffn_post": ("H", "D"),
}
POS = ".pos"


def member(layer: int, name: str) -> str:
    """Side-file array name of a record: `subop.<layer>.<name>` (`+ '.pos'` for an emitted row's positions)."""
    return f"subop.{layer}.{name}"


def record_members(h: TraceHeader) -> list[str]:
    """Every side-file array the header's `subops` promise, layer by layer."""
    return [m for l in range(layers_of(h.checkpoints)) for q in h.subops
            for m in (member(l, q), *((member(l, q) + POS,) if q in ROW_RECORDS else ()))]


def check_names(names: Sequence[str], fail: Fail) -> None:
    """The header's `subops`: known record names, each once, in `RECORD_NAMES` order."""
    unknown = [q for q in names if q not in RECORD_NAMES]
    if unknown:
        held = [q for q in unknown if q in TABLE_HELD]
        raise fail("subops", f"unknown sub-op record name {unknown[0][:40]!r}"
                   + (" (held by the moe / attn records, not a sub-op record)" if held else "")
                   + f"; valid: {', '.join(RECORD_NAMES)}")
    if list(names) != [q for q in RECORD_NAMES if q in names]:
        raise fail("subops", f"names must be listed once each in this order: {', '.join(RECORD_NAMES)}")


def check_records(h: TraceHeader, arrays: dict[str, np.ndarray], fail: Fail) -> None:
    """Every record the header lists: dtype, rows, trailing shape (consistent symbols), emitted-row positions."""
    dims = {"H": h.n_hc, "D": h.dim}
    ends = np.cumsum(h.chunks) - 1
    for l in range(layers_of(h.checkpoints)):
        for q in h.subops:
            name = member(l, q)
            a = arrays[name]
            if a.dtype != np.float32:
                raise fail(name, f"dtype {a.dtype}, expected float32")
            want = SHAPES[q]
            if a.ndim != 1 + len(want):
                raise fail(name, f"shape {a.shape}, expected rows of {len(want)} dimension(s) {want}")
            for sym, n in zip(want, a.shape[1:], strict=True):
                if dims.setdefault(sym, n) != n:
                    raise fail(name, f"shape {a.shape}: {sym} = {n}, but {dims[sym]} elsewhere (rows of {want})")
            if q not in ROW_RECORDS:
                if len(a) != len(h.positions):
                    raise fail(name, f"{len(a)} rows, expected {len(h.positions)} (one per header position)")
                continue
            pos = arrays[name + POS]
            if pos.dtype != np.int32 or pos.shape != (len(a),):
                raise fail(name + POS, f"dtype {pos.dtype} shape {pos.shape}, expected int32 ({len(a)},): one "
                                       "position per emitted row")
            bad = np.flatnonzero(~np.isin(pos, ends))
            if len(bad):
                raise fail(name + POS, f"row {int(bad[0])} at position {int(pos[bad[0]])}: must be the last position "
                                       f"of the chunk that emitted it (chunks end at {ends[:8].tolist()}...)")
            if (np.diff(pos) < 0).any():
                raise fail(name + POS, "positions must be non-decreasing (rows in emission order)")


class SubopRecorder:
    """Accumulates sub-op records chunk by chunk from `ChunkResult.captures` (pass `add` as an on_chunk)."""

    def __init__(self, positions: Sequence[int]) -> None:
        self.positions = np.asarray(positions)
        self.rows: dict[str, list[np.ndarray]] = {}
        self.emitted: dict[str, np.ndarray] = {}    # row record -> rows seen so far (the cache's prefix)
        self.emit_pos: dict[str, list[int]] = {}

    def add(self, r: ChunkResult) -> None:
        """Record one chunk; a chunk that rewrote or dropped rows emitted earlier is a TraceError."""
        if not r.captures:
            raise TraceError("the engine returned no sub-op captures (run with capture=True)")
        n, end = len(r.tokens), r.start_pos + len(r.tokens) - 1
        local = self.positions[(self.positions >= r.start_pos) & (self.positions <= end)] - r.start_pos
        for l, caps in enumerate(r.captures):
            missing = [q for q in RECORD_NAMES if q not in caps]
            if missing:
                raise TraceError(f"layer {l}: the engine captured no {', '.join(missing)} (sub-op records need "
                                 f"every one of {', '.join(RECORD_NAMES)})")
            for q in RECORD_NAMES:
                a = np.asarray(caps[q], np.float32)
                if q not in ROW_RECORDS:
                    if len(a) != n:
                        raise TraceError(f"layer {l} {q}: {len(a)} rows for a chunk of {n} positions")
                    self.rows.setdefault(member(l, q), []).append(a[local])
                    continue
                key = member(l, q)
                seen = self.emitted.get(key, a[:0])
                if len(a) < len(seen) or a[: len(seen)].tobytes() != seen.tobytes():
                    raise TraceError(f"layer {l} {q}: the chunk at position {r.start_pos} rewrote or dropped rows "
                                     "emitted earlier (sub-op records store appended rows)")
                self.rows.setdefault(key, []).append(a[len(seen):])
                self.emit_pos.setdefault(key, []).extend([end] * (len(a) - len(seen)))
                self.emitted[key] = a

    def arrays(self) -> dict[str, np.ndarray]:
        """Side-file arrays by member name."""
        out = {k: np.ascontiguousarray(np.concatenate(v)) for k, v in self.rows.items()}
        out.update({k + POS: np.asarray(v, np.int32) for k, v in self.emit_pos.items()})
        return out


def _table(trace: Trace, kind: str, cols: Sequence[str], per: int) -> dict[str, np.ndarray]:
    """Columns of a diagnostic table reshaped [L, per, T, ...]; every (layer, [sub,] position) must be present."""
    t, L, T = getattr(trace, kind), trace.n_layers, len(trace.header.tokens)
    if len(t) != L * per * T:
        raise TraceError(f"the trace's {kind} records cover {len(t)} of {L * per * T} (layer, position) cells: "
                         "op-level forcing reads them at every position of every layer")
    return {c: t[c].reshape(L, per, T, *t[c].shape[1:]) for c in cols}


def subop_chunks(trace: Trace, config: ModelConfig) -> list[ChunkResult]:
    """The trace's sub-op records as the runner's chunk results on the candidate's own chunking (header `chunks`),
    the form `parity.check.opforce` takes: carriers from the full vectors, captures from the records (emitted rows
    visible after each chunk), HC mixes / router picks / indexer selections from the hc, moe and attn records."""
    h, vec, rec = trace.header, trace.vectors or {}, trace.subops
    T, L = len(h.tokens), trace.n_layers
    if rec is None:
        raise TraceError("the trace's sub-op records were not loaded (read the trace with its side file)")
    if h.positions != list(range(T)):
        raise TraceError(f"sub-op records at {len(h.positions)} of {T} positions: op-level forcing needs every "
                         "position (--positions all)")
    missing = [q for q in RECORD_NAMES if q not in h.subops]
    if missing:
        raise TraceError(f"the trace has no sub-op records of {', '.join(missing)}")
    carriers = [c for l in range(L) for c in (block_attn(l), block(l))]
    if [c for c in carriers if c not in vec]:
        raise TraceError(f"no full vectors of {next(c for c in carriers if c not in vec)} (--full all)")
    _check_config(rec, config, L)
    hc = _table(trace, "hc", ("pre", "post", "comb"), 2)
    moe = _table(trace, "moe", ("ids", "w", "margin"), 1)
    attn = _table(trace, "attn", ("n_comp", "has_sel", "sel"), 1)
    sel = _selections(attn, config.index_topk)
    out, start = [], 0
    for n in h.chunks:
        sl, end = slice(start, start + n), start + n - 1
        diags, captures = [], []
        for l in range(L):
            caps = {q: rec[member(l, q)][sl] for q in RECORD_NAMES if q not in ROW_RECORDS}
            caps.update({q: rec[member(l, q)][rec[member(l, q) + POS] <= end] for q in ROW_RECORDS})
            ids, w, margin = (moe[c][l, 0, sl] for c in ("ids", "w", "margin"))
            has_sel = bool(attn["has_sel"][l, 0, 0])
            caps.update(expert_ids=ids, expert_weights=w, index_sel=sel[l, sl])
            mix = [tuple(hc[c][l, s, sl].reshape(n, h.n_hc, -1) if c == "comb" else hc[c][l, s, sl]
                         for c in ("pre", "post", "comb")) for s in (0, 1)]
            diags.append(LayerDiag(hc_attn=mix[0], hc_ffn=mix[1], expert_ids=ids, expert_weights=w,
                                   router_margin=margin, n_comp_visible=attn["n_comp"][l, 0, sl],
                                   index_sel=sel[l, sl] if has_sel else None))
            captures.append(caps)
        ckpts = {c: vec[c][sl] for c in carriers}
        # op-level forcing reads no logits: an empty [n, 0] block stands for "not part of this view"
        out.append(ChunkResult(start, np.asarray(h.tokens[sl]), ckpts, np.zeros((n, 0), np.float32), diags,
                               captures))
        start += n
    return out


def _selections(attn: dict[str, np.ndarray], top_k: int) -> np.ndarray:
    """Indexer selections [L, T, top_k] (-1 padding) from the attn records; a layer with a selection at some
    positions but not at others, or more than top_k selected rows, is a TraceError."""
    has, sel = attn["has_sel"][:, 0], attn["sel"][:, 0]
    mixed = np.flatnonzero(has.any(axis=1) & ~has.all(axis=1))
    if len(mixed):
        raise TraceError(f"layer {int(mixed[0])}: attn records carry an indexer selection at some positions only")
    if (sel[..., top_k:] != -1).any():
        raise TraceError(f"attn records select more than the model's indexer top_k = {top_k} rows")
    out = np.full((*sel.shape[:2], top_k), -1, np.int32)
    w = min(top_k, sel.shape[2])
    out[..., :w] = sel[..., :w]
    return out


def _check_config(rec: dict[str, np.ndarray], config: ModelConfig, n_layers: int) -> None:
    """Trailing shapes that the header cannot bind (heads, head dims) against the model's."""
    want = {"nh": config.n_heads, "hd": config.head_dim, "dI": config.index_head_dim}
    for l in range(n_layers):
        for q, shape in SHAPES.items():
            got = rec[member(l, q)].shape[1:]
            expect = tuple(want.get(s, g) for s, g in zip(shape, got, strict=True))
            if got != expect:
                raise TraceError(f"record {member(l, q)}: rows of shape {got}, the model's are {expect}")
