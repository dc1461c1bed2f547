"""Build transformers' `DeepseekV4ForCausalLM` from a deepseek4 GGUF: its config from the GGUF metadata, its
weights dequantized from the GGUF tensors (`names.name_map`), refusing what HF does not implement."""

from __future__ import annotations

import numpy as np

from hf_engine.names import name_map
from parity.contract.errors import ParityError
from parity.gguf.config import ModelConfig
from parity.gguf.weights import Weights

RATIOS = (0, 4, 128)   # HF layer types: sliding, compressed_sparse (CSA), heavily_compressed (HCA)


def check_model(cfg: ModelConfig) -> None:
    """What `DeepseekV4Config` cannot express is refused, naming the GGUF key."""
    bad = sorted({r for r in cfg.compress_ratios if r not in RATIOS})
    if bad:
        raise ParityError(f"hf: compress ratios {bad} in deepseek4.attention.compress_ratios; transformers' "
                          f"DeepseekV4 has layer types for {', '.join(map(str, RATIOS))} only")
    limits = {*cfg.swiglu_limit, *cfg.swiglu_limit_shexp}
    if len(limits) != 1:
        raise ParityError(f"hf: transformers applies one swiglu_limit to every layer's routed and shared experts; "
                          f"deepseek4.swiglu_clamp_exp / swiglu_clamp_shexp hold {sorted(limits)}")
    if cfg.n_shared_experts != 1:
        raise ParityError(f"hf: {cfg.n_shared_experts} shared experts; transformers' DeepseekV4 has one")


def hf_config(cfg: ModelConfig):
    """The `DeepseekV4Config` of a GGUF's ModelConfig (every field set from the metadata)."""
    from transformers import DeepseekV4Config

    rope = ({"rope_type": "yarn", "factor": cfg.rope_factor, "original_max_position_embeddings": cfg.original_seq_len,
             "beta_fast": cfg.beta_fast, "beta_slow": cfg.beta_slow} if cfg.yarn else {"rope_type": "default"})
    return DeepseekV4Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, moe_intermediate_size=cfg.moe_inter_dim,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=1,
        head_dim=cfg.head_dim, q_lora_rank=cfg.q_lora_rank, num_experts_per_tok=cfg.n_activated_experts,
        n_routed_experts=cfg.n_routed_experts, n_shared_experts=cfg.n_shared_experts, scoring_func="sqrtsoftplus",
        norm_topk_prob=True, routed_scaling_factor=cfg.route_scale, max_position_embeddings=cfg.context_length,
        rope_theta=cfg.rope_theta, compress_rope_theta=cfg.compress_rope_theta, rope_parameters=rope,
        compress_ratios=list(cfg.compress_ratios), num_hash_layers=cfg.n_hash_layers,
        qk_rope_head_dim=cfg.rope_head_dim, hc_mult=cfg.hc_mult, hc_sinkhorn_iters=cfg.hc_sinkhorn_iters,
        hc_eps=cfg.hc_eps, swiglu_limit=cfg.swiglu_limit[0], sliding_window=cfg.window_size, o_groups=cfg.o_groups,
        o_lora_rank=cfg.o_lora_rank, index_n_heads=cfg.index_n_heads, index_head_dim=cfg.index_head_dim,
        index_topk=cfg.index_topk, rms_norm_eps=cfg.norm_eps, bos_token_id=cfg.bos_token_id,
        eos_token_id=cfg.eos_token_id, tie_word_embeddings=False, num_nextn_predict_layers=0,
    )


def state_dict(weights: Weights, cfg: ModelConfig, dtype) -> dict:
    """HF name -> torch tensor from the GGUF (dequantized; gate and up stacks concatenated)."""
    import torch

    out = {}
    for hf, gguf in name_map(cfg).items():
        arr = (np.concatenate([weights.tensor(g) for g in gguf], axis=1) if isinstance(gguf, tuple)
               else weights.tensor(gguf))
        t = torch.from_numpy(np.array(arr))   # a writable copy of the mapped bytes
        out[hf] = t.long() if arr.dtype.kind == "i" else t.to(dtype)
    return out


def build(weights: Weights, dtype):
    """DeepseekV4ForCausalLM with the GGUF's weights (strict: every HF parameter and buffer set, shapes equal)."""
    import torch
    from transformers import DeepseekV4ForCausalLM

    cfg = weights.config
    check_model(cfg)
    config = hf_config(cfg)
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"   # the modelling file's own expert loop (grouped_mm has no float64)
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(config)
    sd = state_dict(weights, cfg, dtype)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(sd))
    extra = sorted(set(sd) - set(expected))
    if missing or extra:
        raise ParityError(f"hf: GGUF -> HF name map does not cover the model: missing {missing[:5]}, "
                          f"unknown {extra[:5]}")
    for k, v in expected.items():
        if tuple(v.shape) != tuple(sd[k].shape):
            raise ParityError(f"hf: {k} has shape {tuple(v.shape)}, the GGUF gives {tuple(sd[k].shape)}")
    model.load_state_dict(sd, strict=True, assign=True)
    rotary = type(model.model.rotary_emb)
    for mod in list(model.modules()):   # RoPE tables are non-persistent buffers: rebuilt from the config
        if isinstance(getattr(mod, "rotary_emb", None), rotary):
            mod.rotary_emb = rotary(config)
    left = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if left:
        raise ParityError(f"hf: {left[0]} was not set from the GGUF")
    return model.eval(), config
