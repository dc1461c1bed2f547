"""Synthetic drafter GGUFs for a synthetic trunk, in each published layout (spec v4-mtp-dspark §5).

Every canonical tensor (`parity.gguf.drafter`) is drawn from its own stream, seeded by (seed, crc32 of its canonical
name), and then written under the layout's file name, so one seed gives the same weights in every layout (bit for
bit: llama.cpp's `eh_proj` is [e_proj | h_proj] of the same arrays; Q8_0 blocks never straddle the cut).
Quant layouts: `f32` (every tensor F32) and `q8_0` (block and projection matrices Q8_0 as in the released
drafters; norms, HC tensors, Markov and confidence heads F32).

Tiny DSpark values: S = 3 stages, B = 5, taps = the trunk's last 3 layers, r = 16, noise id = V - 1.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Mapping
from pathlib import Path

import numpy as np
from gguf.constants import GGMLQuantizationType as Q

from parity.gguf.config import ModelConfig
from parity.gguf.container import VT, TensorData, Value, write_gguf
from parity.gguf.drafter import LAYOUTS, DrafterConfig, canonical_specs, extend_config, slots, trunk_copy_specs
from parity.gguf.inventory import TensorSpec
from parity.gguf.synth import encode, init_weight
from parity.gguf.weights import Weights

DRAFT_QUANTS = ("f32", "q8_0")
Q8_CLASSES = frozenset({"attention", "shared", "draft_proj"})
TINY_STAGES, TINY_BLOCK, TINY_TAPS, TINY_RANK = 3, 5, 3, 16


def tiny_drafter_config(kind: str, layout: str, trunk: ModelConfig) -> DrafterConfig:
    """The drafter `synthesize_drafter` writes for `trunk` (MTP: one block; DSpark: the tiny values above)."""
    if LAYOUTS.get(layout) != kind:
        raise ValueError(f"layout {layout!r} is not a {kind!r} layout; choose from "
                         f"{', '.join(k for k, v in LAYOUTS.items() if v == kind) or 'mtp, dspark'}")
    L = trunk.n_layers
    if kind == "mtp":
        return DrafterConfig("mtp", layout, 1, L)
    taps = tuple(range(L - TINY_TAPS, L))
    return DrafterConfig("dspark", layout, TINY_STAGES, L, TINY_BLOCK, trunk.vocab_size - 1, taps, TINY_RANK)


def init_drafter_weight(spec: TensorSpec, cfg: ModelConfig, rng: np.random.Generator) -> tuple[np.ndarray, float]:
    """Random weights for one canonical tensor and their std (block tensors as the trunk's, `synth.init_weight`).

    Norms ~1 + 0.1 N; hc_head as the trunk's output head; projections N(0, 1/in) so activations keep unit RMS;
    Markov W1 ~ N(0, 1) and W2 ~ N(0, 0.25/r), so a bias W2 W1[t] has std ~0.5 per vocab entry; confidence
    weights N(0, 1/(D+r)), a raw logit of order 1.
    """
    leaf = spec.name.split(".")[-2]
    shape = spec.shape
    if spec.name.startswith("blk."):
        return init_weight(spec, cfg, rng)
    if leaf.endswith("norm"):
        return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32), 0.1
    if leaf.startswith("hc_head_"):
        return init_weight(replace_name(spec, f"output_hc_{leaf[len('hc_head_'):]}.weight"), cfg, rng)
    std = {"markov_w1": 1.0, "markov_w2": 0.5 / np.sqrt(shape[-1])}.get(leaf, 1.0 / np.sqrt(shape[-1]))
    return (std * rng.standard_normal(shape)).astype(np.float32), float(std)


def replace_name(spec: TensorSpec, name: str) -> TensorSpec:
    return TensorSpec(name, spec.shape, spec.types, spec.klass, spec.required)


def metadata(dc: DrafterConfig, trunk: Weights, model_cfg: ModelConfig) -> dict[str, Value]:
    """The layout's keys with the value types the real converters write (spec §5)."""
    u32 = lambda v: Value(VT.U32, int(v))  # noqa: E731
    cfg = trunk.config
    kv = {"general.architecture": Value(VT.STRING, {"ds4-dspark": "deepseek4-dspark", "dflash": "dflash"}.get(
        dc.layout, "deepseek4")), "general.name": Value(VT.STRING, f"v4parity-synth-draft-{dc.layout}")}
    if dc.layout == "llamacpp-mtp":  # the trunk's keys, one more (ratio-0) layer, one NextN layer
        p = "deepseek4."
        kv = dict(trunk.kv) | kv | {
            p + "block_count": u32(model_cfg.n_layers),
            p + "attention.compress_ratios": Value(VT.ARRAY, list(model_cfg.compress_ratios), VT.I32),
            p + "swiglu_clamp_exp": Value(VT.ARRAY, list(model_cfg.swiglu_limit), VT.F32),
            p + "swiglu_clamp_shexp": Value(VT.ARRAY, list(model_cfg.swiglu_limit_shexp), VT.F32),
            p + "nextn_predict_layers": u32(1)}
    elif dc.layout == "ds4-dspark":
        kv |= {"dspark.block_size": u32(dc.block_size), "dspark.noise_token_id": u32(dc.noise_token_id),
               "dspark.target_layer_ids": Value(VT.ARRAY, list(dc.target_layer_ids), VT.I32),
               "dspark.markov_rank": u32(dc.markov_rank), "dspark.stage_count": u32(dc.n_blocks),
               "dspark.n_layers": u32(cfg.n_layers), "dspark.expert_count": u32(cfg.n_routed_experts),
               "dspark.expert_used_count": u32(cfg.n_activated_experts)}
    elif dc.layout == "dflash":
        kv |= {"dflash.block_size": u32(dc.block_size), "tokenizer.ggml.mask_token_id": u32(dc.noise_token_id),
               "dflash.target_layers": Value(VT.ARRAY, [i + 1 for i in dc.target_layer_ids], VT.I32),
               "dflash.block_count": u32(dc.n_blocks), "dflash.embedding_length": u32(cfg.dim),
               "dflash.expert_count": u32(cfg.n_routed_experts),
               "dflash.expert_used_count": u32(cfg.n_activated_experts)}
    return kv


def random_drafter_weights(dc: DrafterConfig, model_cfg: ModelConfig, seed: int) -> dict[str, tuple[np.ndarray, float]]:
    """Every canonical tensor of the drafter `dc` (blocks: layers of `model_cfg`) and its std, each drawn from its
    own stream seeded by (seed, crc32 of its name)."""
    out = {}
    for spec in canonical_specs(dc, model_cfg):
        rng = np.random.default_rng([seed, zlib.crc32(spec.name.encode())])
        out[spec.name] = init_drafter_weight(spec, model_cfg, rng)
    return out


def check_weights(weights: Mapping[str, np.ndarray], specs: list[TensorSpec]) -> None:
    """`weights` must hold exactly the canonical tensors `specs`, each of its shape and finite (else an error
    naming the tensor)."""
    want = {s.name: s.shape for s in specs}
    if set(weights) != set(want):
        missing, extra = sorted(set(want) - set(weights)), sorted(set(weights) - set(want))
        raise ValueError(f"drafter weights: missing {missing or 'none'}, not canonical {extra or 'none'}")
    for name, shape in want.items():
        arr = np.asarray(weights[name])
        if arr.shape != shape or not np.isfinite(arr).all():
            raise ValueError(f"drafter weights: tensor {name!r} of shape {arr.shape}, expected {shape}, finite")


def synthesize_drafter(path: str | os.PathLike, trunk_path: str | os.PathLike, kind: str, layout: str,
                       seed: int = 0, quant: str = "f32", weights: Mapping[str, np.ndarray] | None = None) -> Path:
    """Write a tiny `kind` drafter ("mtp" | "dspark") for the trunk at `trunk_path` in `layout` (`LAYOUTS`);
    returns its path. Same seed and quant -> the same canonical tensors in every layout of the kind.
    `weights` (canonical name -> array, every canonical tensor, e.g. a fitted drafter's) replaces the random draws."""
    if quant not in DRAFT_QUANTS:
        raise ValueError(f"unknown drafter quant {quant!r}; choose from {', '.join(DRAFT_QUANTS)}")
    trunk = Weights(trunk_path)
    dc = tiny_drafter_config(kind, layout, trunk.config)
    model_cfg = extend_config(trunk.config, dc.n_blocks)
    where = slots(dc, model_cfg)
    specs = canonical_specs(dc, model_cfg)
    if weights is not None:
        check_weights(weights, specs)
        drawn = {k: (np.asarray(v, dtype=np.float32), float(np.std(v))) for k, v in weights.items()}
    else:
        drawn = random_drafter_weights(dc, model_cfg, seed)
    arrays: dict[str, tuple[np.ndarray, float, Q]] = {}
    for spec in specs:
        qtype = Q.Q8_0 if quant == "q8_0" and spec.klass in Q8_CLASSES else Q.F32
        arrays[spec.name] = (*drawn[spec.name], qtype)
    tensors, written = [], set()
    for name, slot in where.items():
        if slot.file_name in written:
            continue
        written.add(slot.file_name)
        arr, std, qtype = arrays[name]
        if slot.half is not None:  # eh_proj = [e_proj | h_proj] along the input axis, e first
            arr = np.concatenate([arrays["mtp.e_proj.weight"][0], arrays["mtp.h_proj.weight"][0]], axis=1)
        rng = np.random.default_rng([seed, zlib.crc32(slot.file_name.encode()), 1])  # only random-block types use it
        tensors.append(TensorData(slot.file_name, tuple(reversed(arr.shape)), int(qtype), encode(arr, qtype, std, rng)))
    for name, (_, trunk_name) in trunk_copy_specs(dc, model_cfg).items():
        if name == trunk_name:  # the llama.cpp MTP file copies token_embd, output and output_norm
            info = trunk.info(trunk_name)
            tensors.append(TensorData(name, info.ne, info.ggml_type, bytes(trunk.raw(trunk_name))))
    write_gguf(path, metadata(dc, trunk, model_cfg), tensors)
    return Path(path)
