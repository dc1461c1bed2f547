"""Synthetic `deepseek4` GGUFs: real key names and value types, real tensor names, tiny dimensions.

Presets are chosen so that every V4 feature fires in a ~300-token prompt (window 8, CSA rows every
4 tokens with an indexer top-k of 4 so the selection is a strict subset, HCA rows at t = 127 and
255, hash-routed first layers, a SwiGLU clamp that actually clips, YaRN on compressed layers) while
staying inside what other deepseek4 loaders accept (ratios 0/4/128, hc 4, 20 Sinkhorn iterations,
head_dim - rope_dim a multiple of 64, indexer head dim a multiple of 64 and != head_dim).

Quant layouts: `f32` (everything F32), `real-mix` (the real release's per-class types), `mxfp4`
(routed experts MXFP4, the rest F32), `lcp-<FTYPE>` (each tensor in the type llama.cpp's quantizer at that
file type writes from the f32 file, `parity.gguf.lcp_layouts`). Types gguf-py quantizes (F16, BF16, Q4_0,
Q5_0, Q5_1, Q8_0, MXFP4) are quantized from the float weights; the k-quants and IQ4_XS/IQ4_NL hold random
valid blocks (`parity.gguf.quant_blocks`). Same preset, quant and seed give a byte-identical file.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import quants
from gguf.constants import GGMLQuantizationType as Q

from parity.gguf import lcp_layouts
from parity.gguf.config import ARCH, ModelConfig
from parity.gguf.container import VT, TensorData, Value, write_gguf
from parity.gguf.inventory import REAL_RELEASE_TYPES, TensorSpec, expected_tensors
from parity.gguf.quant_blocks import RANDOM_BLOCK_TYPES, random_blocks
from parity.gguf.vocab import CHAT_TEMPLATE, synthetic_vocab

LCP_PREFIX = "lcp-"
KEY_PREFIX = ARCH + "."   # every model key but the general.* and tokenizer.* ones
QUANTS = ("f32", "real-mix", "mxfp4", *(LCP_PREFIX + f for f in lcp_layouts.FTYPES))


@dataclass(frozen=True)
class Preset:
    dim: int
    compress_ratios: tuple[int, ...]
    n_heads: int
    head_dim: int
    rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    window_size: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    n_routed_experts: int
    n_activated_experts: int
    moe_inter_dim: int
    n_hash_layers: int
    swiglu_limit: float


PRESETS = {
    "tiny": Preset(dim=256, compress_ratios=(0, 0, 4, 128, 4, 128), n_heads=4, head_dim=96, rope_head_dim=32,
                   q_lora_rank=64, o_groups=2, o_lora_rank=32, window_size=8, index_n_heads=8,
                   index_head_dim=64, index_topk=4, n_routed_experts=8, n_activated_experts=3,
                   moe_inter_dim=256, n_hash_layers=3, swiglu_limit=1.5),
    "small": Preset(dim=512, compress_ratios=(0, 0, 4, 128, 4, 128, 4, 128), n_heads=8, head_dim=192,
                    rope_head_dim=64, q_lora_rank=128, o_groups=4, o_lora_rank=64, window_size=16,
                    index_n_heads=16, index_head_dim=128, index_topk=8, n_routed_experts=16,
                    n_activated_experts=4, moe_inter_dim=512, n_hash_layers=3, swiglu_limit=2.0),
}

# Fixed V4 constants the presets share with the real model.
# epsilons as the F32 the file stores, so reading the file back gives exactly the preset's config
HC_MULT, SINKHORN_ITERS, HC_EPS, NORM_EPS = 4, 20, float(np.float32(1e-6)), float(np.float32(1e-6))
ROPE_THETA, COMPRESS_ROPE_THETA = 10000.0, 160000.0
YARN_FACTOR, YARN_ORIG_CTX, YARN_BETA_FAST, YARN_BETA_SLOW = 16.0, 65536, 32.0, 1.0
ROUTE_SCALE, CONTEXT_LENGTH = 1.5, 1048576


def preset_config(name: str, vocab_size: int) -> ModelConfig:
    """The `ModelConfig` a preset describes (what reading the written file back must give)."""
    p = PRESETS[name]
    L = len(p.compress_ratios)
    return ModelConfig(
        dim=p.dim, n_layers=L, vocab_size=vocab_size, n_heads=p.n_heads, head_dim=p.head_dim,
        rope_head_dim=p.rope_head_dim, q_lora_rank=p.q_lora_rank, o_groups=p.o_groups,
        o_lora_rank=p.o_lora_rank, window_size=p.window_size, compress_ratios=p.compress_ratios,
        rope_theta=ROPE_THETA, compress_rope_theta=COMPRESS_ROPE_THETA, yarn=True, rope_factor=YARN_FACTOR,
        original_seq_len=YARN_ORIG_CTX, beta_fast=YARN_BETA_FAST, beta_slow=YARN_BETA_SLOW,
        index_n_heads=p.index_n_heads, index_head_dim=p.index_head_dim, index_topk=p.index_topk,
        hc_mult=HC_MULT, hc_sinkhorn_iters=SINKHORN_ITERS, hc_eps=HC_EPS, norm_eps=NORM_EPS,
        n_routed_experts=p.n_routed_experts, n_activated_experts=p.n_activated_experts, n_shared_experts=1,
        moe_inter_dim=p.moe_inter_dim, route_scale=ROUTE_SCALE, expert_weights_norm=True,
        score_func="sqrtsoftplus", n_hash_layers=p.n_hash_layers, swiglu_limit=(p.swiglu_limit,) * L,
        swiglu_limit_shexp=(p.swiglu_limit,) * L, context_length=CONTEXT_LENGTH, bos_token_id=0, eos_token_id=1,
    )


def metadata(cfg: ModelConfig, name: str) -> dict[str, Value]:
    """All deepseek4 keys with the GGUF value types the real converters write (spec §3)."""
    return {**_general_keys(cfg, name), **_attention_keys(cfg), **_ffn_keys(cfg), **_tokenizer_keys()}


def _u32(v: float) -> Value:
    """A U32 metadata value."""
    return Value(VT.U32, int(v))


def _f32(v: float) -> Value:
    """An F32 metadata value."""
    return Value(VT.F32, float(v))


def _general_keys(cfg: ModelConfig, name: str) -> dict[str, Value]:
    """The architecture, name and the model's dimensions."""
    return {
        "general.architecture": Value(VT.STRING, "deepseek4"),
        "general.name": Value(VT.STRING, f"v4parity-synth-{name}"),
        "general.quantization_version": _u32(2),
        KEY_PREFIX + "block_count": _u32(cfg.n_layers),
        KEY_PREFIX + "context_length": _u32(cfg.context_length),
        KEY_PREFIX + "embedding_length": _u32(cfg.dim),
        KEY_PREFIX + "embedding_length_out": _u32(cfg.hc_mult * cfg.dim),
        KEY_PREFIX + "vocab_size": _u32(cfg.vocab_size),
    }


def _attention_keys(cfg: ModelConfig) -> dict[str, Value]:
    """Attention, compression, indexer and RoPE keys."""
    return {
        KEY_PREFIX + "attention.head_count": _u32(cfg.n_heads),
        KEY_PREFIX + "attention.head_count_kv": _u32(1),
        KEY_PREFIX + "attention.key_length": _u32(cfg.head_dim),
        KEY_PREFIX + "attention.value_length": _u32(cfg.head_dim),
        KEY_PREFIX + "attention.layer_norm_rms_epsilon": _f32(cfg.norm_eps),
        KEY_PREFIX + "attention.q_lora_rank": _u32(cfg.q_lora_rank),
        KEY_PREFIX + "attention.sliding_window": _u32(cfg.window_size),
        KEY_PREFIX + "attention.output_group_count": _u32(cfg.o_groups),
        KEY_PREFIX + "attention.output_lora_rank": _u32(cfg.o_lora_rank),
        # INT32 array with the trailing MTP slot, exactly as llama.cpp's converter writes it
        KEY_PREFIX + "attention.compress_ratios": Value(VT.ARRAY, [*cfg.compress_ratios, 0], VT.I32),
        KEY_PREFIX + "attention.compress_rope_freq_base": _f32(cfg.compress_rope_theta),
        KEY_PREFIX + "attention.indexer.head_count": _u32(cfg.index_n_heads),
        KEY_PREFIX + "attention.indexer.key_length": _u32(cfg.index_head_dim),
        KEY_PREFIX + "attention.indexer.top_k": _u32(cfg.index_topk),
        KEY_PREFIX + "rope.dimension_count": _u32(cfg.rope_head_dim),
        KEY_PREFIX + "rope.freq_base": _f32(cfg.rope_theta),
        KEY_PREFIX + "rope.scaling.type": Value(VT.STRING, "yarn"),
        KEY_PREFIX + "rope.scaling.factor": _f32(cfg.rope_factor),
        KEY_PREFIX + "rope.scaling.original_context_length": _u32(cfg.original_seq_len),
        KEY_PREFIX + "rope.scaling.yarn_beta_fast": _f32(cfg.beta_fast),
        KEY_PREFIX + "rope.scaling.yarn_beta_slow": _f32(cfg.beta_slow),
    }


def _ffn_keys(cfg: ModelConfig) -> dict[str, Value]:
    """Mixture-of-experts, SwiGLU clamp and hyper-connection keys."""
    return {
        KEY_PREFIX + "expert_count": _u32(cfg.n_routed_experts),
        KEY_PREFIX + "expert_used_count": _u32(cfg.n_activated_experts),
        KEY_PREFIX + "expert_feed_forward_length": _u32(cfg.moe_inter_dim),
        KEY_PREFIX + "expert_shared_count": _u32(cfg.n_shared_experts),
        KEY_PREFIX + "expert_weights_scale": _f32(cfg.route_scale),
        KEY_PREFIX + "expert_weights_norm": Value(VT.BOOL, True),
        KEY_PREFIX + "expert_gating_func": _u32(4),
        KEY_PREFIX + "hash_layer_count": _u32(cfg.n_hash_layers),
        KEY_PREFIX + "swiglu_clamp_exp": Value(VT.ARRAY, list(cfg.swiglu_limit), VT.F32),
        KEY_PREFIX + "swiglu_clamp_shexp": Value(VT.ARRAY, list(cfg.swiglu_limit_shexp), VT.F32),
        KEY_PREFIX + "hyper_connection.count": _u32(cfg.hc_mult),
        KEY_PREFIX + "hyper_connection.sinkhorn_iterations": _u32(cfg.hc_sinkhorn_iters),
        KEY_PREFIX + "hyper_connection.epsilon": _f32(cfg.hc_eps),
    }


def _tokenizer_keys() -> dict[str, Value]:
    """The synthetic BPE vocabulary and chat template."""
    vocab = synthetic_vocab()
    return {
        "tokenizer.ggml.model": Value(VT.STRING, "gpt2"),
        "tokenizer.ggml.pre": Value(VT.STRING, "joyai-llm"),
        "tokenizer.ggml.tokens": Value(VT.ARRAY, vocab.tokens, VT.STRING),
        "tokenizer.ggml.token_type": Value(VT.ARRAY, vocab.token_types, VT.I32),
        "tokenizer.ggml.merges": Value(VT.ARRAY, vocab.merges, VT.STRING),
        "tokenizer.ggml.bos_token_id": _u32(vocab.bos_id),
        "tokenizer.ggml.eos_token_id": _u32(vocab.eos_id),
        "tokenizer.ggml.add_bos_token": Value(VT.BOOL, True),
        "tokenizer.ggml.add_eos_token": Value(VT.BOOL, False),
        "tokenizer.chat_template": Value(VT.STRING, CHAT_TEMPLATE),
    }


def init_weight(spec: TensorSpec, cfg: ModelConfig, rng: np.random.Generator) -> tuple[np.ndarray, float]:
    """Random float weights for one tensor and their intended std.

    Scales keep every layer's carrier finite and non-degenerate: linear maps ~N(0, 1/in) so
    activations keep unit RMS, HC mixing functions small enough that sigmoids/softmaxes stay
    unsaturated, norms near 1, a mild selection bias.
    """
    name, shape = spec.name, spec.shape
    leaf = name.split(".")[-2] if name.count(".") >= 1 else name
    if name == "token_embd.weight":
        std = 1.0
    elif leaf.endswith("_norm") or leaf == "output_norm":
        return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32), 0.1
    elif leaf in ("hc_attn_scale", "hc_ffn_scale", "output_hc_scale"):
        return rng.uniform(0.5, 1.5, shape).astype(np.float32), 0.3
    elif leaf in ("hc_attn_base", "hc_ffn_base", "output_hc_base"):
        std = 0.5
    elif leaf in ("hc_attn_fn", "hc_ffn_fn", "output_hc_fn"):
        std = 1.0 / np.sqrt(shape[-1])
    elif leaf == "attn_sinks":
        std = 1.0
    elif leaf.endswith("_ape"):
        std = 0.5
    elif leaf == "exp_probs_b":
        std = 0.2
    else:
        std = 1.0 / np.sqrt(shape[-1])  # a linear map (out, in) or expert stack (E, out, in)
    return (std * rng.standard_normal(shape)).astype(np.float32), float(std)


def tid2eid(cfg: ModelConfig, rng: np.random.Generator) -> np.ndarray:
    """Hash routing table (V, K): K distinct expert ids per token."""
    E, K = cfg.n_routed_experts, cfg.n_activated_experts
    return np.stack([rng.permutation(E)[:K] for _ in range(cfg.vocab_size)]).astype(np.int32)


def tensor_type(spec: TensorSpec, quant: str, n_layers: int) -> Q:
    """The ggml type layout `quant` stores tensor `spec` in (`n_layers`: the model's, for llama.cpp's per-layer
    choices)."""
    if spec.klass == "i32":
        return Q.I32
    if quant.startswith(LCP_PREFIX):   # llama.cpp keeps an unquantized tensor's source type: F32 here
        return lcp_layouts.tensor_type(spec.name, spec.ne, quant[len(LCP_PREFIX):], n_layers) or Q.F32
    if quant == "real-mix":
        return REAL_RELEASE_TYPES[spec.klass]
    if quant == "mxfp4" and spec.klass in ("expert_gate_up", "expert_down"):
        return Q.MXFP4
    return Q.F32


def encode(arr: np.ndarray, qtype: Q, std: float, rng: np.random.Generator) -> bytes:
    """Tensor bytes in `qtype`: quantized from `arr` where gguf-py can, random valid blocks otherwise."""
    if qtype == Q.F32:
        return arr.astype("<f4").tobytes()
    if qtype == Q.F16:
        return arr.astype("<f2").tobytes()
    if qtype == Q.I32:
        return arr.astype("<i4").tobytes()
    if qtype in RANDOM_BLOCK_TYPES:
        return random_blocks(qtype, arr.shape, std, rng).tobytes()
    return quants.quantize(arr.reshape(-1, arr.shape[-1]), qtype).tobytes()


def synthesize(path: str | Path, preset: str = "tiny", quant: str = "f32", seed: int = 0) -> Path:
    """Write a synthetic deepseek4 GGUF; returns its path."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    if quant not in QUANTS:
        raise ValueError(f"unknown quant layout {quant!r}; choose from {', '.join(QUANTS)}")
    vocab = synthetic_vocab()
    cfg = preset_config(preset, len(vocab.tokens))
    tensors = []
    for spec in expected_tensors(cfg):
        if not spec.required:
            continue
        # per-tensor stream: a tensor's values do not depend on the others or on the quant layout
        rng = np.random.default_rng([seed, zlib.crc32(spec.name.encode())])
        qtype = tensor_type(spec, quant, cfg.n_layers)
        if spec.klass == "i32":
            arr, std = tid2eid(cfg, rng), 0.0
        else:
            arr, std = init_weight(spec, cfg, rng)
        tensors.append(TensorData(spec.name, spec.ne, int(qtype), encode(arr, qtype, std, rng)))
    write_gguf(path, metadata(cfg, preset), tensors)
    return Path(path)
