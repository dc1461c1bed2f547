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
    """The spec §12.1 index k of a checkpoint: embed 0, blk.l and blk.l.attn l+1, final_norm L+1; every draft
    checkpoint L+2 (the drafter is one more layer)."""
    if is_draft(name):
        return n_layers + 2
    if name == EMBED:
        return 0
    if name == FINAL_NORM:
        return n_layers + 1
    layer = checkpoint_layer(name)
    if layer is None:
        raise TraceError(f"unknown checkpoint name {name!r}")
    return layer + 1


def checkpoint_layer(name: str) -> int | None:
    """Layer number of blk.l / blk.l.attn, None for embed, final_norm and the draft checkpoints."""
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



# ---------------------------------------------------------------- draft checkpoints (issue 24, docs/trace-format.md)
# The drafter is one more "layer" after the trunk: its checkpoints follow final_norm in this order.
# MTP, depth k = 0..K-1, one row per traced position p whose pair exists (prev: (X^(L)_{p-1}, t_p), p >= 1; same:
# (X^(L)_p, t_p), p >= 0; depth k > 0 chains from the pair at p):
#   mtp.{k}.in [H, D] X_mtp, mtp.{k}.attn [H, D] after the attention HC_post, mtp.{k} [H, D] block output carrier,
#   mtp.{k}.logits [V] draft logits (argmax = the draft token; row stats carry argmax and top-k like final_norm).
# DSpark, one round per traced position p >= 1 (start position p, anchor t_{p+1}: the next token of the run, at the
# last position the trunk's argmax there):
#   dspark.main [D], dspark.{s} [B, H, D] stage outputs, dspark.base_logits / .bias / .logits [B, V],
#   dspark.confidence [B], dspark.drafts [B] (token ids as float32: exact below 2^24).
MTP_PAIRINGS = ("prev", "same")
MTP_SUFFIXES = (".in", ".attn", "", ".logits")
DSPARK_MAIN = "dspark.main"
DSPARK_HEADS = ("dspark.base_logits", "dspark.bias", "dspark.logits", "dspark.confidence", "dspark.drafts")
DRAFT_KINDS = ("mtp", "dspark")


def mtp_checkpoints(depth: int) -> list[str]:
    """The MTP checkpoints of a depth-`depth` chain, in order: mtp.0.in, mtp.0.attn, mtp.0, mtp.0.logits, mtp.1.in..."""
    return [f"mtp.{k}{s}" for k in range(depth) for s in MTP_SUFFIXES]


def dspark_checkpoints(n_stages: int) -> list[str]:
    """The DSpark checkpoints of an S-stage drafter, in order: dspark.main, dspark.0 .. dspark.{S-1}, the heads."""
    return [DSPARK_MAIN, *(f"dspark.{s}" for s in range(n_stages)), *DSPARK_HEADS]


def draft_kind(name: str) -> str | None:
    """'mtp' / 'dspark' for a draft checkpoint, None for a trunk one (and for 'logits')."""
    head = name.split(".", 1)[0]
    return head if head in DRAFT_KINDS and "." in name else None


def is_draft(name: str) -> bool:
    return draft_kind(name) is not None


def draft_checkpoints(kind: str, size: int) -> list[str]:
    """Every draft checkpoint of a drafter: `size` = MTP chain depth or DSpark stage count."""
    if kind not in DRAFT_KINDS:
        raise TraceError(f"draft kind {kind!r}; expected one of {', '.join(DRAFT_KINDS)}")
    return mtp_checkpoints(size) if kind == "mtp" else dspark_checkpoints(size)


def per_stream(name: str) -> bool:
    """Whether a checkpoint's vector has H streams (its ckpt row holds H l2 numbers): the carriers embed, blk.l,
    blk.l.attn, mtp.k.in, mtp.k.attn, mtp.k and the DSpark stage outputs dspark.{s} ([B, H, D])."""
    if name in (FINAL_NORM, LOGITS, DSPARK_MAIN, *DSPARK_HEADS):
        return False
    return not name.endswith(".logits")


def has_top(name: str) -> bool:
    """Whether a checkpoint's ckpt row carries argmax and top-k logits: final_norm (the trunk's logits) and the MTP
    draft logits mtp.k.logits."""
    return name == FINAL_NORM or (draft_kind(name) == "mtp" and name.endswith(".logits"))


def is_block_rows(name: str) -> bool:
    """DSpark checkpoints with one row per block slot (B rows): stages, logits, bias, confidence, drafts."""
    return draft_kind(name) == "dspark" and name != DSPARK_MAIN


def draft_positions(name: str, positions: Iterable[int], pairing: str | None) -> list[int]:
    """The traced positions at which checkpoint `name` has a record: MTP prev p >= 1, same p >= 0; DSpark p >= 1
    (module comment); a trunk checkpoint at every traced position."""
    kind = draft_kind(name)
    if kind == "mtp":
        if pairing not in MTP_PAIRINGS:
            raise TraceError(f"MTP checkpoint {name}: pairing {pairing!r}, expected one of {', '.join(MTP_PAIRINGS)}")
        lo = 1 if pairing == "prev" else 0
        return [p for p in positions if p >= lo]
    if kind == "dspark":
        return [p for p in positions if p >= 1]
    return list(positions)


def checkpoint_depths(names: Iterable[str], n_layers: int) -> list[float]:
    """Plot / first-drift depth of each checkpoint: trunk ones as `checkpoint_depth`, then each draft checkpoint one
    unit deeper than the one before it (the drafter is one more "layer" after final_norm at L + 1)."""
    out, last = [], float(n_layers + 1)
    for n in names:
        if is_draft(n):
            last += 1.0
            out.append(last)
        else:
            out.append(checkpoint_depth(n, n_layers))
    return out


def vector_shape(name: str, n_hc: int, dim: int, block_size: int | None) -> tuple[int | None, ...]:
    """The shape of one position's full vector of checkpoint `name` (None: the vocabulary, not in a trace header):
    carriers (H, D); final_norm and dspark.main (D,); logits and mtp.k.logits (V,); dspark.{s} (B, H, D);
    dspark.base_logits / bias / logits (B, V); dspark.confidence and dspark.drafts (B,)."""
    if name in (LOGITS,) or (draft_kind(name) == "mtp" and name.endswith(".logits")):
        return (None,)
    if name in (FINAL_NORM, DSPARK_MAIN):
        return (dim,)
    if name in ("dspark.base_logits", "dspark.bias", "dspark.logits"):
        return (block_size, None)
    if name in ("dspark.confidence", "dspark.drafts"):
        return (block_size,)
    return (block_size, n_hc, dim) if is_block_rows(name) else (n_hc, dim)
