"""The linear map y = x Wᵀ, bit-identical for a row whether it comes alone (decode) or in a batch (prefill).

A weight is a plain array (the exact path) or a `Matrix`: the array plus the rounding its input gets first,
as an engine with approximate activations does (`reference_cpu.numerics`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

# Rows per BLAS call. BLAS picks its kernel, and with it the summation order, from the number of rows, so a
# one-row decode step would differ from the same position inside a prefill by float round-off. Running every
# product in zero-padded blocks of ROW_BLOCK rows makes each row's result independent of the rows around it.
ROW_BLOCK = 8


@dataclass(frozen=True)
class Matrix:
    """A weight [out, in] and the rounding applied to the input of every product with it (None: exact)."""

    w: np.ndarray
    round_input: Callable[[np.ndarray], np.ndarray] | None


Weight = np.ndarray | Matrix


def split_rows(w: Weight, groups: int) -> list[Weight]:
    """W [G·R, in] -> G weights [R, in] (consecutive row blocks), each keeping W's input rounding."""
    if isinstance(w, Matrix):
        return [Matrix(part, w.round_input) for part in w.w.reshape(groups, -1, w.w.shape[-1])]
    return list(w.reshape(groups, -1, w.shape[-1]))


def linear(x: np.ndarray, w: Weight) -> np.ndarray:
    """y = x Wᵀ (no bias anywhere in V4), computed in blocks of ROW_BLOCK rows; a Matrix rounds x first.

    x [n, in], w [out, in] -> [n, out].
    """
    if isinstance(w, Matrix):
        x = x if w.round_input is None else w.round_input(x)
        w = w.w
    n = x.shape[0]
    pad = -n % ROW_BLOCK
    if pad:
        x = np.concatenate([x, np.zeros((pad, x.shape[1]), x.dtype)])
    wt = w.T
    return np.concatenate([x[i : i + ROW_BLOCK] @ wt for i in range(0, len(x), ROW_BLOCK)])[:n]
