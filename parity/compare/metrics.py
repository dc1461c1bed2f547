"""The comparison metrics, defined once (docs/metrics.md). `a` is the reference, `b` the candidate.

All functions work row-wise on [n, ...] arrays (one row per position) in float64 and return [n].
NMSE, SQNR and relative L2 are one quantity in three units:
    rel_l2 = ||b - a|| / ||a||,   nmse = rel_l2^2,   sqnr_db = -10 log10(nmse) = -20 log10(rel_l2).
For vectors of equal norm, rel_l2^2 = 2 (1 - cosine).
"""

from __future__ import annotations

import numpy as np

from parity.contract.errors import ParityError


def _rows(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    return x.reshape(len(x), -1)


def l2(x: np.ndarray) -> np.ndarray:
    """||x|| per row.  x: [n, ...] -> [n]"""
    r = _rows(x)
    return np.sqrt(np.einsum("ni,ni->n", r, r))


def _pair(a: np.ndarray, b: np.ndarray, what: str) -> tuple[np.ndarray, np.ndarray]:
    """Both arrays as float64 rows, of one shape (a ParityError naming the metric otherwise)."""
    ra, rb = _rows(a), _rows(b)
    if ra.shape != rb.shape:
        raise ParityError(f"{what} of different shapes: reference {np.shape(a)} vs candidate {np.shape(b)}")
    return ra, rb


def _rel_l2_rows(ra: np.ndarray, rb: np.ndarray, norm_a: np.ndarray) -> np.ndarray:
    finite_b = np.isfinite(rb)
    finite = finite_b.all(axis=1)
    num = l2((rb if finite.all() else np.where(finite_b, rb, 0.0)) - ra)  # non-finite b entries count as 0 here
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(~finite, np.inf, np.where(num == 0, 0.0, num / norm_a))


def _cosine_rows(ra: np.ndarray, rb: np.ndarray, norm_a: np.ndarray) -> np.ndarray:
    den = norm_a * l2(rb)
    with np.errstate(divide="ignore", invalid="ignore"):
        c = np.einsum("ni,ni->n", ra, rb) / den
    same = np.all(ra == rb, axis=1) & (den > 0)
    return np.where(same, 1.0, np.clip(c, -1.0, 1.0))


def rel_l2(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """||b - a|| / ||a|| per row: 0 when the rows are equal, inf when only a is zero and on any non-finite value
    in b (a NaN never compares as a small error). The one relative L2 of the project.  [n, ...] x 2 -> [n]"""
    ra, rb = _pair(a, b, "rel-L2")
    return _rel_l2_rows(ra, rb, l2(ra))


def rel_l2_and_cosine(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(rel_l2(a, b), cosine(a, b)) from one float64 conversion of each array (the differ's hot path)."""
    ra, rb = _pair(a, b, "rel-L2")
    norm_a = l2(ra)
    return _rel_l2_rows(ra, rb, norm_a), _cosine_rows(ra, rb, norm_a)


def nmse(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """sum((b - a)^2) / sum(a^2) per row (ggml's NMSE; not llama.cpp check-nmse's variance form)."""
    return rel_l2(a, b) ** 2


def sqnr_db(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """20 log10(||a|| / ||b - a||) per row (inf for identical rows)."""
    return sqnr_from_rel_l2(rel_l2(a, b))


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """<a, b> / (||a|| ||b||) per row, clipped to [-1, 1] (1 for identical rows, nan if either is zero)."""
    ra, rb = _rows(a), _rows(b)
    return _cosine_rows(ra, rb, l2(ra))


def max_abs(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """max |b - a| per row (ds4's hc_max)."""
    return np.abs(_rows(b) - _rows(a)).max(axis=1)


def set_overlap(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per row |set(a) ∩ set(b)| / max(|set(a)|, |set(b)|), ignoring -1 padding; 1 for two empty rows
    (expert ids, indexer selections).
    a, b: int [T, K] -> [T]"""
    out = np.ones(len(a))
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        sx, sy = set(x[x >= 0].tolist()), set(y[y >= 0].tolist())
        if sx or sy:
            out[i] = len(sx & sy) / max(len(sx), len(sy))
    return out


# Conversions ---------------------------------------------------------------------------------

def sqnr_from_rel_l2(r: np.ndarray | float) -> np.ndarray:
    """SQNR dB = -20 log10(rel_l2)."""
    with np.errstate(divide="ignore"):
        return -20.0 * np.log10(np.asarray(r, dtype=np.float64))


def cosine_at_rel_l2(r: np.ndarray | float) -> np.ndarray:
    """The cosine two equal-norm vectors at relative L2 distance r have: 1 - r^2 / 2."""
    return 1.0 - np.asarray(r, dtype=np.float64) ** 2 / 2.0
