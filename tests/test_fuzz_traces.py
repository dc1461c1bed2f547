"""Fuzzing the trace readers: the crashes the issue lists, the number grammar, seeded mutations of the text form,
of the binary form's header, columns and bytes, and of the vectors side file. Every input either reads back as a
valid trace (which then survives a text round trip) or fails with a TraceError naming the file and a field."""

from __future__ import annotations

import copy
import json
import random
import zipfile

import numpy as np
import pytest
from trace_samples import toy_trace

from parity.contract.errors import TraceError
from parity.tracing.io import (
    TRACE_ID,
    _binary_columns,
    _header_json,
    format_text,
    npz_bytes,
    parse_text,
    read_trace,
    vectors_path,
    write_npz,
    write_trace,
)

BASE = format_text(toy_trace(3))
N_TEXT, N_BINARY, N_SIDE = 1500, 800, 300


def _read_or_refuse(path, case) -> str:
    """'ok' (and the trace survives a text round trip) or 'refused' (a TraceError naming file and field)."""
    try:
        t = read_trace(path)
    except TraceError as e:
        msg = str(e)
        assert str(path) in msg and "field '" in msg, (case, msg[:300])
        assert len(msg.split("\n")[0]) < 400, (case, len(msg))
        return "refused"
    assert parse_text(format_text(t), "round-trip") == t, case
    return "ok"


# ----------------------------------------------------------------------------------------------
# The crashes listed in the issue, one by one

def _with_line(text: str, line: str) -> str:
    return text + line + "\n"


ISSUE_TEXT = {
    "colon-first": (lambda t: _with_line(t, ": a=b"), "record"),
    "int32-overflow": (lambda t: t.replace("ids=", "ids=2147483648,", 1).replace("w=", "w=0.5,", 1), "ids"),
    "deep-flags": (lambda t: t.replace('flags {"seed":3}', "flags " + "[" * 100000 + "]" * 100000), "flags"),
    "huge-top-k": (lambda t: t.replace("top_k 2", "top_k 1000000000"), "top_k"),
    "huge-hc": (lambda t: t.replace("hc 2", "hc 1000000000"), "hc"),
    "huge-layer-name": (lambda t: t.replace("blk.1 final_norm", "blk.1 blk.99999999999 final_norm"),
                        "checkpoints"),
    "arabic-digit-layer": (lambda t: t.replace("blk.1 final_norm", "blk.1 blk.١ final_norm"), "checkpoints"),
    "long-unknown-key": (lambda t: t.replace("dtype float32", "dtype float32\n" + "x" * 100000 + " 1"), "x" * 40),
    # issue 28 item 12: non-finite numbers decoded to floats that `diff --json` could not write back
    "flags-1e999": (lambda t: t.replace('flags {"seed":3}', 'flags {"a":1e999}'), "flags"),
    "flags-nan": (lambda t: t.replace('flags {"seed":3}', 'flags {"a":NaN}'), "flags"),
    "flags-minus-infinity": (lambda t: t.replace('flags {"seed":3}', 'flags {"a":[-Infinity]}'), "flags"),
}


@pytest.mark.parametrize("case", sorted(ISSUE_TEXT))
def test_text_reader_crashes_of_the_issue_are_trace_errors(tmp_path, case):
    edit, field = ISSUE_TEXT[case]
    path = tmp_path / "t.trace"
    path.write_text(edit(BASE))
    with pytest.raises(TraceError) as e:
        read_trace(path)
    assert f"field '{field}'" in str(e.value) and str(path) in str(e.value), str(e.value)[:300]
    assert len(str(e.value)) < 600


def _npz_with(tmp_path, trace, header_edit=None, columns_edit=None):
    cols = _binary_columns(trace)
    header = json.loads(_header_json(trace.header))
    if header_edit:
        header_edit(header)
    if columns_edit:
        columns_edit(cols)
    path = tmp_path / "t.npz"
    path.write_bytes(npz_bytes(cols, {"header.json": json.dumps(header).encode()}))
    return path


def _set(d, key, value):
    d[key] = value


ISSUE_BINARY = {
    "tokens-int": (lambda h: _set(h, "tokens", 5), None, "tokens"),
    "short-comb": (None, lambda c: _set(c, "hc.comb", c["hc.comb"][:, :3]), "hc.comb"),
    "moe-layer-1000": (None, lambda c: _set(c, "moe.layer", c["moe.layer"] + 1000), "moe.layer"),
    "attn-pos-12345": (None, lambda c: _set(c, "attn.pos", c["attn.pos"] + 12345), "attn.pos"),
    "ckpt-tok": (None, lambda c: _set(c, "ckpt.tok", c["ckpt.tok"] + 1), "ckpt.tok"),
    "unsorted-rows": (None, lambda c: _set(c, "moe.margin", c["moe.margin"][::-1].copy())
                      or _set(c, "moe.pos", c["moe.pos"][::-1].copy()), "moe"),
    "final-l2s-padding": (None, lambda c: c["ckpt.l2s"].__setitem__((-1, 1), 1.0), "ckpt.l2s"),
    "top-k-off-final": (None, lambda c: c["ckpt.top_ids"].__setitem__((0, 0), 3), "ckpt.top_ids"),
    "object-column": (None, lambda c: _set(c, "hc.pre", c["hc.pre"].astype(np.float64)), "hc.pre"),
    "unknown-field": (lambda h: _set(h, "colour", "red"), None, "colour"),
    "bool-as-int": (lambda h: _set(h, "n_hc", True), None, "n_hc"),
}


@pytest.mark.parametrize("case", sorted(ISSUE_BINARY))
def test_binary_reader_enforces_the_text_rules(tmp_path, case):
    header_edit, columns_edit, field = ISSUE_BINARY[case]
    path = _npz_with(tmp_path, toy_trace(3), header_edit, columns_edit)
    with pytest.raises(TraceError, match=rf"t\.npz: field '{field}'"):
        read_trace(path)


@pytest.mark.parametrize("value", ["1e999", "-1e400", "NaN", "Infinity"])
def test_a_non_finite_number_in_a_binary_header_is_a_trace_error(tmp_path, value):
    header = json.loads(_header_json(toy_trace(3).header))
    header["flags"] = {"a": "@"}
    path = tmp_path / "t.npz"
    text = json.dumps(header).replace('"@"', value)
    path.write_bytes(npz_bytes(_binary_columns(toy_trace(3)), {"header.json": text.encode()}))
    with pytest.raises(TraceError, match=rf"t\.npz: field 'header.json': invalid JSON .*{value}.*finite"):
        read_trace(path)


def test_a_changed_zip_version_byte_is_a_trace_error(tmp_path):
    path = write_trace(toy_trace(3), tmp_path / "t.npz")
    raw = bytearray(path.read_bytes())
    raw[4] = 0xFF  # "version needed to extract" of the first local header
    cd = raw.rfind(b"PK\x01\x02")
    raw[cd + 6] = 0xFF  # ... and of its central-directory entry
    path.write_bytes(bytes(raw))
    with pytest.raises(TraceError, match="t.npz: field '"):
        read_trace(path)


SIDE = {
    "truncated": lambda p: p.write_bytes(p.read_bytes()[:100]),
    "not-a-zip": lambda p: p.write_bytes(b"hello"),
    "empty": lambda p: p.write_bytes(b""),
    "crc": lambda p: p.write_bytes(_flip_in_member(p, "embed.npy")),
    "stale-id": lambda p: _rewrite_side(p, {TRACE_ID: np.asarray(["0" * 64])}),
    "id-of-wrong-type": lambda p: _rewrite_side(p, {TRACE_ID: np.asarray([1.0])}),
    "positions": lambda p: _rewrite_side(p, {"positions": np.asarray([0, 1, 5])}),
    "float64-vectors": lambda p: _rewrite_side(p, {"embed": np.zeros((3, 2, 3))}),
    "missing-array": lambda p: _rewrite_side(p, {}, drop="blk.1"),
}


def _flip_in_member(path, member):
    with zipfile.ZipFile(path) as z:
        info = z.getinfo(member)
    raw = bytearray(path.read_bytes())
    raw[info.header_offset + 30 + len(member) + 140] ^= 0x10
    return bytes(raw)


def _rewrite_side(path, replace, drop=None):
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    arrays.update(replace)
    arrays.pop(drop, None)
    write_npz(path, arrays)


@pytest.mark.parametrize("case", sorted(SIDE))
@pytest.mark.parametrize("form", ["t.trace", "t.npz"])
def test_a_corrupt_side_file_is_a_trace_error(tmp_path, case, form):
    path = write_trace(toy_trace(3, with_vectors=True), tmp_path / form)
    SIDE[case](vectors_path(path))
    with pytest.raises(TraceError, match=r"t\.vectors\.npz: field '"):
        read_trace(path)


# ----------------------------------------------------------------------------------------------
# The number grammar (docs/trace-format.md): what C's printf writes, ASCII only

ACCEPTED = {"1": 1.0, "-2.5": -2.5, "+3": 3.0, "1e3": 1000.0, "1E-3": 1e-3, ".5": 0.5, "5.": 5.0, "inf": np.inf,
            "-inf": -np.inf, "INF": np.inf, "infinity": np.inf, "nan": np.nan, "-nan": np.nan, "NaN": np.nan,
            "0x1p-2": 0.25, "0x1.8p+1": 3.0, "-0X.8P0": -0.5, "0x10": 16.0, "1e999": np.inf, "0x1p99999": np.inf}
REFUSED = ["1_0", "１", "١", "1,0", "", "0x", "1e", "e5", ".", "nan(1)", "0x1p", "++1", "1..2", "inf1",
           "0b101", "1f"]


@pytest.mark.parametrize("token", sorted(ACCEPTED))
def test_numbers_the_grammar_accepts(token):
    t = parse_text(_replace_first_margin(BASE, token), "g.trace")
    got = float(t.moe["margin"][0])
    want = np.float32(ACCEPTED[token])
    assert (np.isnan(got) and np.isnan(want)) or got == want, (token, got)


def _replace_first_margin(text: str, token: str) -> str:
    lines = text.split("\n")
    i = next(i for i, ln in enumerate(lines) if ln.startswith("moe 0 pos 0"))
    head, _, _ = lines[i].rpartition("margin=")
    lines[i] = head + "margin=" + token
    return "\n".join(lines)


@pytest.mark.parametrize("token", REFUSED)
def test_numbers_the_grammar_refuses(token):
    with pytest.raises(TraceError, match="field 'margin': expected a number"):
        parse_text(_replace_first_margin(BASE, token), "g.trace")


@pytest.mark.parametrize("token", ["1_0", "٣", "+7", "07", "7.0", "0x7", "99999999999999999999999"])
def test_integer_fields_take_ascii_digits_only(token):
    text = BASE.replace("n_prompt 3", f"n_prompt {token}")
    if token in ("+7", "07"):  # the grammar's [+-]?[0-9]+: a valid integer, here the wrong value
        with pytest.raises(TraceError, match="field 'tokens'"):
            parse_text(text, "i.trace")
        return
    with pytest.raises(TraceError, match="field 'n_prompt'"):
        parse_text(text, "i.trace")


# ----------------------------------------------------------------------------------------------
# Seeded mutators

TOKENS = ["nan", "-1", "0", "2147483647", "2147483648", "-2147483649", "1e39", "0x1p3", "1_0", "١", "", "-", ",",
          ":", "=", "pos", "tok", "blk.0", "blk.9", "final_norm", "{}", "[[[[", "99999999999999999999999999",
          "\u00e9", "\x00", "\t", "a=b", "ids=1", "top=1:2", "1:nan", "sel=-", "-7"]


def _mutate_text(text: str, rng: random.Random) -> str:
    lines = text.split("\n")
    for _ in range(rng.randint(1, 3)):
        i = rng.randrange(len(lines))
        ln = lines[i]
        op = rng.randrange(8)
        words = ln.split(" ")
        if op == 0 and words:
            words[rng.randrange(len(words))] = rng.choice(TOKENS)
        elif op == 1 and "=" in ln:  # one value inside a key=value list
            k = rng.randrange(len(words))
            key, eq, val = words[k].partition("=")
            parts = val.split(",")
            parts[rng.randrange(len(parts))] = rng.choice(TOKENS)
            words[k] = key + eq + ",".join(parts)
        elif op == 2:
            del words[rng.randrange(len(words))]
        elif op == 3:
            lines.insert(i, ln)  # duplicate line
        elif op == 4:
            lines[i] = ""  # delete line
            continue
        elif op == 5 and ln:
            j = rng.randrange(len(ln))
            lines[i] = ln[:j] + rng.choice(TOKENS) + ln[j + 1:]
            continue
        elif op == 6:
            lines[i] = ln[: rng.randrange(len(ln) + 1)]
            continue
        else:
            words.insert(rng.randrange(len(words) + 1), rng.choice(TOKENS))
        lines[i] = " ".join(words)
    return "\n".join(lines)


def test_text_mutations_read_back_or_are_refused(tmp_path):
    rng = random.Random(11)
    outcomes = {"ok": 0, "refused": 0}
    path = tmp_path / "m.trace"
    for case in range(N_TEXT):
        path.write_text(_mutate_text(BASE, rng), encoding="utf-8", errors="surrogatepass")
        outcomes[_read_or_refuse(path, case)] += 1
    assert outcomes["refused"] > N_TEXT // 2 and outcomes["ok"] > 0  # both branches are exercised
    print(outcomes)


ODD_VALUES = [None, True, -1, 0, 2**31, 2**63, 1.5, float("nan"), "", "x", [], [1, "a"], [-1], {}, {"a": []},
              [[1]], "0123456789abcdef", "G" * 10]


def _mutate_binary(trace, rng: random.Random, tmp_path):
    cols = _binary_columns(trace)
    header = json.loads(_header_json(trace.header))
    op = rng.randrange(4)
    if op == 0:  # a header field gets a value of another type or range
        key = rng.choice(sorted(header))
        if key == "model" and rng.random() < 0.5:
            header["model"][rng.choice(["file", "size", "header_sha256", "data_sha256"])] = rng.choice(ODD_VALUES)
        else:
            header[key] = rng.choice(ODD_VALUES)
    elif op == 1:  # a column gets another dtype, shape or length
        name = rng.choice(sorted(cols))
        a = cols[name]
        cols[name] = rng.choice([a.astype(np.float64), a.astype(np.int64), a[:-1], a[..., :-1] if a.ndim > 1 else a,
                                 np.concatenate([a, a[:1]]), a.reshape(len(a), -1)[:, :0], a.astype(bool)])
    elif op == 2:  # a cell gets an odd value
        name = rng.choice(sorted(cols))
        a = cols[name].copy()
        if a.size:
            flat = a.reshape(-1)
            flat[rng.randrange(len(flat))] = rng.choice([-1, -2, 7, 1000, 2**31 - 1, 0, 1]) if a.dtype.kind in "iub" \
                else rng.choice([np.nan, np.inf, -1.0, 0.0])
        cols[name] = a
    path = tmp_path / "m.npz"
    blob = bytearray(npz_bytes(cols, {"header.json": json.dumps(header).encode()}))
    if op == 3:  # bytes flipped anywhere
        for _ in range(rng.randint(1, 4)):
            blob[rng.randrange(len(blob))] = rng.randrange(256)
    path.write_bytes(bytes(blob))
    return path


def test_binary_mutations_read_back_or_are_refused(tmp_path):
    rng = random.Random(12)
    trace = toy_trace(4)
    outcomes = {"ok": 0, "refused": 0}
    for case in range(N_BINARY):
        outcomes[_read_or_refuse(_mutate_binary(trace, rng, tmp_path), case)] += 1
    assert outcomes["refused"] > N_BINARY // 2 and outcomes["ok"] > 0
    print(outcomes)


def test_side_file_byte_mutations_load_the_bound_vectors_or_are_refused(tmp_path):
    rng = random.Random(13)
    trace = toy_trace(5, with_vectors=True)
    path = write_trace(trace, tmp_path / "s.trace")
    side = vectors_path(path)
    good = side.read_bytes()
    outcomes = {"ok": 0, "refused": 0}
    for case in range(N_SIDE):
        blob = bytearray(good)
        for _ in range(rng.randint(1, 3)):
            blob[rng.randrange(len(blob))] = rng.randrange(256)
        side.write_bytes(bytes(blob))
        try:
            t = read_trace(path)
        except TraceError as e:
            assert "s.vectors.npz: field '" in str(e), (case, str(e)[:300])
            outcomes["refused"] += 1
            continue
        for name, arr in trace.vectors.items():  # whatever loads is exactly what was written
            np.testing.assert_array_equal(t.vectors[name], arr)
        outcomes["ok"] += 1
    assert outcomes["refused"] > N_SIDE // 2
    print(outcomes)


def test_toy_trace_reads_back_identically(tmp_path):
    t = toy_trace(3, with_vectors=True)
    for name in ("a.trace", "a.npz"):
        back = read_trace(write_trace(t, tmp_path / name))
        assert back == t and all(np.array_equal(back.vectors[k], v) for k, v in t.vectors.items())
    assert copy.deepcopy(t) == t
