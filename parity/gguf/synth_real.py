"""Real-dimension deepseek4 GGUFs for benchmarks: DeepSeek-V4-Flash layer shapes and release types.

Every layer has the true V4-Flash dimensions (hidden 4096, 64 heads x 512 with 64 rotary dims, q rank
1024, 8 output groups x 1024, 256 routed experts x 2048 with 6 active, window 128, indexer 64 x 128 with
top-k 512) and the DS4 2-bit release's tensor types (IQ2_XXS gate/up, Q2_K down, Q8_0 attention/shared,
F16 compressor/indexer/router/HC; `parity.gguf.inventory.REAL_RELEASE_TYPES`). Only the vocabulary is the
small synthetic one (290 tokens instead of 129 280), which keeps the embedding and output head tiny:
a layer costs the same as in the real model, the head does not.

Tensors are drawn exactly as `parity.gguf.synth` draws them (same per-tensor streams and scales), except
that routed-expert stacks are generated a few experts at a time into a memory-mapped scratch file, so
writing a 2 GB layer never holds more than ~0.2 GB of it in memory.
"""

from __future__ import annotations

import dataclasses
import zlib
from pathlib import Path

import numpy as np

from parity.gguf.config import ModelConfig
from parity.gguf.container import TensorData, tensor_nbytes, write_gguf
from parity.gguf.inventory import REAL_RELEASE_TYPES, TensorSpec, expected_tensors
from parity.gguf.quant_blocks import random_blocks
from parity.gguf.synth import encode, init_weight, metadata, preset_config, tid2eid
from parity.gguf.vocab import synthetic_vocab

V4_FLASH_LAYER = {
    "dim": 4096, "n_heads": 64, "head_dim": 512, "rope_head_dim": 64, "q_lora_rank": 1024, "o_groups": 8,
    "o_lora_rank": 1024, "window_size": 128, "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
    "n_routed_experts": 256, "n_activated_experts": 6, "moe_inter_dim": 2048,
}
SWIGLU_LIMIT = 10.0
# layouts the bench writes: one CSA layer, and a CSA + an HCA layer (the two compressed-attention kinds)
LAYOUTS = {"1layer": (4,), "2layer": (4, 128)}
EXPERTS_PER_PIECE = 16


def real_config(compress_ratios: tuple[int, ...], vocab_size: int) -> ModelConfig:
    """V4-Flash layer dimensions with the given per-layer ratios; no hash layers (a bulk V4 layer)."""
    L = len(compress_ratios)
    return dataclasses.replace(
        preset_config("tiny", vocab_size), **V4_FLASH_LAYER, n_layers=L, compress_ratios=tuple(compress_ratios),
        n_hash_layers=0, swiglu_limit=(SWIGLU_LIMIT,) * L, swiglu_limit_shexp=(SWIGLU_LIMIT,) * L)


def _expert_stack(spec: TensorSpec, cfg: ModelConfig, rng: np.random.Generator, scratch: Path) -> np.memmap:
    """Random valid blocks for an (E, out, in) expert tensor, written EXPERTS_PER_PIECE experts at a time
    into a scratch memmap."""
    qtype = REAL_RELEASE_TYPES[spec.klass]
    _, std = init_weight(dataclasses.replace(spec, shape=(1, spec.shape[-1])), cfg, rng)
    out = np.memmap(scratch, dtype=np.uint8, mode="w+", shape=(tensor_nbytes(spec.ne, qtype),))
    piece = out.size // spec.shape[0] * EXPERTS_PER_PIECE
    for i in range(spec.shape[0] // EXPERTS_PER_PIECE):
        out[i * piece : (i + 1) * piece] = random_blocks(qtype, (EXPERTS_PER_PIECE, *spec.shape[1:]), std, rng).ravel()
    return out


def write_real(path: str | Path, compress_ratios: tuple[int, ...], seed: int = 0) -> Path:
    """Write a real-dimension deepseek4 GGUF with one layer per entry of `compress_ratios`; returns its path."""
    path = Path(path)
    if any(r not in (4, 128) for r in compress_ratios):
        raise ValueError(f"compress ratios must be 4 (CSA) or 128 (HCA), got {compress_ratios}")
    vocab = synthetic_vocab()
    cfg = real_config(tuple(compress_ratios), len(vocab.tokens))
    if cfg.n_routed_experts % EXPERTS_PER_PIECE:
        raise ValueError(f"{cfg.n_routed_experts} experts are not a multiple of {EXPERTS_PER_PIECE}")
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch: list[Path] = []
    try:
        tensors = []
        for spec in expected_tensors(cfg):
            if not spec.required:
                continue
            rng = np.random.default_rng([seed, zlib.crc32(spec.name.encode())])
            qtype = REAL_RELEASE_TYPES[spec.klass]
            if spec.klass.startswith("expert_"):
                scratch.append(path.with_name(f"{path.name}.{len(scratch)}.scratch"))
                raw = memoryview(_expert_stack(spec, cfg, rng, scratch[-1]))
            elif spec.klass == "i32":
                raw = encode(tid2eid(cfg, rng), qtype, 0.0, rng)
            else:
                arr, std = init_weight(spec, cfg, rng)
                raw = encode(arr, qtype, std, rng)
            tensors.append(TensorData(spec.name, spec.ne, int(qtype), raw))
        write_gguf(path, metadata(cfg, "v4flash-real-dims"), tensors)
    finally:
        for p in scratch:
            p.unlink(missing_ok=True)
    return path
