"""Turn other engines' tensor dumps into traces (statistics computed here from the full vectors).

* ds4 graph dumps (`DS4_METAL_GRAPH_DUMP_PREFIX=P`, spec ds4-formats §3.2): files
  `P_<name>-<layer>_pos<pos>.bin` (raw little-endian f32, `.i32` for int32), row-major [n_tokens, ...]
  starting at `pos` (a prefill chunk holds n_tokens rows). Used: `hc_ffn_post` -> blk.l,
  `hc_attn_post` -> blk.l.attn, `result_norm` -> final_norm and `result_output` -> logits (layer L,
  pos 0, overwritten every step: they belong to the LAST position of the run), the HC mixes
  (`hc_{attn,ffn}_pre_weights/_post_weights/_comb`) and the router (`ffn_moe_topk`, `ffn_moe_weights_scaled`).
  ds4 has no embedding dump, so an imported ds4 trace has no `embed` checkpoint.
* llama.cpp eval-callback tensors saved one file per tensor name (`<name>.bin` raw f32 or `<name>.npy`),
  each holding the whole ubatch row-major [n_tokens, ...] (ggml ne0 fastest): `hc_init` -> embed,
  `hc_attn_post-l` -> blk.l.attn, `l_last-l` -> blk.l, `result_norm` -> final_norm, `result_output` -> logits.

A checkpoint is kept only if it covers every imported position; dropped ones are listed in the
trace's flags (`import_dropped`) so the omission is visible in every diff, as are ds4 HC mixes
(`hc.<layer>.<attn|ffn>`) and router picks (`moe.<layer>`) that are incomplete.
"""

from __future__ import annotations

import os
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from parity.contract.checkpoints import EMBED, FINAL_NORM, LOGITS, block, block_attn, trace_checkpoints
from parity.contract.errors import TraceError
from parity.gguf.config import ModelConfig
from parity.tracing.recorder import Recorder
from parity.tracing.records import SUBLAYERS, Trace, TraceHeader

DS4_RE = re.compile(r"^(?P<name>[A-Za-z0-9_]+)-(?P<layer>\d+)_pos(?P<pos>\d+)\.(?P<ext>bin|i32)$")
LCP_RE = re.compile(r"^(?P<name>hc_init|result_norm|result_output|l_last-(?P<l1>\d+)|hc_attn_post-(?P<l2>\d+))"
                    r"\.(?P<ext>bin|npy)$")
DS4_HC = {"weights": "pre", "post_weights": "post", "comb": "comb"}


def _rows(data: np.ndarray, width: int, what: str) -> np.ndarray:
    if data.size % width:
        raise TraceError(f"{what}: {data.size} values is not a multiple of the row width {width}")
    return data.reshape(-1, width)


def import_ds4(prefix: str | os.PathLike, *, tokens: list[int], config: ModelConfig, model: dict[str, Any],
               top_k: int = 20, engine_version: str = "unknown") -> Trace:
    """Build a trace from ds4's `P_<name>-<layer>_pos<pos>.bin` dumps (positions index `tokens`)."""
    n_layers, n_hc, dim, K = config.n_layers, config.hc_mult, config.dim, config.n_activated_experts
    prefix = Path(prefix)
    files = sorted(prefix.parent.glob(prefix.name + "_*"))
    carriers: dict[str, dict[int, np.ndarray]] = defaultdict(dict)
    hc: dict[tuple[int, int, str], dict[int, np.ndarray]] = defaultdict(dict)
    moe: dict[tuple[int, str], dict[int, np.ndarray]] = defaultdict(dict)
    last = len(tokens) - 1
    for f in files:
        m = DS4_RE.match(f.name[len(prefix.name) + 1:])
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
        raise TraceError(f"{prefix}: no ds4 dump files `{prefix.name}_<name>-<layer>_pos<pos>.bin` found")
    return _assemble("ds4", engine_version, carriers, tokens, n_layers, n_hc, dim, model, top_k, hc, moe)


def import_llamacpp(directory: str | os.PathLike, *, tokens: list[int], config: ModelConfig, model: dict[str, Any],
                    start_pos: int = 0, top_k: int = 20, engine_version: str = "unknown") -> Trace:
    """Build a trace from per-tensor llama.cpp eval-callback dumps in `directory` (rows = start_pos, ...)."""
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
