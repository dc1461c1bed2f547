"""`v4parity capture llamacpp` -> `v4parity import llama.cpp` round-trips to the trace `trace --engine llamacpp`
writes for the same run (llama.cpp itself, in-process)."""

from __future__ import annotations

import numpy as np
from click.testing import CliRunner
from requires import require

from parity import api
from parity.cli import cli

llama_cpp = require("llama_cpp")

TOKENS = "0,5,7,9,11,13,15,17,19,21"
IMPORT_FLAGS = ("imported", "import_dropped", "import_unmapped")


def test_capture_round_trips_to_the_engine_trace(tiny_f32, tmp_path):
    run = ["--model", str(tiny_f32), "--tokens", TOKENS, "--decode", "3", "--chunk", "4", "--engine-arg",
           "lcp_threads=1"]
    r = CliRunner().invoke(cli, ["capture", "llamacpp", *run, "-o", str(tmp_path / "cap.npz")])
    assert r.exit_code == 0, r.output
    assert "13 tokens (10 prompt + 3 decode)" in r.output and "lcp_threads=1" in r.output
    r = CliRunner().invoke(cli, ["import", "llama.cpp", str(tmp_path / "cap.npz"), "--model", str(tiny_f32),
                                 "-o", str(tmp_path / "imported.trace")])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(cli, ["trace", "--engine", "llamacpp", *run, "--no-fp8-kv", "--no-fp4-indexer",
                                 "--positions", "all", "--full", "all", "-o", str(tmp_path / "engine.trace")])
    assert r.exit_code == 0, r.output
    a, b = api.load_trace(tmp_path / "engine.trace"), api.load_trace(tmp_path / "imported.trace")
    assert b.header.flags["import_dropped"] == [] and b.header.flags["import_unmapped"] == []
    flags_b = {k: v for k, v in b.header.flags.items() if k not in IMPORT_FLAGS}
    assert flags_b == a.header.flags and a.header.flags["engine_args"][2] == "lcp_threads=1"
    ha, hb = a.header.to_dict(), b.header.to_dict()
    assert {k: v for k, v in ha.items() if k != "flags"} == {k: v for k, v in hb.items() if k != "flags"}
    assert a.ckpt == b.ckpt and a.hc == b.hc and a.moe == b.moe and a.attn == b.attn
    assert sorted(a.vectors) == sorted(b.vectors)
    assert all(np.array_equal(a.vectors[k], b.vectors[k]) for k in a.vectors)


def test_llamacpp_engine_args_are_refused_by_another_engine(tiny_f32, tmp_path):
    r = CliRunner().invoke(cli, ["trace", "--engine", "reference", "--model", str(tiny_f32), "--tokens", "0,5",
                                 "--engine-arg", "lcp_threads=2", "-o", str(tmp_path / "x.trace")])
    assert r.exit_code != 0 and "unknown engine argument 'lcp_threads=2'" in str(r.exception)
    assert not (tmp_path / "x.trace").exists()
