"""The linear map y = x Wᵀ, bit-identical for a row whether it comes alone (decode) or in a batch (prefill)."""

from __future__ import annotations

import numpy as np

# Rows per BLAS call. BLAS picks its kernel, and with it the summation order, from the number of rows, so a
# one-row decode step would differ from the same position inside a prefill by float round-off. Running every
# product in zero-padded blocks of ROW_BLOCK rows makes each row's result independent of the rows around it.
ROW_BLOCK = 8


def linear(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """y = x Wᵀ (no bias anywhere in V4), computed in blocks of ROW_BLOCK rows.

    x [n, in], w [out, in] -> [n, out].
    """
    n = x.shape[0]
    pad = -n % ROW_BLOCK
    if pad:
        x = np.concatenate([x, np.zeros((pad, x.shape[1]), x.dtype)])
    wt = w.T
    return np.concatenate([x[i : i + ROW_BLOCK] @ wt for i in range(0, len(x), ROW_BLOCK)])[:n]
