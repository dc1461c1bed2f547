"""The rules every trace obeys, in whichever form it was stored: one validator for text and `.npz`.

`header_from_dict` types and range-checks every header field (a JSON header can hold anything);
`check_header` checks the fields against each other; `check_tables` checks every table column (dtype, shape,
widths from the header) and every row (keys in range and listed in the header, `tok` = the header's token,
no duplicate keys, canonical order, padding cells exactly where the format puts them, one `ckpt` row per
header (checkpoint, position)). The text reader runs the same rules line by line first (to name the line)
and then this validator on the tables it built; the binary reader runs it on the stored columns.
Every failure is `fail(field, message)`, which the readers turn into a `TraceError` naming file and field.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import numpy as np

from parity.contract.checkpoints import (
    MTP_PAIRINGS,
    draft_checkpoints,
    has_top,
    is_draft,
    layers_of,
    per_stream,
    trace_checkpoints,
)
from parity.contract.errors import TraceError, quote
from parity.tracing.records import FORMAT_VERSION, SORT_KEYS, SUBLAYERS, TABLES, Table, TraceHeader
from parity.tracing.stats import FP_DIM
from parity.tracing.subops import check_names

Fail = Callable[[str, str], TraceError]

INT32_MAX = 2**31 - 1
MAX_HC = 64                # ModelConfig's hyper_connection.count bound
MAX_DIM = 1 << 20          # ModelConfig's embedding_length bound
MAX_TOP_K = 1024           # every ckpt row holds top_k cells (padding off final_norm): bounded per line
MAX_LAYER = 9999           # blk.N with at most 4 digits (ModelConfig's block_count bound is 4096)
MODEL_KEYS = ("file", "size", "header_sha256")          # identity written before data hashing (still read)
MODEL_KEYS_DATA = (*MODEL_KEYS, "data_sha256")          # identity covering the tensor data
HEX_RE = re.compile(r"[0-9a-f]{8,64}")
CHECKPOINT_RE = re.compile(r"embed|final_norm|blk\.(0|[1-9][0-9]{0,3})(\.attn)?")
DRAFT_RE = re.compile(r"mtp\.(0|[1-9][0-9]?)(\.in|\.attn|\.logits)?|dspark\.(main|base_logits|bias|logits|confidence|"
                      r"drafts|0|[1-9][0-9]?)")

# header field -> (kind, lo, hi); kinds: str, int, ints (list of int), strs (list of str), dict
HEADER_FIELDS: dict[str, tuple[str, int, int]] = {
    "engine": ("str", 0, 0), "engine_version": ("str", 0, 0), "model": ("dict", 0, 0), "dtype": ("str", 0, 0),
    "n_hc": ("int", 1, MAX_HC), "dim": ("int", 1, MAX_DIM), "top_k": ("int", 1, MAX_TOP_K),
    "tokens": ("ints", 0, INT32_MAX), "n_prompt": ("int", 1, INT32_MAX), "chunks": ("ints", 1, INT32_MAX),
    "decode": ("int", 0, INT32_MAX), "positions": ("ints", 0, INT32_MAX), "checkpoints": ("strs", 0, 0),
    "full": ("strs", 0, 0), "flags": ("dict", 0, 0), "version": ("int", FORMAT_VERSION, FORMAT_VERSION),
    "subops": ("strs", 0, 0), "draft": ("dict", 0, 0),
}
OPTIONAL_FIELDS = ("subops", "draft")  # absent in traces without sub-op records / drafter (and in older traces)
# the header's `draft`: the drafter file's identity, its head and layout, and what the draft checkpoints depend on
DRAFT_KEYS = {"mtp": ("kind", "layout", *MODEL_KEYS_DATA, "pairing", "depth"),
              "dspark": ("kind", "layout", *MODEL_KEYS_DATA, "stages", "block_size")}
MAX_DRAFT = 99             # MTP depth / DSpark stages (mtp.N / dspark.N with at most 2 digits)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_field(key: str, v: Any, fail: Fail) -> None:
    kind, lo, hi = HEADER_FIELDS[key]
    if kind == "str" and not isinstance(v, str):
        raise fail(key, f"expected a string, got {type(v).__name__}")
    if kind == "dict" and not isinstance(v, dict):
        raise fail(key, f"expected a JSON object, got {type(v).__name__}")
    if kind == "int" and not (_is_int(v) and lo <= v <= hi):
        raise fail(key, f"expected an integer in [{lo}, {hi}], got {quote(v, 40)}")
    if kind in ("ints", "strs"):
        if not isinstance(v, list):
            raise fail(key, f"expected a list, got {type(v).__name__}")
        if kind == "strs" and not all(isinstance(x, str) for x in v):
            raise fail(key, "expected a list of strings")
        if kind == "ints" and not all(_is_int(x) and lo <= x <= hi for x in v):
            bad = next(x for x in v if not (_is_int(x) and lo <= x <= hi))
            raise fail(key, f"expected a list of integers in [{lo}, {hi}], found {quote(bad, 40)}")


def header_from_dict(d: Any, fail: Fail) -> TraceHeader:
    """A `TraceHeader` from a decoded JSON object, every field typed and range-checked, then `check_header`."""
    if not isinstance(d, dict):
        raise fail("header.json", "must be a JSON object")
    missing = [n for n in HEADER_FIELDS if n not in d and n not in OPTIONAL_FIELDS]
    if missing:
        raise fail(missing[0], f"required header field(s) missing: {', '.join(missing)}")
    unknown = sorted(k for k in d if k not in HEADER_FIELDS)
    if unknown:
        raise fail(str(unknown[0])[:40], f"unknown header field(s) {quote(unknown, 40)}")
    for key in HEADER_FIELDS:
        if key in d:
            _check_field(key, d[key], fail)
    if "draft" in d and not d["draft"]:
        raise fail("draft", "an empty drafter entry; a trace without a drafter leaves the key out")
    h = TraceHeader(**{n: d[n] for n in HEADER_FIELDS if n in d})
    check_header(h, fail)
    return h


def check_model(m: Any, fail: Fail) -> None:
    """The model identity: file, size, header_sha256 and (identities written since data hashing) data_sha256."""
    if not isinstance(m, dict) or tuple(sorted(m)) not in (tuple(sorted(MODEL_KEYS)), tuple(sorted(MODEL_KEYS_DATA))):
        keys = sorted(m) if isinstance(m, dict) else type(m).__name__
        raise fail("model", f"must hold exactly file, size and header_sha256 (and data_sha256), got {quote(keys, 40)}")
    if not isinstance(m["file"], str) or not m["file"] or m["file"] != m["file"].strip() or "\n" in m["file"]:
        raise fail("model", f"file must be a non-empty one-line name, got {quote(m['file'], 40)}")
    if not (_is_int(m["size"]) and 0 <= m["size"] < 2**63):
        raise fail("model", f"size must be a non-negative integer, got {quote(m['size'], 40)}")
    for key in ("header_sha256", "data_sha256"):
        if key in m and not (isinstance(m[key], str) and HEX_RE.fullmatch(m[key])):
            raise fail("model", f"{key} must be 8..64 lowercase hex digits, got {quote(m[key], 40)}")


def check_header(h: TraceHeader, fail: Fail) -> None:
    """Cross-field consistency of a header (same rules for both forms)."""
    v = h.engine_version
    if not re.fullmatch(r"\S+", h.engine) or not v or v != v.strip() or "\n" in v or "\r" in v:
        raise fail("engine", "engine name must be one word and the version a non-empty, trimmed line")
    if not re.fullmatch(r"\S+", h.dtype):
        raise fail("dtype", f"must be one word, got {quote(h.dtype, 40)}")
    check_model(h.model, fail)
    if h.n_prompt + h.decode != len(h.tokens):
        raise fail("tokens", f"{len(h.tokens)} token ids, but n_prompt {h.n_prompt} + decode {h.decode} "
                             f"= {h.n_prompt + h.decode}")
    if sum(h.chunks) != len(h.tokens) or any(c < 1 for c in h.chunks):
        raise fail("chunks", f"chunk sizes {quote(h.chunks, 40)} must be >= 1 and sum to the {len(h.tokens)} tokens")
    if spec_only(h):   # spec records alone (parity.tracing.specrecords): the readers require at least one
        if h.full or h.subops or h.draft:
            raise fail("checkpoints", "a trace without checkpoints (spec records only) has no full vectors, sub-op "
                                      "records or drafter entry")
        return
    if not h.positions or h.positions != sorted(set(h.positions)) or h.positions[-1] >= len(h.tokens):
        raise fail("positions", f"must be ascending, unique and < {len(h.tokens)}, got {quote(h.positions, 40)}")
    if not h.checkpoints:
        raise fail("checkpoints", "no checkpoints listed")
    bad = [c for c in h.checkpoints if not (CHECKPOINT_RE.fullmatch(c) or DRAFT_RE.fullmatch(c))]
    if bad:
        raise fail("checkpoints", f"unknown checkpoint name(s) {quote(bad, 40)}; valid: embed, blk.N, blk.N.attn "
                                  f"(N <= {MAX_LAYER}), final_norm, and with a drafter mtp.K(.in|.attn|.logits) or "
                                  "dspark.(main|S|base_logits|bias|logits|confidence|drafts)")
    trunk = [c for c in h.checkpoints if not is_draft(c)]
    order = trace_checkpoints(layers_of(h.checkpoints))
    if trunk != [c for c in order if c in trunk]:
        raise fail("checkpoints", "must be listed once each in depth order: embed, blk.0.attn, blk.0, ..., final_norm")
    check_draft(h, fail)
    extra = [c for c in h.full if c not in h.checkpoints and c != "logits"]
    if extra or len(set(h.full)) != len(h.full):
        raise fail("full", f"full vectors for checkpoint(s) {quote(extra or h.full, 40)} that are not in 'checkpoints' "
                           "or listed twice")
    check_names(h.subops, fail)


def spec_only(h: TraceHeader) -> bool:
    """A header listing neither checkpoints nor positions: a trace of `spec` records alone."""
    return not h.checkpoints and not h.positions


def check_draft(h: TraceHeader, fail: Fail) -> None:
    """The header's `draft` entry and the draft checkpoints: none without a drafter; with one, exactly
    `draft_checkpoints(kind, depth | stages)` after the trunk's, in that order."""
    drafts = [c for c in h.checkpoints if is_draft(c)]
    if not h.draft:
        if drafts:
            raise fail("checkpoints", f"draft checkpoint(s) {quote(drafts, 40)} but no 'draft' header entry naming "
                                      "the drafter")
        return
    d = h.draft
    kind = d.get("kind")
    if kind not in DRAFT_KEYS:
        raise fail("draft", f"kind must be one of {', '.join(DRAFT_KEYS)}, got {quote(kind, 40)}")
    if sorted(d) != sorted(DRAFT_KEYS[kind]):
        raise fail("draft", f"a drafter entry of kind {kind} holds exactly {', '.join(DRAFT_KEYS[kind])}, got "
                            f"{quote(sorted(d), 80)}")
    check_model({k: d[k] for k in MODEL_KEYS_DATA}, lambda _f, msg: fail("draft", msg))
    if not isinstance(d["layout"], str) or not re.fullmatch(r"[a-z0-9-]+", d["layout"]):
        raise fail("draft", f"layout must be a lowercase word, got {quote(d['layout'], 40)}")
    sizes = ("depth",) if kind == "mtp" else ("stages", "block_size")
    for key in sizes:
        if not (_is_int(d[key]) and 1 <= d[key] <= (MAX_DRAFT if key != "block_size" else INT32_MAX)):
            raise fail("draft", f"{key} must be an integer >= 1 (<= {MAX_DRAFT} for depth / stages), got "
                                f"{quote(d[key], 40)}")
    if kind == "mtp" and d["pairing"] not in MTP_PAIRINGS:
        raise fail("draft", f"pairing must be one of {', '.join(MTP_PAIRINGS)}, got {quote(d['pairing'], 40)}")
    want = draft_checkpoints(kind, d["depth" if kind == "mtp" else "stages"])
    if drafts != want or h.checkpoints[-len(want):] != want:
        raise fail("checkpoints", f"a {kind} drafter's checkpoints follow the trunk's as {quote(want, 80)}, got "
                                  f"{quote(drafts, 80)}")


def _widths(h: TraceHeader, tables: dict[str, Table]) -> dict[str, int]:
    """Trailing widths: H, F, K from the header; E and S from the stored columns (free in the format)."""
    moe, attn = tables["moe"], tables["attn"]
    return {"H": h.n_hc, "HH": h.n_hc ** 2, "F": FP_DIM, "K": h.top_k,
            "E": moe["ids"].shape[1] if moe["ids"].ndim == 2 else -1,
            "S": attn["sel"].shape[1] if attn["sel"].ndim == 2 else -1}


def check_tables(h: TraceHeader, tables: dict[str, Table], fail: Fail) -> None:
    """Every column and row rule of the format (see the module docstring)."""
    widths = _widths(h, tables)
    for kind, spec in TABLES.items():
        t = tables[kind]
        for c, (dtype, shape) in spec.items():
            arr = t[c]
            want = (widths[shape],) if shape else ()
            if arr.dtype != np.dtype(dtype):
                raise fail(f"{kind}.{c}", f"dtype {arr.dtype}, expected {dtype}")
            if arr.ndim != 1 + len(want) or arr.shape[1:] != want:
                raise fail(f"{kind}.{c}", f"rows of shape {arr.shape[1:]}, expected {want}")
        if len({len(t[c]) for c in spec}) > 1:
            raise fail(kind, "columns have different lengths")
    n_layers = layers_of(h.checkpoints)
    positions = np.asarray(h.positions, np.int64)
    for kind, t in tables.items():
        pos = t["pos"].astype(np.int64)
        if not np.isin(pos, positions).all():
            p = int(pos[~np.isin(pos, positions)][0])
            raise fail(f"{kind}.pos", f"position {p} is not in the header's positions")
        if kind != "ckpt" and len(t) and (t["layer"].min() < 0 or t["layer"].max() >= n_layers):
            raise fail(f"{kind}.layer", f"layer out of range [0, {n_layers})")
        _check_keys(kind, t, fail)
    _check_ckpt(h, tables["ckpt"], fail)
    hc, moe, attn = tables["hc"], tables["moe"], tables["attn"]
    if len(hc) and not np.isin(hc["sub"], np.arange(len(SUBLAYERS))).all():
        raise fail("hc.sub", "sub-layer must be 0 (attn) or 1 (ffn)")
    if (moe["ids"] < 0).any():
        raise fail("moe.ids", "expert ids must be >= 0")
    sel = attn["sel"]
    if (attn["n_comp"] < 0).any() or (sel.size and sel.min() < -1):
        raise fail("attn.sel", "n_comp must be >= 0 and selections >= -1")
    if not _only_minus_one(sel, ~attn["has_sel"]):
        raise fail("attn.sel", "rows without a selection (has_sel false) must hold only -1")


SEL_BLOCK = 4096  # rows of the selection table per block in `_only_minus_one`


def _only_minus_one(sel: np.ndarray, rows: np.ndarray) -> bool:
    """Whether every row of `sel` [n, S] (entries already known >= -1) marked in `rows` [n] bool holds only -1.

    The largest column of a trace (62 % of the bench's 88 x 4096 trace), so no per-row temporaries and no copy of
    it: a block of `SEL_BLOCK` rows is skipped when none is marked, reduced as one array when all are, and per row
    only when mixed (a trace's rows are sorted by (layer, pos), so rows without a selection come in runs)."""
    if not sel.shape[1]:
        return True
    for i in range(0, len(sel), SEL_BLOCK):
        marked = rows[i:i + SEL_BLOCK]
        if marked.all():
            if sel[i:i + SEL_BLOCK].max() != -1:
                return False
        elif marked.any() and (sel[i:i + SEL_BLOCK][marked].max(axis=1) != -1).any():
            return False
    return True


def _check_keys(kind: str, t: Table, fail: Fail) -> None:
    """Rows sorted by the table's key columns, no key twice."""
    if len(t) < 2:
        return
    keys = np.stack([t[k].astype(np.int64) for k in SORT_KEYS[kind]], axis=1)
    step = keys[1:] - keys[:-1]
    first = np.argmax(step != 0, axis=1)
    sign = step[np.arange(len(step)), first]
    if (sign < 0).any():
        raise fail(kind, f"rows are not in canonical order ({', '.join(SORT_KEYS[kind])})")
    if (sign == 0).any():
        i = int(np.flatnonzero(sign == 0)[0]) + 1
        raise fail(kind, f"duplicate row for key {dict(zip(SORT_KEYS[kind], keys[i].tolist(), strict=True))}")


def _check_ckpt(h: TraceHeader, c: Table, fail: Fail) -> None:
    ck = c["ck"].astype(np.int64)
    if len(c) and (ck.min() < 0 or ck.max() >= len(h.checkpoints)):
        raise fail("ckpt.ck", "checkpoint index out of range")
    tokens = np.asarray(h.tokens, np.int64)
    bad = np.flatnonzero(c["tok"] != tokens[c["pos"]]) if len(c) else []
    if len(bad):
        i = int(bad[0])
        raise fail("ckpt.tok", f"token {c['tok'][i]} at position {c['pos'][i]}, but the header's tokens say "
                               f"{tokens[c['pos'][i]]}")
    one_l2 = np.isin(ck, [i for i, n in enumerate(h.checkpoints) if not per_stream(n)])
    if not np.isnan(c["l2s"][one_l2][:, 1:]).all():
        raise fail("ckpt.l2s", "rows of final_norm and the other single vectors (dspark.main, logits, confidence, "
                               "drafts) hold one l2 number; the other cells must be NaN")
    top = np.isin(ck, [i for i, n in enumerate(h.checkpoints) if has_top(n)])
    if (c["argmax"][top] < 0).any() or (c["top_ids"][top] < 0).any():
        raise fail("ckpt.top_ids", "final_norm and mtp.K.logits rows need argmax and top-k ids >= 0")
    off = ~top
    if ((c["argmax"][off] != -1).any() or (c["top_ids"][off] != -1).any()
            or not np.isnan(c["top_logits"][off]).all()):
        raise fail("ckpt.top_ids", "only final_norm and mtp.K.logits rows carry argmax/top-k (others: -1 and NaN)")
    check_complete(h, ck, c["pos"], lambda msg: fail("ckpt", msg))


def check_complete(h: TraceHeader, ck: np.ndarray, pos: np.ndarray, fail: Callable[[str], TraceError]) -> None:
    """Every (checkpoint, position) of the header must have a ckpt record (ck, pos: distinct row keys), a draft
    checkpoint at exactly its own positions (`TraceHeader.positions_of`)."""
    ck, pos = np.asarray(ck, np.int64), np.asarray(pos, np.int64)
    listed = np.isin(pos, h.positions) & (ck >= 0) & (ck < len(h.checkpoints))
    counts = np.bincount(ck[listed], minlength=len(h.checkpoints))
    for k, name in enumerate(h.checkpoints):
        want = h.positions_of(name)
        if counts[k] == len(want) and (not is_draft(name) or np.isin(pos[ck == k], want).all()):
            continue
        present = set(pos[ck == k].tolist())
        missing = [p for p in want if p not in present]
        if missing:
            raise fail(f"no record for checkpoint {name} at position {missing[0]}")
        extra = sorted(present - set(want))
        raise fail(f"checkpoint {name} has a record at position {extra[0]}, where it has none (draft checkpoints: "
                   "docs/trace-format.md)")
