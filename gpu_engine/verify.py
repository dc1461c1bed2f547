"""The torch engine's own picks in a speculative round (spec v4-mtp-dspark §4.1, §4.2, §4.4), as ops of `Ops`:
the argmax of each verify row and the verify row the next step continues from. The model's rules are the first of
equal maxima and row a′ (the last accepted draft's row); each fault is an alternative of the same signature."""

from __future__ import annotations

import numpy as np


def first_max_rows(logits: np.ndarray) -> np.ndarray:
    """The argmax of each row, the first of equal maxima (§4.2: NumPy / torch argmax).  [q, V] -> int [q]."""
    return np.asarray(logits).argmax(axis=1)


def last_max_rows(logits: np.ndarray) -> np.ndarray:
    """The spec-tie-last-max fault: the last of equal maxima (ggml's `argmax` op, §4.2).  [q, V] -> int [q]."""
    logits = np.asarray(logits)
    return logits.shape[1] - 1 - logits[:, ::-1].argmax(axis=1)


def accepted_row(accepted: int, verified: int) -> int:
    """The verify row whose argmax is the bonus token and the next anchor: row a′ (§4.1)."""
    return accepted


def last_verify_row(accepted: int, verified: int) -> int:
    """The spec-logits-row-stale fault (§4.4 'Next-round logits', D4: ds4 #750): after a partial accept the next
    step continues from the last verify row γ, a rejected draft's row, as an engine does that keeps the logits
    buffer the verify batch left instead of row a′."""
    return verified
