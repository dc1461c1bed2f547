"""RMS norms (spec v4-residual-ffn-gguf §7; v4-attention §0)."""

from __future__ import annotations

import numpy as np


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """y = w * x / sqrt(mean(x^2) + eps) over the last axis (weighted RMSNorm, no 1+w offset).

    x [..., n], weight [n] -> [..., n].
    """
    return rms_norm_unweighted(x, eps) * weight


def rms_norm_unweighted(x: np.ndarray, eps: float) -> np.ndarray:
    """y = x / sqrt(mean(x^2) + eps) over the last axis (per-head q norm, HC input norm).

    x [..., n] -> [..., n].
    """
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
