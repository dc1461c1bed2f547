"""Torch engine on its own: verification width, ops against independent implementations, options and errors."""

from __future__ import annotations

import copy
import math
import os

import numpy as np
import pytest
import torch

from gpu_engine import model as model_mod
from gpu_engine.attention import sink_attention
from gpu_engine.engine import TorchEngine
from gpu_engine.indexer import select_rows, select_rows_ties_highest
from gpu_engine.linear import expert_of, linear
from gpu_engine.ops import apply_rope, e2m1_round, e4m3_round, fp8_sim_nope, hadamard_matrix, rope_frequencies
from parity.compare import metrics
from parity.contract.checkpoints import checkpoint_names
from parity.contract.engine import Engine, RunOptions
from parity.contract.errors import ParityError
from parity.tracing.runner import forward_chunk, run_sequence, stack

OFF = RunOptions(fp8_kv=False, fp4_indexer=False)


@pytest.fixture(scope="module")
def engine(tiny_f32):
    """QAT sims off: the width check compares float paths (with sims on, batched vs single-row matmul rounding
    may legitimately flip an FP8 code)."""
    return TorchEngine(str(tiny_f32), OFF)


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    """||a - b|| / ||b|| over the whole array (b the reference), through parity.compare.metrics."""
    return float(metrics.rel_l2(b.reshape(1, -1), a.reshape(1, -1))[0])


def test_protocol_and_boundary_types(engine):
    assert isinstance(engine, Engine) and engine.name == "torch" and engine.version
    X = engine.embed(np.array([0, 5, 7]))
    assert X.dtype == np.float32 and X.shape == (3, 4, 256)
    np.testing.assert_array_equal(X[:, 0], X[:, 3])  # H identical copies


def test_verification_width_q_tokens_equal_q_decode_steps(engine):
    """A q-token forward on a cache == q single-token steps, for q = 1..8, across CSA and HCA boundaries
    (positions 124..131 contain the HCA block end t = 127 and two CSA block ends)."""
    rng = np.random.default_rng(3)
    state = engine.new_state()
    forward_chunk(engine, state, rng.integers(2, 290, 124), 0)
    toks = rng.integers(2, 290, 8)
    for q in range(1, 9):
        s_batch, s_step = copy.deepcopy(state), copy.deepcopy(state)
        wide = forward_chunk(engine, s_batch, toks[:q], 124, capture=True)
        steps = [forward_chunk(engine, s_step, toks[i : i + 1], 124 + i, capture=True) for i in range(q)]
        for name in (*checkpoint_names(6), "blk.3.attn"):
            a, b = wide.checkpoints[name], np.concatenate([r.checkpoints[name] for r in steps])
            # measured 1.04e-6 max (batched vs single-row matmul summation order)
            assert max(_rel(a[i], b[i]) for i in range(q)) < 2e-6, f"q={q} {name}"
        for l in range(6):
            np.testing.assert_array_equal(wide.diags[l].expert_ids, np.concatenate([r.diags[l].expert_ids
                                                                                     for r in steps]))
            for key in ("comp_rows", "index_rows"):
                a, b = wide.captures[l][key], steps[-1].captures[l][key]
                assert a.shape == b.shape, f"q={q} layer {l} {key}: {a.shape} vs {b.shape}"
                if a.size:
                    assert _rel(a, b) < 2e-6  # measured 2.9e-7 max
            # the emitted rows are the ones the q tokens complete
            m = engine.cfg.compress_ratios[l]
            if m:
                assert wide.captures[l]["comp_rows"].shape[0] == (124 + q) // m
            cb, cs = s_batch.layers[l], s_step.layers[l]
            assert cb.pos == cs.pos == 124 + q
            assert _rel(cb.raw.numpy(), cs.raw.numpy()) < 2e-6  # measured 8.0e-7 max


def test_e4m3_rounding_matches_torch_float8_cast():
    """Closed-form e4m3 rounding == torch's float8_e4m3fn conversion (an independent implementation)."""
    g = torch.Generator().manual_seed(0)
    v = torch.cat([torch.randn(20000, generator=g) * s for s in (1e-3, 0.05, 1.0, 30.0, 200.0)])
    grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
    mids = (grid[1:] + grid[:-1]) / 2  # every tie between neighbours
    v = torch.clamp(torch.cat([v, mids, -mids, grid]), -448, 448)
    ours = e4m3_round(v)
    theirs = v.to(torch.float8_e4m3fn).to(torch.float32)
    assert torch.equal(ours, theirs)


def test_e2m1_hand_cases_and_fp8_block_scale():
    v = torch.tensor([0.25, 0.75, 1.75, 2.5, 3.5, 5.0, -5.0, 6.0, 0.2, -1.25])
    assert e2m1_round(v).tolist() == [0.0, 1.0, 2.0, 2.0, 4.0, 4.0, -4.0, 6.0, 0.0, -1.0]
    kv = torch.zeros(1, 96)
    kv[0, 0] = 448.0 * 4  # block amax 1792 -> scale 4 exactly: value kept, rest of block exact zeros
    kv[0, 64:] = 0.1234567  # rope tail never touched
    out = fp8_sim_nope(kv, 64)
    assert out[0, 0] == 1792.0 and (out[0, 1:64] == 0).all() and torch.equal(out[0, 64:], kv[0, 64:])
    assert (fp8_sim_nope(torch.zeros(2, 96), 64) == 0).all()  # all-zero block stays zero (amax floor)


def test_hadamard_is_orthonormal_involution():
    H = hadamard_matrix(64, torch.float64, torch.device("cpu"))
    assert torch.allclose(H @ H, torch.eye(64, dtype=torch.float64), atol=1e-12)
    assert torch.equal(H, H.T) and set((H * 8).round().unique().tolist()) == {-1.0, 1.0}


def test_rope_relative_position_and_inverse():
    f = rope_frequencies(32, 160000.0, True, 16.0, 65536, 32.0, 1.0).to(torch.float64)
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 96, generator=g, dtype=torch.float64), torch.randn(1, 96, generator=g, dtype=torch.float64)
    dots = [float((apply_rope(q, torch.tensor([s + 7]), f) * apply_rope(k, torch.tensor([s]), f)).sum())
            for s in (0, 50, 999)]
    assert max(dots) - min(dots) < 1e-9
    x = apply_rope(q, torch.tensor([123]), f)
    assert torch.allclose(apply_rope(x, torch.tensor([123]), f, inverse=True), q, atol=1e-12)
    assert torch.equal(x[:, :64], q[:, :64])  # only the trailing rope dims move
    # spec table (fp64): pairs 0 / 16 / 31 of the 160000 + YaRN frequencies at rope dim 64
    f64 = rope_frequencies(64, 160000.0, True, 16.0, 65536, 32.0, 1.0)
    assert math.isclose(f64[16], 2.265625e-3, rel_tol=1e-6) and math.isclose(f64[31], 5.68052904e-7, rel_tol=1e-6)


def test_sink_attention_against_a_loop_and_chunking():
    g = torch.Generator().manual_seed(2)
    q, keys = torch.randn(5, 3, 16, generator=g, dtype=torch.float64), torch.randn(9, 16, generator=g,
                                                                                      dtype=torch.float64)
    mask = torch.rand(5, 9, generator=g) > 0.4
    mask[:, 0] = True
    sinks = torch.randn(3, generator=g, dtype=torch.float64)
    want = torch.zeros_like(q)
    for t in range(5):
        for h in range(3):
            z = [float(q[t, h] @ keys[s]) / 4.0 for s in range(9) if mask[t, s]]
            rows = [keys[s] for s in range(9) if mask[t, s]]
            den = math.exp(float(sinks[h])) + sum(math.exp(v) for v in z)
            want[t, h] = sum(math.exp(v) / den * r for v, r in zip(z, rows, strict=True))
    got = sink_attention(q, keys, mask, sinks, budget=1 << 22)
    assert torch.allclose(got, want, atol=1e-12)
    # a budget of 7 scores: one query x one head per chunk
    assert torch.allclose(sink_attention(q, keys, mask, sinks, budget=7), want, atol=1e-12)
    far = sink_attention(q, keys, mask, torch.full((3,), 1e4, dtype=torch.float64), budget=1 << 22)
    assert far.abs().max() < 1e-30  # a dominating sink absorbs all weight: o -> 0, no NaN


def test_select_rows_ties_and_fault():
    """Row-id tables [n, top_k], ascending, -1 padded (the reference's `select_rows` result kind)."""
    scores = torch.tensor([[1.0, 5.0, 5.0, 5.0, 0.0, 9.0]])
    n_vis = torch.tensor([5])  # row 5 not yet visible
    assert select_rows(scores, n_vis, 2).tolist() == [[1, 2]]
    assert select_rows_ties_highest(scores, n_vis, 2).tolist() == [[2, 3]]
    assert select_rows(scores, torch.tensor([2]), 4).tolist() == [[0, 1, -1, -1]]
    two = torch.tensor([[3.0, 1.0, 2.0, 0.0], [0.0, 0.0, 7.0, 1.0]])
    assert select_rows(two, torch.tensor([4, 0]), 2).tolist() == [[0, 2], [-1, -1]]
    assert select_rows(two, torch.tensor([4, 4]), 6).tolist() == [[0, 1, 2, 3, -1, -1], [0, 1, 2, 3, -1, -1]]


def test_options_errors_and_announcements(tiny_f32, capsys):
    with pytest.raises(ParityError, match="unknown fault"):
        TorchEngine(str(tiny_f32), RunOptions(inject=("no-such-bug",)))
    with pytest.raises(ParityError, match="unknown dtype"):
        TorchEngine(str(tiny_f32), RunOptions(dtype="float16"))
    with pytest.raises(ParityError, match="unknown device"):
        TorchEngine(str(tiny_f32), RunOptions(device="tpu"))
    if not torch.cuda.is_available():
        with pytest.raises(ParityError, match="no CUDA device"):
            TorchEngine(str(tiny_f32), RunOptions(device="cuda"))
    capsys.readouterr()
    TorchEngine(str(tiny_f32), RunOptions(dtype="bfloat16", inject=("sink-dropped",), device="auto"))
    err = capsys.readouterr().err
    assert "APPROXIMATE dtype=bfloat16 (bf16 matmul operands" in err and "FAULTS INJECTED: sink-dropped" in err
    TorchEngine(str(tiny_f32), RunOptions())
    assert capsys.readouterr().err == ""  # the default path says nothing
    e = TorchEngine(str(tiny_f32), RunOptions())
    with pytest.raises(ParityError, match="cache holds positions"):
        e.forward_layer(e.new_state(), 0, e.embed(np.array([3])), np.array([3]), start_pos=5)
    with pytest.raises(ParityError, match=r"embed: token id outside \[0, 290\): 290..290"):
        e.embed(np.array([290]))
    with pytest.raises(ParityError, match="non-empty 1-D"):
        e.embed(np.array([], dtype=np.int64))
    with pytest.raises(ParityError, match="do not match"):
        e.forward_layer(e.new_state(), 0, np.zeros((0, 4, 256), np.float32), np.array([], np.int64), start_pos=0)


def test_float64_and_bfloat16_paths(tiny_f32):
    prompt = np.random.default_rng(4).integers(2, 290, 24)
    f32 = run_sequence(TorchEngine(str(tiny_f32), OFF), prompt)
    f64 = run_sequence(TorchEngine(str(tiny_f32), RunOptions(fp8_kv=False, fp4_indexer=False, dtype="float64")),
                       prompt)
    bf16 = run_sequence(TorchEngine(str(tiny_f32), RunOptions(fp8_kv=False, fp4_indexer=False, dtype="bfloat16")),
                        prompt)
    assert stack(f64, "final_norm").dtype == np.float64 and stack(bf16, "final_norm").dtype == np.float32
    a32, a64, a16 = (stack(r, "final_norm") for r in (f32, f64, bf16))
    assert _rel(a32, a64) < 1e-5
    print(f"\nbf16 vs f64 final_norm rel L2 {_rel(a16, a64):.3g}")
    assert 1e-5 < _rel(a16, a64) < 0.1  # approximate: measurably different, still the same model


def test_expert_override_replays_routing(tiny_f32):
    prompt = np.random.default_rng(5).integers(2, 290, 16)
    base = run_sequence(TorchEngine(str(tiny_f32), OFF), prompt)
    ids = {l: base[0].diags[l].expert_ids for l in range(6)}
    same = run_sequence(TorchEngine(str(tiny_f32), RunOptions(fp8_kv=False, fp4_indexer=False,
                                                              expert_override=lambda l, s, n: ids[l])), prompt)
    np.testing.assert_array_equal(stack(same, "logits"), stack(base, "logits"))
    forced = np.tile(np.array([[0, 1, 2]]), (16, 1))
    other = run_sequence(TorchEngine(str(tiny_f32), RunOptions(fp8_kv=False, fp4_indexer=False,
                                                               expert_override=lambda l, s, n: forced)), prompt)
    d = other[0].diags[4]
    np.testing.assert_array_equal(d.expert_ids, forced)
    np.testing.assert_allclose(d.expert_weights.sum(1), 1.5, rtol=1e-6)  # renormalised x route_scale
    bad = TorchEngine(str(tiny_f32), RunOptions(expert_override=lambda l, s, n: np.zeros((n, 2), int)))
    with pytest.raises(ParityError, match="expected int"):
        run_sequence(bad, prompt)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_cuda_matches_cpu(tiny_realmix):
    prompt = np.random.default_rng(6).integers(2, 290, 40)
    cpu = run_sequence(TorchEngine(str(tiny_realmix), OFF), prompt, decode_steps=4)
    gpu = run_sequence(TorchEngine(str(tiny_realmix), RunOptions(fp8_kv=False, fp4_indexer=False, device="cuda")),
                       prompt, decode_steps=4)
    assert _rel(stack(gpu, "final_norm"), stack(cpu, "final_norm")) < 1e-5


def test_query_and_head_chunking_do_not_change_results(tiny_f32, monkeypatch):
    """A tiny score budget forces one query per chunk (banded raw keys, per-chunk masks and indexer scores)."""
    prompt = np.random.default_rng(8).integers(2, 290, 40)
    full = run_sequence(TorchEngine(str(tiny_f32), OFF), prompt, decode_steps=2)
    monkeypatch.setattr(model_mod, "SCORE_BUDGET", 8)
    small = run_sequence(TorchEngine(str(tiny_f32), OFF), prompt, decode_steps=2)
    assert _rel(stack(small, "final_norm"), stack(full, "final_norm")) < 1e-6
    for l in (2, 4):
        np.testing.assert_array_equal(np.concatenate([r.diags[l].index_sel for r in small]),
                                      np.concatenate([r.diags[l].index_sel for r in full]))


def test_dequant_cache_changes_speed_only(tiny_realmix):
    prompt = np.random.default_rng(9).integers(2, 290, 12)
    cached = run_sequence(TorchEngine(str(tiny_realmix), RunOptions()), prompt, decode_steps=3)
    fresh = run_sequence(TorchEngine(str(tiny_realmix), RunOptions(), cache_mb=0), prompt, decode_steps=3)
    np.testing.assert_array_equal(stack(cached, "logits"), stack(fresh, "logits"))
    with pytest.raises(ParityError, match="cache_mb"):
        TorchEngine(str(tiny_realmix), RunOptions(), cache_mb=-1)


@pytest.mark.parametrize("name", ["blk.3.ffn_gate_exps.weight", "blk.3.ffn_down_exps.weight"])
def test_expert_product_in_row_blocks_matches_the_whole_matrix(tiny_realmix, monkeypatch, name):
    """Experts applied a few rows at a time (pieces of 3 x 256 values, last one partial) through one reused buffer
    equal x Wᵀ with W from the independent NumPy/gguf dequantization (parity.gguf.weights)."""
    import gpu_engine.weights as wmod
    from parity.gguf.weights import Weights

    w = TorchEngine(str(tiny_realmix), RunOptions(), cache_mb=0).w
    monkeypatch.setattr(wmod, "CHUNK_VALUES", 3 * w.q[name].shape[-1])
    x = torch.from_numpy(np.random.default_rng(10).standard_normal((5, w.q[name].shape[-1])).astype(np.float32))
    src = Weights(str(tiny_realmix))
    for e in (0, 5, 0):  # the buffer is overwritten between experts
        want = x @ torch.from_numpy(src.expert(name, e)).T
        got = linear(x, expert_of(w.weight(name), e))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert not torch.equal(got, x @ torch.from_numpy(src.expert(name, 7 - e)).T)


def _tid2eid_copy(src, dst, layer: int, value: int):
    """A copy of a GGUF whose hash-routing table of `layer` has entry [5, 1] set to `value` (else byte-identical)."""
    from parity.gguf.container import GGUFFile, TensorData, write_gguf

    g, name = GGUFFile(src), f"blk.{layer}.ffn_gate_tid2eid.weight"
    table = np.frombuffer(bytes(g.data(name)), dtype=np.int32).reshape(g.tensors[name].ne[::-1]).copy()
    table[5, 1] = value
    tensors = [TensorData(n, i.ne, i.ggml_type, table.tobytes() if n == name else bytes(g.data(n)))
               for n, i in g.tensors.items()]
    write_gguf(dst, g.kv, tensors)
    return dst


@pytest.mark.parametrize("value", [-1, 8, 2**31 - 1])  # the tiny model has 8 routed experts
def test_out_of_range_hash_routing_id_is_refused_at_load(tiny_f32, tmp_path, value):
    bad = _tid2eid_copy(tiny_f32, tmp_path / "bad.gguf", 1, value)
    with pytest.raises(ParityError, match=rf"tensor blk\.1\.ffn_gate_tid2eid\.weight: expert id {value} out of range "
                                          r"\[0, 8\) \(1 bad of"):
        TorchEngine(str(bad), OFF)
    ok = _tid2eid_copy(tiny_f32, tmp_path / "ok.gguf", 1, 7)  # the largest valid id loads and routes to it
    e = TorchEngine(str(ok), OFF)
    out = e.forward_layer(e.new_state(), 1, e.embed(np.array([5, 6])), np.array([5, 6]), start_pos=0)
    assert out.diag.expert_ids[0, 1] == 7


def test_token_id_out_of_range_in_forward_layer(engine):
    X = engine.embed(np.array([3]))
    with pytest.raises(ParityError, match=r"layer 0: token id outside \[0, 290\)"):
        engine.forward_layer(engine.new_state(), 0, X, np.array([290]), start_pos=0)


def test_qat_block_shape_is_checked(tmp_path, monkeypatch):
    """A model whose KV nope dims (80 - 32 = 48) are not whole FP8 blocks of 64: the simulation is refused by name
    and the engine runs with it off. (The FP4 indexer rule is not exercised: the config requires a power-of-two
    indexer head dim, so only 1..16 could fail it, below the tiny preset's rope dim of 32.)"""
    import dataclasses

    from parity.gguf import synth

    monkeypatch.setitem(synth.PRESETS, "odd", dataclasses.replace(synth.PRESETS["tiny"], head_dim=80))
    path = synth.synthesize(tmp_path / "odd.gguf", "odd", "f32")
    with pytest.raises(ParityError, match="torch engine: --fp8-kv needs head_dim - rope_head_dim = 48"):
        TorchEngine(str(path), RunOptions())
    e = TorchEngine(str(path), RunOptions(fp8_kv=False))
    assert np.isfinite(run_sequence(e, np.array([3, 4, 5, 6, 7]))[0].logits).all()


# -- act_quant=q8_0: activations as llama.cpp's CPU backend rounds them before a quantized matmul ----------------

def _q8_0_numpy(x: np.ndarray) -> np.ndarray:
    """Independent restatement of ggml's x86 quantize_row_q8_0 (then dequantized): per 32-block d = amax/127 stored
    as f16, q = rint(x · (127/amax)) (half to even), value q·d."""
    b = x.astype(np.float32).reshape(*x.shape[:-1], -1, 32)
    amax = np.abs(b).max(-1, keepdims=True)
    d = (amax / np.float32(127)).astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0))
    return (np.clip(np.rint(b * inv), -127, 127) * d).reshape(x.shape)


def test_q8_0_roundtrip_matches_ggml_rounding():
    from gguf import quants
    from gguf.constants import GGMLQuantizationType as Q

    from gpu_engine.ops import q8_0_roundtrip

    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(2000, 64, generator=g) * s for s in (1e-5, 0.1, 1.0, 300.0)])
    ours = q8_0_roundtrip(x).numpy()
    np.testing.assert_array_equal(ours, _q8_0_numpy(x.numpy()))
    # gguf-py's generic C-reference port (q = roundf(x / d)) agrees away from exact ties: 0 of 512000 differ here
    np.testing.assert_array_equal(ours, quants.dequantize(quants.quantize(x.numpy(), Q.Q8_0), Q.Q8_0))
    # exact ties (amax = 127: scale 1) round half to even as the x86 path does; a zero block stays zero
    tie = torch.zeros(2, 32)
    tie[0, :4] = torch.tensor([127.0, 2.5, 3.5, -2.5])
    assert q8_0_roundtrip(tie)[0, :4].tolist() == [127.0, 2.0, 4.0, -2.0] and (q8_0_roundtrip(tie)[1] == 0).all()
    with pytest.raises(ParityError, match="not a multiple of the block size 32"):
        q8_0_roundtrip(torch.ones(3, 48))


def test_act_quant_none_is_the_default_path_bit_for_bit(tiny_realmix, tiny_f32, capsys):
    """act_quant=none (explicit) runs the default path; on an F32-only model q8_0 changes no bit (no quantized
    matmul) but still announces itself."""
    prompt = np.random.default_rng(13).integers(2, 290, 20)
    for path, approx in ((tiny_realmix, "none"), (tiny_f32, "q8_0")):
        base = run_sequence(TorchEngine(str(path), RunOptions()), prompt, decode_steps=2, capture=True)
        other = run_sequence(TorchEngine(str(path), RunOptions(act_quant=approx)), prompt, decode_steps=2,
                             capture=True)
        for a, b in zip(base, other, strict=True):
            np.testing.assert_array_equal(a.logits, b.logits)
            for ca, cb in zip(a.captures, b.captures, strict=True):
                for k in ca:
                    np.testing.assert_array_equal(ca[k], cb[k], err_msg=f"{path.name} {approx} {k}")
    assert "torch engine: APPROXIMATE act_quant=q8_0 (activations rounded to Q8_0" in capsys.readouterr().err


def test_act_quant_q8_0_rounds_only_quantized_matmuls(tiny_mxfp4):
    """mxfp4 model: only the routed experts are quantized. Layer 0's attention and shared expert stay bit-identical,
    the routed experts differ by a bounded amount (measured rel L2 0.0091..0.0131 per position, in line with the
    ~1.2e-2 the llama.cpp spec reports for its own Q8_0 activations), and equal an independent NumPy emulation
    (gguf-py dequantization, Q8_0-rounded inputs of gate/up and of the unweighted down input) to 2.3e-7."""
    from parity.gguf.weights import Weights

    prompt = np.random.default_rng(12).integers(2, 290, 24)
    ex = run_sequence(TorchEngine(str(tiny_mxfp4), OFF), prompt, capture=True)[0].captures[0]
    eng = TorchEngine(str(tiny_mxfp4), RunOptions(fp8_kv=False, fp4_indexer=False, act_quant="q8_0"))
    ap = run_sequence(eng, prompt, capture=True)[0].captures[0]
    for k in ("attn_out", "ffn_norm", "shared_out"):
        np.testing.assert_array_equal(ap[k], ex[k], err_msg=k)
    rel = metrics.rel_l2(ex["routed_out"], ap["routed_out"])
    assert rel.min() > 0.009 and rel.max() < 0.0135, (rel.min(), rel.max())  # measured 0.0091 .. 0.0131
    w, lim, x = Weights(str(tiny_mxfp4)), eng.cfg.swiglu_limit[0], ap["ffn_norm"]
    want = np.zeros(x.shape, np.float64)
    for t in range(len(x)):
        for e, wt in zip(ap["expert_ids"][t], ap["expert_weights"][t], strict=True):
            g, u = (_q8_0_numpy(x[t]).astype(np.float64) @ w.expert(f"blk.0.ffn_{k}_exps.weight", int(e)).T
                    for k in ("gate", "up"))
            g, u = np.minimum(g, lim), np.clip(u, -lim, lim)
            h = (g / (1 + np.exp(-g)) * u).astype(np.float32)  # llama.cpp: the routing weight after the down matmul
            want[t] += wt * (_q8_0_numpy(h) @ w.expert("blk.0.ffn_down_exps.weight", int(e)).T.astype(np.float64))
    # measured 2.3e-7: the engine scales the float32 operand by the weight before the down matmul, the
    # emulation scales the float64 product after it (equal in exact arithmetic)
    assert metrics.rel_l2(want, ap["routed_out"]).max() < 4e-7


def test_unimplemented_numerics_options_are_refused(tiny_f32):
    for opts, what in ((RunOptions(act_quant="bf16"), "act_quant=bf16"), (RunOptions(kv_cache="f16"), "kv_cache=f16"),
                       (RunOptions(rope_angles="recurrence"), "rope_angles=recurrence")):
        with pytest.raises(ParityError, match=f"torch engine: {what} is not implemented"):
            TorchEngine(str(tiny_f32), opts)
    with pytest.raises(ParityError, match=r"torch engine: unknown engine argument 'lcp_flash=on'; the ones it takes "
                                          r"are cpu_kernels=native\|torch and threads=N \(N >= 1\)"):
        TorchEngine(str(tiny_f32), RunOptions(engine_args=("lcp_flash=on",)))


def test_expert_threads_change_speed_only(tiny_realmix):
    """Routed experts run concurrently on a thread pool (and a few-row dense product's rows are split over it); the
    contributions are still added in ascending expert id and every row is one fixed-order dot product, so any thread
    count gives the same bits (1 intra-op thread, as the suite runs; decode steps take the row-split path)."""
    prompt = np.random.default_rng(14).integers(2, 290, 30)
    runs = [run_sequence(TorchEngine(str(tiny_realmix), RunOptions(), expert_threads=t), prompt, decode_steps=3,
                         capture=True) for t in (1, 3)]
    for a, b in zip(*runs, strict=True):
        np.testing.assert_array_equal(a.logits, b.logits)
        for ca, cb in zip(a.captures, b.captures, strict=True):
            np.testing.assert_array_equal(ca["routed_out"], cb["routed_out"])
    assert TorchEngine(str(tiny_realmix), RunOptions(), expert_threads=1).expert_threads == 1
    from gpu_engine.engine import MAX_EXPERT_THREADS
    from parity.contract.cpus import usable_cpus

    assert 1 <= usable_cpus() <= len(os.sched_getaffinity(0))  # the affinity mask bounds it (a quota may lower it)
    assert TorchEngine(str(tiny_realmix), RunOptions()).expert_threads == min(usable_cpus(), MAX_EXPERT_THREADS)
    with pytest.raises(ParityError, match="expert_threads must be >= 1"):
        TorchEngine(str(tiny_realmix), RunOptions(), expert_threads=0)
