"""Reading and writing traces: a line-per-record text form and a columnar `.npz` form.

Text (`docs/trace-format.md`): a header block (`v4parity-trace 1` ... `end`) then one record per
line (`ckpt`, `hc`, `moe`, `attn`, `spec`), writable with fprintf; `spec` records exist in the text form
only. Binary: an uncompressed zip of `.npy` columns (`ckpt.fp`, `moe.ids`, ...) plus `header.json`.
`read_trace` detects the form from the first bytes. Every write is atomic (temp file + rename) and
deterministic (same trace, same bytes: fixed float formatting, canonical row order, fixed zip timestamps).
Full vectors and sub-op records go to a side file `<stem>.vectors.npz` next to the trace (present when the
header lists `full` checkpoints or `subops`).
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import re
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from parity.contract.checkpoints import checkpoint_index, has_top, layers_of, per_stream, vector_shape
from parity.contract.errors import TraceError
from parity.contract.files import atomic_write_bytes
from parity.tracing.consistency import check_vector_stats
from parity.tracing.records import FORMAT_NAME, FORMAT_VERSION, SUBLAYERS, TABLES, Table, Trace, TraceHeader, make_table
from parity.tracing.specrecords import check_spec, format_spec, parse_spec
from parity.tracing.stats import FP_DIM
from parity.tracing.subops import check_records, record_members
from parity.tracing.validate import INT32_MAX, check_tables, header_from_dict, spec_only
from parity.tracing.zipstore import ZIP_MAGIC, StoredZip

ZIP_DATE = (1980, 1, 1, 0, 0, 0)
HEADER_KEYS = ("engine", "model", "model_data", "dtype", "hc", "dim", "top_k", "tokens", "n_prompt", "chunks", "decode",
               "positions", "checkpoints", "full", "subops", "draft", "flags")
OPTIONAL_KEYS = ("model_data", "subops", "draft")  # absent in traces whose model identity predates the data hash /
# without sub-op records / without a drafter
TRACE_ID = "trace_sha256"  # side-file member binding it to its trace
REGEN_HINT = "re-run `v4parity trace ...` (or your engine's writer) to regenerate it"


# ----------------------------------------------------------------------------------------------
# Deterministic zip writing (files are written with parity.contract.files.atomic_write)

def npz_bytes(arrays: dict[str, np.ndarray], extra: dict[str, bytes] | None = None) -> bytes:
    """An uncompressed `.npz` readable by `np.load`, byte-identical for identical arrays (fixed zip dates)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        for name, data in (extra or {}).items():
            z.writestr(zipfile.ZipInfo(name, ZIP_DATE), data)
        for name, arr in arrays.items():
            member = io.BytesIO()
            np.lib.format.write_array(member, np.ascontiguousarray(arr), allow_pickle=False)
            z.writestr(zipfile.ZipInfo(f"{name}.npy", ZIP_DATE), member.getvalue())
    return buf.getvalue()


def write_npz(path: str | os.PathLike, arrays: dict[str, np.ndarray], extra: dict[str, bytes] | None = None) -> Path:
    """`npz_bytes`, written atomically."""
    return atomic_write_bytes(path, npz_bytes(arrays, extra))


# ----------------------------------------------------------------------------------------------
# Public entry points

def vectors_path(trace_path: str | os.PathLike) -> Path:
    """Side file for full vectors: `run.trace` -> `run.vectors.npz`."""
    p = Path(trace_path)
    return p.with_name(p.name.rsplit(".", 1)[0] + ".vectors.npz")


def content_id(data: bytes) -> str:
    """A trace file's content id: sha256 of its bytes, hex (the side file carries it as `trace_sha256`)."""
    return hashlib.sha256(data).hexdigest()


def write_trace(trace: Trace, path: str | os.PathLike, form: str | None = None) -> Path:
    """Write `trace` as text (default) or binary (`form='npz'` or a `.npz` path), plus its vectors side file.

    The side file is bound to the trace: it carries `trace_sha256`, the content id of the trace bytes written
    with it, and `read_trace` refuses a side file whose id is not the trace's (the two are renamed one after
    the other, so an interrupted write or an older side file beside a newer trace can never be loaded as a pair).
    """
    path = Path(path)
    form = form or ("npz" if path.suffix == ".npz" else "text")
    if form not in ("text", "npz"):
        raise TraceError(f"unknown trace form {form!r} (text | npz)")
    if form == "text":
        data = format_text(trace).encode()
    elif trace.spec:
        raise TraceError(f"{path}: spec records are written in the text form only; give a path not ending in .npz")
    else:
        data = npz_bytes(_binary_columns(trace), {"header.json": _header_json(trace.header).encode()})
    h = trace.header
    if h.full or h.subops:
        side = vectors_path(path)
        if side == path:
            raise TraceError(f"{path}: the trace and its vectors side file would share a name; pick another name")
        if h.full and not trace.vectors:
            raise TraceError(f"trace lists full vectors for {h.full} but holds none to write")
        records = record_members(h)
        absent = [m for m in records if m not in (trace.subops or {})]
        if absent:
            raise TraceError(f"trace lists sub-op records {h.subops} but holds no {absent[0]} to write")
        write_npz(side, {"positions": np.asarray(h.positions, np.int64),
                         TRACE_ID: np.asarray([content_id(data)]),
                         **{n: trace.vectors[n] for n in h.full},    # type: ignore[index]
                         **{m: trace.subops[m] for m in records}})   # type: ignore[index]
    return atomic_write_bytes(path, data)


def read_trace(path: str | os.PathLike, load_vectors: bool = True, allow_spec_only: bool = False) -> Trace:
    """Read a text or binary trace (autodetected) and, when present and wanted, its vectors side file. A trace of
    spec records alone (no checkpoints) is refused unless `allow_spec_only` (`v4parity spec --candidate`)."""
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"{path}: no such trace file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic == ZIP_MAGIC:
        trace, z = _read_binary(path)
        trace_id = z.sha256
    else:
        raw = path.read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise TraceError(f"{path}: field 'file': not UTF-8 text (byte {e.start})") from None
        trace = parse_text(text, str(path))
        trace_id = lambda: content_id(raw)  # noqa: E731
    if spec_only(trace.header) and not allow_spec_only:
        raise TraceError(f"{path}: field 'checkpoints': a trace of spec records alone (no checkpoints); "
                         "`v4parity spec --candidate` reads it, the other commands need checkpoint records")
    if load_vectors and (trace.header.full or trace.header.subops):
        vectors, subops = _read_vectors(vectors_path(path), trace.header, trace_id)
        trace.vectors = vectors if trace.header.full else None
        trace.subops = subops if trace.header.subops else None
        check_vector_stats(trace, lambda m: TraceError(f"{path}: field 'ckpt': {m}"))
    return trace


# ----------------------------------------------------------------------------------------------
# Text form: writer

def fmt(x: float) -> str:
    """A float32 as the shortest %g form that round-trips (9 significant digits suffice)."""
    v = float(x)
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return f"{v:.9g}"


def _floats(a: np.ndarray) -> str:
    return ",".join(fmt(v) for v in a)


def _ints(a: np.ndarray) -> str:
    return ",".join(str(int(v)) for v in a)


def format_header(h: TraceHeader) -> list[str]:
    m = h.model
    return [
        f"{FORMAT_NAME} {h.version}",
        f"engine {h.engine} {h.engine_version}",
        f"model {m['size']} {m['header_sha256']} {m['file']}",
        *([f"model_data {m['data_sha256']}"] if "data_sha256" in m else []),
        f"dtype {h.dtype}",
        f"hc {h.n_hc}",
        f"dim {h.dim}",
        f"top_k {h.top_k}",
        "tokens " + " ".join(map(str, h.tokens)),
        f"n_prompt {h.n_prompt}",
        "chunks " + " ".join(map(str, h.chunks)),
        f"decode {h.decode}",
        "positions" + "".join(f" {p}" for p in h.positions),
        "checkpoints" + "".join(f" {c}" for c in h.checkpoints),
        "full " + (" ".join(h.full) or "-"),
        *(["subops " + " ".join(h.subops)] if h.subops else []),
        *(["draft " + json.dumps(h.draft, sort_keys=True, separators=(",", ":"))] if h.draft else []),
        "flags " + json.dumps(h.flags, sort_keys=True, separators=(",", ":")),
        "end",
    ]


def format_text(trace: Trace) -> str:
    """The whole trace as text; one record per line, canonical order, newline-terminated."""
    h = trace.header
    lines = format_header(h)
    c = trace.ckpt
    for i in range(len(c)):
        name = h.checkpoints[c["ck"][i]]
        k = checkpoint_index(name, trace.n_layers)
        l2s = c["l2s"][i][: h.n_hc if per_stream(name) else 1]
        line = (f"ckpt {k} {name} pos {c['pos'][i]} tok {c['tok'][i]}: min={fmt(c['min'][i])} max={fmt(c['max'][i])} "
                f"rms={fmt(c['rms'][i])} l2s={_floats(l2s)} sum_l2={fmt(c['sum_l2'][i])} fp={_floats(c['fp'][i])}")
        if has_top(name):
            pairs = ",".join(f"{int(t)}:{fmt(v)}" for t, v in zip(c["top_ids"][i], c["top_logits"][i], strict=True))
            line += f" argmax={c['argmax'][i]} top={pairs}"
        lines.append(line)
    t = trace.hc
    for i in range(len(t)):
        lines.append(f"hc {t['layer'][i]} {SUBLAYERS[t['sub'][i]]} pos {t['pos'][i]}: pre={_floats(t['pre'][i])} "
                     f"post={_floats(t['post'][i])} comb={_floats(t['comb'][i])}")
    t = trace.moe
    for i in range(len(t)):
        lines.append(f"moe {t['layer'][i]} pos {t['pos'][i]}: ids={_ints(t['ids'][i])} w={_floats(t['w'][i])} "
                     f"margin={fmt(t['margin'][i])}")
    t = trace.attn
    for i in range(len(t)):
        sel = _ints(t["sel"][i]) if t["has_sel"][i] else "-"
        lines.append(f"attn {t['layer'][i]} pos {t['pos'][i]}: n_comp={t['n_comp'][i]} sel={sel}")
    lines += [format_spec(r, fmt) for r in trace.spec]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------
# Text form: reader

class _Line:
    """One text line being parsed; every failure names file:line and the field."""

    def __init__(self, source: str, lineno: int, text: str) -> None:
        self.source, self.lineno, self.text = source, lineno, text

    def fail(self, field: str, msg: str) -> TraceError:
        return TraceError(f"{self.source}:{self.lineno}: field '{field[:40]}': {msg}\n  {self.text[:160]}")

    def int(self, field: str, s: str, lo: int = 0, hi: int = INT32_MAX) -> int:
        if not INT_RE.fullmatch(s):
            raise self.fail(field, f"expected an integer, got {s[:40]!r}")
        v = int(s)
        if not lo <= v <= hi:
            raise self.fail(field, f"must be in [{lo}, {hi}], got {v}")
        return v

    def float(self, field: str, s: str) -> float:
        return parse_number(s, lambda msg: self.fail(field, msg))

    def floats(self, field: str, s: str, n: int | None) -> list[float]:
        vals = [self.float(field, v) for v in s.split(",")] if s else []
        if n is not None and len(vals) != n:
            raise self.fail(field, f"expected {n} comma-separated numbers, got {len(vals)}")
        return vals

    def ints(self, field: str, s: str, n: int | None, lo: int = 0) -> list[int]:
        vals = [self.int(field, v, lo) for v in s.split(",")] if s else []
        if n is not None and len(vals) != n:
            raise self.fail(field, f"expected {n} comma-separated integers, got {len(vals)}")
        return vals


# The number grammar of the text form (docs/trace-format.md): ASCII only, what C's printf writes with
# %d, %g/%e/%f and %a; strtod reads all of these. Anything else (digit separators, non-ASCII digits,
# "nan(...)", leading/trailing spaces) is refused.
INT_RE = re.compile(r"[+-]?[0-9]{1,20}", re.ASCII)
DEC_RE = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?", re.ASCII)
HEX_RE = re.compile(r"[+-]?0[xX]([0-9a-fA-F]+\.?[0-9a-fA-F]*|\.[0-9a-fA-F]+)([pP][+-]?[0-9]+)?", re.ASCII)
SPECIAL_RE = re.compile(r"[+-]?(inf|infinity|nan)", re.ASCII | re.IGNORECASE)


def parse_number(s: str, fail: Callable[[str], TraceError]) -> float:
    """One number of the text grammar as a float (out-of-range magnitudes become +-inf, as strtod gives)."""
    if DEC_RE.fullmatch(s) or SPECIAL_RE.fullmatch(s):
        return float(s)
    if HEX_RE.fullmatch(s):
        try:
            return float.fromhex(s)
        except OverflowError:
            return -math.inf if s.startswith("-") else math.inf
    raise fail(f"expected a number, got {s[:40]!r}")


def _finite_json_number(s: str) -> float:
    v = float(s)
    if not math.isfinite(v):
        raise ValueError(f"number {s[:40]} is beyond float64 (JSON numbers are finite)")
    return v


def _no_json_constant(s: str) -> None:
    raise ValueError(f"{s} is not a JSON number (JSON numbers are finite)")


def _strict_json(text: str) -> Any:
    """`json.loads` refusing what JSON has no room for: NaN, Infinity and numbers beyond float64 (`1e999`) raise
    ValueError instead of decoding to a float that no JSON writer can write back."""
    return json.loads(text, parse_float=_finite_json_number, parse_constant=_no_json_constant)


def _parse_header(lines: list[_Line], source: str) -> tuple[TraceHeader, int]:
    """Header lines up to `end` -> (header, index of the first record line)."""
    first = lines[0] if lines else _Line(source, 1, "")
    parts = first.text.split()
    if len(parts) != 2 or parts[0] != FORMAT_NAME:
        raise first.fail("format", f"not a v4parity trace: the first line must be '{FORMAT_NAME} {FORMAT_VERSION}'")
    version = first.int("format", parts[1])
    if version != FORMAT_VERSION:
        raise first.fail("format", f"trace format version {version}, this v4parity reads {FORMAT_VERSION}; "
                                   f"{REGEN_HINT}")
    raw: dict[str, tuple[_Line, str]] = {}
    for i, ln in enumerate(lines[1:], start=1):
        key, _, rest = ln.text.partition(" ")
        if key == "end":
            return _header_from_fields(raw, first, version), i + 1
        if key not in HEADER_KEYS:
            raise ln.fail(key, f"unknown header key (expected one of {', '.join(HEADER_KEYS)} or 'end')")
        if key in raw:
            raise ln.fail(key, "header key given twice")
        raw[key] = (ln, rest.strip())
    raise first.fail("end", "header block is not terminated by an 'end' line")


TEXT_KEY = {"n_hc": "hc", "engine_version": "engine", "version": "format"}  # header field -> text key


def _header_from_fields(raw: dict[str, tuple[_Line, str]], first: _Line, version: int) -> TraceHeader:
    missing = [k for k in HEADER_KEYS if k not in raw and k not in OPTIONAL_KEYS]
    if missing:
        raise first.fail(missing[0], f"required header key(s) missing: {', '.join(missing)}")

    def words(key: str, n: int | None = None) -> tuple[_Line, list[str]]:
        ln, rest = raw[key]
        w = rest.split(maxsplit=(n - 1) if n else -1)
        if n is not None and len(w) != n:
            raise ln.fail(key, f"expected {n} values, got {len(w)}")
        return ln, w

    def one_int(key: str) -> int:
        ln, w = words(key, 1)
        return ln.int(key, w[0], -INT32_MAX)

    def int_list(key: str) -> list[int]:
        ln, w = words(key)
        return [ln.int(key, v, -INT32_MAX) for v in w]

    _, eng = words("engine", 2)
    lm, mod = words("model", 3)
    model = {"file": mod[2], "size": lm.int("model", mod[0], 0, 2**63 - 1), "header_sha256": mod[1]}
    if "model_data" in raw:
        model["data_sha256"] = words("model_data", 1)[1][0]
    lf, flags_text = raw["flags"]
    try:
        flags = _strict_json(flags_text)
    except (ValueError, RecursionError) as e:
        raise lf.fail("flags", f"invalid JSON: {str(e)[:80]}") from None
    if not isinstance(flags, dict):
        raise lf.fail("flags", "must be a JSON object like {} or {\"fp8_kv\":true}")
    _, full = words("full")
    draft = {}
    if "draft" in raw:
        ld, draft_text = raw["draft"]
        try:
            draft = _strict_json(draft_text)
        except (ValueError, RecursionError) as e:
            raise ld.fail("draft", f"invalid JSON: {str(e)[:80]}") from None
    d = {"engine": eng[0], "engine_version": eng[1], "model": model, "dtype": words("dtype", 1)[1][0],
         "n_hc": one_int("hc"), "dim": one_int("dim"), "top_k": one_int("top_k"), "tokens": int_list("tokens"),
         "n_prompt": one_int("n_prompt"), "chunks": int_list("chunks"), "decode": one_int("decode"),
         "positions": int_list("positions"), "checkpoints": words("checkpoints")[1],
         "full": [] if full == ["-"] else full, "flags": flags, "version": version,
         **({"subops": words("subops")[1]} if "subops" in raw else {}),
         **({"draft": draft} if "draft" in raw else {})}

    def fail(key: str, msg: str) -> TraceError:
        text_key = TEXT_KEY.get(key, key)
        if key == "model" and "data_sha256" in msg and "model_data" in raw:
            text_key = "model_data"
        return (raw[text_key][0] if text_key in raw else first).fail(text_key, msg)

    return header_from_dict(d, fail)


def _split_record(ln: _Line) -> tuple[list[str], dict[str, str]]:
    """'kind a b pos p: k=v k=v' -> (['kind', 'a', 'b', 'pos', 'p'], {k: v})."""
    head, sep, body = ln.text.partition(":")
    if not sep:
        raise ln.fail("record", "expected '<kind> ... pos <p>: key=value ...'")
    kv: dict[str, str] = {}
    for item in body.split():
        key, eq, val = item.partition("=")
        if not eq:
            raise ln.fail(key, "expected key=value")
        if key in kv:
            raise ln.fail(key, "field given twice")
        kv[key] = val
    return head.split(), kv


def _need(ln: _Line, kv: dict[str, str], required: tuple[str, ...], optional: tuple[str, ...] = ()) -> None:
    for key in required:
        if key not in kv:
            raise ln.fail(key, "required field missing")
    for key in kv:
        if key not in required and key not in optional:
            raise ln.fail(key, f"unknown field (expected {', '.join(required + optional)})")


def _pos(ln: _Line, words: list[str], at: int, positions: set[int]) -> int:
    if len(words) != at + 2 or words[at] != "pos":
        raise ln.fail("pos", f"expected '... pos <p>:' at word {at + 1}")
    p = ln.int("pos", words[at + 1])
    if p not in positions:
        raise ln.fail("pos", f"position {p} is not in the header's positions")
    return p


class _TextTables:
    """Row accumulators for the four tables while parsing text records."""

    def __init__(self, h: TraceHeader) -> None:
        self.h = h
        self.rows: dict[str, dict[str, list]] = {kind: {c: [] for c in TABLES[kind]} for kind in TABLES}
        self.seen: set[tuple] = set()
        self.widths: dict[str, int] = {"H": h.n_hc, "F": FP_DIM, "K": h.top_k}
        self.n_layers = layers_of(h.checkpoints)
        self.positions = set(h.positions)

    def once(self, ln: _Line, key: tuple) -> None:
        if key in self.seen:
            raise ln.fail("record", f"duplicate record {key}")
        self.seen.add(key)

    def width(self, ln: _Line, field: str, name: str, n: int) -> None:
        if self.widths.setdefault(name, n) != n:
            raise ln.fail(field, f"expected {self.widths[name]} values as on earlier lines, got {n}")

    def add(self, kind: str, values: dict[str, Any]) -> None:
        for c, v in values.items():
            self.rows[kind][c].append(v)

    def ckpt(self, ln: _Line, words: list[str], kv: dict[str, str]) -> None:
        h = self.h
        if len(words) < 3:
            raise ln.fail("name", "expected 'ckpt <k> <name> pos <p> tok <id>:'")
        k, name = ln.int("k", words[1]), words[2]
        if name not in h.checkpoints:
            raise ln.fail("name", f"checkpoint {name!r} is not in the header's checkpoints")
        want_k = checkpoint_index(name, self.n_layers)
        if k != want_k:
            raise ln.fail("k", f"{name} has index {want_k} (spec §12.1), got {k}")
        if len(words) != 7 or words[5] != "tok":
            raise ln.fail("tok", "expected 'ckpt <k> <name> pos <p> tok <id>:'")
        p = _pos(ln, words[:5], 3, self.positions)
        tok = ln.int("tok", words[6])
        if tok != h.tokens[p]:
            raise ln.fail("tok", f"token {tok} at position {p}, but the header's tokens say {h.tokens[p]}")
        final = has_top(name)
        _need(ln, kv, ("min", "max", "rms", "l2s", "sum_l2", "fp") + (("argmax", "top") if final else ()))
        self.once(ln, ("ckpt", name, p))
        l2s = ln.floats("l2s", kv["l2s"], h.n_hc if per_stream(name) else 1)
        row = {"ck": h.checkpoints.index(name), "pos": p, "tok": tok, "min": ln.float("min", kv["min"]),
               "max": ln.float("max", kv["max"]), "rms": ln.float("rms", kv["rms"]),
               "l2s": l2s + [math.nan] * (h.n_hc - len(l2s)), "sum_l2": ln.float("sum_l2", kv["sum_l2"]),
               "fp": ln.floats("fp", kv["fp"], FP_DIM)}
        if final:
            pairs = [item.partition(":") for item in kv["top"].split(",")]
            if len(pairs) != h.top_k or any(not sep for _, sep, _ in pairs):
                raise ln.fail("top", f"expected {h.top_k} comma-separated id:logit pairs")
            row.update(argmax=ln.int("argmax", kv["argmax"]), top_ids=[ln.int("top", t) for t, _, _ in pairs],
                       top_logits=[ln.float("top", v) for _, _, v in pairs])
        else:  # the -1 / NaN padding is filled in by `tables` (no top_k-long lists per row)
            row.update(argmax=-1, top_ids=None, top_logits=None)
        self.add("ckpt", row)

    def layer(self, ln: _Line, field: str, s: str) -> int:
        layer = ln.int(field, s)
        if layer >= self.n_layers:
            raise ln.fail(field, f"layer {layer} out of range [0, {self.n_layers})")
        return layer

    def hc(self, ln: _Line, words: list[str], kv: dict[str, str]) -> None:
        layer = self.layer(ln, "layer", words[1] if len(words) > 1 else "")
        sub = words[2] if len(words) > 2 else ""
        if sub not in SUBLAYERS:
            raise ln.fail("sublayer", f"expected 'attn' or 'ffn', got {sub!r}")
        p = _pos(ln, words, 3, self.positions)
        _need(ln, kv, ("pre", "post", "comb"))
        self.once(ln, ("hc", layer, sub, p))
        H = self.h.n_hc
        self.add("hc", {"layer": layer, "sub": SUBLAYERS.index(sub), "pos": p, "pre": ln.floats("pre", kv["pre"], H),
                        "post": ln.floats("post", kv["post"], H), "comb": ln.floats("comb", kv["comb"], H * H)})

    def moe(self, ln: _Line, words: list[str], kv: dict[str, str]) -> None:
        layer = self.layer(ln, "layer", words[1] if len(words) > 1 else "")
        p = _pos(ln, words, 2, self.positions)
        _need(ln, kv, ("ids", "w", "margin"))
        self.once(ln, ("moe", layer, p))
        ids = ln.ints("ids", kv["ids"], None)
        self.width(ln, "ids", "E", len(ids))
        self.add("moe", {"layer": layer, "pos": p, "ids": ids, "w": ln.floats("w", kv["w"], len(ids)),
                         "margin": ln.float("margin", kv["margin"])})

    def attn(self, ln: _Line, words: list[str], kv: dict[str, str]) -> None:
        layer = self.layer(ln, "layer", words[1] if len(words) > 1 else "")
        p = _pos(ln, words, 2, self.positions)
        _need(ln, kv, ("n_comp", "sel"))
        self.once(ln, ("attn", layer, p))
        sel = None if kv["sel"] == "-" else ln.ints("sel", kv["sel"], None, lo=-1)
        if sel is not None:
            self.width(ln, "sel", "S", len(sel))
        self.add("attn", {"layer": layer, "pos": p, "n_comp": ln.int("n_comp", kv["n_comp"]),
                          "has_sel": sel is not None, "sel": sel})

    def tables(self) -> dict[str, Table]:
        K = self.h.top_k
        ckpt = self.rows["ckpt"]
        final = [ids is not None for ids in ckpt["top_ids"]]
        for col, fill, dtype in (("top_ids", -1, np.int32), ("top_logits", np.nan, np.float32)):
            arr = np.full((len(final), K), fill, dtype)
            if any(final):
                arr[np.flatnonzero(final)] = [v for v in ckpt[col] if v is not None]
            ckpt[col] = arr
        S = self.widths.setdefault("S", 0)
        self.widths.setdefault("E", 0)
        self.rows["attn"]["sel"] = [s if s is not None else [-1] * S for s in self.rows["attn"]["sel"]]
        return {kind: make_table(kind, self.rows[kind], self.widths) for kind in TABLES}


def parse_text(text: str, source: str = "<text>") -> Trace:
    """Parse the text form. Blank lines and lines starting with '#' are ignored."""
    lines = [_Line(source, i, t.rstrip("\r")) for i, t in enumerate(text.split("\n"), start=1)
             if t.strip() and not t.lstrip().startswith("#")]
    header, start = _parse_header(lines, source)
    acc = _TextTables(header)
    handlers = {"ckpt": acc.ckpt, "hc": acc.hc, "moe": acc.moe, "attn": acc.attn}
    spec = []
    for ln in lines[start:]:
        words, kv = _split_record(ln)
        if words and words[0] == "spec":
            spec.append(parse_spec(ln, words, kv, _need))
            continue
        if not words or words[0] not in handlers:
            raise ln.fail("record", f"unknown record kind {(words or [''])[0][:40]!r} (ckpt | hc | moe | attn | spec)")
        handlers[words[0]](ln, words, kv)
    tables = acc.tables()
    check_tables(header, tables, lambda key, msg: TraceError(f"{source}: field '{key}': {msg}"))
    if spec_only(header) and not spec:
        raise TraceError(f"{source}: field 'checkpoints': no checkpoints listed (a trace without them holds spec "
                         "records)")
    if spec:
        check_spec(spec, header.tokens, header.n_prompt,
                   lambda r, key, msg: TraceError(f"{r.where if r else source}: field '{key}': {msg}"))
    return Trace(header, **tables, spec=spec)


# ----------------------------------------------------------------------------------------------
# Binary form

def _header_json(h: TraceHeader) -> str:
    return json.dumps(h.to_dict(), sort_keys=True, indent=1) + "\n"


def _binary_columns(trace: Trace) -> dict[str, np.ndarray]:
    return {f"{kind}.{c}": arr for kind in TABLES for c, arr in getattr(trace, kind).cols.items()}


def _read_binary(path: Path) -> tuple[Trace, StoredZip]:
    """Columns are read-only views of the memory-mapped file, CRC-checked; the same rules as the text form."""
    z = StoredZip(path)
    expected = {"header.json"} | {f"{kind}.{c}.npy" for kind, spec in TABLES.items() for c in spec}
    unknown = sorted(set(z.members) - expected)
    if unknown:
        raise z.fail(unknown[0][:40], f"{len(unknown)} member(s) that are not part of a binary trace")
    header = _header_from_json(z.text("header.json", "header.json"), z.fail)
    if spec_only(header):
        raise z.fail("checkpoints", "no checkpoints listed (spec records, which a trace without them holds, exist "
                                    "in the text form only)")
    tables = {kind: Table({c: z.array(f"{kind}.{c}", f"{kind}.{c}") for c in spec}) for kind, spec in TABLES.items()}
    check_tables(header, tables, z.fail)
    return Trace(header, **tables), z


def _header_from_json(text: str, fail: Callable[[str, str], TraceError]) -> TraceHeader:
    try:
        d = _strict_json(text)
    except (ValueError, RecursionError) as e:
        raise fail("header.json", f"invalid JSON ({str(e)[:80]})") from None
    if not isinstance(d, dict) or d.get("format") != FORMAT_NAME:
        raise fail("format", "not a v4parity trace")
    if d.get("version") != FORMAT_VERSION:
        raise fail("version", f"trace format version {str(d.get('version'))[:20]}, this v4parity reads "
                              f"{FORMAT_VERSION}; {REGEN_HINT}")
    return header_from_dict({k: v for k, v in d.items() if k != "format"}, fail)


def _read_vectors(path: Path, h: TraceHeader,
                  trace_id: Callable[[], str]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The side file's (full vectors, sub-op records), checked against the header and bound to the trace by its
    content id."""
    if not path.is_file():
        field = "full" if h.full else "subops"
        raise TraceError(f"{path}: field '{field}': the trace lists {'full vectors' if h.full else 'sub-op records'} "
                         "but this side file does not exist")
    z = StoredZip(path)
    names = z.npy_names()
    if TRACE_ID in names:  # side files written before the binding carry no id and are read as they are
        stored = z.array(TRACE_ID, TRACE_ID)
        if stored.dtype.kind != "U" or stored.shape != (1,) or str(stored[0]) != trace_id():
            raise z.fail(TRACE_ID, "this side file was not written with this trace (an interrupted write or a "
                                   f"stale side file); {REGEN_HINT}")
    if "positions" not in names:
        raise z.fail("positions", "side file has no positions array")
    positions = z.array("positions", "positions")
    if positions.dtype.kind not in "iu" or positions.tolist() != h.positions:
        raise z.fail("positions", "side file positions do not match the trace header")
    records = record_members(h)
    extra = sorted(set(z.members) - {f"{n}.npy" for n in [*h.full, *records, "positions", TRACE_ID]})
    if extra:
        raise z.fail(extra[0][:40], "member not listed in the trace header's 'full' or 'subops'")
    missing = [n for n in h.full if n not in names]
    if missing:
        raise z.fail("vectors", f"no arrays for {missing}")
    absent = [m for m in records if m not in names]
    if absent:
        raise z.fail(absent[0], f"sub-op record missing ({len(absent)} of {len(records)} listed by 'subops' absent)")
    vec = {n: z.array(n, n) for n in h.full}
    subops = {m: z.array(m, m) for m in records}
    check_records(h, subops, z.fail)
    for name, arr in vec.items():
        want = vector_shape(name, h.n_hc, h.dim, h.draft.get("block_size"))
        rows = len(h.positions_of(name))
        if arr.dtype != np.float32:
            raise z.fail(name, f"dtype {arr.dtype}, expected float32")
        if arr.ndim != 1 + len(want) or len(arr) != rows:
            raise z.fail(name, f"shape {arr.shape}, expected {rows} rows (one per position it is recorded at) of "
                               f"{len(want)} dimension(s)")
        if any(w is not None and w != got for w, got in zip(want, arr.shape[1:], strict=True)):
            raise z.fail(name, f"rows of shape {arr.shape[1:]}, expected {want} (header hc, dim, draft block_size; "
                               "None: any)")
    return vec, subops
