"""Top-k logprob files: readers for ds4 dumps, official-API vectors and `official.vec`; the ds4 writer.

Every reader returns a `LogprobRun`: per greedy step the selected token and the listed top entries
(token, logprob), tokens compared by their BYTES (a token's `text` is lossy for byte fragments).
Formats (spec ds4-formats §1.4, §2.2, §2.3):
* ds4 `--dump-logprobs` JSON (`"source":"ds4"`, also what our engines write with `write_ds4_dump`);
* the official-API vector JSON (`"schema":"ds4-official-logprobs-v1"`);
* the compact `official.vec` (`# ds4-official-logprob-vectors-v1`), one or more cases (`FILE#CASE`).
The API spells EOS `<｜｜end▁of▁sentence｜｜>`; readers normalise it to the vocabulary's spelling.
Entries at logprob <= -1000 (the API's -9999 placeholders) carry no probability and are dropped from an
official JSON, as are alternatives with empty bytes, as ds4's own fixture generator does; a run whose steps
then hold only the selected token is greedy-only. `Step.ds4_tops` keeps what `ds4_test --logprob-vectors`
itself checks (as float32, `sscanf %f`): every `top` line of an `.vec` (a -9999 line included), the
generator-filtered entries of an official JSON, the first 20 entries of a dump.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from parity.contract.errors import ParityError
from parity.contract.files import atomic_write_bytes
from parity.gguf.vocab import API_EOS, EOS, byte_decoder, token_bytes
from parity.tracing.stats import top_k

PLACEHOLDER_LOGPROB = -1000.0   # ds4's fetch script drops official entries at or below this
DS4_TEST_TOP = 20               # ds4_test compares against the local top 20 (an official list holds 20)
FLT_MIN = float(np.finfo(np.float32).tiny)  # below this a float32 is subnormal: ds4's FTZ/DAZ build reads 0
MAX_TOP_K = 128                 # ds4 clamps --logprobs-top-k to this
LOGPROB_SLACK = 1e-6            # a float32 logprob may round a hair above 0
MASS_SLACK = 1e-4               # float32 rounding of up to 128 listed probabilities
OFFICIAL_SCHEMA = "ds4-official-logprobs-v1"
VEC_MAGIC = "# ds4-official-logprob-vectors-v1"


class LogprobFileError(ParityError):
    """A logprob file is malformed; the message names the file, the step and the field."""


@dataclass(frozen=True)
class Tok:
    """A token, identified by its bytes; `id` and `text` are informational (the API gives no ids)."""

    data: bytes
    id: int | None = field(default=None, compare=False)
    text: str | None = field(default=None, compare=False)
    api_eos: bool = field(default=False, compare=False)   # spelled as the API's EOS in the file (ds4 never has it)

    def label(self) -> str:
        """Printable form: the UTF-8 text when valid, else the bytes in hex."""
        try:
            return repr(self.data.decode("utf-8"))
        except UnicodeDecodeError:
            return "<0x" + self.data.hex() + ">"


@dataclass(frozen=True)
class Step:
    """One greedy step: selected token, top entries (token, logprob) in file order, raw logits if any."""

    index: int
    selected: Tok
    top: list[tuple[Tok, float]]
    logits: list[float] | None = None
    dropped: int = 0               # placeholder / empty-bytes entries removed by the reader
    ds4_tops: list[tuple[Tok, float]] | None = None   # the entries ds4_test checks (float32), see the module doc


@dataclass(frozen=True)
class LogprobRun:
    """A file's steps in the common form. `greedy_only`: the file carries tokens but no probabilities."""

    path: str
    format: str                    # ds4-dump | official-json | official-vec
    source: str
    steps: list[Step]
    greedy_only: bool
    top_k: int | None
    meta: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        case = f"#{self.meta['case']}" if "case" in self.meta else ""
        return f"{self.path}{case} ({self.format}, source {self.source}, {len(self.steps)} steps)"


def normalise_bytes(data: bytes) -> bytes:
    """Map the API's EOS spelling to the vocabulary's."""
    return EOS.encode() if data == API_EOS.encode() else data


def make_tok(raw: bytes, tid: int | None = None, text: str | None = None) -> Tok:
    """A token from its file bytes: the API EOS spelling normalised, and remembered in `api_eos`."""
    return Tok(normalise_bytes(raw), tid, text, raw == API_EOS.encode())


def f32(x: float) -> float:
    """x rounded to float32, as ds4_test's `sscanf("%f")` reads a number."""
    return float(np.float32(x))


class _Where:
    """Error context: file and step."""

    def __init__(self, path: str) -> None:
        self.path = path

    def fail(self, step: int | None, fld: str, problem: str) -> LogprobFileError:
        at = f"step {step}: " if step is not None else ""
        return LogprobFileError(f"{self.path}: {at}field '{fld}': {problem}")

    def get(self, obj: Any, key: str, kind: str, step: int | None, fld: str) -> Any:
        if not isinstance(obj, dict):
            parent = fld.rsplit(".", 1)[0] if "." in fld else "(the step entry)" if step is not None else "(top level)"
            raise self.fail(step, parent, f"expected an object, got {type(obj).__name__}")
        if key not in obj:
            raise self.fail(step, fld, "missing")
        v = obj[key]
        ok = {"int": isinstance(v, int) and not isinstance(v, bool),
              "num": isinstance(v, (int, float)) and not isinstance(v, bool),
              "str": isinstance(v, str), "list": isinstance(v, list), "obj": isinstance(v, dict)}[kind]
        if not ok:
            raise self.fail(step, fld, f"expected {kind}, got {json.dumps(v)[:40]}")
        if kind == "num" and not (abs(v) < 1e308 if isinstance(v, int) else math.isfinite(v)):
            raise self.fail(step, fld, f"not finite or out of range: {str(v)[:40]}")
        return v


def _load_json(path: str) -> Any:
    try:
        with open(path, "rb") as f:
            return json.loads(f.read().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise LogprobFileError(f"{path}: not UTF-8 at byte {e.start}") from None
    except json.JSONDecodeError as e:
        raise LogprobFileError(f"{path}: not JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except (ValueError, RecursionError) as e:  # an integer over Python's digit limit; nesting too deep
        raise LogprobFileError(f"{path}: not readable JSON: {str(e)[:80]}") from None
    except OSError as e:
        raise LogprobFileError(f"{path}: cannot read: {e.strerror}") from None


def _token(w: _Where, obj: Any, step: int, fld: str, with_id: bool) -> Tok:
    raw = w.get(obj, "bytes", "list", step, fld + ".bytes")
    if not all(isinstance(b, int) and not isinstance(b, bool) and 0 <= b <= 255 for b in raw):
        raise w.fail(step, fld + ".bytes", "expected integers 0..255")
    text = w.get(obj, "text", "str", step, fld + ".text")
    tid = w.get(obj, "id", "int", step, fld + ".id") if with_id else None
    if with_id and text != ds4_text(bytes(raw)):  # ds4 dumps: text is a function of the bytes
        raise w.fail(step, fld + ".text", f"{json.dumps(text)} does not match its bytes (expected "
                     f"{json.dumps(ds4_text(bytes(raw)))}, ds4's escaping)")
    return make_tok(bytes(raw), tid, text)


def ds4_text(data: bytes) -> str:
    """What a ds4 dump's `text` decodes to: the UTF-8 text, or Latin-1 mojibake for a byte fragment."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return data.decode("latin-1")


def _logprob(w: _Where, obj: Any, step: int, fld: str) -> float:
    lp = float(w.get(obj, "logprob", "num", step, fld))
    if lp > LOGPROB_SLACK:
        raise w.fail(step, fld, f"a logprob must be <= 0, got {lp}")
    return lp


def _check_top(w: _Where, step: int, top: list[tuple[Tok, float]]) -> None:
    """Entries descending, and their probabilities (logprobs over the whole vocabulary) sum to <= 1."""
    mass = sum(math.exp(lp) for _, lp in top)
    if mass > 1.0 + MASS_SLACK:
        raise w.fail(step, "top_logprobs", f"listed probabilities sum to {mass:.6g} > 1")
    for r in range(1, len(top)):
        if top[r][1] > top[r - 1][1]:
            raise w.fail(step, f"top_logprobs[{r}].logprob", f"{top[r][1]} ranks below {top[r - 1][1]}: "
                         "entries must be in descending order")


def _steps_list(w: _Where, doc: Any) -> list:
    if not isinstance(doc, dict):
        raise w.fail(None, "(top level)", "expected a JSON object")
    steps = w.get(doc, "steps", "list", None, "steps")
    for i, s in enumerate(steps):
        n = w.get(s, "step", "int", i, "step")
        if n != i:
            raise w.fail(i, "step", f"expected {i} (steps are numbered 0, 1, ...), got {n}")
    return steps


def read_ds4_dump(path: str | os.PathLike) -> LogprobRun:
    """A ds4 `--dump-logprobs` JSON (or one written by `write_ds4_dump`)."""
    path = str(path)
    w, doc = _Where(path), _load_json(path)
    raw_steps = _steps_list(w, doc)
    meta = {k: w.get(doc, k, "int", None, k) for k in ("prompt_tokens", "ctx", "top_k")}
    source = w.get(doc, "source", "str", None, "source")
    steps = []
    for i, s in enumerate(raw_steps):
        sel = _token(w, w.get(s, "selected", "obj", i, "selected"), i, "selected", True)
        entries = w.get(s, "top_logprobs", "list", i, "top_logprobs")
        if len(entries) > meta["top_k"]:  # ds4 writes [] for a row without a finite logit
            raise w.fail(i, "top_logprobs", f"{len(entries)} entries; expected 0..top_k={meta['top_k']}")
        top, logits = [], []
        for r, e in enumerate(entries):
            fld = f"top_logprobs[{r}]"
            top.append((_token(w, w.get(e, "token", "obj", i, fld + ".token"), i, fld + ".token", True),
                        _logprob(w, e, i, fld + ".logprob")))
            logits.append(float(w.get(e, "logit", "num", i, fld + ".logit")))
        _check_top(w, i, top)
        steps.append(Step(i, sel, top, logits, ds4_tops=[(t, f32(lp)) for t, lp in top[:DS4_TEST_TOP]]))
    return LogprobRun(path, "ds4-dump", source, steps, False, meta["top_k"], meta)


def read_official_json(path: str | os.PathLike) -> LogprobRun:
    """An official-API vector (`ds4-official-logprobs-v1`); -9999 placeholders dropped."""
    path = str(path)
    w, doc = _Where(path), _load_json(path)
    raw_steps = _steps_list(w, doc)
    steps, any_alternative = [], False
    for i, s in enumerate(raw_steps):
        sel = _token(w, w.get(s, "token", "obj", i, "token"), i, "token", False)
        sel_lp = _logprob(w, s, i, "logprob")
        entries = w.get(s, "top_logprobs", "list", i, "top_logprobs")
        top = [(_token(w, w.get(e, "token", "obj", i, f"top_logprobs[{r}].token"), i, f"top_logprobs[{r}].token",
                       False), _logprob(w, e, i, f"top_logprobs[{r}].logprob")) for r, e in enumerate(entries)]
        _check_top(w, i, top)
        kept = [(t, lp) for t, lp in top if lp > PLACEHOLDER_LOGPROB and t.data]
        if sel_lp > PLACEHOLDER_LOGPROB and sel not in {t for t, _ in kept}:
            raise w.fail(i, "token", "the selected token is not among top_logprobs")
        any_alternative |= any(t != sel for t, _ in kept)
        # ds4's generator writes each kept logprob with %.9g; ds4_test reads it back as float32
        checked = [(t, f32(float(format(lp, ".9g")))) for t, lp in kept]
        steps.append(Step(i, sel, kept, None, len(top) - len(kept), checked))
    # the case id picks ds4_test's skip list (DS4_TEST_SKIPPED): a file without one is refused, not guessed
    meta = {"id": w.get(doc, "id", "str", None, "id")}
    meta |= {k: doc[k] for k in ("model", "finish_reason", "created_at") if isinstance(doc.get(k), str)}
    if isinstance(doc.get("request"), dict) and isinstance(doc["request"].get("top_logprobs"), int):
        meta["top_k"] = doc["request"]["top_logprobs"]
    if isinstance(doc.get("usage"), dict) and isinstance(doc["usage"].get("prompt_tokens"), int):
        meta["prompt_tokens"] = doc["usage"]["prompt_tokens"]
    source = w.get(doc, "source", "str", None, "source")
    return LogprobRun(path, "official-json", source, steps, not any_alternative, meta.get("top_k"), meta)


def _vec_cases(path: str) -> dict[str, tuple[dict[str, Any], list[Step]]]:
    """Parse every case of an official.vec file (grammar: spec ds4-formats §2.3)."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise LogprobFileError(f"{path}: cannot read: {e}") from None
    p = _VecParser(path)
    for n, line in enumerate(lines, 1):
        f = line.split()
        if not f or f[0].startswith("#"):
            continue
        try:
            p.feed(n, f, line)
        except ValueError as e:
            raise p.fail(n, f"bad number in {line.strip()!r}: {e}") from None
    if p.case is not None:
        raise p.fail(len(lines), f"case {p.case[0]['case']} has no 'end'")
    if not p.cases:
        raise LogprobFileError(f"{path}: no cases")
    return p.cases


class _VecParser:
    """The state of reading an official.vec file line by line: the cases ended so far, the open case (meta,
    steps) and its pending step [index, selected, expected top count, tops]."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.cases: dict[str, tuple[dict[str, Any], list[Step]]] = {}
        self.case: tuple[dict[str, Any], list[Step]] | None = None
        self.pending: list[Any] | None = None

    def fail(self, n: int, msg: str) -> LogprobFileError:
        return LogprobFileError(f"{self.path}: line {n}: {msg}")

    def feed(self, n: int, f: list[str], line: str) -> None:
        """Line n (its fields `f`): a `case`, `step`, `top` or `end` line where the grammar allows one."""
        if f[0] == "case" and len(f) == 5 and self.case is None:
            meta = {"case": f[1], "ctx": int(f[2]), "steps": int(f[3]), "prompt_file": f[4]}
            if f[1] in self.cases:
                raise self.fail(n, f"case {f[1]!r} appears twice")
            self.case = (meta, [])
        elif f[0] == "step" and len(f) == 4 and self.case is not None:
            self._close_step(n)
            idx = int(f[1])
            if idx != len(self.case[1]):
                raise self.fail(n, f"step {idx}: field 'index': expected {len(self.case[1])}")
            self.pending = [idx, self._token(n, f[2]), int(f[3]), []]
        elif f[0] == "top" and len(f) == 3 and self.pending is not None:
            lp = float(f[2])
            if not math.isfinite(lp) or lp > LOGPROB_SLACK:
                raise self.fail(n, f"step {self.pending[0]}: field 'logprob': {f[2]} is not a logprob")
            self.pending[3].append((self._token(n, f[1]), lp))
        elif f[0] == "end" and len(f) == 1 and self.case is not None:
            self._end_case(n)
        else:
            raise self.fail(n, f"unexpected line {line.strip()!r}")

    def _token(self, n: int, hexs: str) -> Tok:
        try:
            return make_tok(bytes.fromhex(hexs))
        except ValueError:
            raise self.fail(n, f"token hex {hexs!r} is not an even-length hex string") from None

    def _close_step(self, n: int) -> None:
        if self.pending is not None:
            idx, sel, want, tops = self.pending
            if len(tops) != want:
                raise self.fail(n, f"step {idx}: field 'top-count' says {want}, found {len(tops)} top lines")
            kept = [(t, lp) for t, lp in tops if lp > PLACEHOLDER_LOGPROB]
            self.case[1].append(Step(idx, sel, kept, None, len(tops) - len(kept), [(t, f32(lp)) for t, lp in tops]))
        self.pending = None

    def _end_case(self, n: int) -> None:
        self._close_step(n)
        meta, steps = self.case
        if len(steps) != meta["steps"]:
            raise self.fail(n, f"case {meta['case']}: field 'steps' says {meta['steps']}, found {len(steps)}")
        self.cases[meta["case"]] = self.case
        self.case = None


def read_official_vec(path: str | os.PathLike, case: str | None = None) -> LogprobRun:
    """One case of an `official.vec` file (`case` may be omitted when the file has exactly one)."""
    path = str(path)
    cases = _vec_cases(path)
    if case is None and len(cases) != 1:
        raise LogprobFileError(f"{path}: holds {len(cases)} cases; pick one with {path}#CASE "
                               f"({', '.join(cases)})")
    name = case if case is not None else next(iter(cases))
    if name not in cases:
        raise LogprobFileError(f"{path}: no case {name!r} (cases: {', '.join(cases)})")
    meta, steps = cases[name]
    greedy_only = not any(t != s.selected for s in steps for t, _ in s.top)
    return LogprobRun(path, "official-vec", "official", steps, greedy_only, None, dict(meta))


def detect_format(path: str) -> str:
    """ds4-dump | official-json | official-vec, from the file's content."""
    try:
        with open(path, "rb") as f:
            head = f.read(4096).decode("utf-8", errors="replace")
    except OSError as e:
        raise LogprobFileError(f"{path}: cannot read: {e.strerror}") from None
    first = head.lstrip()
    if first.startswith(VEC_MAGIC) or first.startswith("case "):
        return "official-vec"
    if first.startswith("{"):
        doc = _load_json(path)
        if isinstance(doc, dict) and doc.get("schema") == OFFICIAL_SCHEMA:
            return "official-json"
        if isinstance(doc, dict) and "top_k" in doc and "steps" in doc:
            return "ds4-dump"
    raise LogprobFileError(f"{path}: not a ds4 dump, an official vector JSON ({OFFICIAL_SCHEMA}) or an official.vec")


def read_run(spec: str | os.PathLike) -> LogprobRun:
    """Read any supported file; `FILE#CASE` picks a case of an official.vec."""
    spec = str(spec)
    path, case = spec, None
    if not os.path.exists(spec) and "#" in spec:
        path, case = spec.rsplit("#", 1)
    fmt = detect_format(path)
    if case is not None and fmt != "official-vec":
        raise LogprobFileError(f"{path}: '#{case}' selects a case, but this is a {fmt} file")
    if fmt == "official-vec":
        return read_official_vec(path, case)
    return read_official_json(path) if fmt == "official-json" else read_ds4_dump(path)


# ---------------------------------------------------------------------------------------------
# The ds4 writer (ds4_cli.c `run_logprob_dump`, `json_write_token`, `json_write_string`)


def g9(x: float) -> str:
    """printf %.9g of a float32 value, as ds4 prints logits and logprobs."""
    return f"{float(np.float32(x)):.9g}"


def json_piece(data: bytes) -> str:
    """ds4's JSON string for a token piece: bytes >= 0x80 as \\u00XX when the piece is not valid UTF-8."""
    try:
        data.decode("utf-8")
        valid = True
    except UnicodeDecodeError:
        valid = False
    out = ['"']
    esc = {0x22: '\\"', 0x5C: "\\\\", 0x0A: "\\n", 0x0D: "\\r", 0x09: "\\t"}
    i = 0
    while i < len(data):
        c = data[i]
        if c in esc:
            out.append(esc[c])
        elif c < 0x20 or (c >= 0x80 and not valid):
            out.append(f"\\u{c:04x}")
        elif c >= 0x80:  # start of a valid multi-byte sequence: copy it whole
            n = 2 if c < 0xE0 else 3 if c < 0xF0 else 4
            out.append(data[i:i + n].decode("utf-8"))
            i += n
            continue
        else:
            out.append(chr(c))
        i += 1
    out.append('"')
    return "".join(out)


def flush_subnormals(logits: np.ndarray) -> np.ndarray:
    """float32 logits with every subnormal replaced by a zero of the same sign (ds4's FTZ/DAZ build)."""
    x = np.asarray(logits, dtype=np.float32)
    return np.where((x != 0) & (np.abs(x) < FLT_MIN), np.copysign(np.float32(0), x), x).astype(np.float32)


def ds4_argmax(row: np.ndarray) -> int:
    """ds4's greedy pick (`sample_argmax`): the first id whose logit is strictly above every earlier one,
    starting from -inf -- NaN never wins, +inf does, a row with nothing above -inf picks id 0."""
    row = np.asarray(row, dtype=np.float32)
    above = np.where(np.isnan(row), -np.inf, row)
    best = int(np.argmax(above))
    return best if above[best] > -np.inf else 0


def ds4_top(row: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """ds4's top-k of one logits row: (ids, logprobs) by descending logit, ties to the lower id.

    logprob = logit - (max + log sum exp(l - max)) over the finite logits, summed in float64 and
    rounded to float32 (`ds4_session_top_logprobs`). Non-finite logits are skipped, as ds4 does; a row
    without a finite logit gives no entry.
    """
    row = np.asarray(row, dtype=np.float32)
    finite = np.isfinite(row)
    if not finite.any():
        return np.zeros(0, np.int64), np.zeros(0, np.float32)
    ids = top_k(np.where(finite, row, -np.inf)[None], k)[0][0]  # NaN / +inf never take a slot
    order = ids[finite[ids]]
    vals = row[finite].astype(np.float64)
    # ds4 sums in id order, one term at a time (cumsum keeps that order; np.sum would pair terms up)
    lse = vals.max() + np.log(np.cumsum(np.exp(vals - vals.max()))[-1])
    return order, (row[order].astype(np.float64) - lse).astype(np.float32)


def ds4_dump_text(*, logits: np.ndarray, selected: Sequence[int], prompt_tokens: int, ctx: int, top_k: int,
                  vocab_tokens: Sequence[str], eos_id: int | None = None, source: str = "ds4") -> str:
    """The exact bytes (as text) of ds4's `--dump-logprobs` file for these step logits [steps, V].

    As ds4 does: subnormal logits read as zero (FTZ/DAZ); NaN / inf logits are skipped in the list, and a
    row without a finite logit is written with `"top_logprobs":[]`; `selected` must be ds4's argmax.
    """
    logits = flush_subnormals(logits)
    if logits.ndim != 2 or logits.shape[1] != len(vocab_tokens):
        raise ParityError(f"logits must be [steps, {len(vocab_tokens)}] (one row per step over the vocab), "
                          f"got {list(logits.shape)}")
    if len(selected) != logits.shape[0]:
        raise ParityError(f"{len(selected)} selected tokens for {logits.shape[0]} logit rows")
    if not 1 <= top_k <= MAX_TOP_K:
        raise ParityError(f"top_k must be 1..{MAX_TOP_K} (ds4's clamp), got {top_k}")
    if not 1 <= prompt_tokens < ctx:
        raise ParityError(f"need 1 <= prompt_tokens < ctx, got prompt_tokens={prompt_tokens} ctx={ctx}")
    if logits.shape[0] > ctx - prompt_tokens - 1:
        raise ParityError(f"{logits.shape[0]} steps exceed ds4's cap ctx - prompt_tokens - 1 = "
                          f"{ctx - prompt_tokens - 1}")
    if eos_id is None:
        if EOS not in vocab_tokens:
            raise ParityError(f"the vocabulary has no {EOS!r}; pass eos_id")
        eos_id = list(vocab_tokens).index(EOS)
    decoder = byte_decoder()
    pieces: dict[int, str] = {}

    def tok(i: int) -> str:
        if i not in pieces:
            b = token_bytes(vocab_tokens[i], decoder)
            pieces[i] = f'{{"id":{i},"text":{json_piece(b)},"bytes":[{",".join(str(x) for x in b)}]}}'
        return pieces[i]

    lines = []
    for s, row in enumerate(logits):
        ids, lps = ds4_top(row, top_k)
        pick = ds4_argmax(row)
        if int(selected[s]) != pick:
            raise ParityError(f"step {s}: selected token {int(selected[s])} is not ds4's argmax {pick}; "
                              "a ds4 dump is greedy")
        tops = ",".join(f'{{"token":{tok(int(i))},"logit":{g9(row[i])},"logprob":{g9(lp)}}}'
                        for i, lp in zip(ids, lps, strict=True))
        lines.append(f'    {{"step":{s},"selected":{tok(pick)},"top_logprobs":[{tops}]}}')
        if pick == eos_id:
            break
    head = (f'{{\n  "source":{json_piece(source.encode())},\n  "prompt_tokens":{prompt_tokens},\n  "ctx":{ctx},\n'
            f'  "top_k":{top_k},\n  "steps":[\n')
    return head + ",\n".join(lines) + "\n  ]\n}\n"


def write_ds4_dump(path: str | os.PathLike, *, logits: np.ndarray, selected: Sequence[int], prompt_tokens: int,
                   ctx: int, top_k: int, vocab_tokens: Sequence[str], eos_id: int | None = None,
                   source: str = "ds4") -> None:
    """Write ds4's `--dump-logprobs` JSON (spec ds4-formats §1.4) for greedy step logits [steps, V].

    Row s holds the logits that chose step s's token (row 0: last prompt position). Writing stops after
    the first step whose token is EOS, as ds4 does. `source` stays "ds4" for byte-identical files.
    """
    text = ds4_dump_text(logits=logits, selected=selected, prompt_tokens=prompt_tokens, ctx=ctx, top_k=top_k,
                         vocab_tokens=vocab_tokens, eos_id=eos_id, source=source)
    atomic_write_bytes(path, text.encode("utf-8"))
