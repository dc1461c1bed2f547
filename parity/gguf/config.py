"""`ModelConfig`: the deepseek4 metadata contract, read strictly from a GGUF (spec v4-residual-ffn-gguf §3).

Rules (no silent defaults):
* a required key that is missing, or has the wrong GGUF type, or is out of range raises
  `MetadataError` naming the key, the expected type, what was found and the file;
* integer keys accept every GGUF integer width (u8 ... i64); float keys accept f32 and f64;
* the only derived values are the three the spec allows (Corrections item 6), and each is recorded
  in `ModelConfig.derived` with its source so `inspect` can print it as derived.
Field names follow DeepSeek's official `config.json` / `ModelArgs`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from parity.contract.errors import MetadataError
from parity.gguf.container import FLOAT_TYPES, INTEGER_TYPES, VT, Value

ARCH = "deepseek4"
GATING_SQRT_SOFTPLUS = 4  # llama.cpp LLAMA_EXPERT_GATING_FUNC_TYPE_SQRT_SOFTPLUS


@dataclass(frozen=True)
class ModelConfig:
    """Every number the V4 math needs. Shapes in comments use these names."""

    dim: int                      # D, embedding_length
    n_layers: int                 # L, block_count
    vocab_size: int               # V
    n_heads: int                  # attention.head_count
    head_dim: int                 # attention.key_length (= value_length)
    rope_head_dim: int            # rope.dimension_count (trailing rotated dims)
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    window_size: int              # attention.sliding_window, current token included
    compress_ratios: tuple[int, ...]  # first n_layers entries of attention.compress_ratios
    rope_theta: float             # rope.freq_base (ratio-0 layers)
    compress_rope_theta: float    # attention.compress_rope_freq_base (compressed layers)
    yarn: bool                    # rope.scaling.type == "yarn" present
    rope_factor: float            # YaRN factor (1.0 when yarn is False)
    original_seq_len: int         # YaRN original context (0 when yarn is False)
    beta_fast: float
    beta_slow: float
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int                  # H, hyper_connection.count
    hc_sinkhorn_iters: int
    hc_eps: float
    norm_eps: float
    n_routed_experts: int         # E
    n_activated_experts: int      # K
    n_shared_experts: int
    moe_inter_dim: int            # F
    route_scale: float            # expert_weights_scale
    expert_weights_norm: bool
    score_func: str               # "sqrtsoftplus"
    n_hash_layers: int
    swiglu_limit: tuple[float, ...]        # per layer, routed experts
    swiglu_limit_shexp: tuple[float, ...]  # per layer, shared expert
    context_length: int
    bos_token_id: int
    eos_token_id: int
    derived: dict[str, str] = field(default_factory=dict, compare=False)

    # -- per-layer facts (a function of (cfg, layer), as in the official code) --------------------
    def ratio(self, layer: int) -> int:
        return self.compress_ratios[layer]

    def is_hash_layer(self, layer: int) -> bool:
        return layer < self.n_hash_layers

    def has_indexer(self, layer: int) -> bool:
        return self.compress_ratios[layer] == 4

    @property
    def nope_dim(self) -> int:
        return self.head_dim - self.rope_head_dim

    @property
    def o_group_width(self) -> int:
        return self.n_heads * self.head_dim // self.o_groups

    @property
    def n_hc_mix(self) -> int:
        return (2 + self.hc_mult) * self.hc_mult

    @property
    def checkpoint_names(self) -> tuple[str, ...]:
        from parity.contract.checkpoints import checkpoint_names

        return checkpoint_names(self.n_layers)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["compress_ratios"] = list(self.compress_ratios)
        d["swiglu_limit"] = list(self.swiglu_limit)
        d["swiglu_limit_shexp"] = list(self.swiglu_limit_shexp)
        return d


# ------------------------------------------------------------------------------------------------
# Typed readers


class _Meta:
    """Typed access to one file's metadata; every error names key, expectation, finding and file."""

    def __init__(self, kv: dict[str, Value], source: str) -> None:
        self.kv, self.source = kv, source

    def fail(self, key: str, expected: str, found: str) -> MetadataError:
        return MetadataError(f"{self.source}: key {key!r}: expected {expected}, found {found}")

    def get(self, key: str, expected: str) -> Value:
        if key not in self.kv:
            raise self.fail(key, expected, "the key is missing")
        return self.kv[key]

    def int(self, key: str, lo: int = 0, hi: int = 1 << 40) -> int:
        v = self.get(key, f"an integer in [{lo}, {hi}]")
        if v.type not in INTEGER_TYPES:
            raise self.fail(key, "an integer (any GGUF integer width)", f"{v.type_name()} {v.value!r}")
        if not lo <= v.value <= hi:
            raise self.fail(key, f"an integer in [{lo}, {hi}]", f"{v.type_name()} {v.value}")
        return int(v.value)

    def float(self, key: str, lo: float = -math.inf, hi: float = math.inf, lo_open: bool = False) -> float:
        bound = f"{'(' if lo_open else '['}{lo}, {hi}]"
        v = self.get(key, f"a float in {bound}")
        if v.type not in FLOAT_TYPES:
            raise self.fail(key, "a float (F32 or F64)", f"{v.type_name()} {v.value!r}")
        x = float(v.value)
        if not math.isfinite(x) or x < lo or x > hi or (lo_open and x == lo):
            raise self.fail(key, f"a finite float in {bound}", f"{v.type_name()} {x}")
        return x

    def bool(self, key: str) -> bool:
        v = self.get(key, "a BOOL")
        if v.type != VT.BOOL:
            raise self.fail(key, "a BOOL", f"{v.type_name()} {v.value!r}")
        return bool(v.value)

    def str(self, key: str) -> str:
        v = self.get(key, "a STRING")
        if v.type != VT.STRING:
            raise self.fail(key, "a STRING", f"{v.type_name()} {v.value!r}")
        return v.value

    def array(self, key: str, elem_types: frozenset, what: str, lengths: tuple[int, ...]) -> list:
        expected = f"an array of {what} with {' or '.join(map(str, lengths))} entries"
        v = self.get(key, expected)
        if v.type != VT.ARRAY or v.elem_type not in elem_types:
            raise self.fail(key, expected, v.type_name())
        if len(v.value) not in lengths:
            raise self.fail(key, expected, f"{len(v.value)} entries")
        return list(v.value)


def _per_layer_lengths(n_layers: int) -> tuple[int, int]:
    # n_layers entries, or one more for the MTP slot (spec Corrections item 2)
    return (n_layers, n_layers + 1)


def config_from_metadata(kv: dict[str, Value], source: str,
                         tensor_shapes: dict[str, tuple[int, ...]] | None = None) -> ModelConfig:
    """Build and validate a `ModelConfig` from GGUF metadata (`source` names the file in errors).

    `tensor_shapes` (numpy shapes by tensor name) is needed only to derive `vocab_size` when the
    key is absent (llama.cpp-converted files), from `token_embd.weight`'s row count.
    """
    m = _Meta(kv, source)
    arch = m.str("general.architecture")
    if arch != ARCH:
        raise m.fail("general.architecture", f"'{ARCH}'", repr(arch))
    p = ARCH + "."
    derived: dict[str, str] = {}

    n_layers = m.int(p + "block_count", 1, 4096)
    dim = m.int(p + "embedding_length", 1, 1 << 20)
    n_heads = m.int(p + "attention.head_count", 1, 4096)
    n_kv_heads = m.int(p + "attention.head_count_kv", 1, 4096)
    if n_kv_heads != 1:
        raise m.fail(p + "attention.head_count_kv", "1 (one shared K=V head)", str(n_kv_heads))
    head_dim = m.int(p + "attention.key_length", 1, 1 << 16)
    value_length = m.int(p + "attention.value_length", 1, 1 << 16)
    if value_length != head_dim:
        expected = f"= key_length ({head_dim}), K and V share one row"
        raise m.fail(p + "attention.value_length", expected, str(value_length))
    rope_dim = m.int(p + "rope.dimension_count", 2, head_dim)
    if rope_dim % 2:
        raise m.fail(p + "rope.dimension_count", "an even number (interleaved pairs)", str(rope_dim))
    o_groups = m.int(p + "attention.output_group_count", 1, n_heads)
    if n_heads % o_groups:
        raise m.fail(p + "attention.output_group_count", f"a divisor of head_count ({n_heads})", str(o_groups))

    ratios = m.array(p + "attention.compress_ratios", INTEGER_TYPES, "integers", _per_layer_lengths(n_layers))
    for i, r in enumerate(ratios):
        if r < 0 or r == 1 or r > 1 << 20:
            raise m.fail(p + "attention.compress_ratios", "entries 0 (no compression) or >= 2", f"entry {i} = {r}")
    ratios = tuple(int(r) for r in ratios[:n_layers])

    yarn = False
    rope_factor, original_seq_len, beta_fast, beta_slow = 1.0, 0, 0.0, 0.0
    if p + "rope.scaling.type" in kv:
        scaling = m.str(p + "rope.scaling.type")
        if scaling == "yarn":
            yarn = True
            rope_factor = m.float(p + "rope.scaling.factor", 1.0, 1e6)
            original_seq_len = m.int(p + "rope.scaling.original_context_length", 1, 1 << 40)
            beta_fast = m.float(p + "rope.scaling.yarn_beta_fast", 0.0, 1e6, lo_open=True)
            beta_slow = m.float(p + "rope.scaling.yarn_beta_slow", 0.0, 1e6, lo_open=True)
        elif scaling != "none":
            raise m.fail(p + "rope.scaling.type", "'yarn' or 'none'", repr(scaling))
    if not yarn:
        derived["yarn"] = "off: no rope.scaling.type = yarn key (compressed layers use plain compress_rope_freq_base)"

    index_head_dim = m.int(p + "attention.indexer.key_length", rope_dim, 1 << 16)
    n_experts = m.int(p + "expert_count", 1, 1 << 16)
    gating = m.int(p + "expert_gating_func", 0, 255)
    if gating != GATING_SQRT_SOFTPLUS:
        expected = f"{GATING_SQRT_SOFTPLUS} (sqrt(softplus), the only V4 gating)"
        raise m.fail(p + "expert_gating_func", expected, str(gating))
    for key in ("expert_group_count", "expert_group_used_count"):
        if p + key in kv and m.int(p + key, 0, 1 << 16) != 0:
            raise m.fail(p + key, "0 or absent (V4 has no expert groups)", str(kv[p + key].value))
    n_shared = m.int(p + "expert_shared_count", 1, 1)
    if not m.bool(p + "expert_weights_norm"):
        raise m.fail(p + "expert_weights_norm", "true (V4 renormalises the selected weights)", "false")

    clamp_lengths = _per_layer_lengths(n_layers)
    clamp_types = FLOAT_TYPES
    swiglu = m.array(p + "swiglu_clamp_exp", clamp_types, "floats", clamp_lengths)
    if p + "swiglu_clamp_shexp" in kv:
        swiglu_sh = m.array(p + "swiglu_clamp_shexp", clamp_types, "floats", clamp_lengths)
    else:
        swiglu_sh = swiglu
        derived["swiglu_limit_shexp"] = "from deepseek4.swiglu_clamp_exp (swiglu_clamp_shexp absent)"
    for key, arr in (("swiglu_clamp_exp", swiglu), ("swiglu_clamp_shexp", swiglu_sh)):
        for i, c in enumerate(arr):
            if not (math.isfinite(c) and c >= 0):
                raise m.fail(p + key, "finite non-negative clamps", f"entry {i} = {c}")

    if p + "vocab_size" in kv:
        vocab = m.int(p + "vocab_size", 1, 1 << 31)
    else:
        shape = (tensor_shapes or {}).get("token_embd.weight")
        if shape is None or len(shape) != 2:
            raise m.fail(p + "vocab_size", "an integer, or a 2-D token_embd.weight to derive it from", "neither")
        vocab = int(shape[0])
        derived["vocab_size"] = f"from token_embd.weight rows ({vocab}); key {p}vocab_size absent"

    cfg = ModelConfig(
        dim=dim, n_layers=n_layers, vocab_size=vocab, n_heads=n_heads, head_dim=head_dim,
        rope_head_dim=rope_dim,
        q_lora_rank=m.int(p + "attention.q_lora_rank", 1, 1 << 20),
        o_groups=o_groups,
        o_lora_rank=m.int(p + "attention.output_lora_rank", 1, 1 << 20),
        window_size=m.int(p + "attention.sliding_window", 1, 1 << 24),
        compress_ratios=ratios,
        rope_theta=m.float(p + "rope.freq_base", 0.0, 1e12, lo_open=True),
        compress_rope_theta=m.float(p + "attention.compress_rope_freq_base", 0.0, 1e12, lo_open=True),
        yarn=yarn, rope_factor=rope_factor, original_seq_len=original_seq_len,
        beta_fast=beta_fast, beta_slow=beta_slow,
        index_n_heads=m.int(p + "attention.indexer.head_count", 1, 4096),
        index_head_dim=index_head_dim,
        index_topk=m.int(p + "attention.indexer.top_k", 1, 1 << 24),
        hc_mult=m.int(p + "hyper_connection.count", 1, 64),
        hc_sinkhorn_iters=m.int(p + "hyper_connection.sinkhorn_iterations", 1, 10000),
        hc_eps=m.float(p + "hyper_connection.epsilon", 0.0, 1.0),
        norm_eps=m.float(p + "attention.layer_norm_rms_epsilon", 0.0, 1.0, lo_open=True),
        n_routed_experts=n_experts,
        n_activated_experts=m.int(p + "expert_used_count", 1, n_experts),
        n_shared_experts=n_shared,
        moe_inter_dim=m.int(p + "expert_feed_forward_length", 1, 1 << 20),
        route_scale=m.float(p + "expert_weights_scale", 0.0, 1e6, lo_open=True),
        expert_weights_norm=True,
        score_func="sqrtsoftplus",
        n_hash_layers=m.int(p + "hash_layer_count", 0, n_layers),
        swiglu_limit=tuple(float(c) for c in swiglu[:n_layers]),
        swiglu_limit_shexp=tuple(float(c) for c in swiglu_sh[:n_layers]),
        context_length=m.int(p + "context_length", 1, 1 << 40),
        bos_token_id=m.int("tokenizer.ggml.bos_token_id", 0, vocab - 1),
        eos_token_id=m.int("tokenizer.ggml.eos_token_id", 0, vocab - 1),
        derived=derived,
    )
    if p + "embedding_length_out" in kv:  # optional (llama.cpp writes it); when present it must agree
        hd_out = m.int(p + "embedding_length_out", 1, 1 << 30)
        if hd_out != cfg.hc_mult * cfg.dim:
            raise m.fail(p + "embedding_length_out", f"hc count x embedding_length = {cfg.hc_mult * cfg.dim}",
                         str(hd_out))
    if cfg.index_head_dim & (cfg.index_head_dim - 1):
        raise m.fail(p + "attention.indexer.key_length", "a power of two (Hadamard size)", str(cfg.index_head_dim))
    if "tokenizer.ggml.tokens" in kv:
        n_tokens = len(kv["tokenizer.ggml.tokens"].value)
        if n_tokens != vocab:
            raise m.fail("tokenizer.ggml.tokens", f"{vocab} entries (= vocab_size)", f"{n_tokens}")
    return cfg

