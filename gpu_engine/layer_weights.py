"""Where the torch engine's layer tensor names are: one layer's weights by role, as `Matrix` handles and tensors.

`layer_weights(w, cfg, layer, ratio)` reads them from a `DeviceWeights` (or the drafter fit's `TrainableWeights`):
the HC weights of both sub-layers, the norms, the attention's (with the main compressor when the scheduled ratio
is > 0 and the indexer's when it is 4) and the MoE FFN's. The model's steps (`gpu_engine.model`) take these records
and hand their parts to the ops; no op looks a weight up by name. Handles are lazy (a product dequantizes when it
runs); the small dense matrices (HC fn, compressor ape) are read when the record is built.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu_engine.linear import Matrix
from gpu_engine.weights import DeviceWeights
from parity.gguf.config import ModelConfig

Tensor = torch.Tensor


@dataclass(frozen=True)
class HcWeights:
    """HC_pre's fn [(2+H)·H, H·D] (activation dtype), scale [3], base [(2+H)·H]."""

    fn: Tensor
    scale: Tensor
    base: Tensor


@dataclass(frozen=True)
class CompressorWeights:
    """A compressor's W_kv, W_gate [c·d_c, D], ape [m, c·d_c] and row norm [d_c]."""

    kv: Matrix
    gate: Matrix
    ape: Tensor
    norm: Tensor


@dataclass(frozen=True)
class AttnWeights:
    """The attention's q path (W_qa, q_norm, W_qb), KV latent (W_kv, kv_norm), sinks [n_heads], grouped output
    (W_oa, W_ob); the main compressor (None at ratio 0), the indexer's compressor, W_Iqb and W_Iw (None off
    ratio 4)."""

    wq_a: Matrix
    q_norm: Tensor
    wq_b: Matrix
    wkv: Matrix
    kv_norm: Tensor
    sinks: Tensor
    wo_a: Matrix
    wo_b: Matrix
    compressor: CompressorWeights | None
    index_compressor: CompressorWeights | None
    index_q_b: Matrix | None
    index_proj: Matrix | None


@dataclass(frozen=True)
class FfnWeights:
    """One layer's MoE FFN weights: the router G [E, D], the selection bias b [E] (None on hash layers) or the hash
    table tid2eid int64 [V, K] (None off them), the routed experts' W_gate, W_up [E, F, D] and W_down [E, D, F], the
    shared expert's [F, D], [F, D], [D, F]."""

    gate: Matrix
    bias: Tensor | None
    tid2eid: Tensor | None
    experts: tuple[Matrix, Matrix, Matrix]
    shared: tuple[Matrix, Matrix, Matrix]


@dataclass(frozen=True)
class LayerWeights:
    hc_attn: HcWeights
    attn_norm: Tensor
    attn: AttnWeights
    hc_ffn: HcWeights
    ffn_norm: Tensor
    ffn: FfnWeights


def hc_weights(w: DeviceWeights, prefix: str) -> HcWeights:
    """`prefix` 'blk.l.hc_attn_' or 'blk.l.hc_ffn_'."""
    return HcWeights(w.matrix(prefix + "fn.weight", w.act), w.vector(prefix + "scale.weight"),
                     w.vector(prefix + "base.weight"))


def compressor_weights(w: DeviceWeights, prefix: str) -> CompressorWeights:
    """`prefix` 'blk.l.attn_compressor' or 'blk.l.indexer_compressor'."""
    return CompressorWeights(w.weight(prefix + "_kv.weight"), w.weight(prefix + "_gate.weight"),
                             w.matrix(prefix + "_ape.weight", w.act), w.vector(prefix + "_norm.weight"))


def attn_weights(w: DeviceWeights, layer: int, ratio: int) -> AttnWeights:
    """Layer `layer`'s attention weights for the scheduled compress ratio `ratio`."""
    p = f"blk.{layer}."
    csa = ratio == 4
    return AttnWeights(w.weight(p + "attn_q_a.weight"), w.vector(p + "attn_q_a_norm.weight"),
                       w.weight(p + "attn_q_b.weight"), w.weight(p + "attn_kv.weight"),
                       w.vector(p + "attn_kv_a_norm.weight"), w.vector(p + "attn_sinks.weight"),
                       w.weight(p + "attn_output_a.weight"), w.weight(p + "attn_output_b.weight"),
                       compressor_weights(w, p + "attn_compressor") if ratio else None,
                       compressor_weights(w, p + "indexer_compressor") if csa else None,
                       w.weight(p + "indexer.attn_q_b.weight") if csa else None,
                       w.weight(p + "indexer.proj.weight") if csa else None)


def ffn_weights(w: DeviceWeights, cfg: ModelConfig, layer: int) -> FfnWeights:
    """Layer `layer`'s FFN weights (the hash table on hash layers, the selection bias on the others)."""
    p, hashed = f"blk.{layer}.", cfg.is_hash_layer(layer)
    return FfnWeights(w.weight(p + "ffn_gate_inp.weight"), None if hashed else w.vector(p + "exp_probs_b.bias"),
                      w.table(p + "ffn_gate_tid2eid.weight") if hashed else None,
                      (w.weight(p + "ffn_gate_exps.weight"), w.weight(p + "ffn_up_exps.weight"),
                       w.weight(p + "ffn_down_exps.weight")),
                      (w.weight(p + "ffn_gate_shexp.weight"), w.weight(p + "ffn_up_shexp.weight"),
                       w.weight(p + "ffn_down_shexp.weight")))


def layer_weights(w: DeviceWeights, cfg: ModelConfig, layer: int, ratio: int) -> LayerWeights:
    """Every weight layer `layer` runs with at the scheduled compress ratio `ratio`."""
    p = f"blk.{layer}."
    return LayerWeights(hc_weights(w, p + "hc_attn_"), w.vector(p + "attn_norm.weight"), attn_weights(w, layer, ratio),
                        hc_weights(w, p + "hc_ffn_"), w.vector(p + "ffn_norm.weight"), ffn_weights(w, cfg, layer))
