"""Turn other engines' tensor dumps into traces (statistics computed here from the full vectors).

* ds4 graph dumps (`DS4_METAL_GRAPH_DUMP_PREFIX=P`, spec ds4-formats §3.2): files
  `P_<name>-<layer>_pos<pos>.bin` (raw little-endian f32, `.i32` for int32), row-major [n_tokens, ...]
  starting at `pos` (a prefill chunk holds n_tokens rows). Used: `hc_ffn_post` -> blk.l,
  `hc_attn_post` -> blk.l.attn, `result_norm` -> final_norm and `result_output` -> logits (layer L,
  pos 0, overwritten every step: they belong to the LAST position of the run), the HC mixes
  (`hc_{attn,ffn}_pre_weights/_post_weights/_comb`) and the router (`ffn_moe_topk`, `ffn_moe_weights_scaled`).
  ds4 has no embedding dump, so an imported ds4 trace has no `embed` checkpoint.
* llama.cpp captures (`v4parity capture llamacpp`, or the script in docs/peers.md for other builds): one `.npz`
  keyed by llama.cpp eval-callback names (`parity.gguf.llamacpp`; tokens on axis 0, `#2` for a layer's second
  tensor of a name) plus `input_ids`, `output_positions` (the positions of the `result_*` rows) and optionally
  `chunks`, `n_prompt` and `meta` (JSON: engine, engine_version, flags of the run). Every checkpoint and
  diagnostic is mapped (`hc_init` -> embed, `hc_attn_post-l` -> blk.l.attn, `l_last-l` -> blk.l, `result_norm` /
  `result_output` -> final_norm / logits, HC gates, expert ids / weights / margin, compressed-row visibility and
  indexer selections); `llamacpp_chunks` maps the sub-ops as well (per chunk, through the same map the engine
  uses). Keys the map does not know are listed in the flags (`import_unmapped`).
* llama.cpp eval-callback tensors saved one file per tensor name in a directory (`<name>.bin` raw f32 or
  `<name>.npy`), each holding the whole ubatch row-major [n_tokens, ...] (ggml ne0 fastest): `hc_init` -> embed,
  `hc_attn_post-l` -> blk.l.attn, `l_last-l` -> blk.l, `result_norm` -> final_norm, `result_output` -> logits.

A checkpoint is kept only if it covers every imported position; dropped ones are listed in the
trace's flags (`import_dropped`) so the omission is visible in every diff, as are ds4 HC mixes
(`hc.<layer>.<attn|ffn>`) and router picks (`moe.<layer>`) that are incomplete.
"""

from __future__ import annotations

import io
import json
import os
import re
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from parity.contract.checkpoints import EMBED, FINAL_NORM, LOGITS, block, block_attn, trace_checkpoints
from parity.contract.errors import TraceError
from parity.contract.files import atomic_write
from parity.gguf import llamacpp as lcp
from parity.gguf.config import ModelConfig
from parity.tracing.recorder import Recorder, resolve_full, resolve_positions
from parity.tracing.records import SUBLAYERS, Trace, TraceHeader
from parity.tracing.runner import ChunkResult

DS4_RE = re.compile(r"^(?P<name>[A-Za-z0-9_]+)-(?P<layer>\d+)_pos(?P<pos>\d+)\.(?P<ext>bin|i32)$")
LCP_RE = re.compile(r"^(?P<name>hc_init|result_norm|result_output|l_last-(?P<l1>\d+)|hc_attn_post-(?P<l2>\d+))"
                    r"\.(?P<ext>bin|npy)$")
DS4_HC = {"weights": "pre", "post_weights": "post", "comb": "comb"}


def _ds4_files(prefix: str | os.PathLike) -> list[tuple[Path, str]]:
    """(file, `<name>-<layer>_pos<pos>.<ext>` part) of a ds4 dump prefix: `dir/run` -> dir/run_*; a prefix ending
    in `/` names a directory: ds4 writes `dir/_<name>...` (`%s_%s`), files without the `_` are taken too."""
    head, stem = os.path.split(os.fspath(prefix))
    if stem:
        return [(f, f.name[len(stem) + 1:]) for f in sorted(Path(head or ".").glob(stem + "_*"))]
    return [(f, f.name[1:] if f.name.startswith("_") else f.name) for f in sorted(Path(head).glob("*"))]


def has_ds4_dumps(prefix: str | os.PathLike) -> bool:
    """Whether `prefix` names at least one file as a ds4 dump prefix (see `_ds4_files`)."""
    return bool(_ds4_files(prefix))


def _rows(data: np.ndarray, width: int, what: str) -> np.ndarray:
    if data.size % width:
        raise TraceError(f"{what}: {data.size} values is not a multiple of the row width {width}")
    return data.reshape(-1, width)


def import_ds4(prefix: str | os.PathLike, *, tokens: list[int], config: ModelConfig, model: dict[str, Any],
               top_k: int = 20, engine_version: str = "unknown") -> Trace:
    """Build a trace from ds4's `P_<name>-<layer>_pos<pos>.bin` dumps (positions index `tokens`)."""
    n_layers, n_hc, dim, K = config.n_layers, config.hc_mult, config.dim, config.n_activated_experts
    carriers: dict[str, dict[int, np.ndarray]] = defaultdict(dict)
    hc: dict[tuple[int, int, str], dict[int, np.ndarray]] = defaultdict(dict)
    moe: dict[tuple[int, str], dict[int, np.ndarray]] = defaultdict(dict)
    last = len(tokens) - 1
    for f, part in _ds4_files(prefix):
        m = DS4_RE.match(part)
        if not m:
            continue
        name, layer, pos0 = m["name"], int(m["layer"]), int(m["pos"])
        data = np.fromfile(f, dtype="<i4" if m["ext"] == "i32" else "<f4")
        if name in ("hc_ffn_post", "hc_attn_post"):
            ck = block(layer) if name == "hc_ffn_post" else block_attn(layer)
            for i, row in enumerate(_rows(data, n_hc * dim, str(f))):
                carriers[ck][pos0 + i] = row.reshape(n_hc, dim)
        elif name in ("result_norm", "result_output"):
            carriers[FINAL_NORM if name == "result_norm" else LOGITS][last] = data
        elif (hm := re.match(r"hc_(attn|ffn)_pre_(weights|post_weights|comb)$", name)) is not None:
            width = n_hc * n_hc if hm[2] == "comb" else n_hc
            for i, row in enumerate(_rows(data, width, str(f))):
                hc[(layer, SUBLAYERS.index(hm[1]), DS4_HC[hm[2]])][pos0 + i] = row
        elif name in ("ffn_moe_topk", "ffn_moe_weights_scaled"):
            for i, row in enumerate(_rows(data, K, str(f))):
                moe[(layer, name)][pos0 + i] = row
    if not carriers:
        raise TraceError(f"{prefix}: no ds4 dump files `{os.path.basename(prefix)}_<name>-<layer>_pos<pos>.bin` found")
    return _assemble("ds4", engine_version, carriers, tokens, n_layers, n_hc, dim, model, top_k, hc, moe)


def import_llamacpp(directory: str | os.PathLike, *, tokens: list[int] | None, config: ModelConfig,
                    model: dict[str, Any], start_pos: int = 0, top_k: int = 20, engine_version: str = "unknown",
                    positions: str | Sequence[int] = "all", full: str | Sequence[str] | None = "all") -> Trace:
    """Build a trace from a llama.cpp capture file (`.npz`, see `import_llamacpp_capture`; `tokens` optional, it
    carries `input_ids`; `positions` / `full` select what is traced) or from per-tensor eval-callback dumps in
    `directory` (rows = start_pos, ...; every covered position, full vectors kept)."""
    if Path(directory).is_file():
        return import_llamacpp_capture(directory, config=config, model=model, tokens=tokens, top_k=top_k,
                                       engine_version=engine_version, positions=positions, full=full)
    if tokens is None:
        raise TraceError(f"{directory}: llama.cpp dump directories carry no token ids; give the tokens")
    n_layers, n_hc, dim = config.n_layers, config.hc_mult, config.dim
    carriers: dict[str, dict[int, np.ndarray]] = defaultdict(dict)
    for f in sorted(Path(directory).iterdir()):
        m = LCP_RE.match(f.name)
        if not m:
            continue
        data = np.load(f) if m["ext"] == "npy" else np.fromfile(f, dtype="<f4")
        data = np.asarray(data, dtype=np.float32)
        name = m["name"]
        if name == "hc_init" or m["l1"] or m["l2"]:
            ck = EMBED if name == "hc_init" else block(int(m["l1"])) if m["l1"] else block_attn(int(m["l2"]))
            rows = _rows(data.ravel(), n_hc * dim, str(f)).reshape(-1, n_hc, dim)
        else:
            ck = FINAL_NORM if name == "result_norm" else LOGITS
            rows = _rows(data.ravel(), dim if ck == FINAL_NORM else config.vocab_size, str(f))
        for i, row in enumerate(rows):
            carriers[ck][start_pos + i] = row
    if not carriers:
        raise TraceError(f"{directory}: no llama.cpp tensor files (hc_init.bin, l_last-N.bin, hc_attn_post-N.bin, "
                         "result_norm.bin, result_output.bin or .npy) found")
    return _assemble("llama.cpp", engine_version, carriers, tokens, n_layers, n_hc, dim, model, top_k, {}, {})


def _assemble(engine: str, version: str, carriers: dict[str, dict[int, np.ndarray]], tokens: list[int],
              n_layers: int, n_hc: int, dim: int, model: dict[str, Any], top_k: int,
              hc: dict, moe: dict) -> Trace:
    """Choose positions (those of the shallowest carrier other than final_norm) and the checkpoints covering them."""
    order = [c for c in trace_checkpoints(n_layers) if c in carriers]
    if not order:
        raise TraceError(f"{engine} import: no carrier checkpoints among {sorted(carriers)}")
    positions = sorted(carriers[next(c for c in order if c != FINAL_NORM) if len(order) > 1 else order[0]])
    bad = [p for p in positions if p >= len(tokens)]
    if bad:
        raise TraceError(f"{engine} import: dumps cover position {bad[0]} but only {len(tokens)} tokens were given")
    keep = [c for c in order if all(p in carriers[c] for p in positions)]
    dropped = [c for c in order if c not in keep]
    logits_ok = LOGITS in carriers and all(p in carriers[LOGITS] for p in positions)
    if FINAL_NORM in keep and not logits_ok:
        raise TraceError(f"{engine} import: final_norm needs the logits (result_output) at the same positions")
    full = [*keep, LOGITS] if logits_ok else keep
    rec = Recorder(keep, positions, full, top_k, n_hc)
    pos = np.array(positions)
    toks = np.array([tokens[p] for p in positions])
    for ck, name in enumerate(keep):
        x = np.stack([carriers[name][p] for p in positions])
        logits = np.stack([carriers[LOGITS][p] for p in positions]) if name == FINAL_NORM else None
        rec.add_checkpoint(ck, pos, toks, x, logits)
        rec.vec[name].append(x.astype(np.float32))
    if logits_ok:
        rec.vec[LOGITS].append(np.stack([carriers[LOGITS][p] for p in positions]).astype(np.float32))
    dropped += _add_ds4_diags(rec, hc, moe, positions)
    header = TraceHeader(engine=engine, engine_version=version, model=model, dtype="float32", n_hc=n_hc, dim=dim,
                         top_k=top_k, tokens=list(tokens), n_prompt=len(tokens), chunks=[len(tokens)], decode=0,
                         positions=positions, checkpoints=keep, full=full,
                         flags={"imported": engine, "import_dropped": dropped})
    return Trace(header, **rec.tables(), vectors=rec.vectors())


def _add_ds4_diags(rec: Recorder, hc: dict, moe: dict, positions: list[int]) -> list[str]:
    """HC mixes and router picks where all parts exist at every position; returns the names of the incomplete ones."""
    dropped = []
    for layer, sub in sorted({(k[0], k[1]) for k in hc}):
        parts = [hc.get((layer, sub, p), {}) for p in ("pre", "post", "comb")]  # absent parts: reported below
        if all(all(q in part for q in positions) for part in parts):
            pre, post, comb = (np.stack([part[q] for q in positions]) for part in parts)
            rec.add_hc(layer, sub, np.array(positions), pre, post, comb)
        else:
            dropped.append(f"hc.{layer}.{SUBLAYERS[sub]}")
    for layer in sorted({k[0] for k in moe}):
        ids, w = moe.get((layer, "ffn_moe_topk"), {}), moe.get((layer, "ffn_moe_weights_scaled"), {})
        if all(q in ids and q in w for q in positions):
            rec.add_moe(layer, np.array(positions), np.stack([ids[q] for q in positions]),
                        np.stack([w[q] for q in positions]), np.full(len(positions), np.nan))
        else:
            dropped.append(f"moe.{layer}")
    return dropped


# ---------------------------------------------------------------- llama.cpp capture files

CAPTURE_EXTRAS = ("input_ids", "output_positions", "chunks", "n_prompt", "meta")


def write_llamacpp_capture(path: str | os.PathLike, arrays: Mapping[str, np.ndarray],
                           meta: dict[str, Any] | None = None) -> Path:
    """Write a capture `.npz` (keys as in `parity.gguf.llamacpp`, plus the extras), atomically."""
    out = dict(arrays)
    if meta is not None:
        out["meta"] = np.array(json.dumps(meta, sort_keys=True))

    def write(f: io.BufferedWriter) -> None:
        np.savez(f, **out)

    return atomic_write(path, write)


@dataclass(frozen=True)
class LlamaCppCapture:
    """A parsed capture: tensors by llama.cpp key, the tokens fed, where the `result_*` rows belong, the schedule."""

    tensors: dict[str, np.ndarray]
    tokens: list[int]
    output_positions: np.ndarray
    chunks: list[int]
    n_prompt: int
    meta: dict[str, Any]


def read_llamacpp_capture(source: str | os.PathLike | Mapping[str, np.ndarray],
                          tokens: Sequence[int] | None = None) -> LlamaCppCapture:
    """Load and check a capture (a path or the arrays). `tokens`, when given, must equal its `input_ids`."""
    if isinstance(source, Mapping):
        arrays, where = dict(source), "capture"
    else:
        where = str(source)
        try:
            with np.load(source, allow_pickle=False) as z:
                arrays = {k: z[k] for k in z.files}
        except (OSError, ValueError) as e:
            raise TraceError(f"{where}: not a llama.cpp capture .npz ({e})") from None
    if "input_ids" in arrays:
        ids = [int(t) for t in np.asarray(arrays["input_ids"]).ravel()]
        if tokens is not None and list(tokens) != ids:
            raise TraceError(f"{where}: the given tokens differ from the capture's input_ids")
    elif tokens is not None:
        ids = [int(t) for t in tokens]
    else:
        raise TraceError(f"{where}: no input_ids in the capture; give the tokens")
    T = len(ids)
    chunks = [int(c) for c in arrays["chunks"]] if "chunks" in arrays else [T]
    n_prompt = int(arrays["n_prompt"]) if "n_prompt" in arrays else T
    if sum(chunks) != T or min(chunks, default=0) < 1 or not 1 <= n_prompt <= T:
        raise TraceError(f"{where}: chunks {chunks} / n_prompt {n_prompt} do not fit the {T} input_ids")
    prefill = 0
    for i, c in enumerate(chunks):
        if prefill >= n_prompt and c != 1:
            raise TraceError(f"{where}: chunk {i} ({c} tokens) after the {n_prompt}-token prompt; decode steps are 1")
        prefill += c
    heads = [k for k in (lcp.NORM_NAME, lcp.LOGITS_NAME) if k in arrays]
    n_out = len(np.asarray(arrays[heads[0]])) if heads else 0
    if "output_positions" in arrays:
        out_pos = np.asarray(arrays["output_positions"], np.int64).ravel()
    elif n_out in (0, T):
        out_pos = np.arange(n_out, dtype=np.int64)
    else:
        raise TraceError(f"{where}: {heads[0]} has {n_out} rows for {T} tokens; the capture needs output_positions")
    if (heads and len(out_pos) != n_out) or (len(out_pos) and (out_pos.min() < 0 or out_pos.max() >= T)):
        raise TraceError(f"{where}: output_positions ({len(out_pos)} entries) do not index the {n_out} result rows "
                         f"within {T} tokens")
    meta = _capture_meta(arrays["meta"], where) if "meta" in arrays else {}
    tensors = {k: v for k, v in arrays.items() if k not in CAPTURE_EXTRAS}
    return LlamaCppCapture(tensors, ids, out_pos, chunks, n_prompt, meta)


META_KEYS = {"engine": str, "engine_version": str, "flags": dict}  # what `v4parity capture llamacpp` writes


def _capture_meta(raw: np.ndarray, where: str) -> dict[str, Any]:
    """The capture's `meta`: a JSON object holding at least engine, engine_version (strings) and flags (object)."""
    try:
        meta = json.loads(str(raw))
    except ValueError as e:
        raise TraceError(f"{where}: meta is not JSON ({e})") from None
    if not isinstance(meta, dict):
        raise TraceError(f"{where}: meta must be a JSON object, got {type(meta).__name__}")
    for key, kind in META_KEYS.items():
        if not isinstance(meta.get(key), kind):
            raise TraceError(f"{where}: meta field {key!r} missing or not a {kind.__name__}")
    return meta


def _per_token(cap: LlamaCppCapture, k: str, shape: tuple[int, ...]) -> np.ndarray | None:
    """A per-token tensor as [T, *shape], or None when absent; a wrong row count is an error."""
    if k not in cap.tensors:
        return None
    a = lcp.rows(cap.tensors[k], shape, k)
    if len(a) != len(cap.tokens):
        raise TraceError(f"capture tensor {k}: {len(a)} rows for {len(cap.tokens)} tokens (tokens on axis 0)")
    return a.astype(np.int64) if lcp.base_name(k) in lcp.INT_NAMES else a.astype(np.float32, copy=False)


def import_llamacpp_capture(source: str | os.PathLike | Mapping[str, np.ndarray], *, config: ModelConfig,
                            model: dict[str, Any], tokens: Sequence[int] | None = None, top_k: int = 20,
                            engine_version: str = "unknown", positions: str | Sequence[int] = "all",
                            full: str | Sequence[str] | None = "all") -> Trace:
    """A trace of a llama.cpp capture: every checkpoint and diagnostic the capture holds at all traced positions;
    the incomplete ones in flags `import_dropped`, keys the map does not know in `import_unmapped`. With the
    capture's `meta` (written by `v4parity capture llamacpp`) the header carries the run's engine, version and
    flags, so the trace equals `trace --engine llamacpp` of the same run apart from the import flags."""
    cap = read_llamacpp_capture(source, tokens)
    cfg, L, H = config, config.n_layers, config.hc_mult
    T = len(cap.tokens)
    pos = np.array(resolve_positions(positions, T))
    toks = np.array(cap.tokens)[pos]
    names = lcp.all_names(cfg)
    src = {EMBED: lcp.EMBED_NAME, **{block_attn(l): lcp.key("hc_attn_post", l) for l in range(L)},
           **{block(l): lcp.key("l_last", l) for l in range(L)}}
    carriers = {ck: a[pos] for ck, k in src.items() if (a := _per_token(cap, k, names[k])) is not None}
    head_ok = {lcp.NORM_NAME, lcp.LOGITS_NAME} <= set(cap.tensors) and set(pos.tolist()) <= set(
        cap.output_positions.tolist())
    if head_ok:
        at = np.searchsorted(np.sort(cap.output_positions), pos)
        order = np.argsort(cap.output_positions)
        carriers[FINAL_NORM], logits = (lcp.rows(cap.tensors[k], names[k], k)[order][at].astype(np.float32)
                                        for k in (lcp.NORM_NAME, lcp.LOGITS_NAME))
    keep = [c for c in trace_checkpoints(L) if c in carriers]
    dropped = [c for c in trace_checkpoints(L) if c not in carriers]
    if not keep:
        raise TraceError("llama.cpp capture: none of hc_init, hc_attn_post-N, l_last-N, result_norm found")
    full_names = [n for n in resolve_full(full, L) if n in keep or (n == LOGITS and head_ok)]
    rec = Recorder(keep, pos.tolist(), full_names, top_k, H)
    for ck, name in enumerate(keep):
        rec.add_checkpoint(ck, pos, toks, carriers[name], logits if name == FINAL_NORM else None)
        if name in rec.vec:
            rec.vec[name].append(carriers[name])
    if LOGITS in rec.vec:
        rec.vec[LOGITS].append(logits)
    for l in range(L):
        dropped += _capture_diags(rec, cap, cfg, l, pos, names)
    known = set(names)
    unmapped = sorted(k for k in cap.tensors if k not in known)
    meta = cap.meta or {"engine": "llama.cpp", "engine_version": engine_version, "flags": {}}  # no meta: the arguments
    flags = {**meta["flags"], "imported": "llama.cpp capture", "import_dropped": dropped,
             "import_unmapped": unmapped}
    header = TraceHeader(engine=meta["engine"], engine_version=meta["engine_version"], model=model,
                         dtype="float32", n_hc=H, dim=cfg.dim, top_k=top_k,
                         tokens=cap.tokens, n_prompt=cap.n_prompt, chunks=cap.chunks, decode=T - cap.n_prompt,
                         positions=pos.tolist(), checkpoints=keep, full=full_names, flags=flags)
    return Trace(header, **rec.tables(), vectors=rec.vectors())


def _capture_diags(rec: Recorder, cap: LlamaCppCapture, cfg: ModelConfig, l: int, pos: np.ndarray,
                   names: dict[str, tuple[int, ...]]) -> list[str]:
    """HC gates, router picks and attention rows of layer l; returns what is incomplete."""
    def get(name: str, occ: int = 1) -> np.ndarray | None:
        k = lcp.key(name, l, occ)
        a = _per_token(cap, k, names[k]) if k in names else None
        return None if a is None else a[pos]

    dropped = []
    for sub, occ in ((0, 1), (1, 2)):
        parts = [get(n, occ) for n in lcp.HC_TWICE]
        if all(p is not None for p in parts):
            rec.add_hc(l, sub, pos, *parts)
        else:
            dropped.append(f"hc.{l}.{SUBLAYERS[sub]}")
    ids, w = get("ffn_moe_topk"), get("ffn_moe_weights_scaled")
    if ids is not None and w is not None:
        biased = None if cfg.is_hash_layer(l) else get("ffn_moe_probs_biased")
        if biased is None and not cfg.is_hash_layer(l):
            dropped.append(f"margin.{l}")
        margin = np.full(len(pos), np.nan, np.float32) if biased is None else lcp.margin(biased, ids.shape[1])
        rec.add_moe(l, pos, ids, w, margin)
    else:
        dropped.append(f"moe.{l}")
    r = cfg.ratio(l)
    picks = get("lid_top_k") if cfg.has_indexer(l) else None
    if get("attn_out") is None or (cfg.has_indexer(l) and picks is None):
        dropped.append(f"attn.{l}")
    else:
        n_comp = (pos + 1) // r if r else np.zeros(len(pos), np.int64)
        sel = lcp.selection(picks, pos, r, cfg.index_topk) if picks is not None else None
        rec.add_attn(l, pos, n_comp, sel)
    return dropped


def llamacpp_chunks(source: str | os.PathLike | Mapping[str, np.ndarray], config: ModelConfig,
                    tokens: Sequence[int] | None = None) -> list[ChunkResult]:
    """The capture as the runner's chunk results (checkpoints, logits, diagnostics and every sub-op capture), through
    the same map the `llamacpp` engine uses. Needs a complete capture (all logits, every mapped tensor)."""
    cap = read_llamacpp_capture(source, tokens)
    T, names = len(cap.tokens), lcp.all_names(config)
    if not np.array_equal(cap.output_positions, np.arange(T)):
        raise TraceError("llama.cpp capture: the chunk view needs result rows at every position (all logits)")
    missing = sorted(set(names) - set(cap.tensors))
    if missing:
        more = f" and {len(missing) - 6} more" if len(missing) > 6 else ""
        raise TraceError(f"llama.cpp capture: the chunk view needs every mapped tensor; missing "
                         f"{', '.join(missing[:6])}{more}")
    out, start = [], 0
    for n in cap.chunks:
        t = {k: (v if lcp.base_name(k) in lcp.CACHE_ROWS else lcp.rows(v, names[k], k)[start:start + n])
             for k, v in cap.tensors.items() if k in names}
        p = start + np.arange(n)
        layers = [lcp.layer_output(t, config, l, p) for l in range(config.n_layers)]
        final, logits = lcp.head_output(t, config, n)
        ckpts = {EMBED: lcp.embed_output(t, config, n), FINAL_NORM: final}
        for l, o in enumerate(layers):
            ckpts[block_attn(l)], ckpts[block(l)] = o.attn_carrier, o.carrier
        out.append(ChunkResult(start, np.array(cap.tokens[start:start + n]), ckpts, logits, [o.diag for o in layers],
                               [o.captures for o in layers]))
        start += n
    return out
