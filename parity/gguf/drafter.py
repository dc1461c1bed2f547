"""Drafter GGUFs (DeepSeek-V4's MTP block and the DSpark drafter), read strictly in each published layout.

Spec v4-mtp-dspark §1 (the head kind comes from tensor names, never from a counter key), §2.1, §3.1, §5.
Layouts: `ds4-mtp` (`mtp.0.<ds4 per-layer suffix>`), `llamacpp-mtp` (arch `deepseek4`, `blk.L.*`,
`blk.L.nextn.*`, root `output_hc_*` = the MTP's head, copies of the trunk's `token_embd`/`output`/`output_norm`),
`ds4-dspark` (arch `deepseek4-dspark`, `dspark.*` keys, `mtp.{s}.*`) and `dflash` (llama.cpp: `fc`,
`enc.output_norm`, `blk.{s}.*`, `output_hc_*`, `markov_w1/w2`, `conf_proj`; taps stored as ids + 1).

Whatever the layout, `Drafter.weights` serves CANONICAL names (numpy shapes, (out, in)):
block s as trunk layer L + s (`blk.{L+s}.<suffix>`, the tensors of a ratio-0, non-hash layer), plus
MTP: `mtp.{enorm,hnorm,norm}.weight` (D,), `mtp.{e_proj,h_proj}.weight` (D, D) (llama.cpp's `eh_proj` (D, 2D) =
[e_proj | h_proj] along the input axis, split per row at column D), `mtp.hc_head_fn.weight` (H, H*D),
`mtp.hc_head_base.weight` (H,), `mtp.hc_head_scale.weight` (1,);
DSpark: `dspark.main_proj.weight` (D, m*D), `dspark.{main_norm,norm}.weight` (D,), `dspark.hc_head_*` as MTP,
`dspark.markov_w{1,2}.weight` (V, r), `dspark.conf_proj.weight` (1, D+r).
The trunk's `token_embd` / `output` are never served here (`merged_weights` joins trunk and drafter).
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as Q

from parity.contract.errors import GGUFError, TensorError, quote
from parity.gguf.config import KEYS_HEAD, KEYS_MOE, KEYS_REST, YARN_KEYS, ModelConfig, _Meta, config_from_metadata
from parity.gguf.container import INTEGER_TYPES, GGUFFile, TensorInfo
from parity.gguf.inventory import DENSE, F32_ONLY, FLOATS, TensorSpec, expected_tensors, table_problems
from parity.gguf.weights import Weights, data_sha256

LAYOUTS = {"ds4-mtp": "mtp", "llamacpp-mtp": "mtp", "ds4-dspark": "dspark", "dflash": "dspark"}
ARCHS = {"ds4-mtp": "deepseek4", "llamacpp-mtp": "deepseek4", "ds4-dspark": "deepseek4-dspark", "dflash": "dflash"}
HC_HEAD = ("fn", "base", "scale")

# tensor-name markers of each family and layout (spec §1 table); `mtp.0.hc_head_fn` is no marker (a 1-stage DSpark)
MARKERS = (
    ("ds4-mtp", re.compile(r"^mtp\.0\.(e_proj|h_proj|enorm|hnorm)\.weight$")),
    ("llamacpp-mtp", re.compile(r"^blk\.\d+\.nextn\.")),
    ("ds4-dspark", re.compile(r"^mtp\.\d+\.(main_proj\.|main_norm\.|markov_head\.|confidence_head\.)")),
    ("dflash", re.compile(r"^(fc|enc\.output_norm|markov_w1|markov_w2|conf_proj)\.weight$")),
)

# DSpark keys: (what, spellings per layout family); every spelling the spec lists is accepted, two must agree
DSPARK_KEYS = {
    "block_size": ("dspark.block_size", "deepseek4.dspark.block_size"),
    "noise_token_id": ("dspark.noise_token_id", "deepseek4.dspark.noise_token_id"),
    "target_layer_ids": ("dspark.target_layer_ids", "dspark.target_layers", "deepseek4.dspark.target_layer_ids"),
    "markov_rank": ("dspark.markov_rank", "deepseek4.dspark.markov_rank"),
    "stage_count": ("dspark.stage_count", "dspark.layer_count", "deepseek4.nextn_predict_layers"),
}
DFLASH_KEYS = {
    "block_size": ("dflash.block_size",),
    "noise_token_id": ("tokenizer.ggml.mask_token_id", "dflash.mask_token_id"),
    "target_layer_ids": ("dflash.target_layers",),   # ids + 1
    "stage_count": ("dflash.block_count",),
}
# trunk hyper-parameters a DSpark file may repeat under its own prefix (`dspark.` / `dflash.`): equal when present
_REPEATABLE = tuple(k for k in KEYS_HEAD + KEYS_MOE + KEYS_REST
                    if k.field and not k.key.startswith("tokenizer.") and k.field not in ("n_layers", "context_length"))
# ModelConfig field -> the deepseek4 key that sets it (for errors on a llama.cpp MTP file)
_FIELD_KEYS = {k.field: k.full_key for k in KEYS_HEAD + KEYS_MOE + KEYS_REST + YARN_KEYS if k.field} | {
    "compress_ratios": "deepseek4.attention.compress_ratios", "swiglu_limit": "deepseek4.swiglu_clamp_exp",
    "swiglu_limit_shexp": "deepseek4.swiglu_clamp_shexp", "yarn": "deepseek4.rope.scaling.type",
    "vocab_size": "deepseek4.vocab_size"}


@dataclass(frozen=True)
class DrafterConfig:
    """What a drafter file says about its head; the DSpark fields are None for an MTP head."""

    kind: str                                  # "mtp" | "dspark" (from tensor names, spec §1)
    layout: str                                # "ds4-mtp" | "llamacpp-mtp" | "ds4-dspark" | "dflash"
    n_blocks: int                              # MTP: 1; DSpark: S stages
    first_layer: int                           # trunk block_count L: drafter block s is layer L + s
    block_size: int | None = None              # DSpark B
    noise_token_id: int | None = None          # DSpark nu
    target_layer_ids: tuple[int, ...] | None = None  # DSpark taps, 0-based (dflash stores ids + 1)
    markov_rank: int | None = None             # DSpark r


@dataclass(frozen=True)
class Drafter:
    """An opened drafter: its config, the trunk config extended by its blocks, its weights (canonical names).

    `model_config` = the trunk's `ModelConfig` with the drafter blocks as layers L..L+n_blocks-1: compress ratio 0
    (no compressor, no indexer, no YaRN), not hash-routed (L >= n_hash_layers), SwiGLU clamps from the file where
    it has them (llama.cpp MTP: entry L of `deepseek4.swiglu_clamp_exp`/`_shexp`), else the trunk's last layer's.
    `trunk_copies` maps a tensor the file copies from the trunk (llama.cpp MTP) to the trunk's name; `notes`
    says which values were derived and how.
    """

    path: Path
    config: DrafterConfig
    model_config: ModelConfig
    weights: DrafterWeights
    trunk_copies: dict[str, str] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Slot:
    """Where a canonical tensor lives in the file; `half` 0/1 = the e/h column half of llama.cpp's eh_proj."""

    file_name: str
    half: int | None = None


# ------------------------------------------------------------------------------------------------
# Canonical tensors and their names in each layout


def extend_config(trunk: ModelConfig, n_blocks: int, swiglu: tuple[float, ...] | None = None,
                  swiglu_shexp: tuple[float, ...] | None = None) -> ModelConfig:
    """The trunk config with `n_blocks` drafter layers appended: ratio 0, clamps `swiglu`/`swiglu_shexp` per block
    (None: the trunk's last layer's)."""
    sw = swiglu if swiglu is not None else (trunk.swiglu_limit[-1],) * n_blocks
    sh = swiglu_shexp if swiglu_shexp is not None else (trunk.swiglu_limit_shexp[-1],) * n_blocks
    return replace(trunk, n_layers=trunk.n_layers + n_blocks, compress_ratios=trunk.compress_ratios + (0,) * n_blocks,
                   swiglu_limit=trunk.swiglu_limit + tuple(sw), swiglu_limit_shexp=trunk.swiglu_limit_shexp + tuple(sh))


def block_specs(model_cfg: ModelConfig, layer: int) -> list[TensorSpec]:
    """The tensors of layer `layer` of `model_cfg` (for a drafter block: ratio 0, non-hash: 24 tensors)."""
    prefix = f"blk.{layer}."
    return [s for s in expected_tensors(model_cfg) if s.name.startswith(prefix)]


def extra_specs(dc: DrafterConfig, cfg: ModelConfig) -> list[TensorSpec]:
    """The head's own tensors beyond its blocks, canonical names, numpy shapes."""
    D, H, V = cfg.dim, cfg.hc_mult, cfg.vocab_size
    p = dc.kind + "."
    head = [TensorSpec(p + "norm.weight", (D,), F32_ONLY, "f32"),
            TensorSpec(p + "hc_head_fn.weight", (H, H * D), FLOATS, "hc"),
            TensorSpec(p + "hc_head_base.weight", (H,), F32_ONLY, "f32"),
            TensorSpec(p + "hc_head_scale.weight", (1,), F32_ONLY, "f32")]
    if dc.kind == "mtp":
        return [TensorSpec("mtp.enorm.weight", (D,), F32_ONLY, "f32"),
                TensorSpec("mtp.hnorm.weight", (D,), F32_ONLY, "f32"),
                TensorSpec("mtp.e_proj.weight", (D, D), DENSE, "draft_proj"),
                TensorSpec("mtp.h_proj.weight", (D, D), DENSE, "draft_proj"), *head]
    m, r = len(dc.target_layer_ids), dc.markov_rank
    return [TensorSpec("dspark.main_proj.weight", (D, m * D), DENSE, "draft_proj"),
            TensorSpec("dspark.main_norm.weight", (D,), F32_ONLY, "f32"), *head,
            TensorSpec("dspark.markov_w1.weight", (V, r), DENSE, "markov"),
            TensorSpec("dspark.markov_w2.weight", (V, r), DENSE, "markov"),
            TensorSpec("dspark.conf_proj.weight", (1, D + r), FLOATS, "conf")]


def canonical_specs(dc: DrafterConfig, model_cfg: ModelConfig) -> list[TensorSpec]:
    """Every canonical drafter tensor: the blocks (stage by stage), then the head's own tensors."""
    blocks = [s for b in range(dc.n_blocks) for s in block_specs(model_cfg, dc.first_layer + b)]
    return blocks + extra_specs(dc, model_cfg)


def extra_file_names(dc: DrafterConfig) -> dict[str, Slot]:
    """Canonical head tensor -> its place in the file, per layout (spec §5.1, §5.2)."""
    L, last = dc.first_layer, f"mtp.{dc.n_blocks - 1}."
    hc = {f"{dc.kind}.hc_head_{x}.weight": x for x in HC_HEAD}
    if dc.layout == "ds4-mtp":
        return {f"mtp.{x}.weight": Slot(f"mtp.0.{x}.weight")
                for x in ("enorm", "hnorm", "e_proj", "h_proj", "norm", *(f"hc_head_{y}" for y in HC_HEAD))}
    if dc.layout == "llamacpp-mtp":
        n = f"blk.{L}.nextn."
        return {"mtp.enorm.weight": Slot(n + "enorm.weight"), "mtp.hnorm.weight": Slot(n + "hnorm.weight"),
                "mtp.e_proj.weight": Slot(n + "eh_proj.weight", 0), "mtp.h_proj.weight": Slot(n + "eh_proj.weight", 1),
                "mtp.norm.weight": Slot(n + "shared_head_norm.weight"),
                **{c: Slot(f"output_hc_{x}.weight") for c, x in hc.items()}}
    if dc.layout == "ds4-dspark":
        return {"dspark.main_proj.weight": Slot("mtp.0.main_proj.weight"),
                "dspark.main_norm.weight": Slot("mtp.0.main_norm.weight"),
                "dspark.norm.weight": Slot(last + "norm.weight"),
                **{c: Slot(f"{last}hc_head_{x}.weight") for c, x in hc.items()},
                "dspark.markov_w1.weight": Slot(last + "markov_head.markov_w1.weight"),
                "dspark.markov_w2.weight": Slot(last + "markov_head.markov_w2.weight"),
                "dspark.conf_proj.weight": Slot(last + "confidence_head.proj.weight")}
    return {"dspark.main_proj.weight": Slot("fc.weight"), "dspark.main_norm.weight": Slot("enc.output_norm.weight"),
            "dspark.norm.weight": Slot("output_norm.weight"),
            **{c: Slot(f"output_hc_{x}.weight") for c, x in hc.items()},
            "dspark.markov_w1.weight": Slot("markov_w1.weight"), "dspark.markov_w2.weight": Slot("markov_w2.weight"),
            "dspark.conf_proj.weight": Slot("conf_proj.weight")}


def block_file_name(dc: DrafterConfig, canonical: str) -> str:
    """`blk.{L+s}.<suffix>` -> the block tensor's name in the file."""
    _, layer, suffix = canonical.split(".", 2)
    s = int(layer) - dc.first_layer
    return {"ds4-mtp": f"mtp.0.{suffix}", "llamacpp-mtp": canonical, "ds4-dspark": f"mtp.{s}.{suffix}",
            "dflash": f"blk.{s}.{suffix}"}[dc.layout]


def slots(dc: DrafterConfig, model_cfg: ModelConfig) -> dict[str, Slot]:
    """Canonical name -> place in the file, for every canonical tensor (in canonical order)."""
    extra = extra_file_names(dc)
    return {s.name: extra.get(s.name) or Slot(block_file_name(dc, s.name)) for s in canonical_specs(dc, model_cfg)}


def trunk_copy_specs(dc: DrafterConfig, cfg: ModelConfig) -> dict[str, tuple[TensorSpec, str]]:
    """Tensors a llama.cpp MTP file copies from the trunk: file name -> (spec, trunk name); none elsewhere."""
    if dc.layout != "llamacpp-mtp":
        return {}
    D, V, n = cfg.dim, cfg.vocab_size, f"blk.{dc.first_layer}.nextn."
    return {"token_embd.weight": (TensorSpec("token_embd.weight", (V, D), DENSE, "embedding"), "token_embd.weight"),
            "output.weight": (TensorSpec("output.weight", (V, D), DENSE, "output"), "output.weight"),
            "output_norm.weight": (TensorSpec("output_norm.weight", (D,), F32_ONLY, "f32"), "output_norm.weight"),
            n + "embed_tokens.weight": (TensorSpec(n + "embed_tokens.weight", (V, D), DENSE, "embedding",
                                                   required=False), "token_embd.weight"),
            n + "shared_head_head.weight": (TensorSpec(n + "shared_head_head.weight", (V, D), DENSE, "output",
                                                       required=False), "output.weight")}


def file_specs(dc: DrafterConfig, model_cfg: ModelConfig) -> list[TensorSpec]:
    """The exact tensor set the file must hold (file names), with shapes and allowed types."""
    specs, seen = [], set()
    for spec, slot in zip(canonical_specs(dc, model_cfg), slots(dc, model_cfg).values(), strict=True):
        if slot.file_name in seen:
            continue
        seen.add(slot.file_name)
        if slot.half is None:
            specs.append(replace(spec, name=slot.file_name))
        else:  # eh_proj: [e_proj | h_proj] along the input axis
            specs.append(TensorSpec(slot.file_name, (spec.shape[0], 2 * spec.shape[1]), DENSE, "draft_proj"))
    return specs + [s for s, _ in trunk_copy_specs(dc, model_cfg).values()]


# ------------------------------------------------------------------------------------------------
# Reading


def detect_layout(tensor_names: list[str], source: str) -> str:
    """The layout from tensor names (spec §1); a file with both families, two layouts or none is refused."""
    found: dict[str, str] = {}
    for name in tensor_names:
        for layout, pattern in MARKERS:
            if layout not in found and pattern.match(name):
                found[layout] = name
    kinds = {LAYOUTS[lay] for lay in found}
    if len(kinds) > 1:
        mtp = next(n for lay, n in found.items() if LAYOUTS[lay] == "mtp")
        dsp = next(n for lay, n in found.items() if LAYOUTS[lay] == "dspark")
        raise TensorError(f"{source}: holds both MTP tensors ({mtp}) and DSpark tensors ({dsp}): refused (spec §1)")
    if len(found) > 1:
        a, b = list(found.items())[:2]
        raise TensorError(f"{source}: mixes two layouts: {a[1]} ({a[0]}) and {b[1]} ({b[0]})")
    if not found:
        raise TensorError(f"{source}: no drafter tensor: expected MTP (mtp.0.e_proj.weight or blk.N.nextn.*) or "
                          "DSpark (mtp.0.main_proj.weight or fc.weight) tensors")
    return next(iter(found))


def _one_of(m: _Meta, spellings: tuple[str, ...], read: Callable[[str], Any]) -> tuple[str, Any]:
    """(key, value) of the spelling present; all present spellings must agree; none present is an error."""
    present = [k for k in spellings if k in m.kv]
    if not present:
        others = f" (or {', '.join(spellings[1:])})" if len(spellings) > 1 else ""
        raise m.fail(spellings[0], f"the key{others}", "the key is missing")
    values = [(k, read(k)) for k in present]
    for k, v in values[1:]:
        if v != values[0][1]:
            raise m.fail(k, f"= {values[0][0]} ({quote(values[0][1])}), both spellings present", quote(v))
    return values[0]


def _layer_ids(m: _Meta, key: str, trunk: ModelConfig, offset: int) -> tuple[int, ...]:
    """A tap-id array: 0-based trunk layers (the file stores id + offset), distinct."""
    lo, hi = offset, trunk.n_layers - 1 + offset
    ids = m.array(key, INTEGER_TYPES, "integers", (1, None))
    for i, v in enumerate(ids):
        if not lo <= v <= hi:
            what = "0-based trunk layer ids" if offset == 0 else "trunk layer ids + 1 (llama.cpp's target_layers)"
            raise m.fail(key, f"{what} in [{lo}, {hi}]", f"entry {i} = {v}")
    if len(set(ids)) != len(ids):
        raise m.fail(key, "distinct layer ids", quote([int(v) for v in ids]))
    return tuple(int(v) - offset for v in ids)


def _check_repeated_hparams(m: _Meta, prefix: str, trunk: ModelConfig) -> None:
    """Trunk hyper-parameters repeated under `prefix` (`dflash.embedding_length`, `dspark.expert_count`, ...)
    must equal the trunk's when present."""
    for k in _REPEATABLE:
        key = prefix + k.key
        if key not in m.kv:
            continue
        want = getattr(trunk, k.field)
        got = m.int(key, 0, 1 << 40) if k.kind == "int" else m.float(key) if k.kind == "float" else m.bool(key)
        if got != want:
            raise m.fail(key, f"the trunk's {k.full_key} = {want}", str(got))


def _dspark_config(f: GGUFFile, m: _Meta, layout: str, trunk: ModelConfig, notes: dict[str, str]) -> DrafterConfig:
    L, V = trunk.n_layers, trunk.vocab_size
    if layout == "ds4-dspark":
        keys, prefix, offset = DSPARK_KEYS, "dspark.", 0
    else:
        keys, prefix, offset = DFLASH_KEYS, "dflash.", 1
    _, B = _one_of(m, keys["block_size"], lambda k: m.int(k, 1, 1 << 16))
    _, nu = _one_of(m, keys["noise_token_id"], lambda k: m.int(k, 0, V - 1))
    _, taps = _one_of(m, keys["target_layer_ids"], lambda k: _layer_ids(m, k, trunk, offset))
    _, S = _one_of(m, keys["stage_count"], lambda k: m.int(k, 1, 64))
    if layout == "ds4-dspark":
        _, r = _one_of(m, keys["markov_rank"], lambda k: m.int(k, 1, 1 << 20))
        if "dspark.n_layers" in m.kv and m.int("dspark.n_layers", 1, 4096) != L:
            raise m.fail("dspark.n_layers", f"the trunk's block_count = {L}", str(m.kv["dspark.n_layers"].value))
    else:
        info = f.tensors.get("markov_w1.weight")
        if info is None or len(info.shape) != 2:
            raise TensorError(f"{f.path}: tensor 'markov_w1.weight' (V, r) is missing or not 2-D: the dflash layout "
                              "has no rank key, r is its column count")
        r = info.shape[1]
        notes["markov_rank"] = f"from markov_w1.weight shape {info.shape} (dflash has no rank key)"
        if "dflash.sample_from_anchor" in m.kv and m.bool("dflash.sample_from_anchor"):
            raise m.fail("dflash.sample_from_anchor", "false or absent (anchor-first block, spec §5.2)", "true")
    _check_repeated_hparams(m, prefix, trunk)
    return DrafterConfig("dspark", layout, S, L, B, nu, taps, r)


def _llamacpp_mtp_config(f: GGUFFile, m: _Meta, trunk: ModelConfig) -> ModelConfig:
    """The llama.cpp MTP file is a deepseek4 model of L + 1 layers: read it with the trunk contract, then every
    field must equal the trunk's extended by one ratio-0 layer (its clamps are the file's entry L)."""
    m.int("deepseek4.nextn_predict_layers", 1, 1)
    shapes = {n: i.shape for n, i in f.tensors.items()}
    got = config_from_metadata(f.kv, f.path, shapes)
    L = trunk.n_layers
    if got.n_layers != L + 1:
        raise m.fail("deepseek4.block_count", f"the trunk's block_count + 1 = {L + 1}", str(got.n_layers))
    want = extend_config(trunk, 1, got.swiglu_limit[L:], got.swiglu_limit_shexp[L:])
    for fl in fields(ModelConfig):
        if fl.compare and getattr(got, fl.name) != getattr(want, fl.name):
            key = _FIELD_KEYS.get(fl.name, fl.name)
            raise m.fail(key, f"{quote(getattr(want, fl.name))} (the trunk's, plus a ratio-0 MTP layer)",
                         quote(getattr(got, fl.name)))
    return want


def _stage_problems(dc: DrafterConfig, names: list[str]) -> list[str]:
    """A DSpark stage with no tensor at all is named as a missing stage (before the per-tensor list)."""
    if dc.kind != "dspark":
        return []
    fmt = "mtp.{}." if dc.layout == "ds4-dspark" else "blk.{}."
    key = "dspark.stage_count" if dc.layout == "ds4-dspark" else "dflash.block_count"
    return [f"stage {s} missing: no {fmt.format(s)}* tensor ({key} = {dc.n_blocks})"
            for s in range(dc.n_blocks) if not any(n.startswith(fmt.format(s)) for n in names)]


def tensor_problems(tensors: dict[str, TensorInfo], specs: list[TensorSpec]) -> list[str]:
    """Missing, misshapen, mistyped and unexpected tensors (all of them, not the first)."""
    def type_problem(spec: TensorSpec, info: TensorInfo) -> str | None:
        if info.ggml_type in spec.types:
            return None
        allowed = ", ".join(sorted(t.name for t in spec.types))
        return f"tensor {spec.name}: type {info.type_name} not allowed (allowed: {allowed})"

    return table_problems(tensors, specs, type_problem)


def open_drafter(path: str | os.PathLike, trunk: ModelConfig) -> Drafter:
    """Open a drafter GGUF for the trunk `trunk` strictly: a wrong or missing key, tensor, shape or type, a DSpark
    stage missing, both head families in one file, or dims / vocab / tap ids that do not fit the trunk raise
    `MetadataError` / `TensorError` naming the key or tensor and the file."""
    f = GGUFFile(path)
    source = f.path
    layout = detect_layout(list(f.tensors), source)
    m = _Meta(f.kv, source)
    arch_key = "general.architecture"
    if layout != "ds4-mtp" or arch_key in f.kv:  # ds4's MTP file: the key is not required, checked when present
        arch = m.str(arch_key)
        if arch != ARCHS[layout]:
            raise m.fail(arch_key, f"{ARCHS[layout]!r} (tensor names say layout {layout})", quote(arch))
    notes: dict[str, str] = {}
    if LAYOUTS[layout] == "mtp":
        dc = DrafterConfig("mtp", layout, 1, trunk.n_layers)
        if layout == "llamacpp-mtp":
            model_cfg = _llamacpp_mtp_config(f, m, trunk)
            notes["swiglu"] = "MTP layer clamps from entry L of deepseek4.swiglu_clamp_exp / _shexp"
        else:
            model_cfg = extend_config(trunk, 1)
            notes["swiglu"] = "MTP layer clamps = the trunk's last layer's (the file has no clamp key)"
    else:
        dc = _dspark_config(f, m, layout, trunk, notes)
        model_cfg = extend_config(trunk, dc.n_blocks)
        notes["swiglu"] = "stage clamps = the trunk's last layer's (the file has no clamp key)"
    problems = _stage_problems(dc, list(f.tensors)) + tensor_problems(f.tensors, file_specs(dc, model_cfg))
    if problems:
        raise TensorError(f"{source}: not a valid {layout} drafter for this trunk: " + "; ".join(problems))
    copies = {name: trunk_name for name, (_, trunk_name) in trunk_copy_specs(dc, model_cfg).items()
              if name in f.tensors}
    weights = DrafterWeights(f, model_cfg, canonical_specs(dc, model_cfg), slots(dc, model_cfg))
    return Drafter(Path(source), dc, model_cfg, weights, copies, notes)


# ------------------------------------------------------------------------------------------------
# Weights over canonical names


def split_columns(raw: np.ndarray, ne: tuple[int, ...], ggml_type: int, at: int, name: str) -> tuple[np.ndarray,
                                                                                                   np.ndarray]:
    """Split a 2-D tensor's rows at input column `at` (ggml ne0 = row length): raw bytes of columns [0, at) and
    [at, ne0), each row-major (rows, bytes per half-row). Quantized rows split at a block boundary: `at` must be a
    multiple of the type's block size (refused, naming it, otherwise)."""
    qtype = Q(ggml_type)
    block, size = GGML_QUANT_SIZES[qtype]
    if at % block or (ne[0] - at) % block:
        raise TensorError(f"tensor {name!r}: cannot split its {qtype.name} rows at column {at}: "
                          f"{at} and {ne[0] - at} must be multiples of the block size {block}")
    rows = np.asarray(raw).reshape(ne[1], ne[0] // block * size)
    cut = at // block * size
    return np.ascontiguousarray(rows[:, :cut]), np.ascontiguousarray(rows[:, cut:])


class DrafterWeights(Weights):
    """A drafter's tensors under canonical names: the methods of `parity.gguf.weights.Weights` (names,
    tensor_infos, info, raw, tensor, expert_raw, expert, identity). `config` is the extended model config.
    A split tensor (llama.cpp's eh_proj halves) has its bytes copied once; its `TensorInfo.offset` is where its
    first row begins in the file."""

    def __init__(self, f: GGUFFile, config: ModelConfig, specs: list[TensorSpec], where: dict[str, Slot]) -> None:
        self.paths = [Path(f.path)]
        self.files = [f]
        self.kv = f.kv
        self.config = config
        self._file = f
        self._slots = where
        self._split: dict[str, np.ndarray] = {}
        self._infos: dict[str, TensorInfo] = {}
        for spec in specs:
            slot = where[spec.name]
            src = f.tensors[slot.file_name]
            if slot.half is None:
                self._infos[spec.name] = TensorInfo(spec.name, src.ne, src.ggml_type, src.offset, src.nbytes)
                continue
            halves = split_columns(f.data(slot.file_name), src.ne, src.ggml_type, src.ne[0] // 2, slot.file_name)
            part = halves[slot.half]
            part.setflags(write=False)
            self._split[spec.name] = part.reshape(-1)
            at = 0 if slot.half == 0 else halves[0].shape[1]
            self._infos[spec.name] = TensorInfo(spec.name, (src.ne[0] // 2, src.ne[1]), src.ggml_type,
                                                src.offset + at, part.nbytes)

    @property
    def names(self) -> list[str]:
        return list(self._infos)

    def file_name(self, name: str) -> str:
        """The tensor's name in the drafter file."""
        self.info(name)
        return self._slots[name].file_name

    def tensor_infos(self) -> dict[str, TensorInfo]:
        return dict(self._infos)

    def file_tensor(self, file_name: str) -> tuple[TensorInfo, np.ndarray]:
        """A tensor of the drafter file by its file name (e.g. a trunk copy): (its table entry, its raw bytes)."""
        return self._file.tensors[file_name], self._file.data(file_name)

    def info(self, name: str) -> TensorInfo:
        if name not in self._infos:
            raise TensorError(f"{self.paths[0]}: {name!r} is not a tensor of this drafter (canonical names: "
                              f"blk.{self.config.n_layers - 1}.*, mtp.* or dspark.*)")
        return self._infos[name]

    def raw(self, name: str) -> np.ndarray:
        self.info(name)
        if name in self._split:
            return self._split[name]
        return self._file.data(self._slots[name].file_name)

    def identity(self) -> dict:
        h = hashlib.sha256(self._file.header_bytes())
        return {"file": self.paths[0].name, "size": self.paths[0].stat().st_size,
                "header_sha256": h.hexdigest()[:32], "data_sha256": data_sha256(self.files)}


# ------------------------------------------------------------------------------------------------
# Trunk + drafter


def check_pair(trunk: Weights, drafter: Drafter) -> dict[str, str]:
    """Check that `drafter` was opened for `trunk` and that the tensors the drafter file copies from the trunk equal
    the trunk's (same shape; same bytes when stored in the same type). Returns notes (a copy whose type differs
    from the trunk's is noted, its bytes not compared); raises `TensorError` naming the first mismatch."""
    dc, cfg = drafter.config, trunk.config
    if dc.first_layer != cfg.n_layers or extend_config(cfg, dc.n_blocks, drafter.model_config.swiglu_limit[
            cfg.n_layers:], drafter.model_config.swiglu_limit_shexp[cfg.n_layers:]) != drafter.model_config:
        raise TensorError(f"{drafter.path}: the drafter was opened for another trunk than {trunk.paths[0]}")
    notes = {}
    for name, trunk_name in drafter.trunk_copies.items():
        (mine, raw), theirs = drafter.weights.file_tensor(name), trunk.info(trunk_name)
        if mine.shape != theirs.shape:
            raise TensorError(f"{drafter.path}: tensor {name}: shape {mine.shape}, the trunk's {trunk_name} has "
                              f"{theirs.shape}")
        if mine.ggml_type != theirs.ggml_type:
            notes[name] = (f"type {mine.type_name}, the trunk's {trunk_name} is {theirs.type_name}: bytes not "
                           "compared (the trunk's tensor is used)")
        elif not np.array_equal(raw, trunk.raw(trunk_name)):
            raise TensorError(f"{drafter.path}: tensor {name} differs from the trunk's {trunk_name} "
                              f"({trunk.paths[0]}): a drafter of another model")
    return notes


class MergedWeights(Weights):
    """Trunk and drafter tensors behind the `Weights` methods: the trunk's names and the drafter's canonical names,
    `config` = `drafter.model_config`, `kv` = the trunk's. `identity()` is the trunk's with a `draft` entry (the
    drafter file's identity), so a trace of the pair still names the trunk model."""

    def __init__(self, trunk: Weights, drafter: Drafter) -> None:
        both = set(trunk.names) & set(drafter.weights.names)
        if both:
            raise GGUFError(f"tensor {sorted(both)[0]!r} is in both the trunk ({trunk.paths[0]}) and the drafter "
                            f"({drafter.path})")
        self.trunk, self.drafter = trunk, drafter
        self.paths = [*trunk.paths, *drafter.weights.paths]
        self.files = [*trunk.files, *drafter.weights.files]
        self.kv = trunk.kv
        self.config = drafter.model_config
        self._owner = {n: trunk for n in trunk.names} | {n: drafter.weights for n in drafter.weights.names}

    @property
    def names(self) -> list[str]:
        return list(self._owner)

    def tensor_infos(self) -> dict[str, TensorInfo]:
        return self.trunk.tensor_infos() | self.drafter.weights.tensor_infos()

    def info(self, name: str) -> TensorInfo:
        if name not in self._owner:
            raise TensorError(f"{self.paths[0]}: tensor {name!r} is in neither the trunk nor the drafter "
                              f"({self.drafter.path})")
        return self._owner[name].info(name)

    def raw(self, name: str) -> np.ndarray:
        self.info(name)
        return self._owner[name].raw(name)

    def identity(self) -> dict:
        return self.trunk.identity() | {"draft": self.drafter.weights.identity()}


def merged_weights(trunk: Weights, drafter: Drafter) -> MergedWeights:
    """A `Weights`-like view serving the trunk's names and the drafter's canonical names (block s as layer L + s,
    config `drafter.model_config`); the pair is checked first (`check_pair`); a name in both is an error."""
    check_pair(trunk, drafter)
    return MergedWeights(trunk, drafter)

