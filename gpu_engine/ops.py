"""Elementwise building blocks in torch: RMSNorm, interleaved partial RoPE (+YaRN), QAT round trips, SwiGLU.

Shapes follow the engine: a batch axis n first (positions), the feature axis last.
"""

from __future__ import annotations

import math

import torch

from parity.contract.errors import ParityError

E4M3_MAX, E4M3_AMAX_FLOOR = 448.0, 1e-4
E2M1_MAX, E2M1_AMAX_FLOOR = 6.0, 6.0 * 2.0**-126


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """y = x / sqrt(mean(x^2) + eps) (* w when weighted).
    x [..., n], weight [n] or None -> [..., n]."""
    y = x / torch.sqrt(torch.mean(x * x, dim=-1, keepdim=True) + eps)
    return y if weight is None else y * weight


def rope_frequencies(rope_dim: int, base: float, yarn: bool, factor: float, original_seq_len: int,
                     beta_fast: float, beta_slow: float) -> torch.Tensor:
    """f_i = 1 / B^(2i/r), YaRN-blended f/factor·(1-keep_i) + f·keep_i when `yarn` (no mscale), formed with
    float32 operations as the official code does: exponent 2i/r, the pow rounded once, the reciprocal, the ramp
    (i - low) / (high - low) clamped to [0, 1] and the blend, each in float32 (spec attention, correction 9).
    -> float64 [r/2] on the CPU, holding those float32 values exactly (the float64 oracle uses them too)."""
    f32 = torch.float32
    expo = torch.arange(0, rope_dim, 2, dtype=f32) / torch.tensor(rope_dim, dtype=f32)
    g = 1.0 / torch.pow(torch.tensor(base, dtype=f32).double(), expo.double()).to(f32)
    if yarn:
        def corr(beta: float) -> float:
            return rope_dim * math.log(original_seq_len / (beta * 2 * math.pi)) / (2 * math.log(base))

        low, high = max(math.floor(corr(beta_fast)), 0), min(math.ceil(corr(beta_slow)), rope_dim - 1)
        span = torch.tensor((high + 0.001 if high == low else high) - low, dtype=f32)
        keep = 1.0 - torch.clamp((torch.arange(rope_dim // 2, dtype=f32) - low) / span, 0.0, 1.0)
        g = g / torch.tensor(factor, dtype=f32) * (1.0 - keep) + g * keep
    return g.to(torch.float64)


def rope_angles(pos: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """φ[t, i] = p_t · f_i in freqs' dtype, one rounding (float32 like the official code).  pos [n] -> [n, r/2]."""
    return pos.to(freqs.dtype)[:, None] * freqs[None, :]


def rope_cos_sin(x: torch.Tensor, pos: torch.Tensor, freqs: torch.Tensor,
                 inverse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """cos φ, sin φ of φ_i = p·f_i (φ -> -φ when inverse), shaped to broadcast over x's middle axes.
    x [n, ..., d], pos [n] int, freqs [r/2] (x's dtype/device) -> cos, sin [n, 1.., r/2]."""
    angle = rope_angles(pos, freqs)
    angle = angle.reshape(angle.shape[0], *([1] * (x.dim() - 2)), angle.shape[1])
    cos, sin = torch.cos(angle), torch.sin(angle)
    if inverse:
        sin = -sin
    return cos, sin


def apply_rope(x: torch.Tensor, pos: torch.Tensor, freqs: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the trailing r dims of x in interleaved pairs (2i, 2i+1) by φ_i = p·f_i (φ -> -φ when inverse).
    x [n, ..., d], pos [n] int, freqs [r/2] (x's dtype/device) -> new tensor [n, ..., d]."""
    r = 2 * freqs.shape[0]
    cos, sin = rope_cos_sin(x, pos, freqs, inverse)
    tail = x[..., -r:]
    a, b = tail[..., 0::2], tail[..., 1::2]
    rotated = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)
    return torch.cat([x[..., :-r], rotated], dim=-1)


def apply_rope_split_halves(x: torch.Tensor, pos: torch.Tensor, freqs: torch.Tensor,
                            inverse: bool = False) -> torch.Tensor:
    """The rope-split-halves fault: `apply_rope` with NeoX pairs (i, i + r/2) instead of interleaved pairs."""
    r = 2 * freqs.shape[0]
    cos, sin = rope_cos_sin(x, pos, freqs, inverse)
    tail = x[..., -r:]
    a, b = tail[..., : r // 2], tail[..., r // 2 :]
    rotated = torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)
    return torch.cat([x[..., :-r], rotated], dim=-1)


def _ceil_log2(x: torch.Tensor) -> torch.Tensor:
    """⌈log2 x⌉ exactly for x > 0 (x = m·2^e, m in [0.5, 1)).  [...] -> int32 [...]"""
    m, e = torch.frexp(x)
    return torch.where(m == 0.5, e - 1, e)


def _pow2(k: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return torch.ldexp(torch.ones((), dtype=like.dtype, device=like.device), k.to(like.dtype))


def e4m3_round(v: torch.Tensor) -> torch.Tensor:
    """Nearest float8-e4m3fn value, ties to even (step 2^-9 below 2^-6, else 2^(⌊log2|v|⌋-3)).  |v| <= 448."""
    a = v.abs()
    _, e = torch.frexp(a)
    step = torch.where(a < 2.0**-6, torch.full_like(a, 2.0**-9), _pow2(e - 4, a))
    return torch.copysign(torch.round(a / step) * step, v)


def e2m1_round(v: torch.Tensor) -> torch.Tensor:
    """Nearest of ±{0, .5, 1, 1.5, 2, 3, 4, 6}, ties to even code (step .5 / 1 / 2 below 2 / 4 / above).  |v| <= 6."""
    a = v.abs()
    step = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0)).to(a.dtype)
    return torch.copysign(torch.round(a / step) * step, v)


def fp8_sim_nope(kv: torch.Tensor, nope_dim: int, block: int = 64) -> torch.Tensor:
    """FP8SIM_nope: per 64-block of dims [0, nope) b <- E4M3(clamp(b/s, ±448))·s, s = 2^⌈log2(amax·fl(1/448))⌉.
    kv [..., hd] -> new tensor [..., hd]; the rope tail is untouched."""
    b = kv[..., :nope_dim].reshape(*kv.shape[:-1], nope_dim // block, block)
    amax = torch.clamp(b.abs().amax(dim=-1, keepdim=True), min=E4M3_AMAX_FLOOR)
    s = _pow2(_ceil_log2(amax * torch.tensor(1.0 / E4M3_MAX, dtype=kv.dtype)), b)
    q = e4m3_round(torch.clamp(b / s, -E4M3_MAX, E4M3_MAX)) * s
    return torch.cat([q.reshape(*kv.shape[:-1], nope_dim), kv[..., nope_dim:]], dim=-1)


def fp4_e2m1_roundtrip(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """FP4SIM: per 32-block b <- E2M1(clamp(b/s, ±6))·s, s = 2^⌈log2(max(amax, 6·2^-126)/6)⌉.
    x [..., k·32] -> [..., k·32]."""
    b = x.reshape(*x.shape[:-1], x.shape[-1] // block, block)
    amax = torch.clamp(b.abs().amax(dim=-1, keepdim=True), min=E2M1_AMAX_FLOOR)
    s = _pow2(_ceil_log2(amax / E2M1_MAX), b)
    return (e2m1_round(torch.clamp(b / s, -E2M1_MAX, E2M1_MAX)) * s).reshape(x.shape)


def hadamard_matrix(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """H_n / √n (Sylvester order), symmetric orthonormal.  -> [n, n]"""
    H = torch.ones(1, 1, dtype=torch.float64)
    while H.shape[0] < n:
        H = torch.cat([torch.cat([H, H], 1), torch.cat([H, -H], 1)], 0)
    return (H / math.sqrt(n)).to(dtype=dtype, device=device)


def swiglu_clamped(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """h = silu(min(g, c)) · clip(u, -c, c) (clamp off when c <= 0).  [..., F] x2 -> [..., F]"""
    if limit > 0:
        gate = torch.clamp(gate, max=limit)
        up = torch.clamp(up, -limit, limit)
    return torch.nn.functional.silu(gate) * up


def swiglu_symmetric_clamp(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """The swiglu-symmetric-clamp fault: `swiglu_clamped` with the gate clipped to [-c, c]."""
    if limit > 0:
        gate = torch.clamp(gate, -limit, limit)
        up = torch.clamp(up, -limit, limit)
    return torch.nn.functional.silu(gate) * up


def q8_0_roundtrip(x: torch.Tensor) -> torch.Tensor:
    """Activations as llama.cpp's CPU backend feeds them to a Q8_0-activation matmul: per block of 32 along the last
    axis d = amax/127 (stored as f16), q = round(x · 127/amax) to nearest even, clamped to [-127, 127], value q·d
    (ggml's x86 quantize_row_q8_0; amax = 0 gives zeros).  Float32 arithmetic.  x [..., 32k] -> x's dtype, shape."""
    if x.shape[-1] % 32:
        raise ParityError(f"act_quant=q8_0: activation width {x.shape[-1]} is not a multiple of the block size 32")
    b = x.to(torch.float32).reshape(*x.shape[:-1], x.shape[-1] // 32, 32)
    amax = b.abs().amax(dim=-1, keepdim=True)
    d = (amax / 127.0).to(torch.float16).to(torch.float32)
    inv = torch.where(amax > 0, 127.0 / amax, 0.0)
    q = torch.clamp(torch.round(b * inv), -127.0, 127.0)
    return (q * d).reshape(x.shape).to(x.dtype)


def identity(x: torch.Tensor) -> torch.Tensor:
    """x unchanged (the op in place of a QAT round trip that is off)."""
    return x
