"""Checkpoint and sub-op names shared by every engine (spec v4-residual-ffn-gguf §12).

Per position there are L + 2 carrier checkpoints (45 for V4-Flash): `embed`, `blk.0` ... `blk.{L-1}`
(carrier after each layer's FFN HC_post) and `final_norm`. `blk.{l}.attn` is the optional
half-layer carrier after the attention HC_post.
"""

from __future__ import annotations

from collections.abc import Iterable

from parity.contract.errors import TraceError

EMBED = "embed"
FINAL_NORM = "final_norm"
LOGITS = "logits"

# Sub-ops of one layer in execution order; the drill-down names the first one that drifts.
# Each maps to the capture names an engine fills when asked to (`forward_layer(..., capture=True)`).
SUBOPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("hc_attn_pre", ("hc_attn_pre",)),          # u = sum_h pre_h X[h]            [T, D]
    ("attn_norm", ("attn_norm",)),              # x = RMSNorm(u; attn_norm)       [T, D]
    ("q_path", ("q_path",)),                    # per-head-normed q, before RoPE  [T, nh, hd]
    ("kv_latent", ("kv_latent",)),              # kv_norm(W_kv x), before RoPE    [T, hd]
    ("rope", ("rope_q", "rope_kv")),            # q after RoPE; raw KV row after RoPE+FP8  [T,nh,hd], [T,hd]
    ("compressor_rows", ("comp_rows", "index_rows")),  # emitted rows after post-processing [n, hd], [n, d_I]
    ("indexer_selection", ("index_sel",)),      # selected compressed rows per position [T, top_k] (-1 pad)
    ("attention", ("attn_heads",)),             # sink attention output per head, before inverse RoPE [T, nh, hd]
    ("output_proj", ("attn_out",)),             # inverse RoPE + grouped output projection  [T, D]
    ("hc_attn_post", ("hc_attn_post",)),        # Y = post*a + C^T X              [T, H, D]
    ("hc_ffn_pre", ("hc_ffn_pre",)),            # v                                [T, D]
    ("ffn_norm", ("ffn_norm",)),                # RMSNorm(v; ffn_norm)             [T, D]
    ("router", ("expert_ids", "expert_weights")),  # selected ids [T, K] and final weights [T, K]
    ("routed_experts", ("routed_out",)),        # sum_k y_k                        [T, D]
    ("shared_expert", ("shared_out",)),         # shared expert output             [T, D]
    ("hc_ffn_post", ("hc_ffn_post",)),          # X' = post*f + C^T Y              [T, H, D]
)
SUBOP_NAMES: tuple[str, ...] = tuple(name for name, _ in SUBOPS)

# Which sub-op feeds which: sub-op -> the captures (and HC mixes) it consumes, besides the layer's input carrier
# `carrier`. Op-level teacher forcing (`OpForcing`) runs each sub-op on the candidate's values of these.
SUBOP_INPUTS: dict[str, tuple[str, ...]] = {
    "hc_attn_pre": ("carrier",),
    "attn_norm": ("hc_attn_pre",),
    "q_path": ("attn_norm",),
    "kv_latent": ("attn_norm",),
    "rope": ("q_path", "kv_latent"),
    "compressor_rows": ("attn_norm",),
    "indexer_selection": ("attn_norm", "index_rows"),
    "attention": ("rope_q", "rope_kv", "comp_rows", "index_sel"),
    "output_proj": ("attn_heads",),
    "hc_attn_post": ("attn_out", "carrier", "hc_attn.post", "hc_attn.comb"),
    "hc_ffn_pre": ("hc_attn_post",),
    "ffn_norm": ("hc_ffn_pre",),
    "router": ("ffn_norm",),
    "routed_experts": ("ffn_norm", "expert_ids", "expert_weights"),
    "shared_expert": ("ffn_norm",),
    "hc_ffn_post": ("routed_out", "shared_out", "hc_attn_post", "hc_ffn.post", "hc_ffn.comb"),
}


def block(layer: int) -> str:
    return f"blk.{layer}"


def block_attn(layer: int) -> str:
    return f"blk.{layer}.attn"


def checkpoint_names(n_layers: int) -> tuple[str, ...]:
    """The L + 2 full-layer carrier checkpoints in depth order (no half-layer blk.l.attn)."""
    return (EMBED, *(block(l) for l in range(n_layers)), FINAL_NORM)


def trace_checkpoints(n_layers: int) -> list[str]:
    """Every carrier checkpoint a trace records, depth order (2L + 2): embed, blk.0.attn, blk.0, ..., final_norm."""
    names = [EMBED]
    for l in range(n_layers):
        names += [block_attn(l), block(l)]
    return [*names, FINAL_NORM]


def checkpoint_index(name: str, n_layers: int) -> int:
    """The spec §12.1 index k of a checkpoint: embed 0, blk.l and blk.l.attn l+1, final_norm L+1."""
    if name == EMBED:
        return 0
    if name == FINAL_NORM:
        return n_layers + 1
    layer = checkpoint_layer(name)
    if layer is None:
        raise TraceError(f"unknown checkpoint name {name!r}")
    return layer + 1


def checkpoint_layer(name: str) -> int | None:
    """Layer number of blk.l / blk.l.attn, None for embed and final_norm."""
    return int(name.split(".")[1]) if name.startswith("blk.") else None


def checkpoint_depth(name: str, n_layers: int) -> float:
    """Plot depth: embed 0, blk.l.attn l+0.5, blk.l l+1, final_norm L+1."""
    if name == EMBED:
        return 0.0
    if name == FINAL_NORM:
        return float(n_layers + 1)
    layer = checkpoint_layer(name)
    if layer is None:
        raise TraceError(f"unknown checkpoint name {name!r}")
    return layer + (0.5 if name.endswith(".attn") else 1.0)


def layers_of(checkpoints: Iterable[str]) -> int:
    """Number of layers a checkpoint list spans: 1 + the highest blk index (0 without blk checkpoints)."""
    return 1 + max((layer for c in checkpoints if (layer := checkpoint_layer(c)) is not None), default=-1)

