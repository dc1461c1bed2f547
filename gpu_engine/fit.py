"""Fit a tiny MTP drafter to its trunk by gradient descent through the engine's own ops (spec v4-mtp-dspark §6.6).

The forward is the torch engine's MTP head (`Ops().mtp_input`, `model.block_forward` on layer L, the MTP HC head,
the output head), run on `TrainableWeights`: the product interface `DeviceWeights` gives the ops (linear, grouped
and expert products, rows, vectors, matrices) over float32 tensors, the drafter's as leaves with gradients, the
trunk's embedding and output head fixed. Loss: the cross-entropy of the MTP logits of each prev pair
(X^(L)_{p-1}, t_p) against the trunk's own greedy token at row p (its argmax there), averaged over the rows of a
step's sequences. Adam, seeded (the sequence order), deterministic on one thread.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

from gpu_engine.attention import new_layer_cache
from gpu_engine.model import LayerPlan, Ops, block_forward
from gpu_engine.ops import rms_norm, rope_frequencies
from parity.contract.errors import ParityError, TensorError
from parity.gguf.config import ModelConfig

Tensor = torch.Tensor
FIXED = ("token_embd.weight", "output.weight")   # the trunk's: shared by the head, never trained


class TrainableWeights:
    """`DeviceWeights`' product interface over dense float tensors (numpy shapes, (out, in)); no quantization."""

    act = torch.float32

    def __init__(self, tensors: Mapping[str, Tensor]) -> None:
        self.t = dict(tensors)

    def _get(self, name: str) -> Tensor:
        if name not in self.t:
            raise TensorError(f"tensor {name!r} is missing")
        return self.t[name]

    def matrix(self, name: str, dtype: torch.dtype) -> Tensor:
        return self._get(name).to(dtype)

    def vector(self, name: str) -> Tensor:
        return self._get(name)

    def rows(self, name: str, idx: Tensor) -> Tensor:
        """idx [n] -> [n, in]"""
        return self._get(name)[idx]

    def linear(self, x: Tensor, name: str) -> Tensor:
        """y = x Wᵀ.  x [n, in] -> [n, out]"""
        return x @ self._get(name).T

    def grouped_linear(self, x: Tensor, name: str) -> Tensor:
        """z_g = W[g] x_g, W [G·r, w] read as G blocks of r rows.  x [n, G, w] -> [n, G, r]"""
        _, groups, width = x.shape
        return torch.einsum("ngw,grw->ngr", x, self._get(name).reshape(groups, -1, width))

    def expert_linear(self, x: Tensor, name: str, e: int, weight: Tensor | None = None) -> Tensor:
        """y = (x · weight) W_eᵀ of expert e of (E, out, in).  x [n, in], weight [n] or None -> [n, out]"""
        return (x if weight is None else x * weight[:, None]) @ self._get(name)[e].T


def mtp_logits(w: TrainableWeights, cfg: ModelConfig, plan: LayerPlan, G: Tensor, tau: Tensor) -> Tensor:
    """The MTP head over n pairs from position 0 on a fresh ring, composed as `TorchEngine._mtp_rows` with the
    model's ops (`Ops()`: no fault, QAT sims off): X0 = mtp_input(E[τ], G); X1 = Block_L(X0);
    logits = W_out RMSNorm_norm(HC_head_mtp(X1)).  G [n, H, D], tau int64 [n] -> [n, V]."""
    ops = Ops()
    X0 = ops.mtp_input(w.rows("token_embd.weight", tau), G, w.vector("mtp.enorm.weight"),
                       w.vector("mtp.hnorm.weight"), w.matrix("mtp.e_proj.weight", w.act),
                       w.matrix("mtp.h_proj.weight", w.act), cfg.norm_eps)
    res = block_forward(w, cfg, ops, plan, new_layer_cache(cfg, 0, G.device, w.act), X0, tau, 0, None, False)
    z = ops.mtp_hc_head(w, cfg, ops.mtp_carrier(res.attn_carrier, res.carrier))
    return w.linear(rms_norm(z, w.vector("mtp.norm.weight"), cfg.norm_eps), "output.weight")


def mtp_plan(cfg: ModelConfig, layer: int) -> LayerPlan:
    """Layer `layer` as the engine runs a drafter block: ratio 0, RoPE base θ without YaRN."""
    freqs = rope_frequencies(cfg.rope_head_dim, cfg.rope_theta, False, 1.0, 0, 0.0, 0.0).to(torch.float32)
    return LayerPlan(layer, 0, freqs)


def fit_mtp(weights: Mapping[str, np.ndarray], cfg: ModelConfig, first_layer: int,
            sequences: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]], steps: int, seed: int,
            lr: float = 3e-3, batch: int = 8, log: Callable[[int, float], None] | None = None) -> dict[str, np.ndarray]:
    """Adam on every drafter tensor of `weights` (canonical names; the FIXED trunk tensors stay), seeded.

    sequences: (carriers X^(L) [n, H, D], tokens [n], targets [n-1]) with targets[i] = the trunk's argmax at row
    i+1, what the prev pair (X_i, t_{i+1}) must predict. Each step takes `batch` sequences (a seeded permutation,
    cycled). Returns the fitted tensors (float32 numpy, the FIXED ones left out).
    """
    if steps < 1 or batch < 1 or not sequences:
        raise ParityError(f"fit_mtp: steps ({steps}) and batch ({batch}) must be >= 1 with >= 1 sequence")
    for name in FIXED:
        if name not in weights:
            raise TensorError(f"fit_mtp: the trunk tensor {name!r} is missing")
    gen = torch.Generator().manual_seed(seed)
    params = {k: torch.tensor(np.asarray(v, dtype=np.float32), requires_grad=k not in FIXED)
              for k, v in weights.items()}
    w, plan = TrainableWeights(params), mtp_plan(cfg, first_layer)
    data = [(torch.from_numpy(np.asarray(X, np.float32)[:-1]), torch.from_numpy(np.asarray(t, np.int64)[1:]),
             torch.from_numpy(np.asarray(y, np.int64))) for X, t, y in sequences]
    opt = torch.optim.Adam([p for k, p in params.items() if k not in FIXED], lr=lr)
    order = torch.randperm(len(data), generator=gen).tolist()
    for step in range(steps):
        picks = [order[(step * batch + i) % len(data)] for i in range(min(batch, len(data)))]
        opt.zero_grad()
        loss = sum(torch.nn.functional.cross_entropy(mtp_logits(w, cfg, plan, *data[i][:2]), data[i][2],
                                                     reduction="sum") for i in picks)
        loss = loss / sum(len(data[i][2]) for i in picks)
        loss.backward()
        opt.step()
        if log is not None:
            log(step, loss.item())
    return {k: p.detach().numpy().copy() for k, p in params.items() if k not in FIXED}
