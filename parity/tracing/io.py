"""Reading and writing traces: a line-per-record text form and a columnar `.npz` form.

Text (`docs/trace-format.md`): a header block (`v4parity-trace 1` ... `end`) then one record per
line (`ckpt`, `hc`, `moe`, `attn`), writable with fprintf. Binary: an uncompressed zip of `.npy`
columns (`ckpt.fp`, `moe.ids`, ...) plus `header.json`. `read_trace` detects the form from the
first bytes. Every write is atomic (temp file + rename) and deterministic (same trace, same bytes:
fixed float formatting, canonical row order, fixed zip timestamps). Full vectors go to a side
file `<stem>.vectors.npz` next to the trace (present when the header lists `full` checkpoints).
"""

from __future__ import annotations

import io
import json
import math
import mmap
import os
import struct
import tempfile
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from parity.contract.checkpoints import checkpoint_index, layers_of, trace_checkpoints
from parity.contract.errors import TraceError
from parity.tracing.records import FORMAT_NAME, FORMAT_VERSION, SUBLAYERS, TABLES, Table, Trace, TraceHeader, make_table
from parity.tracing.stats import FP_DIM

ZIP_MAGIC = b"PK\x03\x04"
ZIP_DATE = (1980, 1, 1, 0, 0, 0)
HEADER_KEYS = ("engine", "model", "dtype", "hc", "dim", "top_k", "tokens", "n_prompt", "chunks", "decode",
               "positions", "checkpoints", "full", "flags")
REGEN_HINT = "re-run `v4parity trace ...` (or your engine's writer) to regenerate it"


# ----------------------------------------------------------------------------------------------
# Atomic, deterministic file writing

def atomic_write(path: str | os.PathLike, write: Callable[[io.BufferedWriter], None]) -> Path:
    """Write via `write(f)` to a temp file in the target directory, fsync, then rename over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp creates 0600; give the file the usual permissions
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_npz(path: str | os.PathLike, arrays: dict[str, np.ndarray], extra: dict[str, bytes] | None = None) -> Path:
    """An uncompressed `.npz` readable by `np.load`, byte-identical for identical arrays (fixed zip dates)."""
    def write(f: io.BufferedWriter) -> None:
        with zipfile.ZipFile(f, "w", zipfile.ZIP_STORED) as z:
            for name, data in (extra or {}).items():
                z.writestr(zipfile.ZipInfo(name, ZIP_DATE), data)
            for name, arr in arrays.items():
                buf = io.BytesIO()
                np.lib.format.write_array(buf, np.ascontiguousarray(arr), allow_pickle=False)
                z.writestr(zipfile.ZipInfo(f"{name}.npy", ZIP_DATE), buf.getvalue())
    return atomic_write(path, write)


# ----------------------------------------------------------------------------------------------
# Public entry points

def vectors_path(trace_path: str | os.PathLike) -> Path:
    """Side file for full vectors: `run.trace` -> `run.vectors.npz`."""
    p = Path(trace_path)
    return p.with_name(p.name.rsplit(".", 1)[0] + ".vectors.npz")


def write_trace(trace: Trace, path: str | os.PathLike, form: str | None = None) -> Path:
    """Write `trace` as text (default) or binary (`form='npz'` or a `.npz` path), plus its vectors side file."""
    path = Path(path)
    form = form or ("npz" if path.suffix == ".npz" else "text")
    if form not in ("text", "npz"):
        raise TraceError(f"unknown trace form {form!r} (text | npz)")
    if trace.header.full:
        side = vectors_path(path)
        if side == path:
            raise TraceError(f"{path}: the trace and its vectors side file would share a name; pick another name")
        if not trace.vectors:
            raise TraceError(f"trace lists full vectors for {trace.header.full} but holds none to write")
        write_npz(side, {"positions": np.asarray(trace.header.positions, np.int64),
                         **{n: trace.vectors[n] for n in trace.header.full}})
    if form == "text":
        text = format_text(trace).encode()
        return atomic_write(path, lambda f: f.write(text))
    return write_npz(path, _binary_columns(trace), {"header.json": _header_json(trace.header).encode()})


def read_trace(path: str | os.PathLike, load_vectors: bool = True) -> Trace:
    """Read a text or binary trace (autodetected) and, when present and wanted, its vectors side file."""
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"{path}: no such trace file")
    with open(path, "rb") as f:
        magic = f.read(4)
    trace = _read_binary(path) if magic == ZIP_MAGIC else parse_text(path.read_text(errors="replace"), str(path))
    if load_vectors and trace.header.full:
        trace.vectors = _read_vectors(vectors_path(path), trace.header)
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
        f"dtype {h.dtype}",
        f"hc {h.n_hc}",
        f"dim {h.dim}",
        f"top_k {h.top_k}",
        "tokens " + " ".join(map(str, h.tokens)),
        f"n_prompt {h.n_prompt}",
        "chunks " + " ".join(map(str, h.chunks)),
        f"decode {h.decode}",
        "positions " + " ".join(map(str, h.positions)),
        "checkpoints " + " ".join(h.checkpoints),
        "full " + (" ".join(h.full) or "-"),
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
        l2s = c["l2s"][i][: 1 if name == "final_norm" else h.n_hc]
        line = (f"ckpt {k} {name} pos {c['pos'][i]} tok {c['tok'][i]}: min={fmt(c['min'][i])} max={fmt(c['max'][i])} "
                f"rms={fmt(c['rms'][i])} l2s={_floats(l2s)} sum_l2={fmt(c['sum_l2'][i])} fp={_floats(c['fp'][i])}")
        if name == "final_norm":
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
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------
# Text form: reader

class _Line:
    """One text line being parsed; every failure names file:line and the field."""

    def __init__(self, source: str, lineno: int, text: str) -> None:
        self.source, self.lineno, self.text = source, lineno, text

    def fail(self, field: str, msg: str) -> TraceError:
        return TraceError(f"{self.source}:{self.lineno}: field '{field}': {msg}\n  {self.text[:160]}")

    def int(self, field: str, s: str, lo: int = 0) -> int:
        try:
            v = int(s)
        except ValueError:
            raise self.fail(field, f"expected an integer, got {s!r}") from None
        if v < lo:
            raise self.fail(field, f"must be >= {lo}, got {v}")
        return v

    def float(self, field: str, s: str) -> float:
        try:
            return float(s)
        except ValueError:
            raise self.fail(field, f"expected a number, got {s!r}") from None

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


def _parse_header(lines: list[_Line]) -> tuple[TraceHeader, int]:
    """Header lines up to `end` -> (header, index of the first record line)."""
    first = lines[0] if lines else _Line("?", 1, "")
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


def _header_from_fields(raw: dict[str, tuple[_Line, str]], first: _Line, version: int) -> TraceHeader:
    missing = [k for k in HEADER_KEYS if k not in raw]
    if missing:
        raise first.fail(missing[0], f"required header key(s) missing: {', '.join(missing)}")

    def words(key: str, n: int | None = None) -> tuple[_Line, list[str]]:
        ln, rest = raw[key]
        w = rest.split(maxsplit=(n - 1) if n else -1)
        if n is not None and len(w) != n:
            raise ln.fail(key, f"expected {n} values, got {len(w)}")
        return ln, w

    def one_int(key: str, lo: int = 0) -> int:
        ln, w = words(key, 1)
        return ln.int(key, w[0], lo)

    def int_list(key: str) -> list[int]:
        ln, w = words(key)
        return [ln.int(key, v) for v in w]

    _, eng = words("engine", 2)
    lm, mod = words("model", 3)
    if len(mod[1]) < 8 or any(ch not in "0123456789abcdef" for ch in mod[1]):
        raise lm.fail("model", f"header_sha256 must be lowercase hex, got {mod[1]!r}")
    lf, flags_text = raw["flags"]
    try:
        flags = json.loads(flags_text)
    except json.JSONDecodeError as e:
        raise lf.fail("flags", f"not a JSON object: {e.msg}") from None
    if not isinstance(flags, dict):
        raise lf.fail("flags", "must be a JSON object like {} or {\"fp8_kv\":true}")
    _, full = words("full")
    h = TraceHeader(
        engine=eng[0], engine_version=eng[1],
        model={"file": mod[2], "size": lm.int("model", mod[0]), "header_sha256": mod[1]},
        dtype=words("dtype", 1)[1][0], n_hc=one_int("hc", 1), dim=one_int("dim", 1), top_k=one_int("top_k", 1),
        tokens=int_list("tokens"), n_prompt=one_int("n_prompt", 1), chunks=int_list("chunks"),
        decode=one_int("decode"), positions=int_list("positions"), checkpoints=words("checkpoints")[1],
        full=[] if full == ["-"] else full, flags=flags, version=version,
    )
    _check_header(h, lambda key, msg: raw[key][0].fail(key, msg))
    return h


def _check_header(h: TraceHeader, fail: Callable[[str, str], TraceError]) -> None:
    """Cross-field consistency of a header (same rules for both forms)."""
    if not isinstance(h.model, dict) or sorted(h.model) != ["file", "header_sha256", "size"]:
        raise fail("model", f"must hold exactly file, size and header_sha256, got {h.model!r}")
    if h.n_prompt + h.decode != len(h.tokens):
        raise fail("tokens", f"{len(h.tokens)} token ids, but n_prompt {h.n_prompt} + decode {h.decode} "
                             f"= {h.n_prompt + h.decode}")
    if sum(h.chunks) != len(h.tokens) or any(c < 1 for c in h.chunks):
        raise fail("chunks", f"chunk sizes {h.chunks} must be >= 1 and sum to the {len(h.tokens)} tokens")
    if not h.positions or h.positions != sorted(set(h.positions)) or h.positions[-1] >= len(h.tokens):
        raise fail("positions", f"must be ascending, unique and < {len(h.tokens)}, got {h.positions}")
    if not h.checkpoints:
        raise fail("checkpoints", "no checkpoints listed")
    for c in h.checkpoints:
        if c.startswith("blk.") and not c.split(".")[1].isdigit():
            raise fail("checkpoints", f"bad checkpoint name {c!r}; valid: embed, blk.N, blk.N.attn, final_norm")
    order = trace_checkpoints(layers_of(h.checkpoints))
    bad = [c for c in h.checkpoints if c not in order]
    if bad:
        raise fail("checkpoints", f"unknown checkpoint name(s) {bad}; valid: embed, blk.N, blk.N.attn, final_norm")
    if h.checkpoints != [c for c in order if c in h.checkpoints]:
        raise fail("checkpoints", "must be listed once each in depth order: embed, blk.0.attn, blk.0, ..., final_norm")
    extra = [c for c in h.full if c not in h.checkpoints and c != "logits"]
    if extra:
        raise fail("full", f"full vectors for checkpoint(s) {extra} that are not in 'checkpoints'")


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


def _pos(ln: _Line, words: list[str], at: int, h: TraceHeader) -> int:
    if len(words) != at + 2 or words[at] != "pos":
        raise ln.fail("pos", f"expected '... pos <p>:' at word {at + 1}")
    p = ln.int("pos", words[at + 1])
    if p not in h.positions:
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
        p = _pos(ln, words[:5], 3, h)
        tok = ln.int("tok", words[6])
        if tok != h.tokens[p]:
            raise ln.fail("tok", f"token {tok} at position {p}, but the header's tokens say {h.tokens[p]}")
        final = name == "final_norm"
        _need(ln, kv, ("min", "max", "rms", "l2s", "sum_l2", "fp") + (("argmax", "top") if final else ()))
        self.once(ln, ("ckpt", name, p))
        l2s = ln.floats("l2s", kv["l2s"], 1 if final else h.n_hc)
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
        else:
            row.update(argmax=-1, top_ids=[-1] * h.top_k, top_logits=[math.nan] * h.top_k)
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
        p = _pos(ln, words, 3, self.h)
        _need(ln, kv, ("pre", "post", "comb"))
        self.once(ln, ("hc", layer, sub, p))
        H = self.h.n_hc
        self.add("hc", {"layer": layer, "sub": SUBLAYERS.index(sub), "pos": p, "pre": ln.floats("pre", kv["pre"], H),
                        "post": ln.floats("post", kv["post"], H), "comb": ln.floats("comb", kv["comb"], H * H)})

    def moe(self, ln: _Line, words: list[str], kv: dict[str, str]) -> None:
        layer = self.layer(ln, "layer", words[1] if len(words) > 1 else "")
        p = _pos(ln, words, 2, self.h)
        _need(ln, kv, ("ids", "w", "margin"))
        self.once(ln, ("moe", layer, p))
        ids = ln.ints("ids", kv["ids"], None)
        self.width(ln, "ids", "E", len(ids))
        self.add("moe", {"layer": layer, "pos": p, "ids": ids, "w": ln.floats("w", kv["w"], len(ids)),
                         "margin": ln.float("margin", kv["margin"])})

    def attn(self, ln: _Line, words: list[str], kv: dict[str, str]) -> None:
        layer = self.layer(ln, "layer", words[1] if len(words) > 1 else "")
        p = _pos(ln, words, 2, self.h)
        _need(ln, kv, ("n_comp", "sel"))
        self.once(ln, ("attn", layer, p))
        sel = None if kv["sel"] == "-" else ln.ints("sel", kv["sel"], None, lo=-1)
        if sel is not None:
            self.width(ln, "sel", "S", len(sel))
        self.add("attn", {"layer": layer, "pos": p, "n_comp": ln.int("n_comp", kv["n_comp"]),
                          "has_sel": sel is not None, "sel": sel})

    def tables(self) -> dict[str, Table]:
        S = self.widths.setdefault("S", 0)
        self.widths.setdefault("E", 0)
        self.rows["attn"]["sel"] = [s if s is not None else [-1] * S for s in self.rows["attn"]["sel"]]
        return {kind: make_table(kind, self.rows[kind], self.widths) for kind in TABLES}


def parse_text(text: str, source: str = "<text>") -> Trace:
    """Parse the text form. Blank lines and lines starting with '#' are ignored."""
    lines = [_Line(source, i, t.rstrip("\r")) for i, t in enumerate(text.split("\n"), start=1)
             if t.strip() and not t.lstrip().startswith("#")]
    header, start = _parse_header(lines)
    acc = _TextTables(header)
    handlers = {"ckpt": acc.ckpt, "hc": acc.hc, "moe": acc.moe, "attn": acc.attn}
    for ln in lines[start:]:
        words, kv = _split_record(ln)
        if words[0] not in handlers:
            raise ln.fail("record", f"unknown record kind {words[0]!r} (ckpt | hc | moe | attn)")
        handlers[words[0]](ln, words, kv)
    _check_complete(header, acc.rows["ckpt"]["ck"], acc.rows["ckpt"]["pos"], lambda msg: TraceError(f"{source}: {msg}"))
    return Trace(header, **acc.tables())


def _check_complete(h: TraceHeader, ck: np.ndarray, pos: np.ndarray, fail: Callable[[str], TraceError]) -> None:
    """Every (checkpoint, position) of the header must have a ckpt record (ck, pos: distinct row keys)."""
    ck, pos = np.asarray(ck, np.int64), np.asarray(pos, np.int64)
    listed = np.isin(pos, h.positions)
    counts = np.bincount(ck[listed], minlength=len(h.checkpoints))
    short = np.flatnonzero(counts[: len(h.checkpoints)] < len(h.positions))
    if len(short):
        k = int(short[0])
        present = set(pos[ck == k].tolist())
        p = next(p for p in h.positions if p not in present)
        raise fail(f"field 'ckpt': no record for checkpoint {h.checkpoints[k]} at position {p}")


# ----------------------------------------------------------------------------------------------
# Binary form

def _header_json(h: TraceHeader) -> str:
    return json.dumps(h.to_dict(), sort_keys=True, indent=1) + "\n"


def _binary_columns(trace: Trace) -> dict[str, np.ndarray]:
    return {f"{kind}.{c}": arr for kind in TABLES for c, arr in getattr(trace, kind).cols.items()}


def _read_binary(path: Path) -> Trace:
    """Columns of stored (uncompressed) members are read-only views of the memory-mapped file, CRC-checked."""
    src = str(path)
    try:
        with open(path, "rb") as f, zipfile.ZipFile(f) as z:
            members = {info.filename: info for info in z.infolist()}
            if "header.json" not in members:
                raise TraceError(f"{src}: field 'header.json': missing from the binary trace")
            header = _header_from_json(z.read("header.json").decode(), src)
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            tables = {}
            for kind, spec in TABLES.items():
                cols = {}
                for c, (dtype, _) in spec.items():
                    member = f"{kind}.{c}.npy"
                    if member not in members:
                        raise TraceError(f"{src}: field '{kind}.{c}': column missing from the binary trace")
                    arr = _member_array(z, mapped, members[member])
                    if arr.dtype != np.dtype(dtype):
                        raise TraceError(f"{src}: field '{kind}.{c}': dtype {arr.dtype}, expected {dtype}")
                    cols[c] = arr
                if len({len(a) for a in cols.values()}) > 1:
                    raise TraceError(f"{src}: field '{kind}': columns have different lengths")
                tables[kind] = Table(cols)
    except (zipfile.BadZipFile, ValueError, OSError, struct.error) as e:
        raise TraceError(f"{src}: field 'file': not a readable binary trace ({e})") from None
    _check_binary_rows(header, tables, src)
    return Trace(header, **tables)


_NPY_HEADERS = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}


def _member_array(z: zipfile.ZipFile, mapped: mmap.mmap, info: zipfile.ZipInfo) -> np.ndarray:
    """The .npy array in zip member `info`: a view of the mapped file when stored, else decompressed."""
    if info.compress_type != zipfile.ZIP_STORED:
        return np.lib.format.read_array(io.BytesIO(z.read(info)), allow_pickle=False)
    at = info.header_offset
    if mapped[at: at + 4] != ZIP_MAGIC:
        raise zipfile.BadZipFile(f"bad local file header for {info.filename!r}")
    name_len, extra_len = struct.unpack("<HH", mapped[at + 26: at + 30])
    start = at + 30 + name_len + extra_len
    data = memoryview(mapped)[start: start + info.file_size]
    if len(data) != info.file_size or zlib.crc32(data) != info.CRC:
        raise zipfile.BadZipFile(f"Bad CRC-32 for file {info.filename!r}")
    head = io.BytesIO(data[: 1 << 16])
    version = np.lib.format.read_magic(head)
    if version not in _NPY_HEADERS:
        raise ValueError(f"{info.filename}: unsupported .npy format version {version}")
    shape, fortran, dtype = _NPY_HEADERS[version](head)
    count = math.prod(shape)
    if head.tell() + count * dtype.itemsize != len(data):
        raise ValueError(f"{info.filename}: {len(data) - head.tell()} data bytes for shape {shape} of {dtype}")
    return np.frombuffer(data, dtype, count, head.tell()).reshape(shape, order="F" if fortran else "C")


def _header_from_json(text: str, src: str) -> TraceHeader:
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise TraceError(f"{src}: field 'header.json': invalid JSON ({e.msg})") from None
    if d.get("format") != FORMAT_NAME:
        raise TraceError(f"{src}: field 'format': not a v4parity trace")
    if d.get("version") != FORMAT_VERSION:
        raise TraceError(f"{src}: field 'version': trace format version {d.get('version')}, this v4parity reads "
                         f"{FORMAT_VERSION}; {REGEN_HINT}")
    names = [f for f in TraceHeader.__dataclass_fields__]
    missing = [n for n in names if n not in d]
    if missing:
        raise TraceError(f"{src}: field '{missing[0]}': required header field(s) missing: {', '.join(missing)}")
    h = TraceHeader(**{n: d[n] for n in names})
    _check_header(h, lambda key, msg: TraceError(f"{src}: field '{key}': {msg}"))
    return h


def _check_binary_rows(h: TraceHeader, tables: dict[str, Table], src: str) -> None:
    c = tables["ckpt"]
    if len(c) and (c["ck"].min() < 0 or c["ck"].max() >= len(h.checkpoints)):
        raise TraceError(f"{src}: field 'ckpt.ck': checkpoint index out of range")
    for col, width in (("fp", FP_DIM), ("l2s", h.n_hc), ("top_ids", h.top_k), ("top_logits", h.top_k)):
        if c[col].shape[1:] != (width,):
            raise TraceError(f"{src}: field 'ckpt.{col}': expected {width} numbers per row, got {c[col].shape[1:]}")
    key = np.sort(c["ck"].astype(np.int64) << 32 | (c["pos"].astype(np.int64) & 0xFFFFFFFF))
    if (key[1:] == key[:-1]).any():
        raise TraceError(f"{src}: field 'ckpt': duplicate (checkpoint, position) rows")
    _check_complete(h, c["ck"], c["pos"], lambda msg: TraceError(f"{src}: {msg}"))


def _read_vectors(path: Path, h: TraceHeader) -> dict[str, np.ndarray]:
    if not path.is_file():
        raise TraceError(f"{path}: field 'full': the trace lists full vectors but this side file does not exist")
    with np.load(path, allow_pickle=False) as z:
        vec = {k: z[k] for k in z.files}
    if "positions" not in vec or vec.pop("positions").tolist() != h.positions:
        raise TraceError(f"{path}: field 'positions': side file positions do not match the trace header")
    missing = [n for n in h.full if n not in vec]
    if missing:
        raise TraceError(f"{path}: field 'vectors': no arrays for {missing}")
    for name, arr in vec.items():
        if len(arr) != len(h.positions):
            raise TraceError(f"{path}: field '{name}': {len(arr)} rows, expected {len(h.positions)} positions")
        want = None if name == "logits" else (h.dim,) if name == "final_norm" else (h.n_hc, h.dim)
        if want is not None and arr.shape[1:] != want:
            raise TraceError(f"{path}: field '{name}': rows of shape {arr.shape[1:]}, expected {want} (header hc, dim)")
    return vec
