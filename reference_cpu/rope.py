"""Partial interleaved RoPE on the trailing rope dims, with static YaRN on compressed layers (spec attention §4).

Only the last r entries of a head vector rotate; pair i is (u[d-r+2i], u[d-r+2i+1]) (GPT-J / complex-pair
layout, never NeoX halves). The inverse rotation uses the conjugate angle.
"""

from __future__ import annotations

import math

import numpy as np


def yarn_ramp_bounds(rope_dim: int, base: float, original_seq_len: int, beta_fast: float,
                     beta_slow: float) -> tuple[float, float]:
    """(low, high) = (max(⌊corr(β_fast)⌋, 0), min(⌈corr(β_slow)⌉, r-1)), corr(β) = r ln(L0/(2πβ)) / (2 ln B) (§4.2).

    Scalars -> two pair indices bounding the blend ramp.
    """
    def corr(beta: float) -> float:
        return rope_dim * math.log(original_seq_len / (beta * 2 * math.pi)) / (2 * math.log(base))

    return max(math.floor(corr(beta_fast)), 0), min(math.ceil(corr(beta_slow)), rope_dim - 1)


def rope_frequencies(rope_dim: int, base: float, yarn: bool = False, factor: float = 1.0,
                     original_seq_len: int = 0, beta_fast: float = 0.0, beta_slow: float = 0.0) -> np.ndarray:
    """f_i = B^(-2i/r); YaRN: f_i = g_i·k_i + (g_i/factor)·(1-k_i), k_i = 1-clamp((i-low)/(high-low)) (§4.2).

    -> [r/2] float64. No YaRN magnitude scaling (cos/sin keep unit amplitude).
    """
    i = np.arange(rope_dim // 2, dtype=np.float64)
    g = base ** (-2.0 * i / rope_dim)
    if not yarn:
        return g
    low, high = yarn_ramp_bounds(rope_dim, base, original_seq_len, beta_fast, beta_slow)
    span = (high - low) if high != low else 0.001
    keep = 1.0 - np.clip((i - low) / span, 0.0, 1.0)
    return g * keep + (g / factor) * (1.0 - keep)


def apply_rope(x: np.ndarray, pos: np.ndarray, freqs: np.ndarray, inverse: bool = False) -> np.ndarray:
    """Rotate pair i of the trailing 2·len(freqs) dims by φ_i = p·f_i: (a, b) -> (a cos φ - b sin φ, a sin φ + b cos φ).

    x [n, ..., d], pos [n] positions, freqs [r/2] -> [n, ..., d] (a new array). `inverse` uses -φ.
    The angle is formed in x's dtype (float32 like the official code, float64 in the oracle mode).
    """
    r = 2 * len(freqs)
    d = x.shape[-1]
    angle = pos.astype(x.dtype)[:, None] * freqs.astype(x.dtype)[None, :]  # [n, r/2]
    angle = angle.reshape(angle.shape[:1] + (1,) * (x.ndim - 2) + angle.shape[1:])
    cos, sin = np.cos(angle), np.sin(angle)
    if inverse:
        sin = -sin
    out = x.copy()
    a, b = x[..., d - r :: 2], x[..., d - r + 1 :: 2]
    out[..., d - r :: 2] = a * cos - b * sin
    out[..., d - r + 1 :: 2] = a * sin + b * cos
    return out
