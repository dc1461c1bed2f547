"""Manifold-constrained hyper-connections: HC_pre, Sinkhorn, HC_post, HC head (spec residual-ffn §6, §8).

The residual carrier of one position is X [H, D] (H streams); flattened stream-major it is x̄ [H*D].
"""

from __future__ import annotations

import numpy as np

from reference_cpu.linear import Matrix, Weight, linear


def sigmoid(z: np.ndarray) -> np.ndarray:
    """σ(z) = 1 / (1 + e^-z), evaluated without overflow for either sign of z.

    z [...] -> [...].
    """
    e = np.exp(-np.abs(z))
    return np.where(z >= 0, 1.0 / (1.0 + e), e / (1.0 + e)).astype(z.dtype, copy=False)


def hc_init(e: np.ndarray, hc_mult: int) -> np.ndarray:
    """X^(0)[h] = e for every stream h: H identical copies of the embedding row (§6).

    e [n, D] -> [n, H, D].
    """
    return np.repeat(e[:, None, :], hc_mult, axis=1)


def hc_mixes(X: np.ndarray, fn: Weight, norm_eps: float) -> np.ndarray:
    """m = r · (Φ x̄), r = 1/sqrt(mean(x̄²) + ε_rms) over the flattened carrier (§8.1 step 1).

    X [n, H, D], fn Φ [M, H*D] -> [n, M]. r is applied after the matmul, as in the official code. An engine that
    rounds the matmul input rounds the normalised carrier, Φ round(r x̄) (llama.cpp normalises first; measured:
    its hc_attn_pre then agrees to 8e-8 instead of 7e-5 with F16 Φ).
    """
    flat = X.reshape(X.shape[0], -1)
    r = 1.0 / np.sqrt(np.mean(flat * flat, axis=-1, keepdims=True) + norm_eps)
    if isinstance(fn, Matrix) and fn.round_input is not None:
        return linear(flat * r, fn)
    return linear(flat, fn) * r


def sinkhorn(Z: np.ndarray, iters: int, eps: float) -> np.ndarray:
    """Sinkhorn-Knopp: C = softmax_rows(Z) + ε; col-normalise; then (iters-1) × (row-, col-normalise) (§8.1 step 6).

    Z [n, H, H] comb logits (row r, column c) -> C [n, H, H]. Every denominator is Σ + ε and the last
    step is a column normalisation, so column sums are S/(S+ε) ≈ 1 while row sums are only close to 1.
    """
    C = np.exp(Z - Z.max(axis=-1, keepdims=True))
    C = C / C.sum(axis=-1, keepdims=True) + eps
    C = C / (C.sum(axis=-2, keepdims=True) + eps)
    for _ in range(iters - 1):
        C = C / (C.sum(axis=-1, keepdims=True) + eps)
        C = C / (C.sum(axis=-2, keepdims=True) + eps)
    return C


def hc_pre(X: np.ndarray, fn: Weight, scale: np.ndarray, base: np.ndarray, norm_eps: float,
           hc_eps: float, iters: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """u = Σ_h pre_h X[h] with pre = σ(α0 m + β)+ε, post = 2σ(α1 m + β), C = Sinkhorn(α2 m + β) (§8.1).

    X [n, H, D], fn [(2+H)H, H*D], scale α [3], base β [(2+H)H]
    -> u [n, D], pre [n, H], post [n, H], comb C [n, H, H] (row-major, row r = source stream).
    """
    n, H, _ = X.shape
    m = hc_mixes(X, fn, norm_eps)
    pre = sigmoid(scale[0] * m[:, :H] + base[:H]) + hc_eps
    post = 2.0 * sigmoid(scale[1] * m[:, H : 2 * H] + base[H : 2 * H])
    Z = (scale[2] * m[:, 2 * H :] + base[2 * H :]).reshape(n, H, H)
    C = sinkhorn(Z, iters, hc_eps)
    u = np.einsum("nh,nhd->nd", pre, X)
    return u, pre, post, C


def hc_post(y: np.ndarray, X: np.ndarray, post: np.ndarray, comb: np.ndarray) -> np.ndarray:
    """X'[c] = post_c · y + Σ_r C[r, c] · X[r], i.e. X' = post ⊗ y + Cᵀ X (§8.2, the transposed comb).

    y [n, D], X [n, H, D] (the carrier fed to the matching HC_pre), post [n, H], comb [n, H, H] -> [n, H, D].
    """
    return post[:, :, None] * y[:, None, :] + np.matmul(comb.transpose(0, 2, 1), X)


def hc_head(X: np.ndarray, fn: Weight, scale: float, base: np.ndarray, norm_eps: float,
            hc_eps: float) -> np.ndarray:
    """z = Σ_h w_h X[h], w = σ(α m_o + β) + ε, m_o = r · Φ_o x̄: single scale, no post, no Sinkhorn (§8.3).

    X [n, H, D], fn [H, H*D], base [H] -> z [n, D].
    """
    w = sigmoid(scale * hc_mixes(X, fn, norm_eps) + base) + hc_eps
    return np.einsum("nh,nhd->nd", w, X)
