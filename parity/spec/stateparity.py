"""State parity after every commit (spec v4-mtp-dspark §6.3.2): the candidate's caches (trunk and drafter, in the
common layout of the `StateView` capability) against the reference's on the same committed prefix.

A component differs when its shape differs (a phantom or missing compressed row, a narrowed window, a pending
block of the wrong length), when its non-finite entries sit elsewhere, or when its rel-L2 exceeds `tol`. The
tolerance is the envelope's limit at its largest checkpoint floor (K · floor + EPS): the caches are projections of
the layer inputs, whose benign drift the checkpoint floors measure. The kind of a difference (`shape`,
`non-finite`, `values`) is kept: with the QAT simulations on, a `values` difference can be one FP8 / FP4 code that
flipped between a batched and a sequential path (spec §4.5.2), which the report notes instead of calling a defect.
"""

from __future__ import annotations

import numpy as np

from parity.check.envelope import Envelope
from parity.compare.metrics import rel_l2


def state_tolerance(env: Envelope) -> float:
    """K · (largest checkpoint floor) + EPS of the envelope."""
    return env.limit(max(env.checkpoints.values(), default=0.0))


def component_difference(cand: np.ndarray, ref: np.ndarray, tol: float) -> tuple[str, str] | None:
    """(kind, why) two arrays of one component differ: shape, non-finite pattern, values (rel-L2 > tol); or None."""
    cand, ref = np.asarray(cand, np.float64), np.asarray(ref, np.float64)
    if cand.shape != ref.shape:
        return "shape", f"shape {cand.shape} vs reference {ref.shape}"
    finite = np.isfinite(ref)
    if not np.array_equal(finite, np.isfinite(cand)) or not np.array_equal(cand[~finite], ref[~finite]):
        return "non-finite", "non-finite entries differ"
    if cand.size == 0:
        return None
    err = float(rel_l2(np.where(finite, ref, 0).reshape(1, -1), np.where(finite, cand, 0).reshape(1, -1))[0])
    return ("values", f"rel-L2 {err:.3g} > {tol:.3g}") if err > tol else None


def first_difference(cand: dict[str, np.ndarray], ref: dict[str, np.ndarray],
                     tol: float) -> tuple[str, str, str] | None:
    """(component, kind, why) of the first differing component in the reference's order (a component only one
    side has is a `shape` difference), or None."""
    for name in [*ref, *(k for k in cand if k not in ref)]:
        if name not in cand or name not in ref:
            return name, "shape", "missing in the candidate" if name not in cand else "missing in the reference"
        found = component_difference(cand[name], ref[name], tol)
        if found is not None:
            return name, *found
    return None
