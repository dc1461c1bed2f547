"""The `llamacpp` engine (llama.cpp itself, in-process) against the NumPy reference on the tiny F32-expert model,
QAT simulations off on our side (llama.cpp omits them): checkpoints, sub-ops, selections, greedy tokens, for
prefill in one chunk, in chunks and token by token; teacher forcing; llama.cpp's constraints."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from requires import require

from parity.bisect.bisect_report import summary
from parity.check.attribution import teacher_forced
from parity.compare.metrics import rel_l2
from parity.compare.verdict import Verdict
from parity.contract.checkpoints import trace_checkpoints
from parity.contract.engine import RunOptions, load_engine
from parity.contract.errors import ParityError
from parity.gguf.synth import PRESETS, preset_config
from parity.gguf.weights import Weights
from parity.tracing.runner import all_tokens, run_sequence, stack

# In CI a missing llama-cpp-python is a failure, not a skip.
llama_cpp = require("llama_cpp")

OFF = RunOptions(fp8_kv=False, fp4_indexer=False)
LCP = replace(OFF, engine_args=("lcp_threads=1", "lcp_ctx=512"))
PROMPT = [0, *((7 * i + 3) % 280 + 2 for i in range(40))]   # 41 tokens: CSA rows beyond the indexer's top-k
DECODE = 6
TOL = 1e-5  # acceptance bound; measured max 1.1e-6 (checkpoints, logits) and 1.7e-6 (sub-op captures)


@pytest.fixture(scope="module")
def engines(tiny_f32):
    return load_engine("reference", str(tiny_f32), OFF), load_engine("llamacpp", str(tiny_f32), LCP)


def _cat(results, layer, name):
    return np.concatenate([r.captures[layer][name] for r in results])


@pytest.mark.parametrize("chunk", [None, 16, 1])
def test_llamacpp_matches_the_reference(engines, chunk):
    ref, lcp = engines
    a = run_sequence(ref, PROMPT, DECODE, chunk=chunk, capture=True)
    b = run_sequence(lcp, PROMPT, DECODE, chunk=chunk, capture=True)   # its own greedy tokens
    assert all_tokens(b).tolist() == all_tokens(a).tolist()
    for name in [*trace_checkpoints(ref.config.n_layers), "logits"]:
        assert rel_l2(stack(a, name), stack(b, name)).max() < TOL, name
    for l in range(ref.config.n_layers):
        for x, y in zip(a, b, strict=True):
            assert np.array_equal(x.diags[l].expert_ids, y.diags[l].expert_ids)
            assert np.array_equal(x.diags[l].n_comp_visible, y.diags[l].n_comp_visible)
            assert (x.diags[l].index_sel is None) == (y.diags[l].index_sel is None)
            if x.diags[l].index_sel is not None:
                assert np.array_equal(x.diags[l].index_sel, y.diags[l].index_sel)
            np.testing.assert_allclose(x.diags[l].expert_weights, y.diags[l].expert_weights, rtol=TOL)
            for p, q in zip((*x.diags[l].hc_attn, *x.diags[l].hc_ffn), (*y.diags[l].hc_attn, *y.diags[l].hc_ffn),
                            strict=True):
                np.testing.assert_allclose(p, q, rtol=TOL, atol=TOL)
            np.testing.assert_allclose(x.diags[l].router_margin, y.diags[l].router_margin, rtol=1e-4, atol=1e-5)
        for name in a[0].captures[l]:
            if name in ("comp_rows", "index_rows"):   # every row emitted so far, as of the last chunk
                got, want = b[-1].captures[l][name], a[-1].captures[l][name]
                assert got.shape == want.shape, (l, name)
                if len(want):
                    assert rel_l2(want, got).max() < TOL, (l, name)
            elif name in ("expert_ids", "index_sel"):
                assert np.array_equal(_cat(a, l, name), _cat(b, l, name)), (l, name)
            else:
                x, y = _cat(a, l, name), _cat(b, l, name)
                assert rel_l2(x.reshape(len(x), -1), y.reshape(len(y), -1)).max() < TOL, (l, name)
    # the selection is a strict subset somewhere (more CSA rows than the indexer keeps), so it was tested
    sel = np.concatenate([r.diags[2].index_sel for r in b])
    assert (sel >= 0).sum(axis=1).max() == ref.config.index_topk < len(PROMPT) // 4


def test_teacher_forcing_runs_llamacpp_layers_on_the_given_inputs(engines):
    """Inputs that no llama.cpp run produced (the reference's carriers, perturbed): every llama.cpp layer's output
    matches the reference layer on the same input, in chunks (caches built from the given inputs)."""
    ref, lcp = engines
    feed = run_sequence(ref, PROMPT[:20], 2, chunk=8)
    for c in feed:
        c.checkpoints["blk.2"] = c.checkpoints["blk.2"] * 1.25 + 0.05   # layer 3's input
    got = teacher_forced(lcp, feed, range(6), capture=True)
    want = teacher_forced(ref, feed, range(6), capture=True)
    for l in range(6):
        y = np.concatenate([o.carrier for o in got[l]])
        assert rel_l2(np.concatenate([o.carrier for o in want[l]]), y).max() < TOL, l
        assert all(np.array_equal(p.diag.expert_ids, q.diag.expert_ids) for p, q in zip(want[l], got[l], strict=True))
    free = np.concatenate([c.checkpoints["blk.3"] for c in feed])   # not what a perturbed input gives
    assert rel_l2(free, np.concatenate([o.carrier for o in got[3]])).max() > 0.1


def test_head_on_a_foreign_carrier(engines):
    ref, lcp = engines
    x = ref.embed(np.array(PROMPT[:5])) * 0.7
    for r, g in zip(ref.head(x), lcp.head(x), strict=True):
        assert rel_l2(r, g).max() < TOL


def test_options_llamacpp_cannot_honour_are_refused(tiny_f32):
    with pytest.raises(ParityError, match="QAT round trips; run with --no-fp8-kv --no-fp4-indexer"):
        load_engine("llamacpp", str(tiny_f32), RunOptions())
    for opts, msg in ((replace(LCP, dtype="float64"), "computes in float32"),
                      (replace(LCP, inject=("x",)), "cannot inject faults"),
                      (replace(LCP, device="cuda"), "runs its CPU backend here; device 'cuda'"),
                      (replace(LCP, act_quant="q8_0"), "act_quant=q8_0"),
                      (replace(OFF, engine_args=("lcp_threds=2",)), "unknown engine argument 'lcp_threds=2'"),
                      (replace(OFF, engine_args=("lcp_threads=two",)), "lcp_threads='two'")):
        with pytest.raises(ParityError, match=msg):
            load_engine("llamacpp", str(tiny_f32), opts)


def test_header_records_llamacpp_settings(engines):
    _, lcp = engines
    flags = lcp.options.flags()
    assert flags["engine_args"] == ["lcp_kv=f32", "lcp_flash_attn=off", "lcp_threads=1", "lcp_ctx=512",
                                    "lcp_ubatch=512", "lcp_rs_seq=16"]
    assert flags["rope_angles"] == "recurrence" and not flags["fp8_kv"] and not flags["fp4_indexer"]


def test_llamacpp_constraints(tiny_f32, tiny_mxfp4, tiny_realmix):
    from llamacpp_engine.constraints import check_config, check_expert_types

    for name in PRESETS:   # every synthetic preset is runnable by llama.cpp
        check_config(preset_config(name, 290))
    for model in (tiny_f32, tiny_mxfp4, tiny_realmix):
        check_expert_types(Weights(model))
    cfg = preset_config("tiny", 290)
    for bad, msg in ((replace(cfg, compress_ratios=(0, 0, 8, 128, 4, 128)), r"compress ratios \[8\]"),
                     (replace(cfg, hc_mult=2), "hyper_connection.count = 2"),
                     (replace(cfg, index_head_dim=32), "indexer.key_length = 32; llama.cpp needs a multiple of 64")):
        with pytest.raises(ParityError, match=msg):
            check_config(bad)


def test_positions_must_follow_in_order(engines):
    _, lcp = engines
    state = lcp.new_state()
    toks = np.array(PROMPT[:4])
    lcp.forward_layer(state, 0, lcp.embed(toks), toks, 0)
    with pytest.raises(ParityError, match="chunk starts at position 9 but the state expects 4"):
        lcp.forward_layer(state, 0, lcp.embed(toks), toks, 9)


def test_bisect_llamacpp_clean_is_no_defect(engines, tiny_f32):
    """Envelope measured for llama.cpp (sims off), then the whole bisection on the built-in prompt."""
    from parity import api
    from parity.bisect.search import bisect, builtin_prompt

    ref, lcp = engines
    env = api.measure_envelope(tiny_f32, "llamacpp", LCP)
    r = bisect(ref, lcp, builtin_prompt(ref.config.vocab_size, ref.config.bos_token_id), 4, env)
    assert r.verdict is Verdict.MATCH, summary(r)


def test_mxfp4_experts_llamacpp_rounds_activations_to_q8_0(tiny_mxfp4):
    """With MXFP4 experts llama.cpp's CPU backend rounds the activations to Q8_0 before the expert matmuls: the
    reference with act_quant=q8_0 reproduces layer 0's routed-expert output (measured 4.3e-7), without it they
    differ (measured 1.3e-2)."""
    lcp = load_engine("llamacpp", str(tiny_mxfp4), LCP)
    got = run_sequence(lcp, PROMPT, capture=True)[0].captures[0]["routed_out"]
    plain, q8 = (run_sequence(load_engine("reference", str(tiny_mxfp4), replace(OFF, act_quant=aq)), PROMPT,
                              capture=True)[0].captures[0]["routed_out"] for aq in ("none", "q8_0"))
    assert rel_l2(q8, got).max() < TOL
    assert rel_l2(plain, got).max() > 1e-3


def test_f16_kv_cache_is_recorded_and_changes_results(engines, tiny_f32):
    _, lcp = engines
    f16 = load_engine("llamacpp", str(tiny_f32), replace(LCP, kv_cache="f16"))
    assert f16.options.flags()["kv_cache"] == "f16" and "lcp_kv=f16" in f16.options.engine_args
    a, b = (stack(run_sequence(e, PROMPT[:28], 4, capture=True), "logits") for e in (lcp, f16))
    assert 1e-4 < np.abs(a - b).max() < 1e-2   # measured 1.6e-3


def test_bisect_localises_llamacpp_q8_0_rounding_with_mxfp4_experts(tiny_mxfp4):
    """The whole bisection with llama.cpp as the candidate (teacher-forced pass, splices, drill-down with
    captures, all through written layer inputs): the Q8_0 activation rounding acts first in layer 0's routed
    experts, from position 0. (bisect has no benign-numerics hypotheses; `check` explains it.)"""
    from parity import api
    from parity.bisect.search import bisect, builtin_prompt

    ref = load_engine("reference", str(tiny_mxfp4), OFF)
    lcp = load_engine("llamacpp", str(tiny_mxfp4), LCP)
    env = api.measure_envelope(tiny_mxfp4, "llamacpp", LCP)
    r = bisect(ref, lcp, builtin_prompt(ref.config.vocab_size, ref.config.bos_token_id), 4, env)
    assert r.verdict is Verdict.DEFECT
    assert (r.culprit.layer, r.culprit.subop, r.culprit.position) == (0, "routed_experts", 0)
    assert r.runs["teacher_forced"] == 1 and r.runs["splice"] >= 2 and r.runs["drill_down_layers"] == 1
