"""Trace format: fingerprint recipe, carrier statistics, text/binary round trip, determinism, a trace printed
the way a C engine would print it, and malformed traces failing with file:line and the field at fault."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
from fake_engine import FakeEngine

from parity import api
from parity.contract.errors import TraceError
from parity.tracing.io import format_text, parse_text, read_trace, vectors_path, write_trace
from parity.tracing.stats import FP_DIM, FP_SEED, carrier_stats, fingerprint, sign_matrix

FIXTURES = Path(__file__).parent / "fixtures" / "traces"
M64 = (1 << 64) - 1


# ----------------------------------------------------------------------------------------------
# A C engine's writer, transcribed with Python ints (an independent implementation of the recipe
# in docs/trace-format.md: splitmix64 sign bits, fprintf("%g")).

def splitmix64_int(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def c_fingerprint(x: list[float]) -> list[float]:
    n = len(x)
    return [sum(-v if splitmix64_int((FP_SEED + k * n + i) & M64) >> 63 else v for i, v in enumerate(x)) / 8.0
            for k in range(FP_DIM)]


def g(v: float) -> str:
    return "%g" % v  # noqa: UP031 - the point is C's printf


# Toy run: 1 layer, H = 2 streams, D = 3, positions 0 and 1, tokens 0 and 7.
VECTORS = {
    "embed": [[[1, 2, 3], [1, 2, 3]], [[-1, 0, 2], [-1, 0, 2]]],
    "blk.0.attn": [[[1.5, 2, 2.5], [0.5, 2, 3.5]], [[-1, 0.25, 2], [-0.75, 0, 2]]],
    "blk.0": [[[2, 1, 0], [0, 1, 2]], [[-2, 0.5, 1], [-1, 0, 3]]],
    "final_norm": [[1.25, -0.5, 0.75], [-1, 1, 0.5]],
}
TOP = [[(5, 2.5), (1, 1.25)], [(1, 3.0), (0, -0.5)]]


def c_style_trace() -> str:
    """What a C engine writes with fprintf for the toy run (header, ckpt, hc, moe, attn lines)."""
    lines = ["v4parity-trace 1", "engine cdemo 0.3", "model 1234 0123456789abcdef toy.gguf", "dtype float32",
             "hc 2", "dim 3", "top_k 2", "tokens 0 7", "n_prompt 2", "chunks 2", "decode 0", "positions 0 1",
             "checkpoints embed blk.0.attn blk.0 final_norm", "full -", "flags {}", "end"]
    for name, k in (("embed", 0), ("blk.0.attn", 1), ("blk.0", 1), ("final_norm", 2)):
        for p, tok in ((0, 0), (1, 7)):
            x = VECTORS[name][p]
            streams = x if name != "final_norm" else [x]
            flat = [v for s in streams for v in s]
            l2s = [math.sqrt(sum(v * v for v in s)) for s in streams]
            ssum = [sum(col) for col in zip(*streams, strict=True)]
            line = (f"ckpt {k} {name} pos {p} tok {tok}: min={g(min(flat))} max={g(max(flat))} "
                    f"rms={g(math.sqrt(sum(v * v for v in flat) / len(flat)))} l2s={','.join(map(g, l2s))} "
                    f"sum_l2={g(math.sqrt(sum(v * v for v in ssum)))} fp={','.join(map(g, c_fingerprint(flat)))}")
            if name == "final_norm":
                line += f" argmax={TOP[p][0][0]} top=" + ",".join(f"{i}:{g(v)}" for i, v in TOP[p])
            lines.append(line)
    for p in (0, 1):
        lines.append(f"hc 0 attn pos {p}: pre=0.5,0.5 post=1,1 comb=0.75,0.25,0.25,0.75")
        lines.append(f"hc 0 ffn pos {p}: pre=0.25,0.75 post=1.5,0.5 comb=1,0,0,1")
        lines.append(f"moe 0 pos {p}: ids=3,1 w=0.6,0.4 margin=0.125")
        lines.append(f"attn 0 pos {p}: n_comp=0 sel=-")
    return "\n".join(lines) + "\n"


def test_fixture_is_what_the_c_recipe_prints():
    assert (FIXTURES / "c_engine.trace").read_text() == c_style_trace()


def test_c_engine_trace_is_accepted_and_means_what_it_says():
    t = read_trace(FIXTURES / "c_engine.trace")
    assert t.header.engine == "cdemo" and t.header.n_hc == 2 and t.header.positions == [0, 1]
    rows = t.checkpoint_rows("embed")
    # hand-computed: embed pos 0 = two copies of (1, 2, 3)
    np.testing.assert_allclose(t.ckpt["l2s"][rows[0]], [math.sqrt(14)] * 2, rtol=1e-5)
    np.testing.assert_allclose(t.ckpt["sum_l2"][rows[0]], math.sqrt(56), rtol=1e-5)
    np.testing.assert_allclose(t.ckpt["rms"][rows[0]], math.sqrt(28 / 6), rtol=1e-5)  # printf %g keeps 6 digits
    assert (t.ckpt["min"][rows[0]], t.ckpt["max"][rows[0]]) == (1, 3)
    # the C recipe and the numpy fingerprint agree to printf's 6 digits
    for name in VECTORS:
        want = fingerprint(np.asarray(VECTORS[name], dtype=np.float64))
        got = t.ckpt["fp"][t.checkpoint_rows(name)]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    final = t.checkpoint_rows("final_norm")
    assert t.ckpt["argmax"][final].tolist() == [5, 1]
    assert t.ckpt["top_ids"][final].tolist() == [[5, 1], [1, 0]]
    assert np.isnan(t.ckpt["l2s"][final][:, 1]).all()  # final_norm has one "stream"
    assert t.moe["ids"].tolist() == [[3, 1], [3, 1]] and not t.attn["has_sel"].any()


def test_c_engine_trace_self_diff_is_exact():
    r = api.diff(FIXTURES / "c_engine.trace", FIXTURES / "c_engine.trace")
    assert r.exact and r.first_drift is None


# ----------------------------------------------------------------------------------------------
# Fingerprint and statistics

def test_sign_matrix_matches_integer_splitmix64():
    s = sign_matrix(37)
    for k in (0, 1, 63):
        for i in (0, 1, 36):
            bit = splitmix64_int((FP_SEED + k * 37 + i) & M64) >> 63
            assert s[k, i] == (-1.0 if bit else 1.0)
    assert abs(s.mean()) < 0.05  # balanced signs


def test_fingerprint_is_linear_and_estimates_norms_and_cosines():
    rng = np.random.default_rng(7)
    a, b = rng.standard_normal((2, 4, 256))
    fa, fb = fingerprint(a[None])[0].astype(np.float64), fingerprint(b[None])[0].astype(np.float64)
    np.testing.assert_allclose(fingerprint((a + b)[None])[0], fa + fb, rtol=1e-5, atol=1e-4)
    # E[|fp(x)|^2] = |x|^2; with 64 signs the relative spread is sqrt(2/64) ~ 0.18
    assert 0.5 < np.dot(fa, fa) / np.sum(a * a) < 1.5
    c = a + 0.3 * b  # true cosine 1/sqrt(1.09) ~ 0.958
    fc = fingerprint(c[None])[0].astype(np.float64)
    est = np.dot(fa, fc) / np.linalg.norm(fa) / np.linalg.norm(fc)
    true = np.sum(a * c) / np.linalg.norm(a) / np.linalg.norm(c)
    assert abs(est - true) < 0.05


def test_carrier_stats_hand_computed():
    x = np.array([[[3.0, 4.0], [0.0, -1.0]]])  # one position, 2 streams, D = 2
    st = carrier_stats(x)
    np.testing.assert_allclose(st["l2s"], [[5.0, 1.0]])
    np.testing.assert_allclose(st["sum_l2"], [math.sqrt(9 + 9)])
    np.testing.assert_allclose(st["rms"], [math.sqrt(26 / 4)])
    assert (st["min"][0], st["max"][0]) == (-1.0, 4.0)
    assert st["fp"].shape == (1, FP_DIM)


# ----------------------------------------------------------------------------------------------
# Round trips and determinism

@pytest.fixture(scope="module")
def fake_trace(tiny_f32):
    eng = FakeEngine(str(tiny_f32))
    return api.trace(eng, tiny_f32, [0, 5, 7, 9, 11, 13, 15], positions="all", decode=3, chunk=3, full="all")


def test_text_and_binary_read_back_identically(fake_trace, tmp_path):
    text, binary = write_trace(fake_trace, tmp_path / "a.trace"), write_trace(fake_trace, tmp_path / "b.npz")
    a, b = read_trace(text), read_trace(binary)
    assert a == fake_trace and b == fake_trace and a == b
    assert format_text(a) == format_text(b)
    for name, arr in fake_trace.vectors.items():
        np.testing.assert_array_equal(a.vectors[name], arr)
        np.testing.assert_array_equal(b.vectors[name], arr)


def test_same_input_gives_byte_identical_files(fake_trace, tmp_path):
    for name in ("x.trace", "x.npz"):
        p1 = write_trace(fake_trace, tmp_path / "1" / name)
        p2 = write_trace(read_trace(p1), tmp_path / "2" / name)
        assert p1.read_bytes() == p2.read_bytes()
        assert vectors_path(p1).read_bytes() == vectors_path(p2).read_bytes()
    assert not list(tmp_path.rglob(".*"))  # no temp files left behind


def test_header_records_the_run(fake_trace, tiny_f32):
    h = fake_trace.header
    assert h.tokens[:7] == [0, 5, 7, 9, 11, 13, 15] and len(h.tokens) == 10 and h.decode == 3
    assert h.chunks == [3, 3, 1, 1, 1, 1] and h.positions == list(range(10))
    assert h.model == api.model_identity(tiny_f32)
    assert h.flags["fp8_kv"] is True and h.flags["inject"] == []
    assert len(fake_trace.ckpt) == len(h.checkpoints) * 10


def test_header_matches_json_schema(fake_trace, tmp_path):
    import jsonschema

    schema = json.loads((Path(__file__).parents[1] / "parity" / "schema" / "trace.schema.json").read_text())
    header = fake_trace.header.to_dict()
    jsonschema.validate(header, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**header, "n_hc": 0}, schema)


# ----------------------------------------------------------------------------------------------
# Malformed traces: file:line and the field

def _edit(text: str, old: str, new: str, count: int = 1) -> str:
    assert old in text
    return text.replace(old, new, count)


def _line_of(text: str, needle: str) -> int:
    return next(i for i, line in enumerate(text.split("\n"), start=1) if needle in line)


BASE = c_style_trace()
MALFORMED = {
    "not-a-trace": (lambda t: "hello\n" + t, 1, "format"),
    "future-version": (lambda t: _edit(t, "v4parity-trace 1", "v4parity-trace 2"), 1, "format"),
    "missing-dim": (lambda t: _edit(t, "dim 3\n", ""), 1, "dim"),
    "bad-token-id": (lambda t: _edit(t, "tokens 0 7", "tokens 0 x7"), _line_of(BASE, "tokens 0 7"), "tokens"),
    "flags-not-json": (lambda t: _edit(t, "flags {}", "flags {fp8"), _line_of(BASE, "flags {}"), "flags"),
    "unknown-header-key": (lambda t: _edit(t, "dtype float32", "dtype float32\ncolour red"),
                           _line_of(BASE, "dtype") + 1, "colour"),
    "l2s-count": (lambda t: _edit(t, "l2s=3.74166,3.74166", "l2s=3.74166"), _line_of(BASE, "l2s=3.74166"), "l2s"),
    "bad-float": (lambda t: _edit(t, "min=1 max=3", "min=one max=3"), _line_of(BASE, "min=1 max=3"), "min"),
    "missing-fp": (lambda t: _edit(t, " fp=", " nofp="), _line_of(BASE, " fp="), "fp"),
    "position-not-traced": (lambda t: _edit(t, "ckpt 0 embed pos 1 tok 7", "ckpt 0 embed pos 2 tok 7"),
                            _line_of(BASE, "ckpt 0 embed pos 1"), "pos"),
    "token-mismatch": (lambda t: _edit(t, "ckpt 0 embed pos 1 tok 7", "ckpt 0 embed pos 1 tok 8"),
                       _line_of(BASE, "ckpt 0 embed pos 1"), "tok"),
    "wrong-index": (lambda t: _edit(t, "ckpt 1 blk.0 pos 0", "ckpt 2 blk.0 pos 0"),
                    _line_of(BASE, "ckpt 1 blk.0 pos 0"), "k"),
    "top-count": (lambda t: _edit(t, "top=5:2.5,1:1.25", "top=5:2.5"), _line_of(BASE, "top=5:2.5"), "top"),
    "bad-sublayer": (lambda t: _edit(t, "hc 0 ffn pos 0", "hc 0 mlp pos 0"), _line_of(BASE, "hc 0 ffn pos 0"),
                     "sublayer"),
    "layer-out-of-range": (lambda t: _edit(t, "moe 0 pos 1", "moe 4 pos 1"), _line_of(BASE, "moe 0 pos 1"), "layer"),
    "unknown-record": (lambda t: t + "tensor 0 pos 0: x=1\n", len(BASE.split("\n")), "record"),
    "duplicate-record": (lambda t: t + next(ln for ln in BASE.split("\n") if ln.startswith("moe 0 pos 0")) + "\n",
                         len(BASE.split("\n")), "record"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_text_names_file_line_and_field(case, tmp_path):
    edit, line, field = MALFORMED[case]
    path = tmp_path / "bad.trace"
    path.write_text(edit(BASE))
    with pytest.raises(TraceError) as e:
        read_trace(path)
    msg = str(e.value)
    assert f"{path}:{line}:" in msg and f"field '{field}'" in msg, msg


def test_missing_record_is_named(tmp_path):
    path = tmp_path / "short.trace"
    path.write_text("\n".join(ln for ln in BASE.split("\n") if not ln.startswith("ckpt 1 blk.0 pos 1")))
    with pytest.raises(TraceError, match=r"no record for checkpoint blk\.0 at position 1"):
        read_trace(path)


def test_version_mismatch_says_how_to_regenerate():
    with pytest.raises(TraceError, match="regenerate"):
        parse_text(BASE.replace("v4parity-trace 1", "v4parity-trace 9"), "old.trace")


def test_malformed_binary_traces(fake_trace, tmp_path):
    good = write_trace(fake_trace, tmp_path / "t.npz")
    broken = tmp_path / "broken.npz"
    broken.write_bytes(good.read_bytes()[: len(good.read_bytes()) // 2])
    with pytest.raises(TraceError, match="broken.npz"):
        read_trace(broken)
    vectors_path(good).unlink()
    with pytest.raises(TraceError, match="field 'full'"):
        read_trace(good)
    assert read_trace(good, load_vectors=False).vectors is None


def test_binary_header_without_model_identity_is_refused(fake_trace, tmp_path):
    header = dataclasses.replace(fake_trace.header, model={"file": "x.gguf", "size": 1}, full=[])
    path = write_trace(dataclasses.replace(fake_trace, header=header, vectors=None), tmp_path / "m.npz")
    with pytest.raises(TraceError, match="field 'model': must hold exactly file, size and header_sha256"):
        read_trace(path)


def test_vectors_of_the_wrong_shape_are_refused(fake_trace, tmp_path):
    from parity.tracing.io import write_npz

    path = write_trace(fake_trace, tmp_path / "v.trace")
    vec = {"positions": np.asarray(fake_trace.header.positions), **fake_trace.vectors}
    vec["blk.1"] = vec["blk.1"][:, :, :-1]
    write_npz(vectors_path(path), vec)
    with pytest.raises(TraceError, match=r"field 'blk.1': rows of shape \(4, 255\), expected \(4, 256\)"):
        read_trace(path)


def test_follow_replays_the_chunking_or_refuses(fake_trace):
    run = api.follow(fake_trace)
    assert run["chunk"] == 3 and run["decode"] == 3 and run["forced"] == fake_trace.header.tokens[7:]
    odd = dataclasses.replace(fake_trace, header=dataclasses.replace(fake_trace.header, chunks=[2, 5, 1, 1, 1]))
    with pytest.raises(TraceError, match=r"cannot replay the prefill chunks \[2, 5\]"):
        api.follow(odd)


def test_traces_with_the_old_model_identity_still_read_and_write_back(tmp_path):
    """c_engine.trace predates the data hash: its `model` line has size, header hash and file, no `model_data`."""
    old = read_trace(FIXTURES / "c_engine.trace")
    assert sorted(old.header.model) == ["file", "header_sha256", "size"]
    again = read_trace(write_trace(old, tmp_path / "old.trace"))
    assert again == old and "model_data" not in (tmp_path / "old.trace").read_text()
    new = dataclasses.replace(old.header, model={**old.header.model, "data_sha256": "ab" * 16})
    assert read_trace(write_trace(dataclasses.replace(old, header=new), tmp_path / "new.trace")).header == new
    assert f"model_data {'ab' * 16}\n" in (tmp_path / "new.trace").read_text()
    assert api.diff(old, dataclasses.replace(old, header=new)).exact  # compared on size + header hash


def test_runner_refusals_are_trace_errors(tiny_f32):
    """A bad schedule is a ParityError (the CLI's clean exit 2), not a bare ValueError traceback."""
    from parity.tracing.runner import chunk_schedule, run_sequence

    assert chunk_schedule(5, 2) == [2, 2, 1] and chunk_schedule(5, None) == [5]
    for n, chunk, match in ((0, None, "at least one token"), (5, 0, "chunk must be >= 1, got 0")):
        with pytest.raises(TraceError, match=match):
            chunk_schedule(n, chunk)
    with pytest.raises(TraceError, match="forced has 1 tokens, 2 decode steps requested"):
        run_sequence(FakeEngine(str(tiny_f32)), [1, 2], decode_steps=2, forced=[3])


def test_positions_spec_is_parsed_strictly():
    from parity.tracing.recorder import resolve_positions

    assert resolve_positions("last", 5) == [4] and resolve_positions("all", 3) == [0, 1, 2]
    assert resolve_positions("3, 1,3", 5) == [1, 3]
    for spec in ("1,,2", "1,2,", "x"):
        with pytest.raises(TraceError, match="comma list of ints"):
            resolve_positions(spec, 5)
    for spec, match in (("", "no positions"), ("5", r"out of range \[0, 5\)")):
        with pytest.raises(TraceError, match=match):
            resolve_positions(spec, 5)
