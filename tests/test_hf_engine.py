"""The `hf` engine (transformers' DeepseekV4ForCausalLM built from the GGUF) against the NumPy reference on the tiny
F32-expert model, QAT simulations off on both sides (transformers omits them): checkpoints, every sub-op capture,
selections and greedy tokens, for one-chunk prefill and token by token; teacher forcing; float64; refusals."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from requires import require

from parity.bisect.bisect_report import summary
from parity.check.attribution import teacher_forced
from parity.check.check_report import cause_words, headline
from parity.compare.metrics import rel_l2
from parity.compare.verdict import Verdict
from parity.contract.checkpoints import trace_checkpoints
from parity.contract.engine import RunOptions, load_engine
from parity.contract.errors import ParityError
from parity.gguf.synth import preset_config
from parity.tracing.runner import all_tokens, run_sequence, stack

# In CI a missing transformers is a failure, not a skip.
transformers = require("transformers")

OFF = RunOptions(fp8_kv=False, fp4_indexer=False)
PROMPT = [0, *((7 * i + 3) % 280 + 2 for i in range(40))]
DECODE = 6
TOL = 1e-5     # acceptance bound; measured float32 max 1.5e-6 (checkpoints, logits), 2.1e-6 (sub-op captures)
TOL64 = 2e-6   # float64: measured 3.9e-7 / 6.5e-7 (transformers keeps its RMS norms and HC mixes in float32)


@pytest.fixture(scope="module")
def engines(tiny_f32):
    return load_engine("reference", str(tiny_f32), OFF), load_engine("hf", str(tiny_f32), OFF)


def _compare(a, b, tol):
    assert all_tokens(b).tolist() == all_tokens(a).tolist()
    for name in [*trace_checkpoints(6), "logits"]:
        assert rel_l2(stack(a, name), stack(b, name)).max() < tol, name
    for l in range(6):
        for x, y in zip(a, b, strict=True):
            assert np.array_equal(x.diags[l].expert_ids, y.diags[l].expert_ids)
            assert np.array_equal(x.diags[l].n_comp_visible, y.diags[l].n_comp_visible)
            if x.diags[l].index_sel is not None:
                assert np.array_equal(x.diags[l].index_sel, y.diags[l].index_sel)
            for p, q in zip((*x.diags[l].hc_attn, *x.diags[l].hc_ffn), (*y.diags[l].hc_attn, *y.diags[l].hc_ffn),
                            strict=True):
                np.testing.assert_allclose(p, q, rtol=tol, atol=tol)
            np.testing.assert_allclose(x.diags[l].router_margin, y.diags[l].router_margin, rtol=1e-4, atol=1e-5)
        for name in a[0].captures[l]:
            if name in ("comp_rows", "index_rows"):
                want, got = a[-1].captures[l][name], b[-1].captures[l][name]
                assert want.shape == got.shape, (l, name)
                if len(want):
                    assert rel_l2(want, got).max() < tol, (l, name)
            elif name in ("expert_ids", "index_sel"):
                assert all(np.array_equal(x.captures[l][name], y.captures[l][name]) for x, y in zip(a, b, strict=True))
            else:
                x = np.concatenate([r.captures[l][name] for r in a])
                y = np.concatenate([r.captures[l][name] for r in b])
                assert rel_l2(x.reshape(len(x), -1), y.reshape(len(y), -1)).max() < tol, (l, name)


@pytest.mark.parametrize("chunk", [None, 1])
def test_hf_matches_the_reference(engines, chunk):
    ref, hf = engines
    _compare(run_sequence(ref, PROMPT, DECODE, chunk=chunk, capture=True),
             run_sequence(hf, PROMPT, DECODE, chunk=chunk, capture=True), TOL)


def test_hf_float64_matches_the_float64_reference(tiny_f32):
    opts = replace(OFF, dtype="float64")
    ref, hf = load_engine("reference", str(tiny_f32), opts), load_engine("hf", str(tiny_f32), opts)
    a, b = (run_sequence(e, PROMPT, 2, chunk=16, capture=True) for e in (ref, hf))
    assert stack(b, "blk.5").dtype == np.float64
    _compare(a, b, TOL64)


def test_hf_teacher_forcing(engines):
    ref, hf = engines
    feed = run_sequence(ref, PROMPT[:20], 2, chunk=8)
    for c in feed:
        c.checkpoints["blk.2"] = c.checkpoints["blk.2"] * 1.25 + 0.05
    got, want = (teacher_forced(e, feed, range(6)) for e in (hf, ref))
    for l in range(6):
        assert rel_l2(np.concatenate([o.carrier for o in want[l]]), np.concatenate([o.carrier for o in got[l]])).max() \
            < TOL
    free = np.concatenate([c.checkpoints["blk.3"] for c in feed])
    assert rel_l2(free, np.concatenate([o.carrier for o in got[3]])).max() > 0.1


def test_hf_refuses_what_transformers_does_not_implement(tiny_f32):
    from hf_engine.model import check_model

    for opts, msg in ((RunOptions(), "does not implement the FP8 KV / FP4 indexer QAT round trips"),
                      (replace(OFF, dtype="bfloat16"), "dtype 'bfloat16'"),
                      (replace(OFF, act_quant="q8_0"), "act_quant=q8_0 is not a transformers code path"),
                      (replace(OFF, inject=("x",)), "injects no faults")):
        with pytest.raises(ParityError, match=msg):
            load_engine("hf", str(tiny_f32), opts)
    cfg = preset_config("tiny", 290)
    with pytest.raises(ParityError, match=r"one swiglu_limit .* hold \[1.5, 2.0\]"):
        check_model(replace(cfg, swiglu_limit_shexp=(2.0,) * 6))
    with pytest.raises(ParityError, match=r"compress ratios \[16\]"):
        check_model(replace(cfg, compress_ratios=(0, 0, 4, 16, 4, 128)))


def test_bisect_hf_clean_is_no_defect(engines, tiny_f32):
    """On a prompt without exactly tied indexer scores. (The built-in bisect prompt repeats a motif so that scores
    tie exactly; there torch.topk in transformers' indexer picks other tied rows than the reference's lowest-index
    rule, and bisect reports that selection difference at layer 4: docs/peers.md.)"""
    from parity import api
    from parity.bisect.search import bisect

    ref, hf = engines
    env = api.measure_envelope(tiny_f32, "hf", OFF)
    r = bisect(ref, hf, PROMPT[:28], 4, env)
    assert r.verdict is Verdict.MATCH, summary(r)


def test_check_calls_transformers_exact_indexer_tie_a_tie(tiny_f32, tmp_path):
    """docs/peers.md's repeated-motif prompt: transformers picks other rows at an exact indexer-score tie (position
    27, layer 4). check labels it TIE with the rows named, never DEFECT."""
    from parity import api
    from parity.bisect.search import builtin_prompt

    prompt = builtin_prompt(290, 0)
    t = api.trace("hf", tiny_f32, prompt, positions="all", full="all", decode=4, options=OFF)
    r = api.check(t, tiny_f32)
    ties = [c for c in r.causes if c.name == "tie"]
    assert r.verdict == "NOISE" and ties, headline(r)
    assert [(c.layer, c.subop) for c in ties] == [(4, "indexer_selection")], ties
    words = cause_words(ties[0])
    assert "position 27" in words and "+6 -2" in words, ties
