"""The exact tensor set a deepseek4 GGUF must hold, derived from its `ModelConfig` (spec §4).

`expected_tensors(cfg)` lists every tensor with its numpy shape (reversed ne) and the ggml types
the release allows for it; `validate(tensors, cfg)` reports *all* problems at once. A tensor llama.cpp's
quantizer re-types (`parity.gguf.lcp_layouts.quantizes`) may also hold any type that quantizer writes
(`lcp_layouts.WRITTEN_TYPES`): that is reported as the file's layout (which llama.cpp file type gives
exactly its types), not as a problem. Any other type (a quantized norm, a non-I32 hash table) is a problem.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from gguf.constants import GGMLQuantizationType as Q

from parity.gguf import lcp_layouts
from parity.gguf.config import ModelConfig
from parity.gguf.container import TensorInfo, tensor_nbytes

FLOATS = frozenset({Q.F32, Q.F16, Q.BF16})
DENSE = FLOATS | {Q.Q8_0}
EXPERTS = DENSE | {Q.Q2_K, Q.Q4_K, Q.IQ2_XXS, Q.MXFP4}
F32_ONLY = frozenset({Q.F32})
I32_ONLY = frozenset({Q.I32})


@dataclass(frozen=True)
class TensorSpec:
    """One expected tensor: numpy shape (out, in) order, allowed types, required or optional."""

    name: str
    shape: tuple[int, ...]
    types: frozenset
    klass: str          # tensor class, used to pick per-class quant types (synth, real-release layout)
    required: bool = True

    @property
    def ne(self) -> tuple[int, ...]:
        return tuple(reversed(self.shape))


def expected_tensors(cfg: ModelConfig) -> list[TensorSpec]:
    """All tensors of the main model in file order: globals, then each layer's tensors."""
    D, H, V = cfg.dim, cfg.hc_mult, cfg.vocab_size
    specs = [
        TensorSpec("token_embd.weight", (V, D), DENSE, "embedding"),
        TensorSpec("output_hc_fn.weight", (H, H * D), FLOATS, "hc"),
        TensorSpec("output_hc_base.weight", (H,), F32_ONLY, "f32"),
        TensorSpec("output_hc_scale.weight", (1,), F32_ONLY, "f32"),
        TensorSpec("output_norm.weight", (D,), F32_ONLY, "f32"),
        TensorSpec("output.weight", (V, D), DENSE, "output"),
    ]
    for l in range(cfg.n_layers):
        specs += _block_specs(cfg, f"blk.{l}.")
        specs += _compressor_specs(cfg, l) + _indexer_specs(cfg, l) + _router_table_specs(cfg, l)
    return specs


def _block_specs(cfg: ModelConfig, b: str) -> list[TensorSpec]:
    """The tensors every layer holds (prefix `b`): hyper-connections, attention, norms, router, experts."""
    D, H, E, F = cfg.dim, cfg.hc_mult, cfg.n_routed_experts, cfg.moe_inter_dim
    hd, nh, mix = cfg.head_dim, cfg.n_heads, cfg.n_hc_mix
    return [
        TensorSpec(b + "hc_attn_fn.weight", (mix, H * D), FLOATS, "hc"),
        TensorSpec(b + "hc_attn_scale.weight", (3,), F32_ONLY, "f32"),
        TensorSpec(b + "hc_attn_base.weight", (mix,), F32_ONLY, "f32"),
        TensorSpec(b + "attn_norm.weight", (D,), F32_ONLY, "f32"),
        TensorSpec(b + "attn_q_a.weight", (cfg.q_lora_rank, D), DENSE, "attention"),
        TensorSpec(b + "attn_q_a_norm.weight", (cfg.q_lora_rank,), F32_ONLY, "f32"),
        TensorSpec(b + "attn_q_b.weight", (nh * hd, cfg.q_lora_rank), DENSE, "attention"),
        TensorSpec(b + "attn_kv.weight", (hd, D), DENSE, "attention"),
        TensorSpec(b + "attn_kv_a_norm.weight", (hd,), F32_ONLY, "f32"),
        TensorSpec(b + "attn_sinks.weight", (nh,), F32_ONLY, "f32"),
        TensorSpec(b + "attn_output_a.weight", (cfg.o_groups * cfg.o_lora_rank, cfg.o_group_width),
                   DENSE, "attention"),
        TensorSpec(b + "attn_output_b.weight", (D, cfg.o_groups * cfg.o_lora_rank), DENSE, "attention"),
        TensorSpec(b + "hc_ffn_fn.weight", (mix, H * D), FLOATS, "hc"),
        TensorSpec(b + "hc_ffn_scale.weight", (3,), F32_ONLY, "f32"),
        TensorSpec(b + "hc_ffn_base.weight", (mix,), F32_ONLY, "f32"),
        TensorSpec(b + "ffn_norm.weight", (D,), F32_ONLY, "f32"),
        TensorSpec(b + "ffn_gate_inp.weight", (E, D), FLOATS, "router"),
        TensorSpec(b + "ffn_gate_exps.weight", (E, F, D), EXPERTS, "expert_gate_up"),
        TensorSpec(b + "ffn_up_exps.weight", (E, F, D), EXPERTS, "expert_gate_up"),
        TensorSpec(b + "ffn_down_exps.weight", (E, D, F), EXPERTS, "expert_down"),
        TensorSpec(b + "ffn_gate_shexp.weight", (F, D), DENSE, "shared"),
        TensorSpec(b + "ffn_up_shexp.weight", (F, D), DENSE, "shared"),
        TensorSpec(b + "ffn_down_shexp.weight", (D, F), DENSE, "shared"),
    ]


def _compressor_specs(cfg: ModelConfig, l: int) -> list[TensorSpec]:
    """Layer l's KV compressor tensors (none on a layer without compression)."""
    ratio, b, hd = cfg.ratio(l), f"blk.{l}.", cfg.head_dim
    if ratio <= 0:
        return []
    cw = (2 if ratio == 4 else 1) * hd
    return [
        TensorSpec(b + "attn_compressor_ape.weight", (ratio, cw), FLOATS, "compressor"),
        TensorSpec(b + "attn_compressor_kv.weight", (cw, cfg.dim), DENSE, "compressor"),
        TensorSpec(b + "attn_compressor_gate.weight", (cw, cfg.dim), DENSE, "compressor"),
        TensorSpec(b + "attn_compressor_norm.weight", (hd,), F32_ONLY, "f32"),
    ]


def _indexer_specs(cfg: ModelConfig, l: int) -> list[TensorSpec]:
    """Layer l's sparse-attention indexer tensors (none on a layer without an indexer)."""
    if not cfg.has_indexer(l):
        return []
    b, D, di, hi = f"blk.{l}.", cfg.dim, cfg.index_head_dim, cfg.index_n_heads
    return [
        TensorSpec(b + "indexer.attn_q_b.weight", (hi * di, cfg.q_lora_rank), DENSE, "indexer"),
        TensorSpec(b + "indexer.proj.weight", (hi, D), DENSE, "indexer"),
        TensorSpec(b + "indexer_compressor_ape.weight", (4, 2 * di), FLOATS, "indexer"),
        TensorSpec(b + "indexer_compressor_kv.weight", (2 * di, D), DENSE, "indexer"),
        TensorSpec(b + "indexer_compressor_gate.weight", (2 * di, D), DENSE, "indexer"),
        TensorSpec(b + "indexer_compressor_norm.weight", (di,), F32_ONLY, "f32"),
    ]


def _router_table_specs(cfg: ModelConfig, l: int) -> list[TensorSpec]:
    """Layer l's routing extras: the hash table of a hash layer, the expert bias (optional on a hash layer)."""
    b, E = f"blk.{l}.", cfg.n_routed_experts
    if cfg.is_hash_layer(l):
        # hash layers ignore a bias; files may still carry one (spec §4.3)
        return [TensorSpec(b + "ffn_gate_tid2eid.weight", (cfg.vocab_size, cfg.n_activated_experts), I32_ONLY,
                           "i32"),
                TensorSpec(b + "exp_probs_b.bias", (E,), F32_ONLY, "f32", required=False)]
    return [TensorSpec(b + "exp_probs_b.bias", (E,), F32_ONLY, "f32")]


# Per-class types of the DS4 2-bit release (IQ2_XXS gate/up, Q2_K down; spec §4 "DS4 q2").
REAL_RELEASE_TYPES = {
    "embedding": Q.F16, "output": Q.Q8_0, "hc": Q.F16, "f32": Q.F32, "attention": Q.Q8_0,
    "router": Q.F16, "expert_gate_up": Q.IQ2_XXS, "expert_down": Q.Q2_K, "shared": Q.Q8_0,
    "compressor": Q.F16, "indexer": Q.F16, "i32": Q.I32,
}


def layout_bytes(specs: list[TensorSpec], types: dict[str, Q]) -> int:
    """Total tensor bytes when each class is stored in `types[klass]` (required tensors only)."""
    return sum(tensor_nbytes(s.ne, types[s.klass]) for s in specs if s.required)


@dataclass(frozen=True)
class ValidationReport:
    """Contract problems; `differs`: tensors in a type llama.cpp's quantizer writes that the release does not
    use; `layout`: one line naming that layout (None when no tensor differs)."""

    problems: tuple[str, ...]
    differs: tuple[str, ...]
    layout: str | None

    @property
    def ok(self) -> bool:
        return not self.problems


def table_problems(tensors: Mapping[str, TensorInfo], specs: Sequence[TensorSpec],
                   type_problem: Callable[[TensorSpec, TensorInfo], str | None]) -> list[str]:
    """Every problem of a tensor table against its specs, in spec order: missing (when required), misshapen,
    `type_problem(spec, info)` when it says one; then the unexpected tensors."""
    problems, names = [], {s.name for s in specs}
    for spec in specs:
        info = tensors.get(spec.name)
        if info is None:
            if spec.required:
                problems.append(f"missing tensor {spec.name} (expected shape {spec.shape})")
            continue
        if info.shape != spec.shape:
            problems.append(f"tensor {spec.name}: shape {info.shape}, expected {spec.shape}")
        why = type_problem(spec, info)
        if why is not None:
            problems.append(why)
    return problems + [f"unexpected tensor {n}" for n in tensors if n not in names]


def validate(tensors: Mapping[str, TensorInfo], cfg: ModelConfig) -> ValidationReport:
    """Compare the file's tensor table with the contract; collect every problem, do not stop at one."""
    differs: list[str] = []

    def type_problem(spec: TensorSpec, info: TensorInfo) -> str | None:
        name = spec.name
        if info.ggml_type in spec.types:
            return None
        if lcp_layouts.quantizes(name, spec.ne) and info.ggml_type in lcp_layouts.WRITTEN_TYPES:
            differs.append(name)
            return None
        allowed = ", ".join(sorted(t.name for t in spec.types))
        why = ("nor a type llama.cpp's quantizer writes" if lcp_layouts.quantizes(name, spec.ne)
               else "llama.cpp's quantizer never re-types it")
        return f"tensor {name}: type {info.type_name} not allowed (allowed: {allowed}; {why})"

    problems = table_problems(tensors, expected_tensors(cfg), type_problem)
    return ValidationReport(tuple(problems), tuple(differs), layout_line(tensors, cfg, len(differs)))


def lcp_file_types(tensors: Mapping[str, TensorInfo], cfg: ModelConfig) -> list[str]:
    """The llama.cpp file types (`lcp_layouts.FTYPES`) whose quantizer gives every tensor it re-types exactly
    the type the file holds."""
    specs = [s for s in expected_tensors(cfg) if s.name in tensors and lcp_layouts.quantizes(s.name, s.ne)]
    return [ft for ft in lcp_layouts.FTYPES
            if all(tensors[s.name].ggml_type == lcp_layouts.tensor_type(s.name, s.ne, ft, cfg.n_layers)
                   for s in specs)]


def layout_line(tensors: Mapping[str, TensorInfo], cfg: ModelConfig, n_differ: int) -> str | None:
    """The `layout:` line of a file with `n_differ` tensors in types the release does not use (None for 0)."""
    if not n_differ:
        return None
    fts = lcp_file_types(tensors, cfg)
    style = (f"llama.cpp quantizer {'/'.join(fts)}-style" if fts
             else "types llama.cpp's quantizer writes, no single llama.cpp file type's mix")
    return f"{style}, differs from the release in {n_differ} tensor(s)"


def type_mix(tensors: Mapping[str, TensorInfo]) -> list[dict[str, int | str]]:
    """The file's ggml types: [{type, id, count, bytes}], most bytes first (ties by type id)."""
    mix: dict[int, dict[str, int | str]] = {}
    for info in tensors.values():
        row = mix.setdefault(info.ggml_type, {"type": info.type_name, "id": info.ggml_type, "count": 0, "bytes": 0})
        row["count"] = int(row["count"]) + 1
        row["bytes"] = int(row["bytes"]) + info.nbytes
    return sorted(mix.values(), key=lambda r: (-int(r["bytes"]), int(r["id"])))
