"""What llama.cpp's deepseek4 loader and CPU backend accept, checked before anything runs (clear messages)."""

from __future__ import annotations

from gguf.constants import GGMLQuantizationType as Q

from parity.contract.errors import ParityError
from parity.gguf.config import ModelConfig
from parity.gguf.weights import Weights

RATIOS = (0, 4, 128)
HC_MULT = 4
INDEXER_BLOCK = 64   # llama.cpp rotates indexer rows with a Hadamard transform of this granularity
# ggml types the CPU backend multiplies (llama.cpp's converter emits MXFP4 for the routed experts)
EXPERT_TYPES = frozenset({
    Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K,
    Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S, Q.IQ1_S, Q.IQ1_M, Q.IQ4_NL, Q.IQ4_XS, Q.MXFP4,
})
EXPERT_TENSORS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


def check_model(cfg: ModelConfig, weights: Weights) -> None:
    """Refuse a model llama.cpp's deepseek4 graph cannot run, naming the key or tensor."""
    check_config(cfg)
    check_expert_types(weights)


def check_config(cfg: ModelConfig) -> None:
    """The deepseek4 metadata llama.cpp's loader accepts."""
    bad = sorted({r for r in cfg.compress_ratios if r not in RATIOS})
    if bad:
        raise ParityError(f"llamacpp: compress ratios {bad} in deepseek4.attention.compress_ratios; llama.cpp "
                          f"supports exactly {', '.join(map(str, RATIOS))}")
    if cfg.hc_mult != HC_MULT:
        raise ParityError(f"llamacpp: deepseek4.hyper_connection.count = {cfg.hc_mult}; llama.cpp supports {HC_MULT}")
    if cfg.index_head_dim % INDEXER_BLOCK:
        raise ParityError(f"llamacpp: deepseek4.attention.indexer.key_length = {cfg.index_head_dim}; llama.cpp needs "
                          f"a multiple of {INDEXER_BLOCK} (Hadamard rotation of the indexer rows)")


def check_expert_types(weights: Weights) -> None:
    """Routed experts in a type the CPU backend multiplies."""
    for l in range(weights.config.n_layers):
        for t in EXPERT_TENSORS:
            name = f"blk.{l}.{t}.weight"
            qtype = Q(weights.info(name).ggml_type)
            if qtype not in EXPERT_TYPES:
                raise ParityError(f"llamacpp: {name} is {qtype.name}; llama.cpp's CPU backend multiplies routed "
                                  f"experts in {', '.join(sorted(q.name for q in EXPERT_TYPES))}")
