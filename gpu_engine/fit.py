"""Fit tiny MTP and DSpark drafters to their trunk by gradient descent through the engine's own ops (spec
v4-mtp-dspark §6.6).

The forwards are the torch engine's draft heads composed with the model's ops (`Ops()`: no fault, QAT sims off):
the MTP head (`mtp_input`, `model.block_forward` on layer L, the MTP HC head, the output head; chained rows through
the same block on the ring of the pairs before them) and the DSpark round
(main rows into fresh rings, `draft_blocks.dspark_stage` per stage, the HC head, the output head), run on
`TrainableWeights`: the interface `DeviceWeights` gives the ops (weight handles for the products of
`gpu_engine.linear`, rows, vectors, matrices) over float32 tensors, the drafter's as leaves with gradients, the
trunk's embedding and output head fixed. Targets: the trunk's own greedy tokens. Adam, seeded (the item order),
deterministic on one thread.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

import numpy as np
import torch

from gpu_engine.attention import LayerCache, new_layer_cache
from gpu_engine.draft import Ring, confidence, dspark_main
from gpu_engine.draft_blocks import dspark_stage, main_kv
from gpu_engine.hc import hc_head
from gpu_engine.linear import Matrix, dense_matrix, linear
from gpu_engine.model import LayerPlan, Ops, block_forward
from gpu_engine.ops import rms_norm, rope_frequencies
from parity.contract.errors import ParityError, TensorError
from parity.gguf.config import ModelConfig

Tensor = torch.Tensor
FIXED = ("token_embd.weight", "output.weight")   # the trunk's: shared by the head, never trained


class TrainableWeights:
    """`DeviceWeights`' interface over dense float tensors (numpy shapes, (out, in)); no quantization."""

    act = torch.float32

    def __init__(self, tensors: Mapping[str, Tensor]) -> None:
        self.t = dict(tensors)
        # handles made once: an expert tensor's split (indexing [e] at every use would give every use a full-size
        # gradient to add) is then shared by every use
        self.handles: dict[str, Matrix] = {}

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

    def weight(self, name: str) -> Matrix:
        """The exact handle of matrix `name` (`gpu_engine.linear`): float32, no rounding; an expert tensor's
        experts split once."""
        if name not in self.handles:
            self.handles[name] = dense_matrix(self._get(name), name)
        return self.handles[name]

def mtp_rows(w: TrainableWeights, cfg: ModelConfig, plan: LayerPlan, cache: LayerCache, G: Tensor, tau: Tensor,
             start_pos: int) -> tuple[Tensor, Tensor, Tensor]:
    """MTP rows at positions start_pos.. through `cache`, composed as `TorchEngine._mtp_rows` with the model's ops
    (`Ops()`: no fault, QAT sims off): X0 = mtp_input(E[τ], G); X1 = Block_L(X0);
    logits = W_out RMSNorm_norm(HC_head_mtp(X1)).  G [n, H, D], tau int64 [n] -> logits [n, V], X1 [n, H, D],
    the rows' keys as the ring stores them [n, hd]."""
    ops = Ops()
    X0 = ops.mtp_input(w.rows("token_embd.weight", tau), G, w.vector("mtp.enorm.weight"),
                       w.vector("mtp.hnorm.weight"), w.matrix("mtp.e_proj.weight", w.act),
                       w.matrix("mtp.h_proj.weight", w.act), cfg.norm_eps)
    res = block_forward(w, cfg, ops, plan, cache, X0, tau, start_pos, None, True)
    X1 = ops.mtp_carrier(res.attn_carrier, res.carrier)
    z = ops.mtp_hc_head(w, cfg, X1)
    return linear(rms_norm(z, w.vector("mtp.norm.weight"), cfg.norm_eps), w.weight("output.weight")), X1, \
        res.attn.captures["rope_kv"]


def mtp_logits(w: TrainableWeights, cfg: ModelConfig, plan: LayerPlan, G: Tensor, tau: Tensor) -> Tensor:
    """`mtp_rows` of n pairs from position 0 on a fresh ring (as `mtp_forward` after `new_mtp_state`).
    G [n, H, D], tau int64 [n] -> [n, V]."""
    return mtp_rows(w, cfg, plan, new_layer_cache(cfg, 0, G.device, w.act), G, tau, 0)[0]


def mtp_chain_logits(w: TrainableWeights, cfg: ModelConfig, plan: LayerPlan, keys: Tensor, X1: Tensor, c: int,
                     tokens: Tensor) -> list[Tensor]:
    """Depths 2..k+1 after pair c, as `TorchEngine.mtp_chain` on the ring of pairs <= c (`keys` [>= c+1, hd] of
    the pairs from position 0, the last W-1 up to c kept), but teacher-forced: depth j+2 takes (X1 of depth j+1,
    tokens[j]) at position c+1+j.  X1 [>= c+1, H, D] of the pairs, tokens int64 [k] -> k x logits [1, V]."""
    W = cfg.window_size
    cache = LayerCache(c + 1, keys[max(0, c + 2 - W) : c + 1])
    G, out = X1[c : c + 1], []
    for j in range(tokens.shape[0]):
        logits, G, _ = mtp_rows(w, cfg, plan, cache, G, tokens[j : j + 1], c + 1 + j)
        out.append(logits)
    return out


def drafter_plan(cfg: ModelConfig, layer: int) -> LayerPlan:
    """Layer `layer` as the engine runs a drafter block: ratio 0, RoPE base θ without YaRN."""
    freqs = rope_frequencies(cfg.rope_head_dim, cfg.rope_theta, False, 1.0, 0, 0.0, 0.0).to(torch.float32)
    return LayerPlan(layer, 0, freqs)


def dspark_logits(w: TrainableWeights, cfg: ModelConfig, plans: Sequence[LayerPlan], taps: Sequence[Tensor],
                  blocks: Tensor) -> tuple[Tensor, Tensor]:
    """R DSpark rounds at once, each as `TorchEngine.dspark_round` on a fresh ring (`Ops()`): round r's ring holds
    the main rows of its taps (the c_r <= W rows up to its p_r), its block runs through the S stages
    (`draft_blocks.dspark_stage`), then the head. The R blocks are one call of each stage: round r's slots take
    positions F+1+rB.., its ring rows the same offsets to them as at p_r (RoPE is relative: the engine's values up
    to rounding), and the stage's key mask (`Ops.dspark_mask`) is block diagonal, each round seeing only its ring
    and its own block.  taps R x [c_r, m·D], blocks int64 [R, B] (anchor, noise ...) -> base logits [R, B, V]
    (before the Markov bias), z [R, B, D] (the HC head's output, the confidence input)."""
    R, B = blocks.shape
    frame, eps = cfg.window_size, cfg.norm_eps           # F >= W - 1 keeps every shifted position >= 0
    counts = [t.shape[0] for t in taps]
    pos = torch.cat([torch.arange(1 - c, 1) + frame + r * B for r, c in enumerate(counts)])
    owner = torch.cat([torch.full((c,), r) for r, c in enumerate(counts)] + [torch.arange(R).repeat_interleave(B)])
    mask = owner[len(pos):, None] == owner[None, :]    # [R·B, rows + R·B]: same round only
    ops = replace(Ops(), dspark_mask=lambda ring_pos, p, window, block: mask)
    M = dspark_main(torch.cat(list(taps)), w.matrix("dspark.main_proj.weight", w.act),
                    w.vector("dspark.main_norm.weight"), eps)
    tok = blocks.reshape(-1)
    X = w.rows("token_embd.weight", tok)[:, None, :].expand(-1, cfg.hc_mult, -1)
    for plan in plans:
        X = dspark_stage(w, cfg, ops, plan, Ring(main_kv(w, cfg, ops, plan, M, pos), pos), X, tok, frame)[1]
    z = hc_head(X, w.matrix("dspark.hc_head_fn.weight", w.act), w.vector("dspark.hc_head_scale.weight"),
                w.vector("dspark.hc_head_base.weight"), eps, cfg.hc_eps)
    base = linear(rms_norm(z, w.vector("dspark.norm.weight"), eps), w.weight("output.weight"))
    return base.reshape(R, B, -1), z.reshape(R, B, -1)


def adam(weights: Mapping[str, np.ndarray], items: Sequence, loss_of: Callable[[TrainableWeights, list], Tensor],
         steps: int, seed: int, lr: float, batch: int,
         log: Callable[[int, float], None] | None) -> dict[str, np.ndarray]:
    """Adam on every tensor of `weights` but the FIXED trunk ones, seeded: each step takes `batch` items (a seeded
    permutation, cycled) and minimises `loss_of(w, those items)` (a mean over them).
    -> the trained tensors (float32 numpy, the FIXED ones left out)."""
    if steps < 1 or batch < 1 or not items:
        raise ParityError(f"fit: steps ({steps}) and batch ({batch}) must be >= 1 with >= 1 training item")
    for name in FIXED:
        if name not in weights:
            raise TensorError(f"fit: the trunk tensor {name!r} is missing")
    params = {k: torch.tensor(np.asarray(v, dtype=np.float32), requires_grad=k not in FIXED)
              for k, v in weights.items()}
    opt = torch.optim.Adam([p for k, p in params.items() if k not in FIXED], lr=lr)
    order = torch.randperm(len(items), generator=torch.Generator().manual_seed(seed)).tolist()
    for step in range(steps):
        picks = [order[(step * batch + i) % len(items)] for i in range(min(batch, len(items)))]
        opt.zero_grad()
        w = TrainableWeights(params)   # this step's graph (the expert split is part of it)
        loss = loss_of(w, [items[i] for i in picks])
        loss.backward()
        opt.step()
        if log is not None:
            log(step, loss.item())
    return {k: p.detach().numpy().copy() for k, p in params.items() if k not in FIXED}


def fit_mtp(weights: Mapping[str, np.ndarray], cfg: ModelConfig, first_layer: int,
            sequences: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray, int]], steps: int, seed: int,
            depth: int = 1, lr: float = 3e-3, batch: int = 8, chain_batch: int = 16,
            log: Callable[[int, float], None] | None = None) -> dict[str, np.ndarray]:
    """Fit the MTP drafter `weights` (canonical names, with the FIXED trunk tensors) by `adam`.

    sequences: (carriers X^(L) [n, H, D], tokens [n], targets [n-1], first drafted pair) with targets[i] = the
    trunk's argmax at row i+1, what the prev pair (X_i, t_{i+1}) must predict. Loss: the mean cross-entropy over a
    sequence's pairs; with depth > 1 plus, over `chain_batch` anchors c >= first drafted pair drawn per step (seeded),
    the mean cross-entropy of the chained depths 2..depth (`mtp_chain_logits`, fed the trunk's tokens) against
    targets[c+1..c+depth-1]."""
    if depth < 1 or chain_batch < 1:
        raise ParityError(f"fit_mtp: depth ({depth}) and chain_batch ({chain_batch}) must be >= 1")
    plan = drafter_plan(cfg, first_layer)
    items = [(torch.from_numpy(np.asarray(X, np.float32)[:-1]), torch.from_numpy(np.asarray(t, np.int64)[1:]),
              torch.from_numpy(np.asarray(y, np.int64)), int(first)) for X, t, y, first in sequences]
    gen = torch.Generator().manual_seed(seed + 1)

    def loss_of(w: TrainableWeights, picked: list[tuple[Tensor, Tensor, Tensor, int]]) -> Tensor:
        loss, chains = 0, []
        for G, tau, y, first in picked:
            logits, X1, keys = mtp_rows(w, cfg, plan, new_layer_cache(cfg, 0, G.device, w.act), G, tau, 0)
            loss = loss + torch.nn.functional.cross_entropy(logits, y) / len(picked)
            chains += [(keys, X1, c, y) for c in range(first, len(y) - depth + 1)]
        if depth == 1 or not chains:
            return loss
        picks = torch.randperm(len(chains), generator=gen)[:chain_batch].tolist()
        chain = [torch.nn.functional.cross_entropy(lg, y[c + 1 + j : c + 2 + j])
                 for keys, X1, c, y in (chains[i] for i in picks)
                 for j, lg in enumerate(mtp_chain_logits(w, cfg, plan, keys, X1, c, y[c : c + depth - 1]))]
        return loss + sum(chain) / len(chain)

    return adam(weights, items, loss_of, steps, seed, lr, batch, log)


def fit_dspark(weights: Mapping[str, np.ndarray], cfg: ModelConfig, first_layer: int, n_stages: int,
               rounds: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]], steps: int, seed: int,
               lr: float = 3e-3, batch: int = 16, log: Callable[[int, float], None] | None = None
               ) -> dict[str, np.ndarray]:
    """Fit the DSpark drafter `weights` (canonical names, with the FIXED trunk tensors) by `adam`.

    rounds: (taps [c <= W, m·D] of the positions up to p, block [B] = anchor then noise, targets [B]) with
    targets[j] = the trunk's argmax at row p+1+j, what slot j must draft; `batch` rounds run as one call. Loss:
    the mean over the slots of the cross-entropy of the Markov-biased logits ℓ_j + W2 W1[o_j], teacher-forced
    (o_0 = anchor, o_j = targets[j-1], the chain the drafts follow once they are right), plus the binary
    cross-entropy of the confidence logit c_j = w_c·[z_j; W1[o_j]] against whether slot j's argmax is its target."""
    plans = [drafter_plan(cfg, first_layer + k) for k in range(n_stages)]
    items = [(torch.from_numpy(np.asarray(T, np.float32)), torch.from_numpy(np.asarray(b, np.int64)),
              torch.from_numpy(np.asarray(y, np.int64))) for T, b, y in rounds]

    def loss_of(w: TrainableWeights, picked: list[tuple[Tensor, Tensor, Tensor]]) -> Tensor:
        blocks, y = torch.stack([b for _, b, _ in picked]), torch.stack([t for _, _, t in picked])
        base, z = dspark_logits(w, cfg, plans, [T for T, _, _ in picked], blocks)
        u = w.matrix("dspark.markov_w1.weight", w.act)[torch.cat([blocks[:, :1], y[:, :-1]], dim=1)]
        biased = base + u @ w.matrix("dspark.markov_w2.weight", w.act).T
        conf = confidence(z.reshape(-1, z.shape[-1]), u.reshape(-1, u.shape[-1]),
                          w.matrix("dspark.conf_proj.weight", w.act))
        right = (biased.argmax(dim=-1) == y).reshape(-1).to(conf.dtype)
        return (torch.nn.functional.cross_entropy(biased.reshape(-1, biased.shape[-1]), y.reshape(-1))
                + torch.nn.functional.binary_cross_entropy_with_logits(conf, right))

    return adam(weights, items, loss_of, steps, seed, lr, batch, log)
