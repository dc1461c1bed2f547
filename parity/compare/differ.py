"""Compare two traces: preflight, per-(checkpoint, position) metrics, the first drifting checkpoint.

`a` is the reference, `b` the candidate. Preflight refuses (PreflightError) when token ids, model
identity, checkpoint sets, traced positions, stream count, dim or top-k differ, unless `force=True` (then
the intersection is compared and the refusals are kept as warnings). Every other recorded field is
compared (a difference makes the report non-exact; NaN never compares equal) or is informational, as
docs/metrics.md lists. Metrics use the full vectors when both traces
recorded them for a checkpoint ("full"), else the 64-number fingerprints ("fp": cosine and rel-L2
are then Johnson-Lindenstrauss estimates, max-abs is unknown). A position drifts when its rel-L2
exceeds `rel_tol` or its RMS ratio leaves 1 +- `norm_tol` or any statistic is non-finite; the first
drifting checkpoint is the shallowest one (depth order) where any position drifts.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import pandas as pd

from parity.compare import metrics
from parity.compare.jsonvalues import json_safe
from parity.compare.rows import CheckpointRow, by_depth, checkpoint_rows, summary_frame
from parity.contract.checkpoints import LOGITS, checkpoint_depths, checkpoint_layer, has_top, is_draft, per_stream
from parity.contract.errors import ParityError, TraceError
from parity.gguf.weights import same_model
from parity.tracing.records import Trace


class PreflightError(ParityError):
    """The two traces are not comparable (different tokens, model, checkpoints or positions)."""


@dataclass(frozen=True)
class Thresholds:
    """Drift thresholds. rel_tol 1e-3 sits ~1000x above float32 engine-vs-reference noise (~1e-6)
    and ~10x below the smallest injected fault's rel-L2 at its first checkpoint (1.3e-2, docs/metrics.md)."""

    rel_tol: float = 1e-3
    norm_tol: float = 1e-3

    def __post_init__(self) -> None:
        for name in ("rel_tol", "norm_tol"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ParityError(f"{name} must be a positive finite number, got {v!r}")

    def with_overrides(self, **kw: float | None) -> Thresholds:
        return replace(self, **{k: v for k, v in kw.items() if v is not None})

    @property
    def cos_tol(self) -> float:
        """The cosine threshold equivalent to rel_tol for equal-norm vectors: 1 - rel_tol^2 / 2."""
        return float(metrics.cosine_at_rel_l2(self.rel_tol))


def preflight(a: Trace, b: Trace) -> list[str]:
    """Reasons the traces are not comparable one-to-one (empty list: comparable)."""
    ha, hb = a.header, b.header
    problems = []
    i = _first_token_difference(ha.tokens, hb.tokens)
    if i is not None:
        at = lambda t: t[i] if i < len(t) else "end"  # noqa: E731
        problems.append(f"token ids differ at position {i} (A: {at(ha.tokens)}, B: {at(hb.tokens)}; "
                        f"A has {len(ha.tokens)} tokens, B {len(hb.tokens)})")
    if not same_model(ha.model, hb.model):
        problems.append(f"model identity differs: A {_model_str(ha.model)} vs B {_model_str(hb.model)}")
    if ha.checkpoints != hb.checkpoints:
        only_a = [c for c in ha.checkpoints if c not in hb.checkpoints]
        only_b = [c for c in hb.checkpoints if c not in ha.checkpoints]
        problems.append(f"checkpoint sets differ: only in A {only_a or '-'}, only in B {only_b or '-'}")
    if ha.positions != hb.positions:
        problems.append(f"traced positions differ: A {_short(ha.positions)} vs B {_short(hb.positions)}")
    if ha.n_hc != hb.n_hc:
        problems.append(f"stream counts differ: A {ha.n_hc} vs B {hb.n_hc}")
    if ha.dim != hb.dim:
        problems.append(f"model dimensions differ: A dim {ha.dim} vs B dim {hb.dim}")
    if ha.draft.get("pairing") != hb.draft.get("pairing"):
        problems.append(f"MTP pairings differ: A {ha.draft.get('pairing')} vs B {hb.draft.get('pairing')} (the draft "
                        "checkpoints of a position pair other carriers)")
    if ha.top_k != hb.top_k:
        problems.append(f"top-k widths differ: A {ha.top_k} vs B {hb.top_k} (top-k entries then never compare equal)")
    return problems


def _first_token_difference(ta: list[int], tb: list[int]) -> int | None:
    """First position whose input token differs (or where one run ends), None if identical."""
    if ta == tb:
        return None
    return next((i for i, (x, y) in enumerate(zip(ta, tb, strict=False)) if x != y), min(len(ta), len(tb)))


def _model_str(m: dict) -> str:
    data = f", data {m['data_sha256']}" if "data_sha256" in m else ", no data hash (old identity)"
    return f"{m['file']} ({m['size']} bytes, header {m['header_sha256']}{data})"


def _short(xs: list) -> str:
    return str(xs) if len(xs) <= 8 else f"[{xs[0]}, {xs[1]}, ..., {xs[-1]}] ({len(xs)})"


@dataclass(frozen=True)
class DiffReport:
    """Everything a diff found. `table`: one row per (checkpoint, position); `rows`: one judged `CheckpointRow` per
    checkpoint (table order), computed once from `table` and `thresholds`; `summary`: those rows as a frame."""

    a: dict[str, Any]
    b: dict[str, Any]
    thresholds: Thresholds
    warnings: list[str]
    table: pd.DataFrame
    layers: pd.DataFrame
    first_drift: dict[str, Any] | None
    flags_differ: dict[str, Any] = field(default_factory=dict)
    logits: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=LOGIT_COLUMNS))
    departure: dict[str, Any] | None = None  # the largest rel-L2 jump between consecutive checkpoints (on drift)
    rows: tuple[CheckpointRow, ...] = field(default=(), repr=False, compare=False)  # () = from table

    def __post_init__(self) -> None:
        if not self.rows:  # `diff_traces` passes the rows it computed once; other callers leave them to this
            rows = checkpoint_rows(self.table, self.thresholds.rel_tol, self.thresholds.norm_tol)
            object.__setattr__(self, "rows", rows)

    def __bool__(self) -> bool:
        return self.first_drift is None

    @property
    def exact(self) -> bool:
        """Bit-identical in every compared field: checkpoint rows, per-layer diagnostics and side-file logits."""
        layers_same = all((self.layers[c] == v).all() for c, v in _NO_DIFF.items())
        return bool(all(r.exact for r in self.rows) and layers_same and self.logits["exact"].all())

    @property
    def summary(self) -> pd.DataFrame:
        """Per checkpoint (depth order): worst position by rel-L2 and its metrics, drift count (`summary_frame`)."""
        return summary_frame(self.rows)

    def to_dict(self) -> dict[str, Any]:
        def records(df: pd.DataFrame) -> list[dict]:
            return [{k: json_safe(v, nan=None) for k, v in row.items()} for row in df.to_dict(orient="records")]

        return {"a": self.a, "b": self.b, "thresholds": {**asdict(self.thresholds), "cos_tol": self.thresholds.cos_tol},
                "warnings": self.warnings, "flags_differ": self.flags_differ, "agree": bool(self),
                "exact": self.exact, "first_drift": self.first_drift, "departure": self.departure,
                "checkpoints": records(self.summary),
                "positions": records(self.table), "layers": records(self.layers), "logits": records(self.logits)}


# ----------------------------------------------------------------------------------------------
# Computing the diff

def diff_traces(a: Trace, b: Trace, thresholds: Thresholds | None = None, force: bool = False) -> DiffReport:
    """Preflight, then metrics for every common (checkpoint, position); raises PreflightError unless forced."""
    th = thresholds or Thresholds()
    problems = preflight(a, b)
    if problems and not force:
        raise PreflightError("refusing to compare these traces (use --force / force=True to compare the "
                             "overlap anyway):\n  - " + "\n  - ".join(problems))
    names = [c for c in a.header.checkpoints if c in set(b.header.checkpoints)]
    in_b = set(b.header.positions)
    positions = [p for p in a.header.positions if p in in_b]
    cut = _first_token_difference(a.header.tokens, b.header.tokens)
    if cut is not None and any(p >= cut for p in positions):
        positions = [p for p in positions if p < cut]
        problems.append(f"compared only positions < {cut}: from there on the runs were fed different tokens")
    if not names or not positions:
        raise PreflightError("the traces share no (checkpoint, position) to compare")
    problems += one_sided_tables(a, b)
    with ThreadPoolExecutor(2) as pool:  # independent tables; their numpy work releases the GIL
        layers_job = pool.submit(_layer_diags, a, b, positions)
        table = _metrics_table(a, b, names, positions, th, a.n_layers)
        logits = _logit_metrics(a, b, positions, th)
        layers = layers_job.result()
    rows = checkpoint_rows(table, th.rel_tol, th.norm_tol)
    return DiffReport(
        a=_side(a), b=_side(b), thresholds=th, warnings=problems, table=table,
        layers=layers, first_drift=(first := _first_drift(table, th) or _logits_drift(logits, th)),
        departure=_departure(rows) if first is not None else None,
        logits=logits, rows=rows,
        flags_differ={k: [a.header.flags.get(k), b.header.flags.get(k)]
                      for k in sorted(set(a.header.flags) | set(b.header.flags))
                      if a.header.flags.get(k) != b.header.flags.get(k)},
    )


DIAGNOSTIC_TABLES = {"hc": "HC gates (pre / post / comb)", "moe": "routing (expert ids, weights, margins)",
                     "attn": "attention diagnostics (visible compressed rows, indexer selection)"}


def one_sided_tables(a: Trace, b: Trace) -> list[str]:
    """A note per diagnostics table that only one trace recorded (it is not compared: `_layer_diags`)."""
    notes = []
    for table, what in DIAGNOSTIC_TABLES.items():
        na, nb = len(getattr(a, table)), len(getattr(b, table))
        if bool(na) != bool(nb):
            side, t = ("A", a) if na else ("B", b)
            notes.append(f"{what}: only {side} ({t.header.engine}) recorded them, so they are not compared")
    return notes


def _side(t: Trace) -> dict[str, Any]:
    h = t.header
    return {"engine": h.engine, "version": h.engine_version, "model": h.model, "dtype": h.dtype, "flags": h.flags,
            "n_tokens": len(h.tokens), "n_prompt": h.n_prompt, **({"draft": h.draft} if h.draft else {})}


def _row_table(t: Trace, positions: list[int]) -> np.ndarray:
    """The `ckpt` row of every (header checkpoint, position in the sorted `positions`); -1 where none.
    One pass over the table, built once per diff (not once per checkpoint).  -> int [n_checkpoints, len(positions)]"""
    ck, pos = t.ckpt["ck"], t.ckpt["pos"]
    at = np.asarray(positions)
    listed = np.flatnonzero(np.isin(pos, at))
    where = np.full((len(t.header.checkpoints), len(at)), -1)
    where[ck[listed], np.searchsorted(at, pos[listed])] = listed
    return where


def _rows_at(t: Trace, names: list[str], positions: list[int], table: tuple[np.ndarray, list[int]] | None = None
             ) -> np.ndarray:
    """The `ckpt` row of every (checkpoint, position), checkpoint-major; `table`: a `_row_table` over sorted positions
    that include `positions`, with those positions.  -> int [len(names) * len(positions)]"""
    where, at = table if table is not None else (_row_table(t, positions), positions)
    cols = np.searchsorted(np.asarray(at), np.asarray(positions, dtype=np.int64))
    index = {n: i for i, n in enumerate(t.header.checkpoints)}
    rows = where[[index[n] for n in names]][:, cols]
    if (rows < 0).any():
        i, j = np.argwhere(rows < 0)[0]
        raise TraceError(f"{t.header.engine} trace: no ckpt row for checkpoint {names[i]} at position {positions[j]}")
    return rows.ravel()


def _metrics_table(a: Trace, b: Trace, names: list[str], positions: list[int], th: Thresholds,
                   n_layers: int) -> pd.DataFrame:
    """One row per (checkpoint, position), checkpoint-major: metrics on full vectors or fingerprints (`method`).
    A draft checkpoint is compared at the positions both traces record it at (`TraceHeader.positions_of`)."""
    at = [_common_positions(a, b, name, positions) for name in names]
    keep = [i for i, ps in enumerate(at) if ps]
    names, at = [names[i] for i in keep], [at[i] for i in keep]
    n = np.array([len(ps) for ps in at])
    full = [a.vectors is not None and b.vectors is not None and name in a.vectors and name in b.vectors
            for name in names]
    ta, tb = (_row_table(a, positions), positions), (_row_table(b, positions), positions)
    every = [name for name, ps in zip(names, at, strict=True) if ps is positions]  # rows looked up at once
    rows_a = dict(zip(every, _rows_at(a, every, positions, ta).reshape(len(every), len(positions)), strict=True))
    rows_b = dict(zip(every, _rows_at(b, every, positions, tb).reshape(len(every), len(positions)), strict=True))
    parts = []
    for batch in _batches(names, at, full, positions):
        name, ps = names[batch[0]], [p for i in batch for p in at[i]]
        ra = np.concatenate([rows_a[names[i]] if names[i] in rows_a else _rows_at(a, [names[i]], at[i], ta)
                             for i in batch])
        rb = np.concatenate([rows_b[names[i]] if names[i] in rows_b else _rows_at(b, [names[i]], at[i], tb)
                             for i in batch])
        parts.append(_checkpoint_metrics(a, b, name, ps, ra, rb, full[batch[0]], th))
    layers = [checkpoint_layer(name) for name in names]
    return pd.DataFrame({
        "checkpoint": np.repeat(np.array(names, dtype=object), n),
        "depth": np.repeat(checkpoint_depths(names, n_layers), n),
        "layer": np.repeat([-1 if layer is None else layer for layer in layers], n).astype(np.int64),
        "pos": np.concatenate([np.asarray(ps, np.int64) for ps in at]),
        "method": np.repeat(np.array(["full" if f else "fp" for f in full], dtype=object), n),
        **{k: np.concatenate([p[k] for p in parts]) for k in parts[0]},
    })


METRIC_BATCH = 8  # checkpoints per `_checkpoint_metrics` call (x 4096 positions: float64 temporaries in cache)


def _batches(names: list[str], at: list[list[int]], full: list[bool], positions: list[int]) -> list[list[int]]:
    """Indices of `names` in the runs one `_checkpoint_metrics` call computes: up to METRIC_BATCH consecutive
    checkpoints compared on fingerprints at every compared position (`at[i] is positions`) with one record layout
    (has_top, per_stream); any other checkpoint alone. Every metric is computed row by row, so a batch gives each
    checkpoint the rows, bit for bit, of a call of its own, with an eighth of the calls (88 x 4096 rows: 0.30 ->
    0.25 s of CPU; one call for all rows was slower, its temporaries leave the cache)."""
    out: list[list[int]] = []
    for i, name in enumerate(names):
        last = out[-1] if out else None
        if (last is not None and len(last) < METRIC_BATCH and not full[i] and at[i] is positions
                and not full[last[0]] and at[last[0]] is positions
                and (has_top(name), per_stream(name)) == (has_top(names[last[0]]), per_stream(names[last[0]]))):
            last.append(i)
        else:
            out.append([i])
    return out


def _common_positions(a: Trace, b: Trace, name: str, positions: list[int]) -> list[int]:
    """The compared positions at which both traces record checkpoint `name`: `positions` itself (the same list) for a
    trunk checkpoint, recorded at every traced position of both traces (the compared ones are among them)."""
    if not is_draft(name):
        return positions
    both = set(a.header.positions_of(name)) & set(b.header.positions_of(name))
    return [p for p in positions if p in both]


def _checkpoint_metrics(a: Trace, b: Trace, name: str, positions: list[int], ra: np.ndarray, rb: np.ndarray,
                        full: bool, th: Thresholds) -> dict[str, np.ndarray]:
    """The metric columns of one checkpoint (rows ra of a.ckpt against rb of b.ckpt, one per position)."""
    ca, cb = _selected(a.ckpt.cols, ra), _selected(b.ckpt.cols, rb)
    ra = rb = slice(None)
    if full:
        va, vb = a.vectors[name][_indices(a, positions, name)], b.vectors[name][_indices(b, positions, name)]
        max_abs = metrics.max_abs(va, vb)
        exact_vec = np.all(va.reshape(len(va), -1) == vb.reshape(len(vb), -1), axis=1)
    else:
        va, vb = ca["fp"][ra], cb["fp"][rb]
        max_abs, exact_vec = np.full(len(positions), np.nan), np.ones(len(positions), bool)
    rel, cos = metrics.rel_l2_and_cosine(va, vb)
    with np.errstate(divide="ignore", invalid="ignore"):
        norm_ratio = cb["rms"][rb].astype(np.float64) / ca["rms"][ra]
        stream = cb["l2s"][rb].astype(np.float64) / ca["l2s"][ra]
    stats = ("min", "max", "rms", "sum_l2")
    finite = np.all([np.isfinite(ca[s][ra]) & np.isfinite(cb[s][rb]) for s in stats], axis=0)
    finite &= np.isfinite(ca["fp"][ra]).all(axis=1) & np.isfinite(cb["fp"][rb]).all(axis=1)
    compared = [*stats, "fp"]
    if has_top(name):  # final_norm, mtp.k.logits: the output's argmax and top-k
        compared += ["argmax", "top_ids", "top_logits"]
    if not per_stream(name):  # one l2 number (the rest is NaN padding)
        l2s_a, l2s_b = ca["l2s"][ra][:, :1], cb["l2s"][rb][:, :1]
    else:
        l2s_a, l2s_b = ca["l2s"][ra], cb["l2s"][rb]
    exact = exact_vec & _same(l2s_a, l2s_b) & np.all([_same(ca[s][ra], cb[s][rb]) for s in compared], axis=0)
    drift = ~finite | ~(rel <= th.rel_tol) | ~(np.abs(norm_ratio - 1.0) <= th.norm_tol)
    with np.errstate(all="ignore"):
        smin, smax = np.nanmin(stream, axis=1), np.nanmax(stream, axis=1)
    return {"norm_ratio": norm_ratio, "cosine": cos, "rel_l2": rel, "nmse": rel ** 2,
            "sqnr_db": metrics.sqnr_from_rel_l2(rel), "max_abs": max_abs, "stream_ratio_min": smin,
            "stream_ratio_max": smax, "finite": finite, "exact": exact, "drift": drift,
            "argmax_a": ca["argmax"][ra], "argmax_b": cb["argmax"][rb]}


def _selected(cols: dict[str, np.ndarray], rows: np.ndarray) -> dict[str, np.ndarray]:
    """Every column at `rows`: views when the rows are one ascending run (a trace's usual layout), else copies."""
    if len(rows) and rows[-1] - rows[0] == len(rows) - 1 and (np.diff(rows) == 1).all():
        run = slice(int(rows[0]), int(rows[-1]) + 1)
        return {k: v[run] for k, v in cols.items()}
    return {k: v[rows] for k, v in cols.items()}


def _indices(t: Trace, positions: list[int], name: str = LOGITS) -> np.ndarray:
    """Rows of t.vectors[name] (one per position it is recorded at) holding `positions`."""
    return np.searchsorted(np.asarray(t.header.positions_of(name)), positions)


def _same(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Row-wise exact equality; NaN equals nothing, not even NaN; rows of different widths differ."""
    if x.shape != y.shape:
        return np.zeros(len(x), bool)
    eq = np.asarray(x == y)
    return eq.reshape(len(eq), -1).all(axis=1)


LOGIT_COLUMNS = ["pos", "rel_l2", "cosine", "max_abs", "finite", "exact", "drift"]


def _logit_metrics(a: Trace, b: Trace, positions: list[int], th: Thresholds) -> pd.DataFrame:
    """Per position: the side files' full logits compared (empty when either trace lacks them)."""
    if not (a.vectors and b.vectors and LOGITS in a.vectors and LOGITS in b.vectors):
        return pd.DataFrame(columns=LOGIT_COLUMNS)
    la, lb = a.vectors[LOGITS][_indices(a, positions)], b.vectors[LOGITS][_indices(b, positions)]
    if la.shape != lb.shape:
        raise PreflightError(f"logits vectors have different shapes: A {la.shape[1:]} vs B {lb.shape[1:]}")
    rel = metrics.rel_l2(la, lb)
    finite = np.isfinite(la).all(axis=1) & np.isfinite(lb).all(axis=1)
    return pd.DataFrame({"pos": np.asarray(positions, np.int64), "rel_l2": rel, "cosine": metrics.cosine(la, lb),
                         "max_abs": metrics.max_abs(la, lb), "finite": finite, "exact": _same(la, lb),
                         "drift": ~finite | ~(rel <= th.rel_tol)})


def _logits_drift(logits: pd.DataFrame, th: Thresholds) -> dict[str, Any] | None:
    """First drift at the logits, when no checkpoint drifted (the logits come after final_norm)."""
    d = logits[logits["drift"].astype(bool)]
    if d.empty:
        return None
    row = d.loc[d["rel_l2"].astype(float).fillna(np.inf).idxmax()]
    reason = "non-finite values" if not row["finite"] else f"rel-L2 {row['rel_l2']:.3g} > {th.rel_tol:g}"
    return {"checkpoint": LOGITS, "layer": None, "first_pos": int(d["pos"].iloc[0]), "worst_pos": int(row["pos"]),
            "positions": d["pos"].tolist(), "method": "full", "rel_l2": json_safe(row["rel_l2"], nan=None),
            "norm_ratio": None, "cosine": json_safe(row["cosine"], nan=None), "reason": reason}


JUMP_FLOOR = float(np.finfo(np.float32).eps)  # rel-L2 at or below float32's epsilon is round-off: jumps from it count
# from the epsilon, so a first non-zero rel-L2 after an exact checkpoint is not an infinite jump


def _departure(rows: tuple[CheckpointRow, ...]) -> dict[str, Any] | None:
    """Where B departs: the checkpoint row with the largest jump of the worst rel-L2 (over positions) from the
    checkpoint before it, in depth order. jump = max(r_k, eps) / max(r_(k-1), eps), eps = float32's epsilon; a
    non-finite r_k is an infinite jump (the first one wins ties). The first threshold crossing can come later: the
    drift grows after the departure until it crosses the threshold. None with fewer than two checkpoints."""
    per = by_depth(rows)
    if len(per) < 2:
        return None
    worst = np.array([np.inf if np.isnan(r.rel_l2) else r.rel_l2 for r in per])
    r = np.maximum(worst, JUMP_FLOOR)
    with np.errstate(invalid="ignore"):
        jumps = np.where(np.isinf(r[1:]), np.inf, r[1:] / r[:-1])
    k = int(np.argmax(jumps)) + 1
    row, prev = per[k], per[k - 1]
    return {"checkpoint": row.checkpoint, "layer": None if row.layer < 0 else row.layer,
            "after": prev.checkpoint, "rel_l2": json_safe(float(worst[k])),
            "rel_l2_before": json_safe(float(worst[k - 1])), "jump": json_safe(float(jumps[k - 1]))}


def _first_drift(table: pd.DataFrame, th: Thresholds) -> dict[str, Any] | None:
    d = table[table["drift"]]
    if d.empty:
        return None
    depth = d["depth"].min()
    at = d[d["depth"] == depth].sort_values("pos")
    row = at.loc[at["rel_l2"].fillna(np.inf).idxmax()]
    reason = ("non-finite values" if not row["finite"] else
              f"rel-L2 {row['rel_l2']:.3g} > {th.rel_tol:g}" if not row["rel_l2"] <= th.rel_tol else
              f"RMS ratio {row['norm_ratio']:.6g} outside 1 +- {th.norm_tol:g}")
    return {"checkpoint": row["checkpoint"], "layer": None if row["layer"] < 0 else int(row["layer"]),
            "first_pos": int(at["pos"].iloc[0]), "worst_pos": int(row["pos"]), "positions": at["pos"].tolist(),
            "method": row["method"], "rel_l2": json_safe(row["rel_l2"], nan=None),
            "norm_ratio": json_safe(row["norm_ratio"], nan=None), "cosine": json_safe(row["cosine"], nan=None),
            "reason": reason}


LAYER_COLUMNS = ["layer", "hc_max_abs", "expert_flips", "first_flip_pos", "weight_max_abs", "order_mismatch",
                 "margin_max_abs", "n_comp_mismatch", "sel_mismatch", "unmatched", "sel_dup_a", "sel_dup_b"]
_BLOCK = 1024  # rows per block when comparing [rows, S] indexer selections (temporaries stay in cache)
_HC_BLOCK = 8192  # rows per block of HC gate differences
_NO_DIFF = {"hc_max_abs": 0.0, "expert_flips": 0, "first_flip_pos": -1, "weight_max_abs": 0.0, "order_mismatch": 0,
            "margin_max_abs": 0.0, "n_comp_mismatch": 0, "sel_mismatch": 0, "unmatched": 0}


def _layer_diags(a: Trace, b: Trace, positions: list[int]) -> pd.DataFrame:
    """Per layer: every per-layer diagnostic the traces recorded, compared (docs/metrics.md "Layer diagnostics").

    Rows are joined on their keys ((layer, sub, pos) / (layer, pos), positions in `positions`; a key listed twice
    counts its last row); `unmatched` counts rows only one side holds (a table one trace did not record at all is
    not compared: importers of engines that dump no diagnostics leave them empty; the report's warnings name it,
    `one_sided_tables`). NaN never equals anything: a NaN
    on either side is an infinite difference (hc_max_abs, weight_max_abs); a router margin of NaN means "not
    recorded" (hash layers, imports) and margins are compared where both sides recorded one.
    hc_max_abs = max |b - a| over pre/post/comb; expert_flips = rows whose expert-id sets differ;
    weight_max_abs = max |b - a| of the weights of the same expert id, over rows with equal id multisets;
    order_mismatch = rows with equal sets but another sequence of ids; sel_mismatch = rows whose indexer selections
    (entries >= 0, compared as sorted lists: a compressed row selected twice counts twice) or has-selection flags
    differ; sel_dup_a / sel_dup_b = rows whose selection in A / B lists a compressed row more than once (a top-k
    bug on that side, counted whether or not the other side agrees; not a difference, so not part of `exact`).
    """
    keep = np.asarray(positions)
    out: dict[int, dict[str, Any]] = {}

    def entries(layers: np.ndarray) -> list[dict[str, Any]]:
        return [out.setdefault(layer, {"layer": layer, **_NO_DIFF, "sel_dup_a": 0, "sel_dup_b": 0})
                for layer in layers.tolist()]

    for table, key in (("hc", ("layer", "sub", "pos")), ("moe", ("layer", "pos")), ("attn", ("layer", "pos"))):
        ta, tb = getattr(a, table), getattr(b, table)
        ia = ib = _aligned_rows(ta, tb, key, keep)
        if ia is None:
            joined = _join(ta, tb, key, keep)
            lone = joined[joined["_merge"] != "both"]
            if len(lone) and len(ta) and len(tb):  # a table one side lacks: not recorded
                layers, counts = np.unique(lone["layer"].to_numpy(), return_counts=True)
                for e, n in zip(entries(layers), counts.tolist(), strict=True):
                    e["unmatched"] += n
            both = joined[joined["_merge"] == "both"]
            ia, ib = both["row_a"].to_numpy(np.int64), both["row_b"].to_numpy(np.int64)
        if len(ia):
            {"hc": _hc_diags, "moe": _moe_diags, "attn": _attn_diags}[table](a, b, ia, ib, entries)
    return pd.DataFrame([out[k] for k in sorted(out)], columns=LAYER_COLUMNS)


def _hc_diags(a: Trace, b: Trace, ia: np.ndarray, ib: np.ndarray, entries: Any) -> None:
    layers, starts = _runs(a.hc["layer"][ia])
    hc_max = np.zeros(len(layers))
    row_max = np.empty(len(ia))
    for c in ("pre", "post", "comb"):
        for i in range(0, len(ia), _HC_BLOCK):  # float64 differences a block of rows at a time (they stay in cache)
            ja, jb = ia[i:i + _HC_BLOCK], ib[i:i + _HC_BLOCK]
            d = np.abs(np.subtract(_take(a.hc[c], ja), _take(b.hc[c], jb), dtype=np.float64))
            row_max[i:i + _HC_BLOCK] = d.max(axis=1, initial=0.0)  # a NaN propagates to its row's maximum
        row_max[np.isnan(row_max)] = np.inf
        hc_max = np.maximum(hc_max, np.maximum.reduceat(row_max, starts))
    for e, v in zip(entries(layers), hc_max.tolist(), strict=True):
        e["hc_max_abs"] = v


def _moe_diags(a: Trace, b: Trace, ia: np.ndarray, ib: np.ndarray, entries: Any) -> None:
    ids_a, ids_b = _take(a.moe["ids"], ia), _take(b.moe["ids"], ib)
    same = _rows_equal(ids_a, ids_b)
    flip = _sets_differ(ids_a, ids_b, same)
    weight = np.zeros(len(ia))
    multiset = np.zeros(len(ia), bool)
    if ids_a.shape[1] == ids_b.shape[1]:
        oa, ob = np.argsort(ids_a, axis=1, kind="stable"), np.argsort(ids_b, axis=1, kind="stable")
        multiset = (np.take_along_axis(ids_a, oa, 1) == np.take_along_axis(ids_b, ob, 1)).all(axis=1)
        wa = np.take_along_axis(a.moe["w"][ia], oa, 1).astype(np.float64)
        wb = np.take_along_axis(b.moe["w"][ib], ob, 1)
        row_max = np.abs(wa - wb).max(axis=1, initial=0.0)  # NaN where a row holds one: an infinite difference
        row_max[np.isnan(row_max)] = np.inf
        weight = np.where(multiset, row_max, 0.0)
    order = ~same & ~flip
    ma, mb = a.moe["margin"][ia].astype(np.float64), b.moe["margin"][ib]
    margin = np.where(np.isnan(ma) | np.isnan(mb), 0.0, np.abs(ma - mb))  # NaN: no margin recorded
    pos = np.where(flip, a.moe["pos"][ia].astype(np.int64), np.iinfo(np.int64).max)
    layers, starts = _runs(a.moe["layer"][ia])
    n_flip = np.add.reduceat(flip.astype(np.int64), starts).tolist()
    first = np.minimum.reduceat(pos, starts).tolist()
    w_max = np.maximum.reduceat(weight, starts).tolist()
    n_order = np.add.reduceat(order.astype(np.int64), starts).tolist()
    m_max = np.maximum.reduceat(margin, starts).tolist()
    for e, n, f, wm, no, mm in zip(entries(layers), n_flip, first, w_max, n_order, m_max, strict=True):
        e.update(expert_flips=n, first_flip_pos=f if n else -1, weight_max_abs=wm, order_mismatch=no,
                 margin_max_abs=mm)


def _attn_diags(a: Trace, b: Trace, ia: np.ndarray, ib: np.ndarray, entries: Any) -> None:
    n_comp = a.attn["n_comp"][ia] != b.attn["n_comp"][ib]
    blocks = [(ia[i:i + _BLOCK], ib[i:i + _BLOCK]) for i in range(0, len(ia), _BLOCK)]
    parts = [_sel_compare(_take(a.attn["sel"], ja), _take(b.attn["sel"], jb)) for ja, jb in blocks]
    sel, dup_a, dup_b = (np.concatenate(c) for c in zip(*parts, strict=True))
    sel |= a.attn["has_sel"][ia] != b.attn["has_sel"][ib]
    layers, starts = _runs(a.attn["layer"][ia])
    counts = [np.add.reduceat(x.astype(np.int64), starts).tolist() for x in (n_comp, sel, dup_a, dup_b)]
    for e, nc, ns, da, db in zip(entries(layers), *counts, strict=True):
        e.update(n_comp_mismatch=nc, sel_mismatch=ns, sel_dup_a=da, sel_dup_b=db)


def _aligned_rows(ta: Any, tb: Any, key: tuple[str, ...], keep: np.ndarray) -> np.ndarray | None:
    """The rows `_join` pairs when it needs no join: both tables hold the same keys, row for row, in strictly
    ascending key order (so no key twice), all at positions in `keep` -> every row, paired with itself (0..n-1, the
    order `_join` sorts to; nothing unmatched). None otherwise (then `_join` decides). Two traces of one run layout,
    the usual case, take this path; a `_join` of 176 128 rows costs tens of ms, this check a few."""
    n = len(ta)
    if n == 0 or len(tb) != n or not all(np.array_equal(ta[k], tb[k]) for k in key):
        return None
    if not np.isin(ta["pos"], keep).all():
        return None
    if n > 1:
        keys = np.stack([ta[k].astype(np.int64) for k in key], axis=1)
        step = keys[1:] - keys[:-1]
        if (step[np.arange(n - 1), np.argmax(step != 0, axis=1)] <= 0).any():  # first non-zero step per row pair
            return None
    return np.arange(n)


def _join(ta: Any, tb: Any, key: tuple[str, ...], keep: np.ndarray) -> pd.DataFrame:
    """Outer merge of two tables' rows at positions in `keep` on their key columns, in ascending key order.

    Columns: the keys, `row_a` / `row_b` (row index in each table, NaN where absent) and `_merge` (both |
    left_only | right_only). A key listed twice in one table counts its last row.
    """
    def side(t: Any, col: str) -> pd.DataFrame:
        rows = np.flatnonzero(np.isin(t["pos"], keep))
        df = pd.DataFrame({k: t[k][rows].astype(np.int64) for k in key} | {col: rows})
        return df.drop_duplicates(list(key), keep="last")

    merged = side(ta, "row_a").merge(side(tb, "row_b"), on=list(key), how="outer", indicator=True, sort=True)
    return merged.reset_index(drop=True)


def _runs(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Values and start indices of the runs of equal values in x (non-empty)."""
    starts = np.flatnonzero(np.concatenate([[True], x[1:] != x[:-1]]))
    return x[starts], starts


def _take(x: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """x[rows], as a view when rows is an ascending run of consecutive indices (rows non-empty)."""
    if rows[-1] - rows[0] == len(rows) - 1 and (np.diff(rows) == 1).all():
        return x[rows[0]: rows[-1] + 1]
    return x[rows]


def _rows_equal(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Row-wise array equality (same width, same values in the same order).  [n, p] x [n, q] -> bool [n]"""
    if x.shape[1] != y.shape[1]:
        return np.zeros(len(x), bool)
    return (x == y).all(axis=1)


def _sel_compare(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Indexer selections (negative = empty slot) as the sorted lists of their entries >= 0, per row.

    x [n, S], y [n, S'] int -> (sorted(x[i] >= 0) != sorted(y[i] >= 0), x[i] lists a value twice, y[i] lists a
    value twice), each bool [n]. Lists, not sets: a compressed row selected twice is not the row selected once.
    Only what can differ is sorted: x's rows holding an entry >= 0 (for its duplicates) and the rows where y is not
    x element for element (equal rows have equal sorted lists and y's duplicates are x's).
    """
    diff = np.flatnonzero(~_rows_equal(x, y))
    live = np.flatnonzero((x >= 0).any(axis=1))
    dup_a = np.zeros(len(x), bool)
    dup_a[live] = _dup(_sorted_entries(x[live]))
    dup_b, mismatch = dup_a.copy(), np.zeros(len(x), bool)
    if len(diff):
        sx, sy = _sorted_entries(x[diff]), _sorted_entries(y[diff])
        width = max(sx.shape[1], sy.shape[1])
        pad = lambda s: np.pad(s, ((0, 0), (width - s.shape[1], 0)), constant_values=-1)  # noqa: E731
        mismatch[diff] = (pad(sx) != pad(sy)).any(axis=1)
        dup_b[diff] = _dup(sy)
    return mismatch, dup_a, dup_b


def _sorted_entries(v: np.ndarray) -> np.ndarray:
    """Each row sorted, every negative entry as -1 (empty slots first).  [n, S] -> [n, S]"""
    s = np.maximum(v, -1)
    s.sort(axis=1)  # in place: the copy np.maximum made is the only one
    return s


def _dup(s: np.ndarray) -> np.ndarray:
    """Rows of sorted entries listing a value >= 0 twice.  [n, S] -> bool [n]"""
    return ((s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)).any(axis=1)


def _sets_differ(x: np.ndarray, y: np.ndarray, same: np.ndarray) -> np.ndarray:
    """set(x[i]) != set(y[i]) per row; rows known equal (`same`) skip.

    x [n, p], y [n, q] int -> bool [n]. Sets compare as canonical rows: sorted, duplicates replaced by the row
    minimum, sorted again, left-padded with the minimum to a common width (equal sets <=> equal rows).
    """
    out = ~same
    rows = np.flatnonzero(out)
    if len(rows):
        cx, cy = _canonical_set(x[rows]), _canonical_set(y[rows])
        width = max(cx.shape[1], cy.shape[1])
        out[rows] = (_pad_left(cx, width) != _pad_left(cy, width)).any(axis=1)
    return out


def _canonical_set(x: np.ndarray) -> np.ndarray:
    """A row form that depends only on the row's value set (and width); see `_sets_differ`.  [n, p] -> [n, p]"""
    s = np.sort(x.astype(np.int64), axis=1)
    if s.shape[1] > 1:
        s[:, 1:] = np.where(s[:, 1:] == s[:, :-1], s[:, :1], s[:, 1:])
        s.sort(axis=1)
    return s


def _pad_left(s: np.ndarray, width: int) -> np.ndarray:
    """Prepend copies of column 0 (the row minimum) up to `width` columns."""
    return np.concatenate([np.repeat(s[:, :1], width - s.shape[1], axis=1), s], axis=1)
