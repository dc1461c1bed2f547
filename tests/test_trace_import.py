"""Importers: ds4 graph dumps and llama.cpp eval-callback tensors become traces that agree with a trace
recorded directly from the same vectors."""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner
from fake_engine import FakeEngine

from parity import api
from parity.cli import cli
from parity.contract.errors import TraceError
from parity.gguf.weights import Weights
from parity.tracing.importers import import_ds4, import_llamacpp

PROMPT = [0, 5, 7, 9, 11, 13]


@pytest.fixture(scope="module")
def direct(tiny_f32):
    """Fake engine, prompt in chunks of 4 then 2 decode steps; every vector kept."""
    return api.trace(FakeEngine(str(tiny_f32)), tiny_f32, PROMPT, positions="all", decode=2, chunk=4, full="all")


def write_ds4_dumps(t, prefix):
    """What ds4 writes: per chunk (pos0 = chunk start) the [n_tokens, ...] rows; result_* = last step only."""
    L, K = t.n_layers, 3
    start = 0
    for n in t.header.chunks:
        rows = slice(start, start + n)
        for l in range(L):
            t.vectors[f"blk.{l}"][rows].tofile(f"{prefix}_hc_ffn_post-{l}_pos{start}.bin")
            t.vectors[f"blk.{l}.attn"][rows].tofile(f"{prefix}_hc_attn_post-{l}_pos{start}.bin")
            moe = [np.flatnonzero((t.moe["layer"] == l) & (t.moe["pos"] == p))[0] for p in range(start, start + n)]
            t.moe["ids"][moe].astype("<i4").tofile(f"{prefix}_ffn_moe_topk-{l}_pos{start}.i32")
            t.moe["w"][moe].astype("<f4").tofile(f"{prefix}_ffn_moe_weights_scaled-{l}_pos{start}.bin")
            assert t.moe["ids"].shape[1] == K
        start += n
    t.vectors["final_norm"][-1].tofile(f"{prefix}_result_norm-{L}_pos0.bin")
    t.vectors["logits"][-1].tofile(f"{prefix}_result_output-{L}_pos0.bin")
    (prefix.parent / f"{prefix.name}_unrelated-0_pos0.bin").write_bytes(b"\0" * 8)  # other stages are ignored


def test_ds4_dumps_import_like_the_direct_trace(direct, tiny_f32, tmp_path):
    write_ds4_dumps(direct, tmp_path / "dump")
    t = import_ds4(tmp_path / "dump", tokens=direct.header.tokens, config=Weights(tiny_f32).config,
                   model=direct.header.model)
    assert t.header.checkpoints == direct.header.checkpoints[1:-1]  # no embed dump; final_norm only at the end
    assert t.header.positions == list(range(8)) and t.header.flags["import_dropped"] == ["final_norm"]
    r = api.diff(direct, t, force=True)
    assert r.exact  # statistics recomputed from the same float32 vectors: bit-identical
    assert r.layers["expert_flips"].sum() == 0 and r.layers["weight_max_abs"].max() == 0 and len(t.moe) == 6 * 8


def test_llamacpp_tensors_import_like_the_direct_trace(tiny_f32, tmp_path):
    direct = api.trace(FakeEngine(str(tiny_f32)), tiny_f32, PROMPT, positions="all", full="all")
    v = direct.vectors
    v["embed"].tofile(tmp_path / "hc_init.bin")
    for l in range(direct.n_layers):
        v[f"blk.{l}"].tofile(tmp_path / f"l_last-{l}.bin")
        np.save(tmp_path / f"hc_attn_post-{l}.npy", v[f"blk.{l}.attn"])
    v["final_norm"].tofile(tmp_path / "result_norm.bin")
    v["logits"].tofile(tmp_path / "result_output.bin")
    t = import_llamacpp(tmp_path, tokens=PROMPT, config=Weights(tiny_f32).config, model=direct.header.model)
    assert t.header.checkpoints == direct.header.checkpoints and t.header.engine == "llama.cpp"
    r = api.diff(direct, t)
    assert r.exact
    final = direct.checkpoint_rows("final_norm")
    assert (t.ckpt["top_ids"][t.checkpoint_rows("final_norm")] == direct.ckpt["top_ids"][final]).all()


def test_incomplete_ds4_diagnostics_are_listed_as_dropped(direct, tiny_f32, tmp_path):
    write_ds4_dumps(direct, tmp_path / "dump")
    (tmp_path / "dump_ffn_moe_topk-1_pos4.i32").unlink()  # layer 1's router picks for positions 4..5
    np.zeros((8, 4), np.float32).tofile(tmp_path / "dump_hc_ffn_pre_weights-0_pos0.bin")  # pre without post/comb
    t = import_ds4(tmp_path / "dump", tokens=direct.header.tokens, config=Weights(tiny_f32).config,
                   model=direct.header.model)
    assert t.header.flags["import_dropped"] == ["final_norm", "hc.0.ffn", "moe.1"]
    assert sorted(set(t.moe["layer"].tolist())) == [0, 2, 3, 4, 5] and len(t.hc) == 0


def test_import_errors_are_clear(tiny_f32, tmp_path):
    cfg = Weights(tiny_f32).config
    with pytest.raises(TraceError, match="no ds4 dump files"):
        import_ds4(tmp_path / "nothing", tokens=PROMPT, config=cfg, model={})
    np.zeros(7, np.float32).tofile(tmp_path / "p_hc_ffn_post-0_pos0.bin")
    with pytest.raises(TraceError, match="not a multiple of the row width 1024"):
        import_ds4(tmp_path / "p", tokens=PROMPT, config=cfg, model={})


def test_import_cli(direct, tiny_f32, tmp_path):
    write_ds4_dumps(direct, tmp_path / "d")
    out = tmp_path / "ds4.trace"
    res = CliRunner().invoke(cli, ["import", "ds4", str(tmp_path / "d"), "--model", str(tiny_f32), "--tokens",
                                   ",".join(map(str, direct.header.tokens)), "-o", str(out)])
    assert res.exit_code == 0, res.output
    assert "dropped (incomplete): final_norm" in res.output
    assert api.load_trace(out).header.engine == "ds4"
