"""Partial interleaved RoPE on the trailing rope dims, with static YaRN on compressed layers (spec attention §4).

Only the last r entries of a head vector rotate; pair i is (u[d-r+2i], u[d-r+2i+1]) (GPT-J / complex-pair
layout, never NeoX halves). The inverse rotation uses the conjugate angle.

Frequencies are formed with float32 operations exactly as DeepSeek's official code and HF do (spec attention,
correction 9); the float64 oracle uses the same float32 frequency values and forms φ = p·f in float64.
`rope_angles='recurrence'` instead builds the angles as ggml does, by repeated float32 multiplication.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from parity.contract.errors import ParityError

F32 = np.float32
ROPE_ANGLE_MODES = ("exact", "recurrence")


@dataclass(frozen=True)
class RopeSpec:
    """What the file says about one layer's RoPE: r rotary dims, base B, and the YaRN keys when it has them."""

    rope_dim: int
    base: float
    yarn: bool
    factor: float = 1.0
    original_seq_len: int = 0
    beta_fast: float = 0.0
    beta_slow: float = 0.0


def yarn_ramp_bounds(rope_dim: int, base: float, original_seq_len: int, beta_fast: float,
                     beta_slow: float) -> tuple[int, int]:
    """(low, high) = (max(⌊corr(β_fast)⌋, 0), min(⌈corr(β_slow)⌉, r-1)), corr(β) = r ln(L0/(2πβ)) / (2 ln B) (§4.2).

    Scalars -> two pair indices bounding the blend ramp.
    """
    def corr(beta: float) -> float:
        return rope_dim * math.log(original_seq_len / (beta * 2 * math.pi)) / (2 * math.log(base))

    return max(math.floor(corr(beta_fast)), 0), min(math.ceil(corr(beta_slow)), rope_dim - 1)


def yarn_keep(spec: RopeSpec) -> np.ndarray:
    """keep_i = 1 - clamp((i - low) / (high - low), 0, 1) in float32; high - low becomes 0.001 when equal (§4.2).

    -> float32 [r/2]; 1 = the pair keeps its original frequency.
    """
    low, high = yarn_ramp_bounds(spec.rope_dim, spec.base, spec.original_seq_len, spec.beta_fast, spec.beta_slow)
    span = F32((high + 0.001 if high == low else high) - low)
    ramp = np.clip((np.arange(spec.rope_dim // 2, dtype=F32) - F32(low)) / span, F32(0), F32(1))
    return F32(1) - ramp


def rope_frequencies(spec: RopeSpec) -> np.ndarray:
    """f_i = 1 / B^(2i/r) in float32 (pow rounded once, then the float32 reciprocal); YaRN: f/factor·(1-keep) + f·keep.

    -> float32 [r/2]. Every step is one float32 operation, as in the official code; no YaRN magnitude scaling.
    """
    expo = np.arange(0, spec.rope_dim, 2, dtype=F32) / F32(spec.rope_dim)
    g = F32(1) / np.power(np.float64(F32(spec.base)), expo.astype(np.float64)).astype(F32)
    if not spec.yarn:
        return g
    keep = yarn_keep(spec)
    return g / F32(spec.factor) * (F32(1) - keep) + g * keep


def recurrence_angles(pos: np.ndarray, spec: RopeSpec) -> np.ndarray:
    """ggml's angles: θ_0 = p, θ_{i+1} = θ_i · B^(-2/r) in float32; YaRN: θ/factor·(1-keep_i) + θ·keep_i (§4.2, LCP).

    pos [n] -> float32 [n, r/2]. The step B^(-2/r) is rounded once to float32; the error grows with i and p.
    """
    step = F32(math.pow(float(F32(spec.base)), float(F32(-2.0) / F32(spec.rope_dim))))
    half = spec.rope_dim // 2
    theta = np.empty((len(pos), half), F32)
    theta[:, 0] = np.asarray(pos).astype(F32)
    for i in range(1, half):
        theta[:, i] = theta[:, i - 1] * step
    if not spec.yarn:
        return theta
    keep = yarn_keep(spec)
    return (F32(1) / F32(spec.factor)) * theta * (F32(1) - keep) + theta * keep


@dataclass(frozen=True)
class RopeTable:
    """A layer's RoPE as the engine runs it: the spec, its float32 frequencies in the working dtype, the angle mode."""

    spec: RopeSpec
    freqs: np.ndarray  # [r/2] float32 recipe values, held in the working dtype
    mode: str          # exact (φ = p·f, one rounding) | recurrence (ggml)

    @classmethod
    def build(cls, spec: RopeSpec, dtype: np.dtype, mode: str) -> RopeTable:
        if mode not in ROPE_ANGLE_MODES:
            raise ParityError(f"rope angle mode {mode!r}; expected one of {', '.join(ROPE_ANGLE_MODES)}")
        return cls(spec, rope_frequencies(spec).astype(dtype), mode)


def rope_angles(pos: np.ndarray, rope: RopeTable) -> np.ndarray:
    """φ[t, i] = float(p_t) · f_i in the working dtype (one rounding), or ggml's recurrence angles.

    pos [n] -> [n, r/2] in the dtype of rope.freqs.
    """
    if rope.mode == "recurrence":
        return recurrence_angles(pos, rope.spec).astype(rope.freqs.dtype)
    return np.asarray(pos).astype(rope.freqs.dtype)[:, None] * rope.freqs[None, :]


def rotate_pairs(x: np.ndarray, angle: np.ndarray, inverse: bool = False) -> np.ndarray:
    """Rotate pair i of the trailing 2·r/2 dims by φ_i: (a, b) -> (a cos φ - b sin φ, a sin φ + b cos φ).

    x [n, ..., d], angle [n, r/2] -> [n, ..., d] (a new array). `inverse` uses -φ.
    """
    r = 2 * angle.shape[-1]
    d = x.shape[-1]
    angle = angle.reshape(angle.shape[:1] + (1,) * (x.ndim - 2) + angle.shape[1:])
    cos, sin = np.cos(angle), np.sin(angle)
    if inverse:
        sin = -sin
    out = x.copy()
    a, b = x[..., d - r :: 2], x[..., d - r + 1 :: 2]
    out[..., d - r :: 2] = a * cos - b * sin
    out[..., d - r + 1 :: 2] = a * sin + b * cos
    return out


def apply_rope(x: np.ndarray, pos: np.ndarray, rope: RopeTable, inverse: bool = False) -> np.ndarray:
    """RoPE of x at positions pos with the layer's table: rotate_pairs(x, rope_angles(pos, rope)).

    x [n, ..., d], pos [n] -> [n, ..., d]; x and the table share the working dtype.
    """
    return rotate_pairs(x, rope_angles(pos, rope), inverse)
