"""The GGUF -> transformers `DeepseekV4ForCausalLM` parameter map (docs/peers.md prints it in full).

Every entry is (HF state-dict name, how to build it from the GGUF tensors); shapes are checked on load.
The routed experts' gate and up stacks are concatenated along the output axis into HF's `gate_up_proj`.
"""

from __future__ import annotations

from parity.gguf.config import ModelConfig

GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "model.hc_head.hc_fn": "output_hc_fn.weight",
    "model.hc_head.hc_base": "output_hc_base.weight",
    "model.hc_head.hc_scale": "output_hc_scale.weight",
    "lm_head.weight": "output.weight",
}
LAYER = {
    "self_attn.sinks": "attn_sinks.weight",
    "self_attn.q_a_proj.weight": "attn_q_a.weight",
    "self_attn.q_a_norm.weight": "attn_q_a_norm.weight",
    "self_attn.q_b_proj.weight": "attn_q_b.weight",
    "self_attn.kv_proj.weight": "attn_kv.weight",
    "self_attn.kv_norm.weight": "attn_kv_a_norm.weight",
    "self_attn.o_a_proj.weight": "attn_output_a.weight",
    "self_attn.o_b_proj.weight": "attn_output_b.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.experts.down_proj": "ffn_down_exps.weight",
    "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "attn_hc.fn": "hc_attn_fn.weight",
    "attn_hc.base": "hc_attn_base.weight",
    "attn_hc.scale": "hc_attn_scale.weight",
    "ffn_hc.fn": "hc_ffn_fn.weight",
    "ffn_hc.base": "hc_ffn_base.weight",
    "ffn_hc.scale": "hc_ffn_scale.weight",
}
COMPRESSOR = {  # ratio > 0 layers
    "self_attn.compressor.position_bias": "attn_compressor_ape.weight",
    "self_attn.compressor.kv_proj.weight": "attn_compressor_kv.weight",
    "self_attn.compressor.gate_proj.weight": "attn_compressor_gate.weight",
    "self_attn.compressor.kv_norm.weight": "attn_compressor_norm.weight",
}
INDEXER = {  # ratio-4 (CSA) layers
    "self_attn.compressor.indexer.position_bias": "indexer_compressor_ape.weight",
    "self_attn.compressor.indexer.kv_proj.weight": "indexer_compressor_kv.weight",
    "self_attn.compressor.indexer.gate_proj.weight": "indexer_compressor_gate.weight",
    "self_attn.compressor.indexer.kv_norm.weight": "indexer_compressor_norm.weight",
    "self_attn.compressor.indexer.q_b_proj.weight": "indexer.attn_q_b.weight",
    "self_attn.compressor.indexer.scorer.weights_proj.weight": "indexer.proj.weight",
}
HASH = {"mlp.gate.tid2eid": "ffn_gate_tid2eid.weight"}
TOPK = {"mlp.gate.e_score_correction_bias": "exp_probs_b.bias"}
GATE_UP = ("mlp.experts.gate_up_proj", ("ffn_gate_exps.weight", "ffn_up_exps.weight"))


def name_map(cfg: ModelConfig) -> dict[str, str | tuple[str, ...]]:
    """HF name -> GGUF tensor name (a tuple: concatenated along the output axis, in that order)."""
    out: dict[str, str | tuple[str, ...]] = dict(GLOBAL)
    for l in range(cfg.n_layers):
        parts = {**LAYER, **(COMPRESSOR if cfg.ratio(l) else {}), **(INDEXER if cfg.has_indexer(l) else {}),
                 **(HASH if cfg.is_hash_layer(l) else TOPK), GATE_UP[0]: GATE_UP[1]}
        for hf, gguf in parts.items():
            out[f"model.layers.{l}.{hf}"] = (tuple(f"blk.{l}.{g}" for g in gguf) if isinstance(gguf, tuple)
                                             else f"blk.{l}.{gguf}")
    return out
