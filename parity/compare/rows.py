"""One checkpoint of a diff, judged once: `CheckpointRow`, built by `checkpoint_rows` from a diff's position table.

Every per-checkpoint view of a diff reads these rows: `DiffReport.summary` and its JSON `checkpoints`, the
printers' tables and JSON `worst`, the HTML table, `gate`'s cases (re-judged by each checkpoint's own tolerance,
`CheckpointRow.failing_at`). Per checkpoint each
metric keeps its OWN worst value over the compared positions (NaN counting as the worst): the largest rel-L2, the
RMS ratio farthest from 1, the smallest cosine. `pos` is the worst position of the metric that fails (non-finite
values first, then rel-L2, then the RMS ratio), else rel-L2's worst.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

# The JSON fields of a row as `--json`'s `worst` lists them (the printers' row; later fields are not in `worst`).
WORST_FIELDS = ("checkpoint", "method", "pos", "failing", "rel_l2", "rel_l2_pos", "norm_ratio", "norm_ratio_pos",
                "cosine", "sqnr_db", "max_abs", "stream_min", "stream_max", "positions", "drifting", "exact")


@dataclass(frozen=True)
class CheckpointRow:
    """One checkpoint's numbers over its compared positions and its judgement by the diff's thresholds."""

    checkpoint: str
    method: str              # full | fp (fingerprint estimate)
    pos: int                 # worst position of the failing metric (else of rel-L2)
    failing: str             # "non-finite" | "rel-L2" | "norm ratio" | "" (agrees), by the diff's thresholds
    rel_l2: float            # the largest rel-L2 (NaN if any position's is NaN)
    rel_l2_pos: int
    norm_ratio: float        # the RMS ratio farthest from 1 (NaN if any is NaN)
    norm_ratio_pos: int
    cosine: float            # the smallest cosine
    sqnr_db: float           # at `pos`
    max_abs: float           # the largest max-abs (NaN on fingerprints)
    stream_min: float
    stream_max: float
    positions: int
    drifting: int            # positions the diff's thresholds call drifting
    exact: bool
    depth: float             # plot / first-drift depth (`checkpoint_depths`)
    layer: int               # -1: not a layer's checkpoint
    worst_norm_ratio: float  # the RMS ratio at rel_l2_pos
    worst_sqnr_db: float     # the SQNR at rel_l2_pos
    finite: bool             # every statistic finite at every position
    rel_l2_nanmax: float     # the largest rel-L2 over the positions whose rel-L2 is not NaN (NaN: none)
    norm_dev_nanmax: float   # the same for |RMS ratio - 1|
    top1_flips: tuple[tuple[int, int, int], ...]  # (position, argmax A, argmax B) where the argmaxes differ

    @property
    def status(self) -> str:
        if self.exact:
            return "exact"
        return f"DRIFT {self.drifting}/{self.positions}" if self.drifting else "ok"

    def failing_at(self, rel_tol: float, norm_tol: float) -> list[str]:
        """The metrics that fail at these tolerances: 'non-finite', 'rel-L2', 'norm ratio' (in that order)."""
        out = [] if self.finite else ["non-finite"]
        out += [] if self.rel_l2 <= rel_tol else ["rel-L2"]
        return out + ([] if abs(self.norm_ratio - 1.0) <= norm_tol else ["norm ratio"])


def _argworst(key: np.ndarray) -> int:
    """Index of the largest key, NaN counting as the worst (the first on ties)."""
    return int(np.argmax(np.where(np.isnan(key), np.inf, key)))


def _nanmax(x: np.ndarray) -> float:
    """The largest value that is not NaN; NaN when there is none (no warning; pandas' `max`)."""
    kept = x[~np.isnan(x.astype(np.float64))]
    return float(kept.max()) if len(kept) else float("nan")


def _nanmin(x: np.ndarray) -> float:
    """The smallest value that is not NaN; NaN when there is none (pandas' `min`)."""
    kept = x[~np.isnan(x.astype(np.float64))]
    return float(kept.min()) if len(kept) else float("nan")


_COLUMNS = ("pos", "rel_l2", "norm_ratio", "finite", "sqnr_db", "argmax_a", "argmax_b", "cosine", "max_abs",
            "stream_ratio_min", "stream_ratio_max", "drift", "exact", "depth", "layer", "method")


def _row(name: str, g: dict[str, np.ndarray], rel_tol: float, norm_tol: float) -> CheckpointRow:
    """The row of checkpoint `name` from its positions' columns `g` (sorted by position)."""
    pos, rel, norm, finite = g["pos"], g["rel_l2"].astype(np.float64), g["norm_ratio"].astype(np.float64), g["finite"]
    dev = np.abs(norm - 1.0)
    i_rel, i_norm = _argworst(rel), _argworst(dev)
    failing = [] if finite.all() else ["non-finite"]
    failing += [] if rel[i_rel] <= rel_tol else ["rel-L2"]
    failing += [] if dev[i_norm] <= norm_tol else ["norm ratio"]
    first = failing[0] if failing else ""
    i = {"non-finite": int(np.argmin(finite)), "rel-L2": i_rel, "norm ratio": i_norm, "": i_rel}[first]
    sqnr, a, b = g["sqnr_db"].astype(np.float64), g["argmax_a"], g["argmax_b"]
    return CheckpointRow(
        checkpoint=name, method=str(g["method"][0]), pos=int(pos[i]), failing=first,
        rel_l2=float(rel[i_rel]), rel_l2_pos=int(pos[i_rel]), norm_ratio=float(norm[i_norm]),
        norm_ratio_pos=int(pos[i_norm]), cosine=_nanmin(g["cosine"]), sqnr_db=float(sqnr[i]),
        max_abs=_nanmax(g["max_abs"]), stream_min=_nanmin(g["stream_ratio_min"]),
        stream_max=_nanmax(g["stream_ratio_max"]), positions=len(pos), drifting=int(g["drift"].sum()),
        exact=bool(g["exact"].all()), depth=float(g["depth"][0]), layer=int(g["layer"][0]),
        worst_norm_ratio=float(norm[i_rel]), worst_sqnr_db=float(sqnr[i_rel]), finite=bool(finite.all()),
        rel_l2_nanmax=_nanmax(rel), norm_dev_nanmax=_nanmax(dev),
        top1_flips=tuple((int(pos[j]), int(a[j]), int(b[j])) for j in np.flatnonzero(a != b)))


def checkpoint_rows(table: pd.DataFrame, rel_tol: float, norm_tol: float) -> tuple[CheckpointRow, ...]:
    """One row per checkpoint of a diff's (checkpoint, position) table, in the table's checkpoint order (the
    traces' header order), each judged by `rel_tol` / `norm_tol` (the diff's thresholds)."""
    codes, names = _codes(table["checkpoint"].to_numpy())
    order = np.lexsort((table["pos"].to_numpy(), codes))   # by checkpoint (first appearance), then position
    cols = {c: table[c].to_numpy()[order] for c in _COLUMNS}
    bounds = np.flatnonzero(np.diff(codes[order])) + 1
    starts, ends = np.concatenate([[0], bounds]), np.concatenate([bounds, [len(order)]])
    return tuple(_row(str(name), {c: v[s:e] for c, v in cols.items()}, rel_tol, norm_tol)
                 for name, s, e in zip(names, starts, ends, strict=True))


def _codes(names: np.ndarray) -> tuple[np.ndarray, list[str]]:
    """(per-row code, names in order of first appearance); a checkpoint-major table (the differ's) by its runs,
    which is cheaper than hashing every row's name."""
    starts = np.flatnonzero(np.concatenate([[True], names[1:] != names[:-1]])) if len(names) else np.array([], int)
    first = names[starts].tolist()
    if len(set(first)) == len(first):
        return np.repeat(np.arange(len(starts)), np.diff(np.append(starts, len(names)))), first
    codes, uniques = pd.factorize(names)
    return codes, list(uniques)


def by_depth(rows: tuple[CheckpointRow, ...]) -> list[CheckpointRow]:
    """The rows in depth order (stable: rows of equal depth keep their order)."""
    return sorted(rows, key=lambda r: r.depth)


SUMMARY_COLUMNS = ("checkpoint", "depth", "layer", "method", "worst_pos", "norm_ratio", "rel_l2", "sqnr_db",
                   "positions", "drifting", "exact", "cosine_min", "max_abs", "stream_ratio_min", "stream_ratio_max")


def summary_frame(rows: tuple[CheckpointRow, ...]) -> pd.DataFrame:
    """`DiffReport.summary`: per checkpoint (depth order) the worst position by rel-L2 with its metrics, the drift
    count and each metric's own extreme (the JSON `checkpoints`)."""
    return pd.DataFrame([(r.checkpoint, r.depth, r.layer, r.method, r.rel_l2_pos, r.worst_norm_ratio, r.rel_l2,
                          r.worst_sqnr_db, r.positions, r.drifting, r.exact, r.cosine, r.max_abs, r.stream_min,
                          r.stream_max) for r in by_depth(rows)], columns=list(SUMMARY_COLUMNS))
