"""The C route (issue 28, item 3): `include/v4parity_trace.h` writes a trace `check` judges.

`include/example_trace.c` is compiled with the system C compiler (`cc -std=c99 -Wall -Werror`), fed the
reference's own checkpoint vectors (exported, written as raw float32 files with numpy) and writes a text trace
plus a stored-zip side file through the header's API. Independent checks: the record lines are the Python
writer's, byte for byte, for the same vectors (the statistics and fingerprint code in C against the numpy code),
the side file's arrays are the input vectors bit for bit (read by numpy's own zip reader and by v4parity's), and
`check` judges it op-level (the example writes the hc / moe / attn lines and the sub-op records too): MATCH on the
unperturbed trace, DEFECT at the perturbed layer's output op for a 2e-3 relative error at every position of layer
3's output carrier (the planted error of tests/test_check.py; the example perturbs the record of the same vectors,
subop.3.hc_ffn_post, alike).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import zipfile
from pathlib import Path

import numpy as np
import pytest
from requires import require_program

from parity import api
from parity.bisect.search import builtin_prompt
from parity.check.check_report import headline
from parity.contract.checkpoints import block
from parity.contract.errors import TraceError
from parity.gguf.weights import Weights
from parity.tracing.io import format_text, read_trace, vectors_path
from parity.tracing.stats import carrier_stats, top_k
from parity.tracing.subops import record_members

ROOT = Path(__file__).resolve().parent.parent
INCLUDE = ROOT / "include"
ENV_F32 = ROOT / "traces" / "tiny-f32.envelope.json"
DECODE = 4


@pytest.fixture(scope="module")
def example(tmp_path_factory) -> Path:
    cc = require_program("cc", "gcc")
    exe = tmp_path_factory.mktemp("cc") / "example_trace"
    subprocess.run([cc, "-std=c99", "-pedantic", "-Wall", "-Wextra", "-Werror", "-O2", "-o", str(exe),
                    str(INCLUDE / "example_trace.c"), "-lm"], check=True, capture_output=True, text=True)
    return exe


@pytest.fixture(scope="module")
def reference(tiny_f32, tmp_path_factory):
    """The reference's trace of the built-in prompt (every position, every full vector), saved by Python, and
    its vectors exported to DIR/<checkpoint>.bin + DIR/meta.txt: the example's input."""
    cfg = Weights(tiny_f32).config
    t = api.trace("reference", tiny_f32, builtin_prompt(cfg.vocab_size, cfg.bos_token_id), positions="all",
                  full="all", decode=DECODE, subops=True)
    out = tmp_path_factory.mktemp("ref")
    api.save_trace(t, out / "ref.trace")
    api.export(t, out / "ref.npz")
    h = t.header
    with np.load(out / "ref.npz") as z:
        for name in h.full:
            z[name].astype("<f4").tofile(out / f"{name}.bin")
    m = h.model
    meta = ["engine c-example 1.0 (v4parity_trace.h)", f"model {m['size']} {m['header_sha256']} {m['file']}",
            f"model_data {m['data_sha256']}", f"dtype {h.dtype}", f"layers {t.n_layers}", f"hc {h.n_hc}",
            f"dim {h.dim}", f"vocab {cfg.vocab_size}", f"top_k {h.top_k}", "tokens " + " ".join(map(str, h.tokens)),
            f"n_prompt {h.n_prompt}", "chunks " + " ".join(map(str, h.chunks)), f"decode {h.decode}",
            "positions " + " ".join(map(str, h.positions)),
            "flags " + json.dumps(h.flags, sort_keys=True, separators=(",", ":"))]
    meta += [*_diagnostics(t, out), "subops " + " ".join(h.subops)]
    (out / "meta.txt").write_text("\n".join(meta) + "\n")
    manifest = []
    for m in record_members(h):
        a = t.subops[m]
        manifest.append(f"{m} {a.dtype.str} {' '.join(map(str, a.shape))}")
        a.tofile(out / f"{m}.bin")
    (out / "arrays.txt").write_text("\n".join(manifest) + "\n")
    return out, t


def _diagnostics(t, out: Path) -> list[str]:
    """The hc / moe / attn tables as the example reads them (files + meta lines)."""
    hc, moe, attn = t.hc, t.moe, t.attn
    np.stack([hc["layer"], hc["sub"], hc["pos"]], 1).astype("<i4").tofile(out / "hc.idx.bin")
    np.concatenate([hc["pre"], hc["post"], hc["comb"]], 1).astype("<f4").tofile(out / "hc.val.bin")
    np.concatenate([moe["layer"][:, None], moe["pos"][:, None], moe["ids"]], 1).astype("<i4").tofile(
        out / "moe.idx.bin")
    np.concatenate([moe["w"], moe["margin"][:, None]], 1).astype("<f4").tofile(out / "moe.val.bin")
    np.concatenate([np.stack([attn["layer"], attn["pos"], attn["n_comp"], attn["has_sel"]], 1), attn["sel"]],
                   1).astype("<i4").tofile(out / "attn.bin")
    return [f"hc_rows {len(hc)}", f"moe_rows {len(moe)}", f"moe_k {moe['ids'].shape[1]}", f"attn_rows {len(attn)}",
            f"sel_width {attn['sel'].shape[1]}"]


def _run(exe: Path, src: Path, out: Path, *perturb: str) -> Path:
    subprocess.run([str(exe), str(src), str(out), *perturb], check=True, capture_output=True, text=True)
    return out


@pytest.fixture(scope="module")
def clean(example, reference, tmp_path_factory):
    return _run(example, reference[0], tmp_path_factory.mktemp("c") / "c.trace")


def _records(path: Path) -> list[str]:
    return path.read_text().split("\nend\n", 1)[1].splitlines()


def test_record_lines_are_the_python_writers_byte_for_byte(reference, clean):
    src, ref = reference
    c_lines, py_lines = _records(clean), _records(src / "ref.trace")
    kinds = [ln.split(" ", 1)[0] for ln in c_lines]
    assert kinds.count("ckpt") == len(ref.header.checkpoints) * len(ref.header.positions)
    assert (kinds.count("hc"), kinds.count("moe"), kinds.count("attn")) == (len(ref.hc), len(ref.moe), len(ref.attn))
    assert len(ref.hc) and len(ref.moe) and len(ref.attn)
    assert c_lines == py_lines
    # the header differs in the engine line only (the example names itself)
    c_head, py_head = (p.read_text().split("\nend\n")[0].splitlines() for p in (clean, src / "ref.trace"))
    assert [a for a, b in zip(c_head, py_head, strict=True) if a != b] == ["engine c-example 1.0 (v4parity_trace.h)"]


def test_side_file_is_a_stored_zip_of_the_input_vectors(reference, clean):
    src, ref = reference
    side = vectors_path(clean)
    with zipfile.ZipFile(side) as z:       # Python's own zip reader: CRCs, stored members
        assert z.testzip() is None
        assert {i.compress_type for i in z.infolist()} == {zipfile.ZIP_STORED}
    with np.load(side) as z:               # numpy's .npy reader
        assert sorted(z.files) == sorted(["positions", "trace_sha256", *ref.header.full, *ref.subops])
        assert z["trace_sha256"].tolist() == [hashlib.sha256(clean.read_bytes()).hexdigest()]
        assert z["positions"].tolist() == ref.header.positions
        for name in ref.header.full:
            want = np.fromfile(src / f"{name}.bin", "<f4").reshape(z[name].shape)
            assert z[name].dtype == np.float32 and z[name].tobytes() == want.tobytes(), name
        for name, a in ref.subops.items():
            assert z[name].dtype == a.dtype and z[name].shape == a.shape and z[name].tobytes() == a.tobytes(), name
    back = api.load_trace(clean)           # and v4parity's reader: the whole trace equals the reference's
    assert back.vectors.keys() == ref.vectors.keys()
    assert all(np.array_equal(back.vectors[n], ref.vectors[n]) for n in ref.vectors)
    assert np.array_equal(back.ckpt["fp"], ref.ckpt["fp"])
    assert np.array_equal(back.ckpt["top_ids"], ref.ckpt["top_ids"])
    assert back.header.subops == ref.header.subops and back.subops.keys() == ref.subops.keys()


def test_check_matches_the_unperturbed_trace_and_finds_the_perturbed_layer(tiny_f32, example, reference, clean,
                                                                            tmp_path):
    r = api.check(clean, tiny_f32, envelope=ENV_F32)
    assert (r.verdict, r.judged) == ("MATCH", "op-level") and not r.causes, headline(r)
    bad = _run(example, reference[0], tmp_path / "bad.trace", block(3), "2e-3")
    vec, ref = api.load_trace(bad).vectors[block(3)], reference[1].vectors[block(3)]
    rel = np.linalg.norm((vec - ref).reshape(len(vec), -1), axis=1) / np.linalg.norm(ref.reshape(len(ref), -1), axis=1)
    assert np.allclose(rel, 2e-3, rtol=1e-3), rel          # the planted error is what the test says it is
    r = api.check(bad, tiny_f32, envelope=ENV_F32)
    assert (r.verdict, r.judged, r.culprit.layer, r.culprit.subop, r.causes[-1].name) == \
        ("DEFECT", "op-level", 3, "hc_ffn_post", "unexplained"), headline(r)


def test_the_side_file_is_bound_to_its_trace(clean, tmp_path):
    # the C writer's trace_sha256 is what the reader checks: an edited trace beside it is refused
    edited = tmp_path / "c.trace"
    edited.write_text(clean.read_text().replace("engine c-example 1.0", "engine c-example 1.1", 1))
    vectors_path(edited).write_bytes(vectors_path(clean).read_bytes())
    with pytest.raises(TraceError, match="field 'trace_sha256': this side file was not written with this trace"):
        api.load_trace(edited)


SHA_MAIN = """#define V4P_TRACE_IMPLEMENTATION
#include "v4parity_trace.h"
int main(void) {  /* sha256 of stdin, hex */
    unsigned char buf[4096]; size_t n; char hex[65]; v4p_sha256 c;
    v4p_sha_init(&c);
    while ((n = fread(buf, 1, sizeof buf, stdin)) > 0) v4p_sha_update(&c, buf, n);
    v4p_sha_hex(&c, hex);
    puts(hex);
    return 0;
}
"""


def test_sha256_agrees_with_hashlib_across_block_boundaries(tmp_path):
    cc = require_program("cc", "gcc")
    (tmp_path / "sha.c").write_text(SHA_MAIN)
    subprocess.run([cc, "-std=c99", "-Wall", "-Werror", "-I", str(INCLUDE), "-o", str(tmp_path / "sha"),
                    str(tmp_path / "sha.c"), "-lm"], check=True)
    data = np.random.default_rng(0).integers(0, 256, 200_000, dtype=np.uint8).tobytes()
    for n in (*range(0, 130), 4095, 4096, 4097, 200_000):   # every padding case: 55, 56, 63, 64 bytes into a block
        out = subprocess.run([str(tmp_path / "sha")], input=data[:n], capture_output=True, check=True).stdout
        assert out.decode().strip() == hashlib.sha256(data[:n]).hexdigest(), n


def _synthetic(out: Path, positions: list[int], vocab: int, top_k: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """A one-layer run of random vectors (H = 4, D = 64) and integer-valued logits (ties) as the example reads it."""
    rng = np.random.default_rng(7)
    n_pos, names = 3, ["embed", "blk.0.attn", "blk.0", "final_norm"]
    vec = {n: rng.standard_normal((n_pos, 64) if n == "final_norm" else (n_pos, 4, 64)).astype(np.float32)
           for n in names}
    vec["blk.0"][1, 2, 5] = np.float32(3e38)      # large values: float64 sums, float32 results
    logits = rng.integers(-3, 3, (n_pos, vocab)).astype(np.float32)
    for n, a in [*vec.items(), ("logits", logits)]:
        a.tofile(out / f"{n}.bin")
    meta = ["engine c-example 1", "model 1 " + "0" * 32 + " x.gguf", "dtype float32", "layers 1", "hc 4", "dim 64",
            f"vocab {vocab}", f"top_k {top_k}", "tokens 5 6 7", "n_prompt 3", "chunks 3", "decode 0",
            "positions " + " ".join(map(str, positions)), "flags {}"]
    (out / "meta.txt").write_text("\n".join(meta) + "\n")
    return vec, logits


def test_statistics_and_top_k_are_the_numpy_definitions(example, tmp_path):
    # integer-valued logits tie often (ties go to the lower id)
    vocab = 40
    vec, logits = _synthetic(tmp_path, [0, 1, 2], vocab, 16)
    t = api.load_trace(_run(example, tmp_path, tmp_path / "s.trace"))
    for ck, name in enumerate(t.header.checkpoints):
        rows = t.ckpt["ck"] == ck
        st = carrier_stats(vec[name])
        for field in ("min", "max", "rms", "sum_l2", "fp"):
            assert np.array_equal(t.ckpt[field][rows], st[field]), (name, field)
        assert np.array_equal(t.ckpt["l2s"][rows][:, : st["l2s"].shape[1]], st["l2s"]), name
    ids, vals = top_k(logits, 16)
    final = t.ckpt["ck"] == t.header.checkpoints.index("final_norm")
    assert np.array_equal(t.ckpt["top_ids"][final], ids) and np.array_equal(t.ckpt["top_logits"][final], vals)
    assert len(set(logits[0].tolist())) < 16        # ties inside the top 16
    assert t.ckpt["argmax"][final].tolist() == np.argmax(logits, axis=1).tolist()


def test_a_writer_error_is_named_and_leaves_no_file(example, tmp_path):
    # position 5 has no token (3 tokens): every call fails, v4p_close reports the first error and removes its temps
    _synthetic(tmp_path, [0, 1, 5], 40, 16)
    res = subprocess.run([str(example), str(tmp_path), str(tmp_path / "x.trace")], capture_output=True, text=True)
    assert res.returncode == 2 and "v4p_close: v4p_ckpt: position 5 has no token" in res.stderr, res.stderr
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith("x.")]
    _synthetic(tmp_path, [0, 1, 2], 9, 16)   # a vocabulary smaller than top_k has no top-16 of real tokens
    res = subprocess.run([str(example), str(tmp_path), str(tmp_path / "x.trace")], capture_output=True, text=True)
    assert res.returncode == 2 and "vocab 9 < top_k 16" in res.stderr, res.stderr
    (tmp_path / "blk.0.bin").unlink()   # the example's own input errors name the file
    res = subprocess.run([str(example), str(tmp_path), str(tmp_path / "x.trace")], capture_output=True, text=True)
    assert res.returncode == 2 and "blk.0.bin: cannot open" in res.stderr


# ---------------------------------------------------------------- spec records (issue 25 point 4)

SPEC_ONLY_C = r"""
#define V4P_TRACE_IMPLEMENTATION
#include "v4parity_trace.h"
#include <stdio.h>
int main(int argc, char **argv) {
    static const int32_t tokens[] = {0, 1, 2, 5, 6, 7, 8}, chunks[] = {3, 1, 1, 1, 1};
    static const int32_t d0[] = {6, 9}, v0[] = {6, 7, 4}, d1[] = {8, 1, 3}, v1[] = {8};
    static const float c1[] = {0.5f, -1.0f, 2000.0f};
    v4p_header h = {0};
    char err[512];
    v4p_trace *t;
    h.engine = "c-spec"; h.engine_version = "1"; h.model_size = 1; h.model_file = "m.gguf";
    h.model_header_sha256 = "0123456789abcdef0123456789abcdef"; h.dtype = "float32"; h.n_layers = 1;
    h.n_hc = 4; h.dim = 8; h.top_k = 4; h.tokens = tokens; h.n_tokens = 7; h.n_prompt = 3;
    h.chunks = chunks; h.n_chunks = 5; h.decode = 4; h.flags_json = "{\"fp4_indexer\":false,\"fp8_kv\":false}";
    t = v4p_open(argv[1], &h, err, sizeof err);
    if (!t) { fprintf(stderr, "%s\n", err); return 2; }
    v4p_spec(t, 3, d0, 2, 2, NULL, v0, argc > 2 ? 0 : 1, NULL);    /* argv[2]: a wrong a' */
    v4p_spec(t, 5, d1, 3, 0, "budget", v1, 0, c1);
    if (v4p_close(t, err, sizeof err)) { fprintf(stderr, "%s\n", err); return 2; }
    return 0;
}
"""


def test_a_spec_only_trace_from_c_is_the_python_writers_and_a_wrong_accept_is_named(tmp_path):
    cc = require_program("cc", "gcc")
    (tmp_path / "spec.c").write_text(SPEC_ONLY_C)
    exe = tmp_path / "spec"
    subprocess.run([cc, "-std=c99", "-pedantic", "-Wall", "-Wextra", "-Werror", "-I", str(INCLUDE), "-o", str(exe),
                    str(tmp_path / "spec.c"), "-lm"], check=True, capture_output=True, text=True)
    out = tmp_path / "s.trace"
    subprocess.run([str(exe), str(out)], check=True, capture_output=True, text=True)
    t = read_trace(out, allow_spec_only=True)
    assert [(r.start_pos, r.drafts, r.verified, r.cut, r.verify, r.accepted, r.conf) for r in t.spec] == [
        (3, (6, 9), 2, "", (6, 7, 4), 1, None), (5, (8, 1, 3), 0, "budget", (8,), 0, (0.5, -1.0, 2000.0))]
    assert out.read_bytes() == format_text(t).encode()          # the whole file, header included
    assert not vectors_path(out).exists()
    res = subprocess.run([str(exe), str(tmp_path / "x.trace"), "wrong"], capture_output=True, text=True)
    assert res.returncode == 2 and "round 0: accepted 0, the greedy rule accepts 1" in res.stderr, res.stderr
    assert not list(tmp_path.glob("x.*"))


def test_spec_records_from_the_example_are_read_by_spec_candidate(tiny_f32, example, reference, tmp_path):
    """A speculative run on the reference trace's own prompt and tokens (the reference engine, QAT sims on as
    the trace, scripted drafts of depth 2 with the second wrong), its rounds handed to the example as spec.txt
    (confidences set to float32 values to exercise their format): the C lines are the Python writer's and `spec
    --candidate` attributes them as the live run."""
    from dataclasses import replace

    from click.testing import CliRunner

    from parity.check.envelope import load_envelope
    from parity.cli import cli
    from parity.contract.engine import RunOptions
    from parity.spec.candidate import records_of
    from parity.spec.report import spec_report
    from parity.tracing.io import fmt
    from parity.tracing.specrecords import format_spec
    from reference_cpu.engine import ReferenceEngine

    src, ref_trace = reference
    h = ref_trace.header
    eng = ReferenceEngine(str(tiny_f32), RunOptions())
    live = spec_report(eng, eng, "script", h.tokens[: h.n_prompt], h.decode, load_envelope(ENV_F32, "float32"),
                       depth=2, reject_at=2)
    assert list(live.spec_tokens) == h.tokens[h.n_prompt:] and live.exact
    conf = (np.float32(0.1), np.float32(-3.25e-5))
    records = [replace(r, conf=tuple(map(float, conf)) if i == 0 else None)
               for i, r in enumerate(records_of(live.rounds))]
    d = tmp_path / "in"
    shutil.copytree(src, d)
    (d / "spec.txt").write_text("".join(
        f"{r.start_pos} {len(r.drafts)} {r.verified} {r.cut or '-'} {r.accepted} {int(r.conf is not None)} "
        + " ".join(map(str, [*r.drafts, *r.verify])) + "".join(f" {c!r}" for c in (r.conf or ())) + "\n"
        for r in records))
    out = _run(example, d, tmp_path / "c.trace")
    c_spec = [ln for ln in _records(out) if ln.startswith("spec ")]
    assert len(c_spec) == len(live.rounds) >= 2
    assert c_spec == [format_spec(r, fmt) for r in records]
    res = CliRunner().invoke(cli, ["spec", "-m", str(tiny_f32), "--candidate", str(out), "--envelope", str(ENV_F32),
                                   "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["exact"] and [x["labels"] for x in doc["rounds"]] == [list(a.labels) for a in live.attribution]
    assert doc["committed"]["counts"] == live.committed_counts and doc["state_divergence"] is None
