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

from parity.contract.errors import MetadataError, quote
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
    notes: dict[str, str] = field(default_factory=dict, compare=False)  # accepted oddities, e.g. extra entries

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
        d.pop("notes")
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
            raise self.fail(key, "an integer (any GGUF integer width)", f"{v.type_name()} {quote(v.value)}")
        if not lo <= v.value <= hi:
            raise self.fail(key, f"an integer in [{lo}, {hi}]", f"{v.type_name()} {v.value}")
        return int(v.value)

    def float(self, key: str, lo: float = -math.inf, hi: float = math.inf, lo_open: bool = False) -> float:
        bound = f"{'(' if lo_open else '['}{lo}, {hi}]"
        v = self.get(key, f"a float in {bound}")
        if v.type not in FLOAT_TYPES:
            raise self.fail(key, "a float (F32 or F64)", f"{v.type_name()} {quote(v.value)}")
        x = float(v.value)
        if not math.isfinite(x) or x < lo or x > hi or (lo_open and x == lo):
            raise self.fail(key, f"a finite float in {bound}", f"{v.type_name()} {x}")
        return x

    def bool(self, key: str) -> bool:
        v = self.get(key, "a BOOL")
        if v.type != VT.BOOL:
            raise self.fail(key, "a BOOL", f"{v.type_name()} {quote(v.value)}")
        return bool(v.value)

    def str(self, key: str) -> str:
        v = self.get(key, "a STRING")
        if v.type != VT.STRING:
            raise self.fail(key, "a STRING", f"{v.type_name()} {quote(v.value)}")
        return v.value

    def array(self, key: str, elem_types: frozenset, what: str, lengths: tuple[int, int]) -> list:
        """An array with lengths[0] .. lengths[1] entries (lengths[1] None: no upper bound)."""
        lo, hi = lengths
        span = f"at least {lo}" if hi is None else f"{lo} or {hi}" if hi == lo + 1 else f"{lo}..{hi}"
        expected = f"an array of {what} with {span} entries"
        v = self.get(key, expected)
        if v.type != VT.ARRAY or v.elem_type not in elem_types:
            raise self.fail(key, expected, v.type_name())
        if not lo <= len(v.value) <= (len(v.value) if hi is None else hi):
            raise self.fail(key, expected, f"{len(v.value)} entries")
        return list(v.value)


# ------------------------------------------------------------------------------------------------
# The contract as data: (field, key, type, range). A bound given as a string is an earlier field's value.

@dataclass(frozen=True)
class Key:
    """One scalar metadata key: the ModelConfig field it sets (None: checked only), its type and range."""

    field: str | None
    key: str                       # without the "deepseek4." prefix unless it starts with "tokenizer."
    kind: str                      # int | float | bool
    lo: float | str = 0
    hi: float | str = 1 << 40
    lo_open: bool = False

    @property
    def full_key(self) -> str:
        return self.key if self.key.startswith("tokenizer.") else ARCH + "." + self.key


KEYS_HEAD = (  # read first: the shape of the model
    Key("n_layers", "block_count", "int", 1, 4096),
    Key("dim", "embedding_length", "int", 1, 1 << 20),
    Key("n_heads", "attention.head_count", "int", 1, 4096),
    Key(None, "attention.head_count_kv", "int", 1, 4096),
    Key("head_dim", "attention.key_length", "int", 1, 1 << 16),
    Key(None, "attention.value_length", "int", 1, 1 << 16),
    Key("rope_head_dim", "rope.dimension_count", "int", 2, "head_dim"),
    Key("o_groups", "attention.output_group_count", "int", 1, "n_heads"),
)
KEYS_MOE = (
    Key("index_head_dim", "attention.indexer.key_length", "int", "rope_head_dim", 1 << 16),
    Key("n_routed_experts", "expert_count", "int", 1, 1 << 16),
    Key(None, "expert_gating_func", "int", 0, 255),
    Key("n_shared_experts", "expert_shared_count", "int", 1, 1),
    Key(None, "expert_weights_norm", "bool"),
)
KEYS_REST = (
    Key("q_lora_rank", "attention.q_lora_rank", "int", 1, 1 << 20),
    Key("o_lora_rank", "attention.output_lora_rank", "int", 1, 1 << 20),
    Key("window_size", "attention.sliding_window", "int", 1, 1 << 24),
    Key("rope_theta", "rope.freq_base", "float", 0.0, 1e12, lo_open=True),
    Key("compress_rope_theta", "attention.compress_rope_freq_base", "float", 0.0, 1e12, lo_open=True),
    Key("index_n_heads", "attention.indexer.head_count", "int", 1, 4096),
    Key("index_topk", "attention.indexer.top_k", "int", 1, 1 << 24),
    Key("hc_mult", "hyper_connection.count", "int", 1, 64),
    Key("hc_sinkhorn_iters", "hyper_connection.sinkhorn_iterations", "int", 1, 10000),
    Key("hc_eps", "hyper_connection.epsilon", "float", 0.0, 1.0),
    Key("norm_eps", "attention.layer_norm_rms_epsilon", "float", 0.0, 1.0, lo_open=True),
    Key("n_activated_experts", "expert_used_count", "int", 1, "n_routed_experts"),
    Key("moe_inter_dim", "expert_feed_forward_length", "int", 1, 1 << 20),
    Key("route_scale", "expert_weights_scale", "float", 0.0, 1e6, lo_open=True),
    Key("n_hash_layers", "hash_layer_count", "int", 0, "n_layers"),
    Key("context_length", "context_length", "int", 1, 1 << 40),
    Key("bos_token_id", "tokenizer.ggml.bos_token_id", "int", 0, "vocab_max"),
    Key("eos_token_id", "tokenizer.ggml.eos_token_id", "int", 0, "vocab_max"),
)
YARN_KEYS = (
    Key("rope_factor", "rope.scaling.factor", "float", 1.0, 1e6),
    Key("original_seq_len", "rope.scaling.original_context_length", "int", 1, 1 << 40),
    Key("beta_fast", "rope.scaling.yarn_beta_fast", "float", 0.0, 1e6, lo_open=True),
    Key("beta_slow", "rope.scaling.yarn_beta_slow", "float", 0.0, 1e6, lo_open=True),
)
# (key, required value, what the expectation says) for keys whose only allowed value is fixed by V4
FIXED = (
    ("expert_gating_func", GATING_SQRT_SOFTPLUS, f"{GATING_SQRT_SOFTPLUS} (sqrt(softplus), the only V4 gating)"),
    ("expert_weights_norm", True, "true (V4 renormalises the selected weights)"),
)


def _read_keys(m: _Meta, keys: tuple[Key, ...], out: dict[str, Any]) -> dict[str, Any]:
    """Read `keys` into `out` (by field, or by key for check-only keys); string bounds look up `out`."""
    for k in keys:
        lo, hi = (out[b] if isinstance(b, str) else b for b in (k.lo, k.hi))
        if k.kind == "int":
            v = m.int(k.full_key, lo, hi)
        elif k.kind == "float":
            v = m.float(k.full_key, lo, hi, lo_open=k.lo_open)
        else:
            v = m.bool(k.full_key)
        out[k.field or k.key] = v
    return out


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
        raise m.fail("general.architecture", f"'{ARCH}'", quote(arch))
    p = ARCH + "."
    derived: dict[str, str] = {}
    notes: dict[str, str] = {}
    f = _read_keys(m, KEYS_HEAD, {})
    _cross_checks_head(m, f)
    f["compress_ratios"] = _compress_ratios(m, f["n_layers"], notes)
    f.update(_yarn(m, derived))
    _read_keys(m, KEYS_MOE, f)
    for key, want, expected in FIXED:
        if f[key] != want:
            raise m.fail(p + key, expected, str(f[key]).lower() if isinstance(want, bool) else str(f[key]))
    for key in ("expert_group_count", "expert_group_used_count"):
        if p + key in kv and m.int(p + key, 0, 1 << 16) != 0:
            raise m.fail(p + key, "0 or absent (V4 has no expert groups)", str(kv[p + key].value))
    f["swiglu_limit"], f["swiglu_limit_shexp"] = _clamps(m, f["n_layers"], derived)
    f["vocab_size"] = _vocab_size(m, tensor_shapes, derived)
    f["vocab_max"] = f["vocab_size"] - 1
    _read_keys(m, KEYS_REST, f)
    fields = set(ModelConfig.__dataclass_fields__) - {"expert_weights_norm"}  # the FIXED check read a key of that name
    cfg = ModelConfig(**{k: v for k, v in f.items() if k in fields}, expert_weights_norm=True,
                      score_func="sqrtsoftplus", derived=derived, notes=notes)
    _cross_checks_tail(m, cfg)
    return cfg


def _cross_checks_head(m: _Meta, f: dict[str, Any]) -> None:
    p = ARCH + "."
    if f["attention.value_length"] != f["head_dim"]:
        expected = f"= key_length ({f['head_dim']}), K and V share one row"
        raise m.fail(p + "attention.value_length", expected, str(f["attention.value_length"]))
    if f["rope_head_dim"] % 2:
        raise m.fail(p + "rope.dimension_count", "an even number (interleaved pairs)", str(f["rope_head_dim"]))
    if f["n_heads"] % f["o_groups"]:
        raise m.fail(p + "attention.output_group_count", f"a divisor of head_count ({f['n_heads']})",
                     str(f["o_groups"]))
    if f["attention.head_count_kv"] != 1:
        raise m.fail(p + "attention.head_count_kv", "1 (one shared K=V head)", str(f["attention.head_count_kv"]))


def _compress_ratios(m: _Meta, n_layers: int, notes: dict[str, str]) -> tuple[int, ...]:
    """At least block_count entries (spec Corrections item 2); the first block_count are used, extras noted."""
    key = ARCH + ".attention.compress_ratios"
    ratios = m.array(key, INTEGER_TYPES, "integers", (n_layers, None))
    for i, r in enumerate(ratios):
        if r < 0 or r == 1 or r > 1 << 20:
            raise m.fail(key, "entries 0 (no compression) or >= 2", f"entry {i} = {r}")
    if len(ratios) > n_layers:
        notes["compress_ratios"] = (f"{len(ratios)} entries for {n_layers} layers: the first {n_layers} are used, "
                                    f"{len(ratios) - n_layers} extra (MTP slot(s)) {quote(ratios[n_layers:])}")
    return tuple(int(r) for r in ratios[:n_layers])


def _yarn(m: _Meta, derived: dict[str, str]) -> dict[str, Any]:
    p = ARCH + "."
    out = {"yarn": False, "rope_factor": 1.0, "original_seq_len": 0, "beta_fast": 0.0, "beta_slow": 0.0}
    if p + "rope.scaling.type" in m.kv:
        scaling = m.str(p + "rope.scaling.type")
        if scaling == "yarn":
            return _read_keys(m, YARN_KEYS, {"yarn": True})
        if scaling != "none":
            raise m.fail(p + "rope.scaling.type", "'yarn' or 'none'", quote(scaling))
    derived["yarn"] = "off: no rope.scaling.type = yarn key (compressed layers use plain compress_rope_freq_base)"
    return out


def _clamps(m: _Meta, n_layers: int, derived: dict[str, str]) -> tuple[tuple[float, ...], tuple[float, ...]]:
    p = ARCH + "."
    lengths = _per_layer_lengths(n_layers)
    swiglu = m.array(p + "swiglu_clamp_exp", FLOAT_TYPES, "floats", lengths)
    if p + "swiglu_clamp_shexp" in m.kv:
        swiglu_sh = m.array(p + "swiglu_clamp_shexp", FLOAT_TYPES, "floats", lengths)
    else:
        swiglu_sh = swiglu
        derived["swiglu_limit_shexp"] = "from deepseek4.swiglu_clamp_exp (swiglu_clamp_shexp absent)"
    for key, arr in (("swiglu_clamp_exp", swiglu), ("swiglu_clamp_shexp", swiglu_sh)):
        for i, c in enumerate(arr):
            if not (math.isfinite(c) and c >= 0):
                raise m.fail(p + key, "finite non-negative clamps", f"entry {i} = {c}")
    return tuple(float(c) for c in swiglu[:n_layers]), tuple(float(c) for c in swiglu_sh[:n_layers])


def _vocab_size(m: _Meta, tensor_shapes: dict[str, tuple[int, ...]] | None, derived: dict[str, str]) -> int:
    p = ARCH + "."
    if p + "vocab_size" in m.kv:
        return m.int(p + "vocab_size", 1, 1 << 31)
    shape = (tensor_shapes or {}).get("token_embd.weight")
    if shape is None or len(shape) != 2:
        raise m.fail(p + "vocab_size", "an integer, or a 2-D token_embd.weight to derive it from", "neither")
    derived["vocab_size"] = f"from token_embd.weight rows ({shape[0]}); key {p}vocab_size absent"
    return int(shape[0])


def _cross_checks_tail(m: _Meta, cfg: ModelConfig) -> None:
    p = ARCH + "."
    if p + "embedding_length_out" in m.kv:  # optional (llama.cpp writes it); when present it must agree
        hd_out = m.int(p + "embedding_length_out", 1, 1 << 30)
        if hd_out != cfg.hc_mult * cfg.dim:
            raise m.fail(p + "embedding_length_out", f"hc count x embedding_length = {cfg.hc_mult * cfg.dim}",
                         str(hd_out))
    if cfg.index_head_dim & (cfg.index_head_dim - 1):
        raise m.fail(p + "attention.indexer.key_length", "a power of two (Hadamard size)", str(cfg.index_head_dim))
    tokens = m.kv.get("tokenizer.ggml.tokens")
    if tokens is not None:
        if tokens.type != VT.ARRAY or tokens.elem_type != VT.STRING:
            raise m.fail("tokenizer.ggml.tokens", "an array of STRING (one entry per token)", tokens.type_name())
        if len(tokens.value) != cfg.vocab_size:
            raise m.fail("tokenizer.ggml.tokens", f"{cfg.vocab_size} entries (= vocab_size)", f"{len(tokens.value)}")
