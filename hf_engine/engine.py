"""`HFEngine`: transformers' `DeepseekV4ForCausalLM` (eager attention, CPU) behind the Engine protocol.

Each `forward_layer` calls that HF decoder layer directly on the given carrier, with the layer's own cache
(transformers' DynamicCache: sliding-window K=V, compressor buffers and rows), so prefill, chunks, decode and
teacher forcing are the model's own code paths. Sub-ops and diagnostics come from forward hooks on the layer's
modules; where HF computes a value inside a function rather than a module, it is recomputed from the hooked
tensors with HF's own function (pre gates of the hyper-connections from the hooked normed mix input, RoPE'd q/kv
with `apply_rotary_pos_emb` and the layer's cos/sin, the attention output before the inverse RoPE by re-applying
the rotation to the hooked de-roped output). The attention mask is built here for the positions of the chunk
(sliding window including the current token), so a layer never depends on another layer's cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from hf_engine.model import build
from parity.contract.engine import LayerDiag, LayerOutput, RunOptions, check_tokens, refuse_roundoff
from parity.contract.errors import ParityError
from parity.gguf.config import ModelConfig
from parity.gguf.weights import Weights

VERSION = "0.1.0"
DTYPES = ("float32", "float64")


def check_options(options: RunOptions) -> None:
    """Refuse what transformers' DeepseekV4 does not implement (no silent substitute)."""
    if options.dtype not in DTYPES:
        raise ParityError(f"hf: dtype {options.dtype!r}; the hf engine runs {', '.join(DTYPES)} on the CPU")
    if options.fp8_kv or options.fp4_indexer:
        raise ParityError("hf: transformers' DeepseekV4 does not implement the FP8 KV / FP4 indexer QAT round trips; "
                          "run with --no-fp8-kv --no-fp4-indexer")
    refuse_roundoff(options, "hf")
    if options.inject:
        raise ParityError(f"hf: the hf engine injects no faults (got {list(options.inject)})")
    if options.expert_override is not None:
        raise ParityError("hf: transformers' routers cannot replay another engine's expert choices")
    for name, exact in (("act_quant", "none"), ("kv_cache", "f32"), ("rope_angles", "exact")):
        if getattr(options, name) != exact:
            raise ParityError(f"hf: {name}={getattr(options, name)} is not a transformers code path")
    if options.engine_args:
        raise ParityError(f"hf: the hf engine takes no engine arguments (got {list(options.engine_args)})")
    if options.device != "cpu":
        raise ParityError(f"hf: the hf engine runs on the CPU (device {options.device!r})")


@dataclass
class HFState:
    cache: object
    next_pos: list[int] = field(default_factory=list)   # per layer


class HFEngine:
    name = "hf"
    layerwise_state = True   # capability LayerwiseState: one cache per layer in a state

    def __init__(self, model_path: str, options: RunOptions) -> None:
        check_options(options)
        import torch
        import transformers

        self.torch = torch
        self.options = options
        self.dtype = {"float32": torch.float32, "float64": torch.float64}[options.dtype]
        weights = Weights(model_path)
        self.config: ModelConfig = weights.config
        self.identity = weights.identity()
        self.model, self.hf_config = build(weights, self.dtype)
        self.version = f"transformers {transformers.__version__} DeepseekV4ForCausalLM ({VERSION})"

    # -- protocol -------------------------------------------------------------------------------
    def new_state(self) -> HFState:
        from transformers import DynamicCache

        return HFState(DynamicCache(config=self.hf_config), [0] * self.config.n_layers)

    def embed(self, tokens: np.ndarray) -> np.ndarray:
        tokens = self._tokens(tokens, "embed")
        with self.torch.no_grad():
            e = self.model.model.embed_tokens(self.torch.from_numpy(tokens))
        return self._np(e[:, None, :].expand(-1, self.config.hc_mult, -1))

    def forward_layer(self, state: HFState, layer: int, carrier: np.ndarray, tokens: np.ndarray,
                      start_pos: int, capture: bool = False) -> LayerOutput:
        torch, cfg = self.torch, self.config
        if not 0 <= layer < cfg.n_layers:
            raise ParityError(f"layer {layer} out of range [0, {cfg.n_layers})")
        tokens = self._tokens(tokens, f"layer {layer}")
        n = len(tokens)
        if np.shape(carrier) != (n, cfg.hc_mult, cfg.dim):
            raise ParityError(f"layer {layer}: carrier shape {np.shape(carrier)}, expected ({n}, {cfg.hc_mult}, "
                              f"{cfg.dim})")
        if start_pos != state.next_pos[layer]:
            raise ParityError(f"layer {layer}: chunk starts at position {start_pos} but the state expects "
                              f"{state.next_pos[layer]} (feed positions in order through one state)")
        x = torch.from_numpy(np.ascontiguousarray(carrier)).to(self.dtype)[None]
        pos = torch.arange(start_pos, start_pos + n)[None]
        rope = self.model.model.rotary_emb
        pe = {kind: rope(x[:, :, 0], position_ids=pos, layer_type=kind) for kind in ("main", "compress")}
        block = self.model.model.layers[layer]
        got: dict[str, object] = {}
        hooks = _hooks(block, got)
        try:
            with torch.no_grad():
                out = block(x, position_embeddings=pe, position_ids=pos, attention_mask=self._mask(start_pos, n),
                            input_ids=torch.from_numpy(tokens)[None], past_key_values=state.cache)
        finally:
            for h in hooks:
                h.remove()
        state.next_pos[layer] = start_pos + n
        return self._output(layer, out, got, pe, pos, state, capture)

    def head(self, carrier: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        x = self.torch.from_numpy(np.ascontiguousarray(carrier)).to(self.dtype)[None]
        with self.torch.no_grad():
            final = self.model.model.norm(self.model.model.hc_head(x))
            logits = self.model.lm_head(final)
        return self._np(final[0]), self._np(logits[0])

    # -- internals ------------------------------------------------------------------------------
    def _tokens(self, tokens: np.ndarray, where: str) -> np.ndarray:
        return check_tokens(tokens, self.config.vocab_size, where)

    def _np(self, t) -> np.ndarray:
        return np.ascontiguousarray(t.detach().to(self.dtype).numpy(), dtype=np.dtype(self.options.dtype)).copy()

    def _mask(self, start: int, n: int):
        """Additive mask over [cached window rows, new rows]: key k visible to query p iff k <= p < k + window."""
        torch, w = self.torch, self.config.window_size
        c = min(start, w - 1)
        keys = torch.arange(start - c, start + n)
        q = torch.arange(start, start + n)[:, None]
        ok = (keys[None] <= q) & (q - keys[None] < w)
        return torch.zeros(ok.shape, dtype=self.dtype).masked_fill(~ok, torch.finfo(self.dtype).min)[None, None]

    def _output(self, layer: int, out, got: dict, pe: dict, pos, state: HFState, capture: bool) -> LayerOutput:
        cfg, block = self.config, self.model.model.layers[layer]
        n, r = pos.shape[1], cfg.ratio(layer)
        positions = pos[0].numpy()
        hc = [self._hc_gates(block, got, which) for which in ("attn_hc", "ffn_hc")]
        ids, weights, margin = self._routing(layer, block, got, n)
        sel = self._index_sel(layer, got, n)
        diag = LayerDiag(hc_attn=hc[0], hc_ffn=hc[1], expert_ids=ids, expert_weights=weights, router_margin=margin,
                         n_comp_visible=(positions + 1) // r if r else np.zeros(n, np.int64), index_sel=sel)
        caps = self._captures(layer, out, got, pe, n, state, ids, weights, sel) if capture else {}
        return LayerOutput(attn_carrier=self._np(got["blk_attn"][0]), carrier=self._np(out[0]), diag=diag,
                           captures=caps)

    def _hc_gates(self, block, got: dict, which: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(pre, post, comb) of the block's `which` hyper-connection. HF consumes `pre` inside its HC module: it
        is recomputed from the normed input."""
        torch, H = self.torch, self.config.hc_mult
        hc = getattr(block, which)
        mix = torch.nn.functional.linear(got[f"{which}.norm"], hc.fn.float())[..., :H]
        pre = self._np((torch.sigmoid(mix * hc.scale.float()[0] + hc.base.float()[:H]) + hc.hc_eps)[0])
        post, comb, _ = got[which]
        return pre, self._np(post[0]), self._np(comb[0])

    def _routing(self, layer: int, block, got: dict, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The routed experts' ids and weights in selection order, and the router margin (NaN on a hash layer)."""
        cfg = self.config
        logits, weights, ids = got["gate"]
        ids = ids.numpy().astype(np.int64)
        weights = self._np(weights)
        if cfg.is_hash_layer(layer):
            return ids, weights, np.full(n, np.nan, weights.dtype)
        # HF picks unsorted top-k: present them in selection order (keys descending) like the reference
        keys = self._np(block.mlp.gate.score_fn(logits) + block.mlp.gate.e_score_correction_bias)
        order = np.argsort(-np.take_along_axis(keys, ids, axis=1), axis=1, kind="stable")
        ids, weights = np.take_along_axis(ids, order, 1), np.take_along_axis(weights, order, 1)
        ranked = -np.sort(-keys, axis=1)
        return ids, weights, ranked[:, cfg.n_activated_experts - 1] - ranked[:, cfg.n_activated_experts]

    def _index_sel(self, layer: int, got: dict, n: int) -> np.ndarray | None:
        """The indexer's picks per row, sorted and padded with -1 to top-k (None on a layer without one)."""
        cfg = self.config
        if not cfg.has_indexer(layer):
            return None
        picks = got["indexer"][0].numpy()
        sel = np.full((n, cfg.index_topk), -1, np.int64)
        for i in range(n):
            v = np.sort(picks[i][picks[i] >= 0])
            sel[i, : len(v)] = v
        return sel

    def _captures(self, layer: int, out, got: dict, pe: dict, n: int, state: HFState, ids: np.ndarray,
                  weights: np.ndarray, sel: np.ndarray | None) -> dict[str, np.ndarray]:
        """The layer's sub-op captures, read from the hooks' outputs (`got`) and the layer's cache."""
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import apply_rotary_pos_emb

        cfg, block, r, f = self.config, self.model.model.layers[layer], self.config.ratio(layer), self._np
        cos, sin = pe[block.self_attn.rope_layer_type]
        q = got["q_b_norm"]                                 # [1, nh, n, hd], before RoPE
        kv = got["kv_norm"][:, None]                        # [1, 1, n, hd]
        derope = got["o_a_proj"].reshape(1, n, cfg.n_heads, cfg.head_dim).transpose(1, 2)
        rows = state.cache.layers[layer].compressed_kv if r else {}   # None until the layer's first block completes
        return {
            "hc_attn_pre": f(got["attn_hc"][2][0]), "attn_norm": f(got["input_layernorm"][0]),
            "q_path": f(q[0].transpose(0, 1)), "kv_latent": f(kv[0, 0]),
            "rope_q": f(apply_rotary_pos_emb(q, cos, sin)[0].transpose(0, 1)),
            "rope_kv": f(apply_rotary_pos_emb(kv, cos, sin)[0, 0]),
            "comp_rows": (f(rows["compressor"][0]) if r and rows["compressor"] is not None
                          else np.zeros((0, cfg.head_dim), self.options.dtype)),
            "index_rows": (f(rows["indexer"][0]) if cfg.has_indexer(layer) and rows["indexer"]
                           is not None else np.zeros((0, cfg.index_head_dim), self.options.dtype)),
            "index_sel": sel if sel is not None else np.full((n, cfg.index_topk), -1, np.int64),
            "attn_heads": f(apply_rotary_pos_emb(derope, cos, sin)[0].transpose(0, 1)),
            "attn_out": f(got["self_attn"][0][0]), "hc_attn_post": f(got["blk_attn"][0]),
            "hc_ffn_pre": f(got["ffn_hc"][2][0]), "ffn_norm": f(got["post_attention_layernorm"][0]),
            "expert_ids": ids, "expert_weights": weights, "routed_out": f(got["experts"]),
            "shared_out": f(got["shared_experts"][0]), "hc_ffn_post": f(out[0]),
        }


def _hooks(block, got: dict) -> list:
    """Forward hooks on one decoder layer's modules; each stores its output (or, for ffn_hc, its input) in `got`."""
    def keep(name: str, use_input: bool = False):
        def hook(_module, args, output):
            got[name] = args[0] if use_input else output
        return hook

    attn = block.self_attn
    mods = {"attn_hc": block.attn_hc, "ffn_hc": block.ffn_hc, "attn_hc.norm": block.attn_hc.input_norm,
            "ffn_hc.norm": block.ffn_hc.input_norm, "input_layernorm": block.input_layernorm,
            "post_attention_layernorm": block.post_attention_layernorm, "self_attn": attn,
            "q_b_norm": attn.q_b_norm, "kv_norm": attn.kv_norm, "gate": block.mlp.gate,
            "experts": block.mlp.experts, "shared_experts": block.mlp.shared_experts}
    hooks = [m.register_forward_hook(keep(k)) for k, m in mods.items()]
    hooks.append(attn.o_a_proj.register_forward_hook(keep("o_a_proj", use_input=True)))
    hooks.append(block.ffn_hc.register_forward_hook(keep("blk_attn", use_input=True)))
    if getattr(attn, "compressor", None) is not None and hasattr(attn.compressor, "indexer"):
        hooks.append(attn.compressor.indexer.register_forward_hook(keep("indexer")))
    return hooks
