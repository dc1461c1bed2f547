"""llama.cpp's `deepseek4` graph tensors <-> v4parity checkpoints, sub-ops and diagnostics (one map, two users).

The `llamacpp` engine (live eval-callback tensors) and `parity.tracing.importers` (a capture file written on
another machine) both turn llama.cpp-named tensors into `LayerOutput`s through `layer_output`, so a trace
recorded live and one imported from a capture of the same run are identical by construction.

Names: `<name>-<layer>` for layer tensors, bare `hc_init`, `result_norm`, `result_output`. A layer that
names a tensor twice (the attention and FFN hyper-connections both produce `hc_pre`, `hc_post`, `hc_comb`)
has the second one keyed `<name>-<layer>#2`. Arrays have tokens on axis 0 (one row per position of the
chunk), except the compressed-row cache views (`CACHE_ROWS`), whose axis 0 is the compressed row index;
their first `end // ratio` rows are the rows emitted up to position `end - 1`.
Full table with shapes and caveats: docs/peers.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import numpy as np

from parity.contract.draft import MTPOutput
from parity.contract.engine import LayerDiag, LayerOutput
from parity.contract.errors import TraceError
from parity.gguf.config import ModelConfig

EMBED_NAME, NORM_NAME, LOGITS_NAME = "hc_init", "result_norm", "result_output"
SECOND = "#2"
HC_TWICE = ("hc_pre", "hc_post", "hc_comb")   # attention HC first, the FFN HC's reuse of the name second
CACHE_ROWS = ("csa_comp_k", "hca_comp_k", "lid_k")
# llama.cpp's attention output tensor (before the inverse RoPE) by compress ratio
ATTN_HEADS = {0: "attn_raw", 4: "attn_csa_lid", 128: "attn_hca"}
COMP_ROWS = {4: "csa_comp_k", 128: "hca_comp_k"}

# v4parity capture name -> llama.cpp layer tensor (same for every layer; attention/compressor ones by ratio below)
SUBOP_SOURCES: dict[str, str] = {
    "hc_attn_pre": "hc_attn_pre", "attn_norm": "attn_norm", "q_path": "q_norm", "kv_latent": "kv_norm",
    "rope_q": "q", "rope_kv": "kv", "attn_out": "attn_out", "hc_attn_post": "hc_attn_post",
    "hc_ffn_pre": "hc_ffn_pre", "ffn_norm": "ffn_norm", "expert_ids": "ffn_moe_topk",
    "expert_weights": "ffn_moe_weights_scaled", "routed_out": "ffn_moe_out", "shared_out": "ffn_shexp",
    "hc_ffn_post": "l_last",
}
INT_NAMES = ("ffn_moe_topk", "lid_top_k")


def key(name: str, layer: int, occurrence: int = 1) -> str:
    """Capture key of the `occurrence`-th tensor called `name` in layer `layer` (`hc_pre-3`, `hc_pre-3#2`)."""
    return f"{name}-{layer}" + ("" if occurrence == 1 else f"#{occurrence}")


def layer_names(cfg: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """Every llama.cpp tensor key of one layer that v4parity maps, with its per-row numpy shape."""
    D, H, nh, hd, K = cfg.dim, cfg.hc_mult, cfg.n_heads, cfg.head_dim, cfg.n_activated_experts
    r = cfg.ratio(layer)
    per_row: dict[str, tuple[int, ...]] = {
        "hc_attn_pre": (D,), "attn_norm": (D,), "q_norm": (nh, hd), "kv_norm": (hd,), "q": (nh, hd), "kv": (hd,),
        ATTN_HEADS[r]: (nh, hd), "attn_out": (D,), "hc_attn_post": (H, D), "hc_ffn_pre": (D,), "ffn_norm": (D,),
        "ffn_moe_topk": (K,), "ffn_moe_weights_scaled": (K,), "ffn_moe_out": (D,), "ffn_shexp": (D,),
        "l_last": (H, D), "hc_pre": (H,), "hc_post": (H,), "hc_comb": (H, H),
    }
    if not cfg.is_hash_layer(layer):
        per_row["ffn_moe_probs_biased"] = (cfg.n_routed_experts,)
    if r:
        per_row[COMP_ROWS[r]] = (hd,)
    if cfg.has_indexer(layer):
        per_row["lid_k"] = (cfg.index_head_dim,)
        # llama.cpp stores min(top_k, compressed rows its context can hold) picks per token (256 for a short
        # context at the real top_k 512): the count is read from the tensor, and `selection` pads to top_k
        per_row["lid_top_k"] = (PER_TENSOR,)
    out = {key(n, layer): s for n, s in per_row.items()}
    out.update({key(n, layer, 2): per_row[n] for n in HC_TWICE})
    return out


def global_names(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    return {EMBED_NAME: (cfg.hc_mult, cfg.dim), NORM_NAME: (cfg.dim,), LOGITS_NAME: (cfg.vocab_size,)}


def all_names(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every mapped key of the model -> per-row numpy shape."""
    out = global_names(cfg)
    for l in range(cfg.n_layers):
        out.update(layer_names(cfg, l))
    return out


def base_name(k: str) -> str:
    """`hc_pre-3#2` -> `hc_pre`; `result_norm` -> `result_norm`."""
    stem = k.split("#")[0]
    head, _, tail = stem.rpartition("-")
    return head if head and tail.isdigit() else stem


PER_TENSOR = -1   # a per-row shape entry whose size the tensor itself gives (its innermost axis)


def rows(arr: np.ndarray, shape: tuple[int, ...], what: str) -> np.ndarray:
    """Reshape a tensor (tokens or cache rows on axis 0, singleton axes kept or dropped) to [n, *shape];
    a PER_TENSOR entry (only as the whole per-row shape) takes the tensor's innermost axis."""
    arr = np.asarray(arr)
    if shape == (PER_TENSOR,):
        if arr.ndim == 0 or arr.shape[-1] == 0:
            raise TraceError(f"{what}: no per-row axis in a tensor of shape {arr.shape}")
        shape = (arr.shape[-1],)
    width = int(np.prod(shape))
    if arr.size % width:
        raise TraceError(f"{what}: {arr.size} values is not a multiple of the row size {width} (shape {shape})")
    return arr.reshape(arr.size // width, *shape)


def hadamard_matrix(n: int) -> np.ndarray:
    """Sylvester Hadamard matrix of size n (a power of two), scaled by 1/sqrt(n): orthonormal and symmetric."""
    if n < 1 or n & (n - 1):
        raise TraceError(f"Hadamard size {n} is not a power of two")
    h = np.ones((1, 1))
    while len(h) < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(n)


def selection(picks: np.ndarray, positions: np.ndarray, ratio: int, top_k: int) -> np.ndarray:
    """llama.cpp's `lid_top_k` rows (unsorted; entries >= (t+1)//ratio are masked picks) -> v4parity's
    ascending selection padded with -1. picks [n, top_k], positions [n] -> int [n, top_k]."""
    if picks.shape[1] > top_k:
        raise TraceError(f"lid_top_k holds {picks.shape[1]} picks per token, more than the model's top_k {top_k}")
    out = np.full((len(positions), top_k), -1, np.int64)
    for i, t in enumerate(positions):
        valid = np.sort(picks[i][picks[i] < (int(t) + 1) // ratio])
        out[i, : len(valid)] = valid
    return out


def margin(probs_biased: np.ndarray, k: int) -> np.ndarray:
    """Router margin: K-th minus (K+1)-th largest selection key (scores + bias). [n, E] -> [n]."""
    ranked = -np.sort(-probs_biased, axis=-1)
    return ranked[:, k - 1] - ranked[:, k]


def cache_rows(t: Mapping[str, np.ndarray], k: str, width: int, end: int, ratio: int) -> np.ndarray:
    """The rows of a compressed-row cache view emitted before position `end` -> [end // ratio, width]."""
    r = rows(t[k], (width,), k)
    n = end // ratio
    if len(r) < n:
        raise TraceError(f"{k}: the cache view holds {len(r)} rows, {n} are emitted by position {end - 1}")
    return r[:n].astype(np.float32, copy=False)   # an f16 KV cache stores them as F16


def layer_output(t: Mapping[str, np.ndarray], cfg: ModelConfig, layer: int, positions: np.ndarray,
                 capture: bool = True) -> LayerOutput:
    """One layer's LayerOutput from the llama.cpp tensors of one chunk (`t` holds at least `layer_names`;
    per-token arrays have one row per entry of `positions`, cache views every row emitted so far)."""
    missing = [k for k in layer_names(cfg, layer) if k not in t]
    if missing:
        raise TraceError(f"layer {layer}: llama.cpp tensor(s) {', '.join(missing)} missing")
    positions = np.asarray(positions, np.int64)
    n, r = len(positions), cfg.ratio(layer)
    shapes = layer_names(cfg, layer)

    def get(name: str, occurrence: int = 1) -> np.ndarray:
        k = key(name, layer, occurrence)
        a = rows(t[k], shapes[k], k)
        if len(a) != n:
            raise TraceError(f"{k}: {len(a)} rows for a chunk of {n} positions")
        return a.astype(np.int64) if name in INT_NAMES else a.astype(np.float32, copy=False)

    hc = [tuple(get(name, occ) for name in HC_TWICE) for occ in (1, 2)]
    ids = get("ffn_moe_topk")
    sel = (selection(get("lid_top_k"), positions, r, cfg.index_topk) if cfg.has_indexer(layer) else None)
    diag = LayerDiag(
        hc_attn=hc[0], hc_ffn=hc[1], expert_ids=ids, expert_weights=get("ffn_moe_weights_scaled"),
        router_margin=(np.full(n, np.nan, np.float32) if cfg.is_hash_layer(layer)
                       else margin(get("ffn_moe_probs_biased"), cfg.n_activated_experts)),
        # structural: llama.cpp does not expose the count; it follows from the positions and the ratio
        n_comp_visible=(positions + 1) // r if r else np.zeros(n, np.int64),
        index_sel=sel,
    )
    caps: dict[str, np.ndarray] = {}
    if capture:
        caps = {ours: get(theirs) for ours, theirs in SUBOP_SOURCES.items()}
        caps["attn_heads"] = get(ATTN_HEADS[r])
        end = int(positions[-1]) + 1
        caps["comp_rows"] = (cache_rows(t, key(COMP_ROWS[r], layer), cfg.head_dim, end, r) if r
                             else np.zeros((0, cfg.head_dim), np.float32))
        if cfg.has_indexer(layer):  # lid_k is stored Hadamard-rotated: H·H = I undoes it
            lid = cache_rows(t, key("lid_k", layer), cfg.index_head_dim, end, r)
            caps["index_rows"] = (lid @ hadamard_matrix(cfg.index_head_dim)).astype(np.float32)
        else:
            caps["index_rows"] = np.zeros((0, cfg.index_head_dim), np.float32)
        caps["index_sel"] = sel if sel is not None else np.full((n, cfg.index_topk), -1, np.int64)
    return LayerOutput(attn_carrier=get("hc_attn_post"), carrier=get("l_last"), diag=diag, captures=caps)


def head_output(t: Mapping[str, np.ndarray], cfg: ModelConfig, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(final_norm [n, D], logits [n, V]) from `result_norm` / `result_output` (all rows requested)."""
    out = []
    for k, shape in ((NORM_NAME, (cfg.dim,)), (LOGITS_NAME, (cfg.vocab_size,))):
        if k not in t:
            raise TraceError(f"llama.cpp tensor {k} missing")
        a = rows(t[k], shape, k)
        if len(a) != n:
            raise TraceError(f"{k}: {len(a)} rows for {n} positions (llama.cpp gives one row per requested logit: "
                             "request logits for every position)")
        out.append(a.astype(np.float32, copy=False))
    return out[0], out[1]


def embed_output(t: Mapping[str, np.ndarray], cfg: ModelConfig, n: int) -> np.ndarray:
    if EMBED_NAME not in t:
        raise TraceError(f"llama.cpp tensor {EMBED_NAME} missing")
    a = rows(t[EMBED_NAME], (cfg.hc_mult, cfg.dim), EMBED_NAME)
    if len(a) != n:
        raise TraceError(f"{EMBED_NAME}: {len(a)} rows for {n} positions")
    return a.astype(np.float32, copy=False)


# llama.cpp's MTP graph (`graph_mtp`, its block is layer L = the trunk's block_count): MTPOutput field -> tensor
MTP_CARRIER = "h_nextn"   # the output carrier of every output row, flat [H·D]: what chaining feeds back
MTP_SOURCES = {"input": "mtp_eh_proj", "attn_carrier": "mtp_hc_attn_post", "expert_ids": "ffn_moe_topk"}


def mtp_names(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The llama.cpp tensors of the MTP graph that v4parity maps (trunk config `cfg`), with per-row shapes."""
    L, H, D = cfg.n_layers, cfg.hc_mult, cfg.dim
    return {key(MTP_SOURCES["input"], L): (H, D), key(MTP_SOURCES["attn_carrier"], L): (H, D),
            key(MTP_SOURCES["expert_ids"], L): (cfg.n_activated_experts,), MTP_CARRIER: (H, D),
            LOGITS_NAME: (cfg.vocab_size,)}


def mtp_output(t: Mapping[str, np.ndarray], cfg: ModelConfig, n: int) -> MTPOutput:
    """An MTPOutput from the MTP graph's tensors of n rows (all rows requested as outputs)."""
    shapes = mtp_names(cfg)
    missing = [k for k in shapes if k not in t]
    if missing:
        raise TraceError(f"llama.cpp MTP graph tensor(s) {', '.join(missing)} missing")

    def get(k: str) -> np.ndarray:
        a = rows(t[k], shapes[k], k)
        if len(a) != n:
            raise TraceError(f"{k}: {len(a)} rows for {n} MTP pairs")
        return a

    L = cfg.n_layers
    return MTPOutput(input=get(key(MTP_SOURCES["input"], L)).astype(np.float32, copy=False),
                     attn_carrier=get(key(MTP_SOURCES["attn_carrier"], L)).astype(np.float32, copy=False),
                     carrier=get(MTP_CARRIER).astype(np.float32, copy=False),
                     logits=get(LOGITS_NAME).astype(np.float32, copy=False),
                     expert_ids=get(key(MTP_SOURCES["expert_ids"], L)).astype(np.int64))


def layer_input_name(layer: int) -> str:
    """The llama.cpp tensor holding the carrier that enters `layer` (what teacher forcing overwrites)."""
    return EMBED_NAME if layer == 0 else key("l_last", layer - 1)


@runtime_checkable
class Capturer(Protocol):
    """Capability of an engine that runs llama.cpp: a raw capture of one free-running greedy run."""

    def capture(self, prompt: list[int], chunks: list[int], decode: int) -> dict[str, np.ndarray]:
        """Every mapped tensor by capture key, tokens on axis 0 (cache views: the rows emitted by the end), plus
        input_ids, output_positions, chunks and n_prompt."""


@runtime_checkable
class Quantizer(Protocol):
    """Capability of an engine class that runs llama.cpp: llama.cpp's own quantizer (`llama_model_quantize`),
    no model loaded. Both are static methods of the registered class."""

    @staticmethod
    def file_types() -> dict[str, int]:
        """llama.cpp's quantization file types (`Q4_K_M`, `MXFP4_MOE`, ...) -> `llama_ftype` value."""

    @staticmethod
    def quantize(src: str, dst: str, file_type: str, threads: int | None = None) -> dict[str, Any]:
        """Write `dst`, `src` quantized by llama.cpp at `file_type` -> {path, file_type, ftype, seconds, log}."""
