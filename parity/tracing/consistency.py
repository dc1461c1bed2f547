"""Self-consistency of a trace: every ckpt record that has a full vector must describe that vector.

A record's statistics (min, max, rms, l2s, sum_l2) and 64-number fingerprint are recomputed from its own full
vector with `parity.tracing.stats.carrier_stats` (the code that records them) and compared. A writer that gets the
vectors right and the summaries wrong (all-zero fingerprints, a wrong sign seed, stats of another checkpoint) would
otherwise pass `check`, `diff` and `gate` and fail only later against fingerprint-only goldens. With a `logits`
vector, each final_norm record's argmax and top-k are checked against it too (draft mtp.k.logits records are not).

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

from parity.contract.checkpoints import FINAL_NORM, LOGITS
from parity.contract.errors import TraceError
from parity.tracing.records import Trace
from parity.tracing.stats import carrier_stats, stats_view, top_k

RTOL = 1e-4
FIELDS = ("min", "max", "rms", "l2s", "sum_l2", "fp")
TOP_FIELDS = ("argmax", "top_ids", "top_logits")   # final_norm records, against the logits vector


def _scales(x: np.ndarray, got: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Per-row scale of each field's tolerance (module docstring)."""
    x3 = x if x.ndim == 3 else x[:, None, :]
    x64 = x3.astype(np.float64).reshape(len(x3), -1)
    norm = np.sqrt(np.einsum("ni,ni->n", x64, x64))
    peak = np.abs(x64).max(axis=1)
    return {"min": peak, "max": peak, "rms": got["rms"].astype(np.float64), "l2s": norm,
            "sum_l2": np.sqrt(x3.shape[1]) * norm, "fp": norm}


def _first_disagreement(name: str, positions: np.ndarray, recorded: dict[str, np.ndarray],
                        x: np.ndarray) -> tuple[str, np.ndarray] | None:
    """(message, mask of the disagreeing records) for the first record of checkpoint `name` whose summaries
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
            f"{RTOL:g} x its scale)", bad_rows)


def _first_top_disagreement(positions: np.ndarray, argmax: np.ndarray, top_ids: np.ndarray,
                            top_logits: np.ndarray, logits: np.ndarray) -> tuple[str, np.ndarray] | None:
    """(message, mask of the disagreeing records) for the first final_norm record whose argmax / top-k disagree
    with its own logits vector, or None: each recorded id's logit must be its recorded top logit, the recorded top
    logits the vector's K largest, and the argmax's logit the largest, all within RTOL x max |logit| (a near-tie may
    order ids either way)."""
    n, vocab = logits.shape
    _, top_vals = top_k(logits, top_ids.shape[1])
    ids_ok = (top_ids >= 0) & (top_ids < vocab) & (argmax[:, None] >= 0) & (argmax[:, None] < vocab)
    at = np.take_along_axis(logits, np.clip(top_ids, 0, vocab - 1), axis=1).astype(np.float64)
    best = logits[np.arange(n), np.clip(argmax, 0, vocab - 1)].astype(np.float64)
    tol = RTOL * np.abs(logits.astype(np.float64)).max(axis=1)
    rec = top_logits.astype(np.float64)
    checks = (("top_ids", ~ids_ok.all(axis=1) | ~(np.abs(at - rec) <= tol[:, None]).all(axis=1),
               "a recorded id's logit in the vector is not its recorded top logit"),
              ("top_logits", ~(np.abs(rec - top_vals) <= tol[:, None]).all(axis=1),
               "the recorded top logits are not the vector's largest"),
              ("argmax", ~(np.abs(best - top_vals[:, 0]) <= tol), "the argmax's logit is not the vector's largest"))
    bad = np.zeros(n, bool)
    for _, rows, _ in checks:
        bad |= rows
    if not bad.any():
        return None
    r = int(np.flatnonzero(bad)[0])
    field, _, why = next(c for c in checks if c[1][r])
    return (f"checkpoint final_norm at position {int(positions[r])}: {field}: {why} (logits vector, tolerance "
            f"{tol[r]:.3g} = {RTOL:g} x max |logit|)", bad)


def check_vector_stats(trace: Trace, fail: Callable[[str], TraceError]) -> None:
    """Raise `fail(message)` naming the first record (checkpoint depth order, then position) whose statistics or
    fingerprint disagree with its own full vector beyond RTOL (and, with a logits vector, whose final_norm argmax
    or top-k disagree with it), with the field, recorded and computed values and how many records disagree in
    all. Traces without full vectors pass unchecked."""
    h, vectors = trace.header, trace.vectors
    if not vectors:
        return
    ck, found, total = trace.ckpt, None, 0
    for ci, name in enumerate(h.checkpoints):
        top = name == FINAL_NORM and LOGITS in vectors
        if name not in vectors and not top:
            continue
        rows = np.flatnonzero(ck["ck"] == ci)
        order, hits = rows[np.argsort(ck["pos"][rows], kind="stable")], []
        for vec_name, check in ((name, name in vectors), (LOGITS, top)):
            if check and len(vectors[vec_name]) != len(order):
                raise fail(f"checkpoint {name}: {len(order)} ckpt records but {len(vectors[vec_name])} rows of "
                           f"full vector {vec_name}")
        if name in vectors:
            x = np.asarray(stats_view(name, vectors[name]))
            hits.append(_first_disagreement(name, ck["pos"][order], {f: ck[f][order] for f in FIELDS}, x))
        if top:
            hits.append(_first_top_disagreement(ck["pos"][order], *(ck[f][order] for f in TOP_FIELDS),
                                                np.asarray(vectors[LOGITS])))
        hits = [hit for hit in hits if hit is not None]
        if hits:
            found = found or hits[0][0]
            total += int(np.logical_or.reduce([mask for _, mask in hits]).sum())
    if found is not None:
        raise fail(f"{found}; {total} record(s) in all disagree with their vectors: the statistics and fingerprint "
                   "must be computed from the vector written (docs/trace-format.md)")
