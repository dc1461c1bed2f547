"""Torch engine vs the NumPy reference on the synthetic tiny models (float32).

Sims off: every checkpoint and position within rel L2 1e-5 / cosine 0.99999, every sub-op capture
close, identical expert ids, indexer rows and visible-row counts, identical greedy tokens over 64
decode steps (prompt 200: past the window of 8, CSA boundaries every 4, HCA boundaries at t = 127 in
prefill and t = 255 in decode). Sims on: the same holds at every (layer, position) that no FP8/FP4
code flip can reach; the number of flipped codes is printed.
"""

from __future__ import annotations

import numpy as np
import pytest

from parity.compare import metrics
from parity.contract.checkpoints import checkpoint_names
from parity.contract.engine import RunOptions
from parity.tracing.runner import all_tokens, run_sequence, stack

PROMPT_LEN, DECODE = 200, 64
REL_TOL, COS_MIN = 1e-5, 0.99999


def _prompt(n: int) -> np.ndarray:
    return np.random.default_rng(7).integers(2, 290, n)


def _both(path, opts: RunOptions, n_prompt: int, decode: int):
    from gpu_engine.engine import TorchEngine
    from reference_cpu.engine import ReferenceEngine

    prompt = _prompt(n_prompt)
    ref = run_sequence(ReferenceEngine(str(path), opts), prompt, decode_steps=decode, capture=True)
    tor = run_sequence(TorchEngine(str(path), opts), prompt, decode_steps=decode, capture=True)
    return ref, tor


def _rel_cos(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-position relative L2 error of a vs the reference b and cosine (parity.compare.metrics).
    [T, ...] x2 -> [T], [T]"""
    return metrics.rel_l2(b, a), metrics.cosine(b, a)


MODELS = ["tiny_f32", "tiny_realmix", "tiny_mxfp4"]


@pytest.fixture(scope="module", params=MODELS)
def sims_off_run(request):
    path = request.getfixturevalue(request.param)
    ref, tor = _both(path, RunOptions(fp8_kv=False, fp4_indexer=False), PROMPT_LEN, DECODE)
    return request.param, ref, tor


def test_every_checkpoint_and_position_matches(sims_off_run):
    model, ref, tor = sims_off_run
    worst_rel, worst_cos = 0.0, 1.0
    for name in (*checkpoint_names(6), *(f"blk.{l}.attn" for l in range(6)), "logits"):
        rel, cos = _rel_cos(stack(tor, name), stack(ref, name))
        assert len(rel) == PROMPT_LEN + DECODE
        bad = np.flatnonzero((rel > REL_TOL) | (cos < COS_MIN))
        assert not bad.size, f"{model} {name}: position {bad[0]} rel {rel[bad[0]]:.3g} cos {cos[bad[0]]:.8f}"
        worst_rel, worst_cos = max(worst_rel, rel.max()), min(worst_cos, cos.min())
    print(f"\n{model} sims off: max rel L2 {worst_rel:.3g}, min cosine {worst_cos:.9f}")


def test_greedy_tokens_experts_and_indexer_identical(sims_off_run):
    model, ref, tor = sims_off_run
    np.testing.assert_array_equal(all_tokens(tor), all_tokens(ref))
    assert len(set(all_tokens(tor)[PROMPT_LEN:].tolist())) > 1, "decode degenerated to one token"
    for l in range(6):
        for field in ("expert_ids", "n_comp_visible", "index_sel"):
            a = [getattr(r.diags[l], field) for r in tor]
            b = [getattr(r.diags[l], field) for r in ref]
            if b[0] is None:
                assert all(x is None for x in a), f"layer {l}: {field} should be None"
                continue
            np.testing.assert_array_equal(np.concatenate(a), np.concatenate(b), err_msg=f"{model} layer {l} {field}")
    # the run really crosses both kinds of compressor boundary in decode and in prefill
    n_vis = np.concatenate([r.diags[3].n_comp_visible for r in ref])
    assert n_vis[127] == 1 and n_vis[255] == 2 and n_vis[-1] == 2
    assert (np.concatenate([r.diags[2].index_sel for r in ref]) >= 0).sum(1).max() == 4  # top-k is a strict subset


def test_every_subop_capture_matches(sims_off_run):
    model, ref, tor = sims_off_run
    for l in range(6):
        for step in (0, len(ref) - 1):  # the prefill chunk and the last decode step
            cr, ct = ref[step].captures[l], tor[step].captures[l]
            assert set(ct) == set(cr), f"layer {l}: capture names differ: {set(ct) ^ set(cr)}"
            for k in cr:
                a, b = ct[k], cr[k]
                assert a.shape == b.shape, f"{model} layer {l} {k}: {a.shape} vs {b.shape}"
                if b.dtype.kind in "iu":
                    np.testing.assert_array_equal(a, b, err_msg=f"{model} layer {l} {k}")
                elif b.size:
                    rel, _ = _rel_cos(a, b)
                    assert rel.max() <= REL_TOL, f"{model} layer {l} step {step} {k}: rel {rel.max():.3g}"


def _flips(a: np.ndarray, b: np.ndarray, dims: slice) -> np.ndarray:
    """Per row: number of quantized elements that differ (the round trips are discrete, so any difference
    beyond the unquantized tail is a flipped code).  [R, d] x2 -> int [R]"""
    return (a[:, dims] != b[:, dims]).sum(axis=1)


@pytest.mark.parametrize("model", MODELS)
def test_sims_on_match_wherever_no_code_flipped(model, request):
    """Sims on (the default), prompt 200 + 64 decode steps, torch teacher-forced on the reference's greedy tokens.
    A flip is a quantized element that differs between the engines (FP8 nope dims of raw KV rows and main rows,
    FP4 indexer rows) or an indexer selection that differs (FP4 of the indexer queries is not captured). A flip at
    (layer l, position p) can reach every (L >= l, P >= p); everywhere else the sims-off bounds must hold."""
    from gpu_engine.engine import TorchEngine
    from reference_cpu.engine import ReferenceEngine

    path = str(request.getfixturevalue(model))
    prompt = _prompt(PROMPT_LEN)
    ref = run_sequence(ReferenceEngine(path, RunOptions()), prompt, decode_steps=DECODE, capture=True)
    tor = run_sequence(TorchEngine(path, RunOptions()), prompt, decode_steps=DECODE, capture=True,
                       forced=all_tokens(ref)[PROMPT_LEN:])
    T, nope = PROMPT_LEN + DECODE, 96 - 32
    first_flip = np.full(6, T, dtype=np.int64)
    total = 0
    for l in range(6):
        fk = _flips(np.concatenate([r.captures[l]["rope_kv"] for r in tor]),
                    np.concatenate([r.captures[l]["rope_kv"] for r in ref]), slice(0, nope))
        total += int(fk.sum())
        if fk.any():
            first_flip[l] = min(first_flip[l], np.flatnonzero(fk)[0])
        m = (0, 0, 4, 128, 4, 128)[l]
        for key, dims in (("comp_rows", slice(0, nope)), ("index_rows", slice(None))):
            fr = _flips(tor[-1].captures[l][key], ref[-1].captures[l][key], dims)
            total += int(fr.sum())
            if fr.any():
                first_flip[l] = min(first_flip[l], (np.flatnonzero(fr)[0] + 1) * m - 1)
        if ref[0].diags[l].index_sel is not None:
            differ = np.flatnonzero((np.concatenate([r.diags[l].index_sel for r in tor])
                                     != np.concatenate([r.diags[l].index_sel for r in ref])).any(1))
            if differ.size:
                first_flip[l] = min(first_flip[l], differ[0])
    reach = np.minimum.accumulate(first_flip)
    print(f"\n{model} sims on, {T} positions: {total} flipped FP8/FP4 codes; first flip per layer "
          f"{first_flip.tolist()}")
    checked = 0
    for l in range(6):
        for name in (f"blk.{l}.attn", f"blk.{l}"):
            rel, cos = _rel_cos(stack(tor, name), stack(ref, name))
            clean = slice(0, reach[l])
            assert (rel[clean] <= REL_TOL).all() and (cos[clean] >= COS_MIN).all(), f"{name} before any flip"
            checked += reach[l]
        ids_t = np.concatenate([r.diags[l].expert_ids for r in tor])[: reach[l]]
        ids_r = np.concatenate([r.diags[l].expert_ids for r in ref])[: reach[l]]
        np.testing.assert_array_equal(ids_t, ids_r)
    assert checked >= 2 * 6 * 8, "too few flip-free positions to say anything"


def test_float64_oracle_mode_agrees_to_rounding_with_sims_on(tiny_realmix):
    """In float64 the QAT round trips see (almost) no rounding noise, so no code flips: the two engines then agree
    to ~1e-15 at every checkpoint and position, sims included (FP8 KV, Hadamard + FP4 indexer); measured 2.2e-15."""
    ref, tor = _both(tiny_realmix, RunOptions(dtype="float64"), 40, 6)
    for name in (*checkpoint_names(6), "logits"):
        a, b = stack(tor, name), stack(ref, name)
        assert a.dtype == np.float64
        rel, _ = _rel_cos(a, b)
        assert rel.max() < 2e-14, f"{name}: rel {rel.max():.3g}"


@pytest.mark.parametrize("chunk", [3, 5, 129])
def test_chunked_prefill_matches_reference_single_prefill(tiny_f32, chunk):
    """Prefill cut into chunks at every offset mod 4 (and across the HCA block end t = 127) through the torch caches
    equals the reference's one-chunk prefill: compressor pending state survives every kind of chunk boundary."""
    from gpu_engine.engine import TorchEngine
    from reference_cpu.engine import ReferenceEngine

    opts = RunOptions(fp8_kv=False, fp4_indexer=False)
    prompt = _prompt(140)
    ref = run_sequence(ReferenceEngine(str(tiny_f32), opts), prompt)
    tor = run_sequence(TorchEngine(str(tiny_f32), opts), prompt, chunk=chunk)
    for name in (*checkpoint_names(6), "logits"):
        rel, cos = _rel_cos(stack(tor, name), stack(ref, name))
        assert rel.max() <= REL_TOL and cos.min() >= COS_MIN, f"chunk {chunk} {name}: rel {rel.max():.3g}"
