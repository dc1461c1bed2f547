"""Trace records: what one engine run looked like at every checkpoint, in a few numbers per position.

A `Trace` is a header (engine, model identity, tokens, schedule, flags) plus four columnar tables:
* `ckpt`  one row per (checkpoint, position): per-stream L2, stream-sum L2, RMS, min, max and a
          64-number fingerprint; `final_norm` rows also carry the argmax token and the top-k logits;
* `hc`    one row per (layer, sub-layer, position): the HC pre[H], post[H] and comb[H*H] mixes;
* `moe`   one row per (layer, position): selected expert ids, their final weights, router margin;
* `attn`  one row per (layer, position): compressed rows visible and the indexer's selection.
Optional full vectors (`vectors`: name -> [P, H, D] / [P, D], row i = header.positions[i]) live in a
side file. `Recorder` turns the engine's `ChunkResult`s into a Trace; engines never see traces.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields
from functools import lru_cache
from typing import Any

import numpy as np

from parity.contract.checkpoints import EMBED, FINAL_NORM, LOGITS, block, block_attn
from parity.contract.errors import TraceError
from parity.tracing.runner import ChunkResult

FORMAT_NAME = "v4parity-trace"
FORMAT_VERSION = 1

FP_DIM = 64                        # fingerprint length
FP_SEED = 0x7634706172697479       # "v4parity" in ASCII
_GOLDEN = 0x9E3779B97F4A7C15       # splitmix64 increment
_MIX1, _MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def trace_checkpoints(n_layers: int) -> list[str]:
    """Every carrier checkpoint in depth order: embed, blk.0.attn, blk.0, ..., blk.{L-1}, final_norm."""
    names = [EMBED]
    for l in range(n_layers):
        names += [block_attn(l), block(l)]
    return [*names, FINAL_NORM]


def checkpoint_index(name: str, n_layers: int) -> int:
    """The spec §12.1 index k of a checkpoint: embed 0, blk.l and blk.l.attn l+1, final_norm L+1."""
    if name == EMBED:
        return 0
    if name == FINAL_NORM:
        return n_layers + 1
    layer = checkpoint_layer(name)
    if layer is None:
        raise TraceError(f"unknown checkpoint name {name!r}")
    return layer + 1


def checkpoint_layer(name: str) -> int | None:
    """Layer number of blk.l / blk.l.attn, None for embed and final_norm."""
    return int(name.split(".")[1]) if name.startswith("blk.") else None


def checkpoint_depth(name: str, n_layers: int) -> float:
    """Plot depth: embed 0, blk.l.attn l+0.5, blk.l l+1, final_norm L+1."""
    if name == EMBED:
        return 0.0
    if name == FINAL_NORM:
        return float(n_layers + 1)
    layer = checkpoint_layer(name)
    if layer is None:
        raise TraceError(f"unknown checkpoint name {name!r}")
    return layer + (0.5 if name.endswith(".attn") else 1.0)


def layers_of(checkpoints: Iterable[str]) -> int:
    """Number of layers a checkpoint list spans: 1 + the highest blk index (0 without blk checkpoints)."""
    return 1 + max((layer for c in checkpoints if (layer := checkpoint_layer(c)) is not None), default=-1)


# ----------------------------------------------------------------------------------------------
# Fingerprint

def splitmix64(x: np.ndarray) -> np.ndarray:
    """z = x + golden; z = (z ^ z>>30) * m1; z = (z ^ z>>27) * m2; z ^ z>>31 (all mod 2^64).

    x: uint64 [...] -> uint64 [...]
    """
    z = x + np.uint64(_GOLDEN)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(_MIX1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(_MIX2)
    return z ^ (z >> np.uint64(31))


@lru_cache(maxsize=8)
def sign_matrix(n: int) -> np.ndarray:
    """s(k, i) = +1 if the top bit of splitmix64(seed + k*n + i) is 0, else -1.

    n -> float64 [64, n] (read-only; cached per n)
    """
    idx = (np.uint64(FP_SEED) + np.arange(FP_DIM * n, dtype=np.uint64)).reshape(FP_DIM, n)
    top = splitmix64(idx) >> np.uint64(63)
    s = 1.0 - 2.0 * top.astype(np.float64)
    s.setflags(write=False)
    return s


def fingerprint(x: np.ndarray) -> np.ndarray:
    """fp[k] = (1/sqrt(64)) * sum_i s(k, i) * x[i] over the flattened (stream-major) vector.

    x: [n, ...] -> float32 [n, 64]; computed in float64. E[fp(a).fp(b)] = a.b, so fingerprint
    cosines and norms estimate the vectors' (Johnson-Lindenstrauss, ~1/sqrt(64) relative spread).
    """
    flat = np.asarray(x, dtype=np.float64).reshape(len(x), -1)
    s = sign_matrix(flat.shape[1])
    return (flat @ s.T / np.sqrt(FP_DIM)).astype(np.float32)


# ----------------------------------------------------------------------------------------------
# Carrier statistics

def carrier_stats(x: np.ndarray) -> dict[str, np.ndarray]:
    """Per position: l2s[h] = ||X[h]||, sum_l2 = ||sum_h X[h]||, rms = sqrt(sum x^2 / (H*D)), min, max, fp.

    x: [n, H, D] (a [n, D] vector is treated as H = 1) -> dict of float32 arrays [n, H] / [n] / [n, 64].
    """
    x = np.asarray(x)
    if x.ndim == 2:
        x = x[:, None, :]
    if x.ndim != 3:
        raise TraceError(f"carrier must be [n, H, D] or [n, D], got shape {x.shape}")
    x64 = x.astype(np.float64)
    sq = np.einsum("nhd,nhd->nh", x64, x64)
    streamsum = x64.sum(axis=1)
    return {
        "l2s": np.sqrt(sq).astype(np.float32),
        "sum_l2": np.sqrt(np.einsum("nd,nd->n", streamsum, streamsum)).astype(np.float32),
        "rms": np.sqrt(sq.sum(axis=1) / (x.shape[1] * x.shape[2])).astype(np.float32),
        "min": x.min(axis=(1, 2)).astype(np.float32),
        "max": x.max(axis=(1, 2)).astype(np.float32),
        "fp": fingerprint(x),
    }


def top_k(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-k (ids, logits) per row, descending by logit, ties by lower id.

    logits: [n, V] -> int32 [n, k], float32 [n, k]
    """
    logits = np.asarray(logits, dtype=np.float32)
    order = np.lexsort((np.broadcast_to(np.arange(logits.shape[1]), logits.shape), -logits), axis=1)[:, :k]
    return order.astype(np.int32), np.take_along_axis(logits, order, axis=1)


# ----------------------------------------------------------------------------------------------
# Data model

@dataclass
class TraceHeader:
    """Everything needed to know what was run. All fields are required in every form."""

    engine: str
    engine_version: str
    model: dict[str, Any]          # {"file", "size", "header_sha256"} = Weights.identity()
    dtype: str
    n_hc: int
    dim: int
    top_k: int
    tokens: list[int]              # prompt + generated
    n_prompt: int
    chunks: list[int]              # chunk sizes of the forward schedule (prefill pieces, then 1 per decode)
    decode: int
    positions: list[int]           # traced positions, ascending
    checkpoints: list[str]         # checkpoints recorded, depth order
    full: list[str]                # checkpoints (and "logits") with full vectors in <stem>.vectors.npz
    flags: dict[str, Any]          # RunOptions.flags() plus anything else that changes numerics
    version: int = FORMAT_VERSION

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["format"] = FORMAT_NAME
        return d


@dataclass
class Table:
    """Columns of equal length; equality is exact (NaN == NaN), dtype included."""

    cols: dict[str, np.ndarray]

    def __len__(self) -> int:
        return len(next(iter(self.cols.values()))) if self.cols else 0

    def __getitem__(self, name: str) -> np.ndarray:
        return self.cols[name]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Table) or self.cols.keys() != other.cols.keys():
            return False
        return all(a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b, equal_nan=a.dtype.kind == "f")
                   for a, b in ((self.cols[k], other.cols[k]) for k in self.cols))

    __hash__ = None  # type: ignore[assignment]


# Column dtypes and trailing shapes by table; widths: H = n_hc, F = 64, K = top_k, E = experts, S = index width
TABLES: dict[str, dict[str, tuple[str, str]]] = {
    "ckpt": {"ck": ("int32", ""), "pos": ("int32", ""), "tok": ("int32", ""), "min": ("float32", ""),
             "max": ("float32", ""), "rms": ("float32", ""), "l2s": ("float32", "H"), "sum_l2": ("float32", ""),
             "fp": ("float32", "F"), "argmax": ("int32", ""), "top_ids": ("int32", "K"),
             "top_logits": ("float32", "K")},
    "hc": {"layer": ("int32", ""), "sub": ("int32", ""), "pos": ("int32", ""), "pre": ("float32", "H"),
           "post": ("float32", "H"), "comb": ("float32", "HH")},
    "moe": {"layer": ("int32", ""), "pos": ("int32", ""), "ids": ("int32", "E"), "w": ("float32", "E"),
            "margin": ("float32", "")},
    "attn": {"layer": ("int32", ""), "pos": ("int32", ""), "n_comp": ("int32", ""), "has_sel": ("bool", ""),
             "sel": ("int32", "S")},
}
SORT_KEYS = {"ckpt": ("ck", "pos"), "hc": ("layer", "sub", "pos"), "moe": ("layer", "pos"), "attn": ("layer", "pos")}
SUBLAYERS = ("attn", "ffn")


def _trailing(shape: str, widths: dict[str, int]) -> tuple[int, ...]:
    if not shape:
        return ()
    return (widths["H"] ** 2,) if shape == "HH" else (widths[shape],)


def make_table(kind: str, rows: dict[str, Sequence | np.ndarray], widths: dict[str, int]) -> Table:
    """Build a table of `kind` with canonical dtypes and shapes, sorted by its key columns."""
    cols = {}
    for name, (dtype, shape) in TABLES[kind].items():
        trailing = _trailing(shape, widths)
        arr = np.asarray(rows[name], dtype=dtype)
        cols[name] = arr.reshape((len(arr), *trailing))
    order = np.lexsort([cols[k] for k in reversed(SORT_KEYS[kind])])
    return Table({k: np.ascontiguousarray(v[order]) for k, v in cols.items()})


@dataclass
class Trace:
    header: TraceHeader
    ckpt: Table
    hc: Table
    moe: Table
    attn: Table
    vectors: dict[str, np.ndarray] | None = field(default=None, compare=False)

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Trace) and self.header == other.header and self.ckpt == other.ckpt
                and self.hc == other.hc and self.moe == other.moe and self.attn == other.attn)

    __hash__ = None  # type: ignore[assignment]

    @property
    def n_layers(self) -> int:
        return layers_of(self.header.checkpoints)

    def checkpoint_rows(self, name: str) -> np.ndarray:
        """Row indices of checkpoint `name` in `ckpt`, ordered by position."""
        return np.flatnonzero(self.ckpt["ck"] == self.header.checkpoints.index(name))


# ----------------------------------------------------------------------------------------------
# Building a trace from engine output

def resolve_positions(spec: str | Sequence[int], n_total: int) -> list[int]:
    """'last' | 'all' | '0,5,9' | list of ints -> sorted unique positions in [0, n_total)."""
    if isinstance(spec, str):
        if spec == "last":
            return [n_total - 1]
        if spec == "all":
            return list(range(n_total))
        try:
            spec = [int(p) for p in spec.split(",") if p.strip()]
        except ValueError:
            raise TraceError(f"--positions must be 'last', 'all' or a comma list of ints, got {spec!r}") from None
    out = sorted(set(int(p) for p in spec))
    if not out:
        raise TraceError("no positions to trace")
    bad = [p for p in out if not 0 <= p < n_total]
    if bad:
        raise TraceError(f"positions {bad} out of range [0, {n_total}) for this run")
    return out


def resolve_full(spec: str | Iterable[str] | None, n_layers: int) -> list[str]:
    """'all' | 'blk.2,final_norm,logits' | None -> checkpoint names (plus 'logits') with full vectors."""
    allowed = [*trace_checkpoints(n_layers), LOGITS]
    if spec is None or spec == "":
        return []
    if spec == "all":
        return allowed
    names = [s.strip() for s in spec.split(",")] if isinstance(spec, str) else list(spec)
    unknown = [n for n in names if n not in allowed]
    if unknown:
        raise TraceError(f"--full: unknown checkpoint(s) {unknown}; "
                         "valid: embed, blk.N, blk.N.attn, final_norm, logits")
    return [n for n in allowed if n in names]


class Recorder:
    """Accumulates trace rows chunk by chunk (pass `add` as `run_sequence(on_chunk=...)`)."""

    def __init__(self, names: Sequence[str], positions: Sequence[int], full: Sequence[str], top_k: int,
                 n_hc: int) -> None:
        self.names, self.positions, self.full, self.k = list(names), list(positions), list(full), top_k
        self.rows: dict[str, dict[str, list]] = {kind: {c: [] for c in TABLES[kind]} for kind in TABLES}
        self.vec: dict[str, list[np.ndarray]] = {n: [] for n in self.full}
        self.widths: dict[str, int] = {"F": FP_DIM, "K": top_k, "H": n_hc}

    def add(self, r: ChunkResult) -> None:
        n = len(r.tokens)
        local = [p - r.start_pos for p in self.positions if r.start_pos <= p < r.start_pos + n]
        if not local:
            return
        idx = np.array(local)
        toks = r.tokens[idx]
        for ck, name in enumerate(self.names):
            x = np.asarray(r.checkpoints[name])[idx]
            self.add_checkpoint(ck, idx + r.start_pos, toks, x, r.logits[idx] if name == FINAL_NORM else None)
            if name in self.vec:
                self.vec[name].append(x.astype(np.float32))
        if LOGITS in self.vec:
            self.vec[LOGITS].append(np.asarray(r.logits[idx], dtype=np.float32))
        for layer, diag in enumerate(r.diags):
            self._add_diag(layer, idx, idx + r.start_pos, diag)

    def add_checkpoint(self, ck: int, pos: np.ndarray, toks: np.ndarray, x: np.ndarray,
                       logits: np.ndarray | None) -> None:
        """Rows for checkpoint self.names[ck] at positions `pos` from its vectors x [n, H, D] / [n, D]."""
        st = carrier_stats(x)
        if x.ndim == 3 and x.shape[1] != self.widths["H"]:
            raise TraceError(f"checkpoint {self.names[ck]}: {x.shape[1]} streams, expected {self.widths['H']}")
        rows, n = self.rows["ckpt"], len(pos)
        l2s = _pad(st["l2s"], self.widths["H"], np.nan, np.float32)
        for c, v in (("ck", [ck] * n), ("pos", pos), ("tok", toks), ("min", st["min"]), ("max", st["max"]),
                     ("rms", st["rms"]), ("l2s", l2s), ("sum_l2", st["sum_l2"]), ("fp", st["fp"])):
            rows[c].extend(v)
        if logits is None:
            rows["argmax"].extend([-1] * n)
            rows["top_ids"].extend(np.full((n, self.k), -1, np.int32))
            rows["top_logits"].extend(np.full((n, self.k), np.nan, np.float32))
        else:
            ids, vals = top_k(logits, self.k)
            rows["argmax"].extend(ids[:, 0])
            rows["top_ids"].extend(ids)
            rows["top_logits"].extend(vals)

    def add_hc(self, layer: int, sub: int, pos: np.ndarray, pre: np.ndarray, post: np.ndarray,
               comb: np.ndarray) -> None:
        """HC rows: pre/post [n, H], comb [n, H, H] (or flat [n, H*H])."""
        n = len(pos)
        for c, v in (("layer", [layer] * n), ("sub", [sub] * n), ("pos", pos), ("pre", pre), ("post", post),
                     ("comb", np.asarray(comb).reshape(n, -1))):
            self.rows["hc"][c].extend(v)

    def add_moe(self, layer: int, pos: np.ndarray, ids: np.ndarray, w: np.ndarray, margin: np.ndarray) -> None:
        """MoE rows: ids / w [n, K], margin [n]."""
        self.widths["E"] = np.asarray(ids).shape[1]
        for c, v in (("layer", [layer] * len(pos)), ("pos", pos), ("ids", ids), ("w", w), ("margin", margin)):
            self.rows["moe"][c].extend(v)

    def _add_diag(self, layer: int, idx: np.ndarray, pos: np.ndarray, d: Any) -> None:
        n = len(pos)
        for sub, (pre, post, comb) in enumerate((d.hc_attn, d.hc_ffn)):
            self.add_hc(layer, sub, pos, np.asarray(pre)[idx], np.asarray(post)[idx], np.asarray(comb)[idx])
        self.add_moe(layer, pos, np.asarray(d.expert_ids)[idx], np.asarray(d.expert_weights)[idx],
                     np.asarray(d.router_margin)[idx])
        sel = None if d.index_sel is None else np.asarray(d.index_sel)[idx]
        if sel is not None:
            self.widths["S"] = max(self.widths.get("S", 0), sel.shape[1])
        for c, v in (("layer", [layer] * n), ("pos", pos), ("n_comp", np.asarray(d.n_comp_visible)[idx]),
                     ("has_sel", [sel is not None] * n), ("sel", list(sel) if sel is not None else [None] * n)):
            self.rows["attn"][c].extend(v)

    def tables(self) -> dict[str, Table]:
        """The four tables, canonically typed and sorted."""
        self.widths.setdefault("S", 0)
        self.widths.setdefault("E", 0)
        attn = self.rows["attn"]
        attn["sel"] = [np.full(self.widths["S"], -1) if s is None else _pad(s[None], self.widths["S"], -1, np.int32)[0]
                       for s in attn["sel"]]
        return {kind: make_table(kind, self.rows[kind], self.widths) for kind in TABLES}

    def vectors(self) -> dict[str, np.ndarray] | None:
        return {n: np.concatenate(v) for n, v in self.vec.items()} if self.full else None


def _pad(a: np.ndarray, width: int, fill: float, dtype: Any) -> np.ndarray:
    """Right-pad [n, w] to [n, width] with `fill`."""
    out = np.full((a.shape[0], width), fill, dtype=dtype)
    out[:, : a.shape[1]] = a
    return out
