"""Sub-op records in the trace format (issue 22, point 1): written by `trace --subops`, read back bit for bit,
refused when malformed (naming the record), and turned into an op-level `check` verdict.

The expected values come from outside the code under test: the record arrays are compared with the torch
engine's own captures of the same run (`run_sequence(capture=True)`), chunk by chunk; the culprit layer of an
injected fault is the first layer whose recorded output differs at all, bitwise, between the clean and the faulty
trace (as in tests/test_check.py), and its sub-op is where the fault acts by its meaning (tests/test_bisect_engines).
"""

from __future__ import annotations

import json
import re
import subprocess
import zipfile
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from requires import require_program
from test_bisect_engines import SUBOP

from parity import api
from parity.bisect.search import builtin_prompt
from parity.check.check_report import headline
from parity.cli import cli
from parity.contract.checkpoints import SUBOPS, block
from parity.contract.engine import RunOptions, load_engine
from parity.contract.errors import TraceError
from parity.gguf.weights import Weights
from parity.tracing.io import TRACE_ID, vectors_path, write_npz
from parity.tracing.runner import run_sequence
from parity.tracing.subops import POS, RECORD_NAMES, ROW_RECORDS, member, subop_chunks
from parity.tracing.zipstore import StoredZip

DECODE, CHUNK = 4, 10
FAULTS = ("sink-dropped", "swiglu-symmetric-clamp")


@pytest.fixture(scope="module")
def prompt(tiny_f32):
    cfg = Weights(tiny_f32).config
    return builtin_prompt(cfg.vocab_size, cfg.bos_token_id)


def _trace(model, prompt, path, **options):
    t = api.trace("torch", model, prompt, positions="all", full="all", decode=DECODE, chunk=CHUNK, subops=True,
                  options=RunOptions(**options))
    api.save_trace(t, path)
    return t


@pytest.fixture(scope="module")
def clean(tiny_f32, prompt, tmp_path_factory):
    path = tmp_path_factory.mktemp("subops") / "clean.trace"
    return path, _trace(tiny_f32, prompt, path)


@pytest.fixture(scope="module")
def envelope(tiny_f32, tmp_path_factory):
    """The reference's own envelope (QAT sims on), measured once: what `check` measures when none is stored."""
    return api.envelope(tiny_f32, engine="reference", output=tmp_path_factory.mktemp("env") / "tiny.envelope.json")[1]


def test_records_are_the_engines_captures_and_round_trip_bit_for_bit(tiny_f32, prompt, clean, tmp_path):
    path, written = clean
    eng = load_engine("torch", str(tiny_f32), RunOptions())
    runs = run_sequence(eng, prompt, DECODE, chunk=CHUNK, forced=written.header.tokens[len(prompt):], capture=True)
    assert [len(r.tokens) for r in runs] == written.header.chunks == [10, 10, 8, 1, 1, 1, 1]
    for form, p in (("text", path), ("npz", tmp_path / "clean.npz")):
        if form == "npz":
            api.save_trace(written, p)
        back = api.load_trace(p)
        assert back == written and back.header.subops == list(RECORD_NAMES)
        assert sorted(back.subops) == sorted(written.subops)
        for name, a in written.subops.items():
            b = back.subops[name]
            assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), (form, name)
        # the records cut back into the candidate's chunks are the engine's captures of each chunk, bit for bit
        # (emitted rows: all rows visible after the chunk), every capture op-level forcing reads
        chunks = subop_chunks(back, eng.config)
        for got, want in zip(chunks, runs, strict=True):
            assert got.start_pos == want.start_pos
            for l in range(eng.config.n_layers):
                assert set(got.captures[l]) == {q for _, caps in SUBOPS for q in caps}
                for q, a in want.captures[l].items():
                    b = got.captures[l][q]
                    assert a.shape == b.shape and np.array_equal(a, b), (want.start_pos, l, q)
                for which in ("hc_attn", "hc_ffn"):
                    for a, b in zip(getattr(want.diags[l], which), getattr(got.diags[l], which), strict=True):
                        assert np.array_equal(a, b), (want.start_pos, l, which)
    rows = {q: [len(written.subops[member(l, q)]) for l in range(eng.config.n_layers)] for q in ROW_RECORDS}
    assert max(rows["comp_rows"]) > 0 and max(rows["index_rows"]) > 0   # the prompt exercises emitted rows


def _side(path: Path) -> dict[str, np.ndarray]:
    z = StoredZip(vectors_path(path))
    return {n: np.array(z.array(n, n)) for n in z.npy_names()}


@pytest.mark.parametrize("damage, field, message", [
    ("truncated", "subop.2.q_path", "rows, expected 32"),
    ("shape", "subop.1.rope_q", "hd = 95"),
    ("dtype", "subop.0.attn_out", "dtype float64"),
    ("missing", "subop.3.shared_out", "sub-op record missing"),
    ("row position", "subop.2.comp_rows.pos", "last position of the chunk"),
    ("extra", "subop.0.expert_ids", "not listed in the trace header"),
])
def test_a_malformed_record_is_refused_naming_it(clean, tmp_path, damage, field, message):
    path = tmp_path / "bad.trace"
    path.write_bytes(clean[0].read_bytes())
    arrays = _side(clean[0])
    if damage == "truncated":
        arrays[field] = arrays[field][:-1]
    elif damage == "shape":
        arrays[field] = arrays[field][..., :-1]
    elif damage == "dtype":
        arrays[field] = arrays[field].astype(np.float64)
    elif damage == "missing":
        del arrays[field]
    elif damage == "row position":
        arrays[field] = arrays[field] - 1
    else:
        arrays[field] = np.zeros((32, 3), np.float32)
    write_npz(vectors_path(path), arrays)
    with pytest.raises(TraceError, match=f"field '{field}(.npy)?'.*{message}"):
        api.load_trace(path)


@pytest.mark.parametrize("name, message", [("q_pth", "unknown sub-op record name 'q_pth'"),
                                           ("expert_ids", "held by the moe / attn records")])
def test_an_unknown_record_name_is_refused_naming_it(clean, tmp_path, name, message):
    text = clean[0].read_text().replace("subops hc_attn_pre ", f"subops {name} hc_attn_pre ", 1)
    path = tmp_path / "bad.trace"
    path.write_text(text)
    with pytest.raises(TraceError, match=f"field 'subops'.*{message}"):
        api.load_trace(path)


def test_a_rewritten_emitted_row_is_refused_when_recording():
    from parity.tracing.runner import ChunkResult
    from parity.tracing.subops import SubopRecorder

    caps = {q: np.zeros((2, 3), np.float32) for q in RECORD_NAMES}
    rec = SubopRecorder([0, 1, 2, 3])
    rec.add(ChunkResult(0, np.array([1, 2]), {}, np.zeros((2, 0)), [], [dict(caps)]))
    caps["comp_rows"] = caps["comp_rows"] + 1
    with pytest.raises(TraceError, match="layer 0 comp_rows: the chunk at position 2 rewrote"):
        rec.add(ChunkResult(2, np.array([1, 2]), {}, np.zeros((2, 0)), [], [dict(caps)]))


def test_cli_subops_needs_every_position(tiny_f32, tmp_path):
    r = CliRunner().invoke(cli, ["trace", "--engine", "reference", "-m", str(tiny_f32), "--tokens", "0,5,7,9",
                                 "--subops", "--full", "all", "-o", str(tmp_path / "t.trace")])
    assert r.exit_code == 2 and "--subops needs --positions all" in r.output, r.output
    with pytest.raises(TraceError, match="--positions all, not 1 of 4"):
        api.trace("reference", tiny_f32, [0, 5, 7, 9], positions="last", subops=True)
    r = CliRunner().invoke(cli, ["trace", "--engine", "reference", "-m", str(tiny_f32), "--tokens", "0,5,7,9",
                                 "--subops", "--positions", "all", "--full", "all", "-o", str(tmp_path / "t.npz"),
                                 "--json"])
    assert r.exit_code == 0, r.output
    back = api.load_trace(json.loads(r.stdout)["wrote"])
    assert back.header.subops == list(RECORD_NAMES) and len(back.subops[member(0, "q_path")]) == 4


def test_clean_torch_with_qat_sims_is_match_or_noise_op_level(tiny_f32, clean, envelope):
    r = api.check(clean[0], tiny_f32, envelope=envelope)
    assert r.verdict in ("MATCH", "NOISE") and r.judged == "op-level", headline(r)
    assert headline(r).startswith(f"{r.verdict} [op-level]:"), headline(r)


@pytest.mark.parametrize("fault", FAULTS)
def test_a_fault_is_a_defect_at_its_layer_op_level(tiny_f32, prompt, clean, envelope, tmp_path, fault):
    path = tmp_path / f"{fault}.trace"
    faulty = _trace(tiny_f32, prompt, path, inject=(fault,))
    layer = next(l for l in range(faulty.n_layers)
                 if not np.array_equal(clean[1].vectors[block(l)], faulty.vectors[block(l)]))
    r = api.check(path, tiny_f32, envelope=envelope)
    assert r.verdict == "DEFECT" and r.judged == "op-level", headline(r)
    assert (r.culprit.layer, r.causes[-1].name) == (layer, fault), headline(r)
    assert r.culprit.subop in SUBOP[fault] and headline(r).endswith("[op-level]"), headline(r)


def test_emitted_rows_carry_the_last_position_of_their_chunk(clean):
    t = clean[1]
    ends = set((np.cumsum(t.header.chunks) - 1).tolist())
    for l in range(t.n_layers):
        for q in ROW_RECORDS:
            assert set(t.subops[member(l, q) + POS].tolist()) <= ends


def test_a_side_file_written_from_c_as_the_docs_show_reads_back_equal(clean, tmp_path):
    """docs/trace-format.md's `v4p_npy`, compiled, writes every side-file array of the clean trace from its raw
    bytes; packed uncompressed as `zip -0` would (Python's zipfile, ZIP_STORED; no trace_sha256: the unbound form)
    the trace reads back with equal records. The C compiler is required in CI (tests/requires.py)."""
    cc = require_program("cc", "gcc")
    doc = (Path(__file__).resolve().parents[1] / "docs" / "trace-format.md").read_text()
    block = re.search(r"```c\n(/\* one \.npy.*?\n})\n", doc, re.S)
    assert block, "docs/trace-format.md lost its v4p_npy example"
    main = r"""
int main(int argc, char **argv) {   /* argv: name descr shape nbytes, repeated; data from raw/<name> */
    for (int i = 1; i + 3 < argc; i += 4) {
        char src[512], dst[512];
        size_t nbytes = strtoull(argv[i + 3], 0, 10);
        void *data = malloc(nbytes + 1);
        snprintf(src, sizeof src, "raw/%s", argv[i]);
        FILE *f = fopen(src, "rb");
        if (!f || fread(data, 1, nbytes, f) != nbytes) return 1;
        fclose(f);
        snprintf(dst, sizeof dst, "side/%s.npy", argv[i]);
        v4p_npy(dst, argv[i + 1], argv[i + 2], data, nbytes);
        free(data);
    }
    return 0;
}
"""
    (tmp_path / "w.c").write_text("#include <stdio.h>\n#include <stdlib.h>\n#include <stdint.h>\n"
                                  + block.group(1) + main)
    subprocess.run([cc, "-O0", "-o", str(tmp_path / "w"), str(tmp_path / "w.c")], check=True)
    (tmp_path / "raw").mkdir()
    (tmp_path / "side").mkdir()
    args = []
    for name, a in _side(clean[0]).items():
        if name == TRACE_ID:
            continue
        (tmp_path / "raw" / name).write_bytes(np.ascontiguousarray(a).tobytes())
        shape = "(" + ", ".join(map(str, a.shape)) + ("," if a.ndim == 1 else "") + ")"
        args += [name, a.dtype.str, shape, str(a.nbytes)]
    subprocess.run([str(tmp_path / "w"), *args], cwd=tmp_path, check=True)
    path = tmp_path / "c.trace"
    path.write_bytes(clean[0].read_bytes())
    with zipfile.ZipFile(vectors_path(path), "w", zipfile.ZIP_STORED) as z:
        for npy in sorted((tmp_path / "side").glob("*.npy")):
            z.write(npy, npy.name)
    back = api.load_trace(path)
    assert back.subops.keys() == clean[1].subops.keys()
    assert all(back.subops[k].tobytes() == a.tobytes() and back.subops[k].dtype == a.dtype
               for k, a in clean[1].subops.items())


def test_a_header_with_subops_matches_the_json_schema(clean):
    import jsonschema

    schema = json.loads((Path(__file__).resolve().parents[1] / "parity" / "schema" / "trace.schema.json").read_text())
    header = clean[1].header.to_dict()
    assert header["subops"] == list(RECORD_NAMES)
    jsonschema.validate(header, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**header, "subops": ["q_pth"]}, schema)
    no_records = {k: v for k, v in header.items() if k != "subops"}   # optional, as in every older trace
    jsonschema.validate(no_records, schema)


def test_llamacpp_engine_records_its_captures(tiny_f32, tmp_path):
    """The llamacpp engine captures every sub-op too: its records cut back into chunks are its own captures."""
    from requires import require

    require("llama_cpp")
    opts = RunOptions(fp8_kv=False, fp4_indexer=False)
    eng = load_engine("llamacpp", str(tiny_f32), opts)
    t = api.trace(eng, tiny_f32, list(range(2, 21)), positions="all", full="all", decode=2, chunk=7, subops=True)
    api.save_trace(t, tmp_path / "lcp.npz")
    chunks = subop_chunks(api.load_trace(tmp_path / "lcp.npz"), eng.config)
    runs = run_sequence(eng, list(range(2, 21)), 2, chunk=7, forced=t.header.tokens[19:], capture=True)
    for got, want in zip(chunks, runs, strict=True):
        for l in range(eng.config.n_layers):
            for q, a in want.captures[l].items():
                assert np.array_equal(np.asarray(a, np.float32), got.captures[l][q]), (want.start_pos, l, q)
