"""`v4parity synth` and `v4parity inspect` through the CLI."""

from __future__ import annotations

import json

from click.testing import CliRunner

from parity.cli import cli
from parity.gguf.container import VT, GGUFFile, TensorData, Value, write_gguf


def test_synth_then_inspect_json(tmp_path):
    out = tmp_path / "m.gguf"
    r = CliRunner().invoke(cli, ["synth", "--preset", "tiny", "--quant", "real-mix", "-o", str(out)])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(cli, ["inspect", "-m", str(out), "--json"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.output)
    assert rep["validation"]["ok"] and rep["config"]["n_layers"] == 6
    assert [s["kind"] for s in rep["schedule"]] == ["SWA", "SWA", "CSA", "HCA/128", "CSA", "HCA/128"]
    types = {t["name"]: t["type"] for t in rep["tensors"]}
    assert types["blk.2.ffn_gate_exps.weight"] == "IQ2_XXS" and types["blk.2.ffn_down_exps.weight"] == "Q2_K"


def test_inspect_marks_derived_values_and_fails_on_invalid_file(tmp_path, tiny_f32):
    src = GGUFFile(tiny_f32)
    kv = {k: v for k, v in src.kv.items() if k not in ("deepseek4.vocab_size", "deepseek4.swiglu_clamp_shexp")}
    keep = [n for n in src.tensors if n != "blk.1.attn_sinks.weight"]
    tensors = [TensorData(n, src.tensors[n].ne, src.tensors[n].ggml_type, bytes(src.data(n))) for n in keep]
    bad = tmp_path / "bad.gguf"
    write_gguf(bad, kv, tensors)
    r = CliRunner().invoke(cli, ["inspect", "--model", str(bad)], env={"COLUMNS": "250"})
    assert r.exit_code == 1
    assert "derived: from token_embd.weight rows" in r.output
    assert "missing tensor blk.1.attn_sinks.weight" in r.output
    rep = json.loads(CliRunner().invoke(cli, ["inspect", "-m", str(bad), "--json"]).output)
    assert set(rep["config"]["derived"]) == {"vocab_size", "swiglu_limit_shexp"}


def test_inspect_reports_a_mistyped_key_as_an_error(tmp_path, tiny_f32):
    src = GGUFFile(tiny_f32)
    kv = dict(src.kv)
    kv["deepseek4.attention.compress_ratios"] = Value(VT.ARRAY, [0.0] * 7, VT.F32)
    write_gguf(tmp_path / "x.gguf", kv, [])
    r = CliRunner().invoke(cli, ["inspect", "-m", str(tmp_path / "x.gguf")])
    assert r.exit_code != 0
    assert "compress_ratios" in str(r.exception)
    r = CliRunner().invoke(cli, ["inspect", "-m", str(tmp_path / "x.gguf"), "--json"])
    err = json.loads(r.output)  # --json reports errors as JSON too
    assert r.exit_code == 2 and "compress_ratios" in err["error"] and err["exit_code"] == 2


def test_inspect_lists_tensors_only_with_tensors(tiny_f32):
    n = len(GGUFFile(tiny_f32).tensors)
    short = CliRunner().invoke(cli, ["inspect", "-m", str(tiny_f32)], env={"COLUMNS": "200"}).output
    assert f"{n} tensors" in short and "(--tensors lists them)" in short and "blk.2.ffn_gate_exps.weight" not in short
    full = CliRunner().invoke(cli, ["inspect", "-m", str(tiny_f32), "--tensors"], env={"COLUMNS": "200"}).output
    assert "blk.2.ffn_gate_exps.weight" in full and len(full.splitlines()) > len(short.splitlines()) + n


def test_synth_json(tmp_path):
    r = CliRunner().invoke(cli, ["synth", "-o", str(tmp_path / "m.gguf"), "--json"])
    d = json.loads(r.output)
    out = tmp_path / "m.gguf"
    assert r.exit_code == 0 and d["wrote"] == str(out) and d["bytes"] == out.stat().st_size
