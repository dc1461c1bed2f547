"""Importers: ds4 graph dumps and llama.cpp eval-callback tensors become traces that agree with a trace
recorded directly from the same vectors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from fake_engine import FakeEngine

from parity import api
from parity.cli import cli
from parity.contract.engine import RunOptions, load_engine
from parity.contract.errors import TraceError
from parity.gguf.weights import Weights
from parity.tracing.importers import import_ds4, import_llamacpp, llamacpp_chunks, write_llamacpp_capture

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
    Path(f"{prefix}_unrelated-0_pos0.bin").write_bytes(b"\0" * 8)  # other stages are ignored


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


# ---------------------------------------------------------------- llama.cpp capture files
# The capture is written here from the reference engine's own chunk results, with llama.cpp's names and layouts
# as llama.cpp produces them (spec llamacpp-deepseek4): ggml-shaped singleton axes, unsorted indexer picks with
# masked entries, Hadamard-rotated indexer rows, cache views holding more rows than were emitted.

def _sylvester(n):
    h = np.ones((1, 1))
    while len(h) < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(n)


def write_llamacpp_capture_like_llamacpp(results, cfg, n_prompt=18):
    cat = lambda f: np.concatenate([f(r) for r in results])  # noqa: E731
    T = sum(len(r.tokens) for r in results)
    a = {"hc_init": cat(lambda r: r.checkpoints["embed"]), "result_norm": cat(lambda r: r.checkpoints["final_norm"]),
         "result_output": cat(lambda r: r.logits), "input_ids": cat(lambda r: r.tokens),
         "output_positions": np.arange(T), "chunks": np.array([len(r.tokens) for r in results]),
         "n_prompt": np.array(n_prompt)}
    names = {"hc_attn_pre": "hc_attn_pre", "attn_norm": "attn_norm", "q_path": "q_norm", "rope_q": "q",
             "attn_out": "attn_out", "hc_attn_post": "hc_attn_post", "hc_ffn_pre": "hc_ffn_pre",
             "ffn_norm": "ffn_norm", "routed_out": "ffn_moe_out", "shared_out": "ffn_shexp", "hc_ffn_post": "l_last"}
    for l in range(cfg.n_layers):
        for ours, theirs in names.items():
            a[f"{theirs}-{l}"] = cat(lambda r, o=ours, l=l: r.captures[l][o])
        a[f"kv_norm-{l}"] = cat(lambda r, l=l: r.captures[l]["kv_latent"])[:, None, :]   # ggml ne [hd, 1, T]
        a[f"kv-{l}"] = cat(lambda r, l=l: r.captures[l]["rope_kv"])[:, None, :]
        a[f"{ {0: 'attn_raw', 4: 'attn_csa_lid', 128: 'attn_hca'}[cfg.ratio(l)]}-{l}"] = cat(
            lambda r, l=l: r.captures[l]["attn_heads"]).reshape(T, -1)
        for occ, hc in (("", "hc_attn"), ("#2", "hc_ffn")):
            for i, name in enumerate(("hc_pre", "hc_post", "hc_comb")):
                a[f"{name}-{l}{occ}"] = cat(lambda r, l=l, hc=hc, i=i: getattr(r.diags[l], hc)[i])
        a[f"ffn_moe_topk-{l}"] = cat(lambda r, l=l: r.diags[l].expert_ids).astype(np.int32)
        a[f"ffn_moe_weights_scaled-{l}"] = cat(lambda r, l=l: r.diags[l].expert_weights)[:, :, None]
        if not cfg.is_hash_layer(l):   # selection keys whose K-th minus (K+1)-th is the margin
            m = cat(lambda r, l=l: r.diags[l].router_margin)
            keys = np.zeros((T, cfg.n_routed_experts), np.float32)
            keys[:, : cfg.n_activated_experts] = m[:, None]
            a[f"ffn_moe_probs_biased-{l}"] = keys
        r = cfg.ratio(l)
        if r:
            rows = results[-1].captures[l]["comp_rows"]
            a[f"{'csa' if r == 4 else 'hca'}_comp_k-{l}"] = np.concatenate([rows, np.ones((3, cfg.head_dim))])[:, None]
        if cfg.has_indexer(l):
            rows = results[-1].captures[l]["index_rows"] @ _sylvester(cfg.index_head_dim)
            a[f"lid_k-{l}"] = np.concatenate([rows, np.ones((2, cfg.index_head_dim))]).astype(np.float32)
            sel = cat(lambda r, l=l: r.diags[l].index_sel)
            pos = np.arange(T)
            masked = np.where(sel < 0, (pos[:, None] + 1) // 4 + np.arange(sel.shape[1]), sel)  # picks beyond n_t
            a[f"lid_top_k-{l}"] = masked[:, ::-1].astype(np.int32)   # unsorted
    return a


@pytest.fixture(scope="module")
def ref_run(tiny_f32):
    from parity.tracing.runner import run_sequence

    eng = load_engine("reference", str(tiny_f32), RunOptions(fp8_kv=False, fp4_indexer=False))
    return eng, run_sequence(eng, PROMPT * 3, 3, chunk=8, capture=True)


def test_llamacpp_capture_imports_like_the_direct_trace(ref_run, tiny_f32, tmp_path):
    eng, results = ref_run
    cfg = eng.config
    write_llamacpp_capture(tmp_path / "cap.npz", write_llamacpp_capture_like_llamacpp(results, cfg))
    direct = api.trace(eng, tiny_f32, PROMPT * 3, positions="all", decode=3, chunk=8, full="all",
                       forced=[int(t) for t in np.concatenate([r.tokens for r in results])[18:]])
    t = import_llamacpp(tmp_path / "cap.npz", tokens=None, config=cfg, model=direct.header.model)
    assert t.header.flags["import_dropped"] == [] and t.header.flags["import_unmapped"] == []
    assert (t.header.chunks, t.header.n_prompt, t.header.decode) == ([8, 8, 2, 1, 1, 1], 18, 3)
    assert t.ckpt == direct.ckpt and t.hc == direct.hc and t.moe == direct.moe and t.attn == direct.attn
    assert all(np.array_equal(t.vectors[k], direct.vectors[k]) for k in direct.vectors)


def test_llamacpp_capture_chunks_map_every_subop(ref_run, tmp_path):
    eng, results = ref_run
    got = llamacpp_chunks(write_llamacpp_capture_like_llamacpp(results, eng.config), eng.config)
    assert [len(c.tokens) for c in got] == [len(r.tokens) for r in results]
    for g, r in zip(got, results, strict=True):
        for l in range(eng.config.n_layers):
            assert sorted(g.captures[l]) == sorted(r.captures[l])
            for name, want in r.captures[l].items():   # index_rows through H·H = I: measured 1.19e-7 (2^-23)
                atol = 2e-7 if name == "index_rows" else 0   # every other sub-op measured exact
                np.testing.assert_allclose(g.captures[l][name], want, rtol=0, atol=atol, err_msg=f"{l} {name}")
            assert np.array_equal(g.diags[l].n_comp_visible, r.diags[l].n_comp_visible)
        for name, want in r.checkpoints.items():
            assert np.array_equal(g.checkpoints[name], want)


def test_incomplete_llamacpp_capture_lists_what_it_dropped(ref_run, tiny_f32, tmp_path):
    eng, results = ref_run
    a = write_llamacpp_capture_like_llamacpp(results, eng.config)
    for k in ("hc_pre-1#2", "lid_top_k-2", "result_norm", "ffn_moe_probs_biased-4"):
        del a[k]
    a["ffn_moe_argsort-3"] = np.zeros((len(a["input_ids"]), 8), np.int32)
    t = import_llamacpp(_written(a, tmp_path), tokens=None, config=eng.config, model={})
    assert t.header.flags["import_dropped"] == ["final_norm", "hc.1.ffn", "attn.2", "margin.4"]
    assert t.header.flags["import_unmapped"] == ["ffn_moe_argsort-3"]
    assert np.isnan(t.moe["margin"][t.moe["layer"] == 4]).all() and not (t.attn["layer"] == 2).any()


def _written(arrays, tmp_path):
    return write_llamacpp_capture(tmp_path / "x.npz", arrays)


def test_llamacpp_capture_errors_are_clear(ref_run, tmp_path):
    eng, results = ref_run
    a = write_llamacpp_capture_like_llamacpp(results, eng.config)
    with pytest.raises(TraceError, match="differ from the capture's input_ids"):
        import_llamacpp(_written(a, tmp_path), tokens=[1, 2], config=eng.config, model={})
    a["l_last-0"] = a["l_last-0"][:-1]
    with pytest.raises(TraceError, match="capture tensor l_last-0: 20 rows for 21 tokens"):
        import_llamacpp(_written(a, tmp_path), tokens=None, config=eng.config, model={})
    del a["input_ids"]
    with pytest.raises(TraceError, match="no input_ids in the capture; give the tokens"):
        import_llamacpp(_written(a, tmp_path), tokens=None, config=eng.config, model={})


def test_llamacpp_capture_meta_is_checked_not_guessed(ref_run, tmp_path):
    eng, results = ref_run
    a = write_llamacpp_capture_like_llamacpp(results, eng.config)
    meta = {"engine": "llamacpp", "engine_version": "0.3.36", "flags": {"kv": "f16"}}
    t = import_llamacpp(write_llamacpp_capture(tmp_path / "m.npz", a, meta), tokens=None, config=eng.config,
                        model={})
    assert (t.header.engine, t.header.engine_version, t.header.flags["kv"]) == ("llamacpp", "0.3.36", "f16")
    for bad, match in (({"engine": "llamacpp", "flags": {}}, "meta field 'engine_version' missing"),
                       ({**meta, "flags": []}, "meta field 'flags' missing or not a dict"), ([1], "JSON object")):
        with pytest.raises(TraceError, match=match):
            import_llamacpp(write_llamacpp_capture(tmp_path / "m.npz", a, bad), tokens=None, config=eng.config,
                            model={})
    for chunks in ([0, 21], [22, -1]):   # sums to the 21 tokens, but a chunk of 0 or fewer tokens is no chunk
        with pytest.raises(TraceError, match=r"chunks \[.*\] / n_prompt 18 do not fit the 21 input_ids"):
            import_llamacpp(_written({**a, "chunks": np.array(chunks)}, tmp_path), tokens=None, config=eng.config,
                            model={})
    a["meta"] = np.array("{not json")
    with pytest.raises(TraceError, match="meta is not JSON"):
        import_llamacpp(_written(a, tmp_path), tokens=None, config=eng.config, model={})


def test_ds4_prefix_ending_in_a_slash(direct, tiny_f32, tmp_path):
    """ds4 writes `<prefix>_<name>...`: with DS4_METAL_GRAPH_DUMP_PREFIX=dumps/ the files are dumps/_<name>..."""
    (tmp_path / "dumps").mkdir()
    write_ds4_dumps(direct, f"{tmp_path / 'dumps'}/")
    t = import_ds4(f"{tmp_path / 'dumps'}/", tokens=direct.header.tokens, config=Weights(tiny_f32).config,
                   model=direct.header.model)
    assert t.header.checkpoints == direct.header.checkpoints[1:-1] and len(t.moe) == 6 * 8


def test_llamacpp_index_picks_per_token_are_read_from_the_tensor():
    # llama.cpp stores min(top_k, rows its context holds) picks per token (256 at the real top_k 512 for a short
    # context): the count comes from the tensor, the selection is padded to top_k, and more picks than top_k is
    # an error naming the tensor
    from parity.contract.errors import TraceError
    from parity.gguf.llamacpp import PER_TENSOR, rows, selection

    picks = np.array([[3, 0, 9, 1], [5, 2, 4, 0]], np.int32)          # 4 picks per token, unsorted
    got = rows(picks, (PER_TENSOR,), "lid_top_k-2")
    assert got.shape == (2, 4)
    sel = selection(got, np.array([15, 23]), 4, 8)
    assert sel.tolist() == [[0, 1, 3, -1, -1, -1, -1, -1], [0, 2, 4, 5, -1, -1, -1, -1]]
    with pytest.raises(TraceError, match="more than the model's top_k 2"):
        selection(got, np.array([15, 23]), 4, 2)
