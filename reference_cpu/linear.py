"""The linear map y = x Wᵀ, bit-identical for a row whether it comes alone (decode) or in a batch (prefill).

A weight is a plain array (the exact path) or a `Matrix`: the array plus the rounding its input gets first,
as an engine with approximate activations does (`reference_cpu.numerics`), and, for llama.cpp's Q4_1 / Q5_1 x Q8_1
products, the per-block min term that rounding leaves out (`MinTerm`).
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
class MinTerm:
    """The additive output term of a product whose weight has per-block mins and whose engine keeps a rounded sum
    of each input block (llama.cpp's Q4_1 / Q5_1 x Q8_1: `reference_cpu.numerics.q8_1_sum_residual`).

    y = W x' + M c: mins M [out, in/B] (the weight's per-block min m), and quantize(x) -> (x' [n, in], c [n, in/B]),
    the rounded input and the per-block residual c = s − d·Σq, from ONE call, so that a perturbed input (round-off
    twins) is perturbed once for both.
    """

    mins: np.ndarray
    quantize: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]


@dataclass(frozen=True)
class Matrix:
    """A weight [out, in], the rounding applied to the input of every product with it (None: exact), and the
    per-block min term of that product (None: none; when set, its `quantize` replaces `round_input` in `linear`,
    and `round_input` is the value part of that same quantization)."""

    w: np.ndarray
    round_input: Callable[[np.ndarray], np.ndarray] | None
    min_term: MinTerm | None


Weight = np.ndarray | Matrix


def split_rows(w: Weight, groups: int) -> list[Weight]:
    """W [G·R, in] -> G weights [R, in] (consecutive row blocks), each keeping W's input rounding and the rows of its
    min term's M [G·R, in/B]."""
    if isinstance(w, Matrix):
        parts = w.w.reshape(groups, -1, w.w.shape[-1])
        if w.min_term is None:
            return [Matrix(part, w.round_input, None) for part in parts]
        mins = w.min_term.mins.reshape(groups, -1, w.min_term.mins.shape[-1])
        return [Matrix(part, w.round_input, MinTerm(m, w.min_term.quantize)) for part, m in zip(parts, mins,
                                                                                               strict=True)]
    return list(w.reshape(groups, -1, w.shape[-1]))


def _blocked(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x Wᵀ in zero-padded blocks of ROW_BLOCK rows.  x [n, in], w [out, in] -> [n, out]."""
    n = x.shape[0]
    pad = -n % ROW_BLOCK
    if pad:
        x = np.concatenate([x, np.zeros((pad, x.shape[1]), x.dtype)])
    wt = w.T
    return np.concatenate([x[i : i + ROW_BLOCK] @ wt for i in range(0, len(x), ROW_BLOCK)])[:n]


def linear(x: np.ndarray, w: Weight) -> np.ndarray:
    """y = x Wᵀ (no bias anywhere in V4), computed in blocks of ROW_BLOCK rows; a Matrix rounds x first, and one
    with a min term adds it: y = x' Wᵀ + c Mᵀ with (x', c) = quantize(x) (each row's c is its own, so a row's
    result stays independent of the rows around it).

    x [n, in], w [out, in] -> [n, out].
    """
    if not isinstance(w, Matrix):
        return _blocked(x, w)
    if w.min_term is not None:
        xq, c = w.min_term.quantize(x)
        return _blocked(xq, w.w) + _blocked(c, w.min_term.mins)
    return _blocked(x if w.round_input is None else w.round_input(x), w.w)
