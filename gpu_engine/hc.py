"""Manifold-constrained hyper-connections in torch (spec residual-ffn §8): HC_pre, Sinkhorn, HC_post, HC head.

Carrier X [n, H, D] (H streams); mixes come from the RMS-normalised flattened carrier.
"""

from __future__ import annotations

import torch


def hc_mixes(X: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """m = r·(Φ x̄), r = 1/sqrt(mean(x̄²)+ε) over the flattened carrier.
    X [n, H, D], fn [M, H*D] -> [n, M]."""
    flat = X.reshape(X.shape[0], -1)
    r = torch.rsqrt(torch.mean(flat * flat, dim=-1, keepdim=True) + norm_eps)
    return (flat @ fn.T) * r


def sinkhorn(Z: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """C = softmax_rows(Z) + ε, column-normalise, then (iters-1) x (row, column) normalisations (each Σ + ε).
    Z [n, H, H] -> C [n, H, H]."""
    C = torch.softmax(Z, dim=-1) + eps
    C = C / (C.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        C = C / (C.sum(dim=-1, keepdim=True) + eps)
        C = C / (C.sum(dim=-2, keepdim=True) + eps)
    return C


def hc_pre(X: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, norm_eps: float,
           hc_eps: float, iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """u = Σ_h pre_h X[h]; pre = σ(α0 m+β)+ε, post = 2σ(α1 m+β), C = Sinkhorn(α2 m+β).
    X [n, H, D] -> u [n, D], pre [n, H], post [n, H], C [n, H, H] (row r = source stream)."""
    n, H, _ = X.shape
    m = hc_mixes(X, fn, norm_eps)
    pre = torch.sigmoid(scale[0] * m[:, :H] + base[:H]) + hc_eps
    post = 2.0 * torch.sigmoid(scale[1] * m[:, H : 2 * H] + base[H : 2 * H])
    C = sinkhorn((scale[2] * m[:, 2 * H :] + base[2 * H :]).reshape(n, H, H), iters, hc_eps)
    u = torch.einsum("nh,nhd->nd", pre, X)
    return u, pre, post, C


def hc_post(y: torch.Tensor, X: torch.Tensor, post: torch.Tensor, C: torch.Tensor) -> torch.Tensor:
    """X'[c] = post_c·y + Σ_r C[r, c]·X[r]  (X' = post ⊗ y + Cᵀ X).
    y [n, D], X [n, H, D], post [n, H], C [n, H, H] -> [n, H, D]."""
    return post[:, :, None] * y[:, None, :] + torch.bmm(C.transpose(1, 2), X)


def hc_post_not_transposed(y: torch.Tensor, X: torch.Tensor, post: torch.Tensor, C: torch.Tensor) -> torch.Tensor:
    """The comb-not-transposed fault: `hc_post` mixing the streams with C X instead of Cᵀ X."""
    return post[:, :, None] * y[:, None, :] + torch.bmm(C, X)


def hc_head(X: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, norm_eps: float,
            hc_eps: float) -> torch.Tensor:
    """z = Σ_h w_h X[h], w = σ(α m_o + β) + ε (one scalar scale, no Sinkhorn).
    X [n, H, D], fn [H, H*D] -> z [n, D]."""
    w = torch.sigmoid(scale[0] * hc_mixes(X, fn, norm_eps) + base) + hc_eps
    return torch.einsum("nh,nhd->nd", w, X)
