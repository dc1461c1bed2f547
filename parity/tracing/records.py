"""Trace records: what one engine run looked like at every checkpoint, in a few numbers per position.

A `Trace` is a header (engine, model identity, tokens, schedule, flags) plus four columnar tables:
* `ckpt`  one row per (checkpoint, position): per-stream L2, stream-sum L2, RMS, min, max and a
          64-number fingerprint; `final_norm` rows also carry the argmax token and the top-k logits;
* `hc`    one row per (layer, sub-layer, position): the HC pre[H], post[H] and comb[H*H] mixes;
* `moe`   one row per (layer, position): selected expert ids, their final weights, router margin;
* `attn`  one row per (layer, position): compressed rows visible and the indexer's selection.
Draft checkpoints (`mtp.*`, `dspark.*`, parity.contract.checkpoints) are `ckpt` rows like the trunk's, at the
positions `draft_positions` gives; the header's `draft` names the drafter.
Optional full vectors (`vectors`: name -> [P, H, D] / [P, D], row i = header.positions[i]; a draft checkpoint's
rows are its own positions) and sub-op records
(`subops`: side-file member name -> array, `parity.tracing.subops`) live in a side file.
`spec` records (`parity.tracing.specrecords`): one per speculative round; a trace of spec records alone lists no
checkpoints and no positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from parity.contract.checkpoints import draft_positions, layers_of
from parity.tracing.specrecords import SpecRecord

FORMAT_NAME = "v4parity-trace"
FORMAT_VERSION = 1


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
    subops: list[str] = field(default_factory=list)  # sub-op record names (every layer) in the side file
    draft: dict[str, Any] = field(default_factory=dict)  # the drafter of the draft checkpoints (validate.DRAFT_KEYS)

    def to_dict(self) -> dict[str, Any]:
        """The header as `header.json` holds it (`subops` / `draft` only when present: older files lack them)."""
        d = {f.name: getattr(self, f.name) for f in fields(self)
             if f.name not in ("subops", "draft") or getattr(self, f.name)}
        d["format"] = FORMAT_NAME
        return d

    def positions_of(self, name: str) -> list[int]:
        """The traced positions holding checkpoint `name` (all of them, except for draft checkpoints)."""
        return draft_positions(name, self.positions, self.draft.get("pairing"))


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
        with np.errstate(over="ignore"):  # text numbers beyond float32 range are stored as +-inf (trace-format.md)
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
    subops: dict[str, np.ndarray] | None = field(default=None, compare=False)
    spec: list[SpecRecord] = field(default_factory=list)   # speculative rounds (text form only)

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Trace) and self.header == other.header and self.ckpt == other.ckpt
                and self.hc == other.hc and self.moe == other.moe and self.attn == other.attn
                and self.spec == other.spec)

    __hash__ = None  # type: ignore[assignment]

    @property
    def n_layers(self) -> int:
        return layers_of(self.header.checkpoints)

    def checkpoint_rows(self, name: str) -> np.ndarray:
        """Row indices of checkpoint `name` in `ckpt`, ordered by position."""
        return np.flatnonzero(self.ckpt["ck"] == self.header.checkpoints.index(name))
