"""Self-consistency of a trace: every ckpt record that has a full vector must describe that vector.

A record's statistics (min, max, rms, l2s, sum_l2) and 64-number fingerprint are recomputed from its own full
vector with `parity.tracing.stats.carrier_stats` (the code that records them) and compared. A writer that gets the
vectors right and the summaries wrong (all-zero fingerprints, a wrong sign seed, stats of another checkpoint) would
otherwise pass `check`, `diff` and `gate` and fail only later against fingerprint-only goldens.

Tolerance: |recorded - computed| <= RTOL x scale, scale = ||x|| (the L2 norm of the record's whole vector) for fp
and l2s, sqrt(H) ||x|| for sum_l2, rms for rms and max |x| for min and max. An engine may sum in another order or in
float32: float32 sequential accumulation of the same vectors differed from the float64 recomputation by at most
2.3e-6 x ||x|| (fp; 1.1e-6 for l2s, sum_l2, rms), measured on the tiny model's torch trace (H x D = 4 x 256) and
on random float32 rows with outlier channels at 4 x 4096 and 4 x 7168. RTOL = 1e-4 leaves 40x room over that,
while a zeroed fingerprint is off by ~||x|| / 8 per component.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from parity.contract.errors import TraceError
from parity.tracing.records import Trace
from parity.tracing.stats import carrier_stats, stats_view

RTOL = 1e-4
FIELDS = ("min", "max", "rms", "l2s", "sum_l2", "fp")


def _scales(x: np.ndarray, got: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Per-row scale of each field's tolerance (module docstring)."""
    x3 = x if x.ndim == 3 else x[:, None, :]
    x64 = x3.astype(np.float64).reshape(len(x3), -1)
    norm = np.sqrt(np.einsum("ni,ni->n", x64, x64))
    peak = np.abs(x64).max(axis=1)
    return {"min": peak, "max": peak, "rms": got["rms"].astype(np.float64), "l2s": norm,
            "sum_l2": np.sqrt(x3.shape[1]) * norm, "fp": norm}


def _first_disagreement(name: str, positions: np.ndarray, recorded: dict[str, np.ndarray],
                        x: np.ndarray) -> tuple[str, int] | None:
    """(message, number of disagreeing records) for the first record of checkpoint `name` whose summaries
    disagree with its vector (rows in position order), or None."""
    got = carrier_stats(x)
    scales = _scales(x, got)
    bad_rows = np.zeros(len(x), bool)
    first: tuple[int, str, int, float, float, float] | None = None
    for field in FIELDS:
        comp = got[field].astype(np.float64).reshape(len(x), -1)
        rec = recorded[field].astype(np.float64).reshape(len(x), -1)[:, :comp.shape[1]]  # l2s: padding beyond H
        tol = RTOL * scales[field][:, None]
        off = ~(np.abs(rec - comp) <= tol)           # NaN recorded where a number is computed: off too
        rows = off.any(axis=1)
        bad_rows |= rows
        if rows.any():
            r = int(np.flatnonzero(rows)[0])
            k = int(np.flatnonzero(off[r])[0])
            if first is None or r < first[0]:
                first = (r, field, k, rec[r, k], comp[r, k], tol[r, 0])
    if first is None:
        return None
    r, field, k, rec_v, comp_v, tol_v = first
    cell = f"{field}[{k}]" if field in ("l2s", "fp") else field
    return (f"checkpoint {name} at position {int(positions[r])}: {cell} recorded {rec_v:.9g}, computed from its "
            f"own full vector {comp_v:.9g} (|difference| {abs(rec_v - comp_v):.3g} > tolerance {tol_v:.3g} = "
            f"{RTOL:g} x its scale)", int(bad_rows.sum()))


def check_vector_stats(trace: Trace, fail: Callable[[str], TraceError]) -> None:
    """Raise `fail(message)` naming the first record (checkpoint depth order, then position) whose statistics or
    fingerprint disagree with its own full vector beyond RTOL, with the field, recorded and computed values and
    how many records disagree in all. Traces without full vectors pass unchecked."""
    h, vectors = trace.header, trace.vectors
    if not vectors:
        return
    ck, found, total = trace.ckpt, None, 0
    for ci, name in enumerate(h.checkpoints):
        if name not in vectors:
            continue
        rows = np.flatnonzero(ck["ck"] == ci)
        order = rows[np.argsort(ck["pos"][rows], kind="stable")]
        x = np.asarray(stats_view(name, vectors[name]))
        if len(order) != len(x):
            raise fail(f"checkpoint {name}: {len(order)} ckpt records but {len(x)} full-vector rows")
        hit = _first_disagreement(name, ck["pos"][order], {f: ck[f][order] for f in FIELDS}, x)
        if hit is not None:
            found = found or hit[0]
            total += hit[1]
    if found is not None:
        raise fail(f"{found}; {total} record(s) in all disagree with their vectors: the statistics and fingerprint "
                   "must be computed from the vector written (docs/trace-format.md)")
