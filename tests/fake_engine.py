"""A deterministic stand-in engine implementing the `Engine` protocol, for harness tests.

Carriers are a seeded random walk: layer l adds tanh(X W_l) plus a position term, so every
checkpoint depends on all earlier ones (a perturbation amplifies downstream, as in a real model).
`perturb={layer: eps}` adds eps * a fixed direction at that layer's attention output, i.e. a
"fault" that first acts at blk.{layer}.attn.
"""

from __future__ import annotations

import numpy as np

from parity.contract.engine import LayerDiag, LayerOutput, RunOptions
from parity.gguf.weights import Weights


class FakeEngine:
    name = "fake"
    version = "0.0.1"

    def __init__(self, model_path: str, options: RunOptions | None = None, perturb: dict[int, float] | None = None):
        weights = Weights(model_path)
        self.config, self.identity = weights.config, weights.identity()
        self.options = options or RunOptions()
        self.perturb = perturb or {}
        c = self.config
        rng = np.random.default_rng(1234)
        self.emb = rng.standard_normal((c.vocab_size, c.dim)).astype(np.float32)
        self.w = rng.standard_normal((c.n_layers, c.dim, c.dim)).astype(np.float32) / np.sqrt(c.dim)
        self.dir = rng.standard_normal((c.hc_mult, c.dim)).astype(np.float32)
        self.head_w = rng.standard_normal((c.dim, c.vocab_size)).astype(np.float32) / np.sqrt(c.dim)

    def new_state(self) -> dict:
        return {}

    def embed(self, tokens: np.ndarray) -> np.ndarray:
        return np.repeat(self.emb[tokens][:, None, :], self.config.hc_mult, axis=1)

    def forward_layer(self, state, layer, carrier, tokens, start_pos, capture=False) -> LayerOutput:
        n, H, _ = carrier.shape
        pos = np.arange(start_pos, start_pos + n, dtype=np.float32)[:, None, None]
        attn = carrier + 0.1 * np.tanh(carrier @ self.w[layer]) + 0.01 * np.sin(pos + layer)
        attn = attn + self.perturb.get(layer, 0.0) * self.dir
        out = attn + 0.1 * np.tanh(attn @ self.w[layer].T)
        K = self.config.n_activated_experts
        ids = (np.arange(K)[None, :] + tokens[:, None] + layer) % self.config.n_routed_experts
        hc = (np.full((n, H), 0.25, np.float32), np.full((n, H), 0.5, np.float32), np.tile(np.eye(H), (n, 1, 1)))
        ratio = self.config.ratio(layer)
        n_comp = (pos[:, 0, 0].astype(int) + 1) // ratio if ratio else np.zeros(n, int)
        sel = np.full((n, self.config.index_topk), -1) if self.config.has_indexer(layer) else None
        diag = LayerDiag(hc, hc, ids, np.full((n, K), 1.0 / K, np.float32), np.full(n, 0.5, np.float32), n_comp, sel)
        return LayerOutput(attn.astype(np.float32), out.astype(np.float32), diag)

    def head(self, carrier: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        z = carrier.sum(axis=1)
        n = z / np.sqrt((z * z).mean(axis=1, keepdims=True) + 1e-6)
        return n.astype(np.float32), (n @ self.head_w).astype(np.float32)
