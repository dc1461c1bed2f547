"""Step comparison of logprob runs: verdicts, overlap metrics and KL/JS bounds, checked by hand."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from parity.logprobs.compare import LogprobPreflightError, compare_runs, truncated_divergence
from parity.logprobs.io import read_run

FIX = Path(__file__).parent / "fixtures" / "logprobs"
e = math.exp


def run(name: str):
    return read_run(FIX / name)


def test_tie_flip_step_and_the_steps_after_it():
    cmp = compare_runs(run("ref.ds4.json"), run("cand_tie.ds4.json"))
    s0, s1, s2 = cmp.steps
    # step 0: same token, top-1 logprobs -0.2 vs -0.25 -> |0.05| <= 0.1 -> MATCH
    assert (s0.verdict, s0.same_token) == ("MATCH", True)
    # listed sets {16, 204, EOS} vs {16, 204, \n}: Jaccard 2/4; shared deltas |−0.25+0.2|, |−2.3+2.5|
    assert s0.k == 3 and s0.jaccard == pytest.approx(0.5) and s0.n_shared == 2
    assert s0.max_abs_dlogprob == pytest.approx(0.2) and s0.mean_abs_dlogprob == pytest.approx(0.125)
    assert s0.max_rank_shift == 0
    # ds4_test: A's EOS (rank 3) is not in B's list
    assert s0.ds4_test is False and "missing from the candidate's top 20" in s0.ds4_test_detail
    # step 1: A picks the fragment at -0.75, B picks "\n", which A scores -0.8: margin 0.05 <= 0.1
    assert s1.verdict == "TIE-FLIP" and s1.ref_margin == pytest.approx(0.05)
    assert s1.max_rank_shift == 1 and s1.jaccard == 1.0
    # step 2: free-running runs now see different contexts
    assert s2.verdict is None and "contexts differ since step 1" in s2.note
    assert cmp.first_divergent_step() == 1 and cmp.first_non_match_step() == 1
    assert cmp.counts() == {"MATCH": 1, "TIE-FLIP": 1, "DRIFT": 0, "WRONG": 0}
    # the run-level rule is n/a: B is a top-3 dump, and ds4_test compares against a local top 20
    assert cmp.ds4_test() is None and "ds4_test: n/a (B lists top 3 < 20)" in cmp.summary_line()
    assert cmp.failures(["wrong"]) == [] and cmp.failures(["tie", "ds4-test"]) == ["tie"]


def test_tie_flip_becomes_wrong_with_a_tighter_margin():
    cmp = compare_runs(run("ref.ds4.json"), run("cand_tie.ds4.json"), tie_margin=0.04)
    assert cmp.steps[1].verdict == "WRONG" and cmp.failures(["wrong"]) == ["wrong"]


def test_drift_and_match():
    cmp = compare_runs(run("ref.ds4.json"), run("cand_drift.ds4.json"))
    # top-1 deltas: |−0.21+0.2| = 0.01, |−0.9+0.75| = 0.15 (> 0.1), |−0.012+0.01| = 0.002
    assert [s.verdict for s in cmp.steps] == ["MATCH", "DRIFT", "MATCH"]
    assert [s.jaccard for s in cmp.steps] == [1.0, 1.0, 1.0]
    assert cmp.steps[2].max_abs_dlogprob == pytest.approx(0.2)       # frag: -6 vs -6.2
    assert cmp.first_divergent_step() is None and cmp.first_non_match_step() == 1
    assert [s.ds4_test for s in cmp.steps] == [True, True, True]  # each step passes; the run is n/a (top 3)
    assert cmp.failures(["wrong", "tie"]) == [] and cmp.failures(["drift"]) == ["drift"]
    assert "MATCH 2, TIE-FLIP 0, DRIFT 1, WRONG 0; first divergent step: none; ds4_test: n/a" in cmp.summary_line()


def test_kl_and_js_bounds_by_hand():
    # step 0 of ref vs cand_tie: p = {16: e^-0.2, 204: e^-2.5, EOS: e^-3}, q = {16: e^-0.25, 204: e^-2.3, \n: e^-3.5}
    d = compare_runs(run("ref.ds4.json"), run("cand_tie.ds4.json")).steps[0].divergence
    P = 1 - e(-0.2) - e(-2.5)            # A's mass outside the shared tokens {16, 204}
    Q = 1 - e(-0.25) - e(-2.3)
    kl_lo = e(-0.2) * 0.05 + e(-2.5) * (-0.2) + P * math.log(P / Q)   # = 0.0048495
    assert d.kl_lower == pytest.approx(kl_lo, rel=1e-3) and d.kl_lower <= kl_lo   # Q padded by 1e-6 (rounding)
    assert d.kl_upper == math.inf         # B never listed EOS: its probability there is unbounded below

    def js(a, b):
        m = (a + b) / 2
        return (a * math.log(a / m) + b * math.log(b / m)) / 2

    shared = js(e(-0.2), e(-0.25)) + js(e(-2.5), e(-2.3))
    assert d.js_lower == pytest.approx(shared + js(P, Q), rel=1e-9)
    assert d.js_upper == pytest.approx(shared + math.log(2) / 2 * (P + Q), rel=1e-9)
    assert d.tail_ref == pytest.approx(1 - e(-0.2) - e(-2.5) - e(-3))
    assert d.tail_cand == pytest.approx(1 - e(-0.25) - e(-2.3) - e(-3.5))


def test_full_distributions_give_exact_kl():
    p = {b"a": math.log(0.5), b"b": math.log(0.3), b"c": math.log(0.2)}
    q = {b"a": math.log(0.4), b"b": math.log(0.4), b"c": math.log(0.2)}
    d = truncated_divergence(p, q)
    kl = 0.5 * math.log(0.5 / 0.4) + 0.3 * math.log(0.3 / 0.4)
    assert d.kl_lower == pytest.approx(kl) and d.kl_upper == pytest.approx(kl)
    assert d.js_lower == pytest.approx(d.js_upper, abs=1e-12)


def _top(x: np.ndarray, k: int) -> dict[bytes, float]:
    return {bytes([i]): math.log(x[i]) for i in np.argsort(-x)[:k]}


def test_bounds_bracket_the_true_divergence_for_random_truncations():
    # independent check: full softmax distributions, truncated to their own top-k like a dump
    rng = np.random.default_rng(0)
    for _ in range(300):
        V, k = int(rng.integers(4, 60)), int(rng.integers(1, 12))
        a = rng.normal(0, rng.uniform(0.5, 4), V)
        b = a + rng.normal(0, rng.uniform(0, 2), V)
        p, q = np.exp(a - np.logaddexp.reduce(a)), np.exp(b - np.logaddexp.reduce(b))
        kl = float(np.sum(p * np.log(p / q)))
        m = (p + q) / 2
        jsd = float(0.5 * np.sum(p * np.log(p / m)) + 0.5 * np.sum(q * np.log(q / m)))
        d = truncated_divergence(_top(p, k), _top(q, k))
        assert d.kl_lower <= kl + 1e-9 <= d.kl_upper + 2e-9
        assert d.js_lower - 1e-9 <= jsd <= d.js_upper + 1e-9
        assert d.js_upper <= math.log(2) + 1e-12


def test_greedy_only_reference_compares_tokens_only():
    cmp = compare_runs(run("greedy.official.json"), run("ref.ds4.json"))
    assert cmp.greedy_only and "A carries greedy tokens only" in cmp.notes[0]
    assert [s.verdict for s in cmp.steps] == ["MATCH", "MATCH", None]
    assert cmp.steps[2].note == "only in B"
    assert all(s.divergence is None and s.jaccard is None for s in cmp.steps)
    # ds4_test: the official top (selected, "logprob 0") against B's -0.2 and -0.75: within 4 nats
    assert [s.ds4_test for s in cmp.steps[:2]] == [True, True] and cmp.ds4_test() is None  # B: top 3
    assert "greedy-only (tokens compared, no logprob metrics)" in cmp.summary_line()


def test_greedy_only_wrong_token_and_missing_candidate_logprobs():
    cmp = compare_runs(run("cases.vec#wrong_case"), run("ref.ds4.json"))
    assert [s.verdict for s in cmp.steps[:2]] == ["MATCH", "WRONG"] and cmp.first_divergent_step() == 1
    assert cmp.steps[1].ds4_test is False and "selected token mismatch" in cmp.steps[1].ds4_test_detail
    assert cmp.ds4_test() is None  # B is a top-3 dump: the run-level rule is n/a, the WRONG token still fails
    back = compare_runs(run("ref.ds4.json"), run("cases.vec#match_case"))   # B has no logprobs
    assert back.ds4_test() is None and "ds4_test: n/a" in back.summary_line()
    assert back.steps[2].note == "only in A"


def test_api_eos_spelling_matches_the_vocab_eos():
    cmp = compare_runs(run("ref.ds4.json"), run("ranked.official.json"))
    # without normalising the doubled-bar EOS, step 0's Jaccard would be 2/4 and step 2 a WRONG token
    assert [s.verdict for s in cmp.steps] == ["MATCH", "MATCH", "MATCH"]
    assert cmp.steps[0].jaccard == 1.0 and cmp.steps[2].same_token
    assert cmp.steps[0].max_abs_dlogprob == pytest.approx(0.05)        # EOS: -3 vs -2.95


def test_to_dict_is_strict_json():
    import json

    d = compare_runs(run("ref.ds4.json"), run("cand_tie.ds4.json")).to_dict()
    text = json.dumps(d, allow_nan=False)
    assert '"kl_upper": "inf"' in text and d["first_divergent_step"] == 1


def test_prompt_length_mismatch_is_reported(tmp_path):
    import json

    doc = json.loads((FIX / "cand_drift.ds4.json").read_text())
    doc["prompt_tokens"] = 13
    (tmp_path / "b.json").write_text(json.dumps(doc))
    with pytest.raises(LogprobPreflightError, match="prompt_tokens differs: A 12, B 13"):
        compare_runs(run("ref.ds4.json"), read_run(tmp_path / "b.json"))
    notes = compare_runs(run("ref.ds4.json"), read_run(tmp_path / "b.json"), force=True).notes
    assert notes[0] == "forced: prompt_tokens differs: A 12, B 13" and notes[1].startswith("prompt lengths differ")
    # the official fixture's usage.prompt_tokens (12) agrees with the dump's
    assert not any("prompt lengths" in n for n in compare_runs(run("greedy.official.json"), run("ref.ds4.json")).notes)


def test_comparison_is_frozen_and_built_once():
    import dataclasses

    cmp = compare_runs(run("ref.ds4.json"), run("cand_tie.ds4.json"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        cmp.notes = ()  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cmp.steps[0].verdict = "WRONG"  # type: ignore[misc]
    assert isinstance(cmp.steps, tuple) and isinstance(cmp.notes, tuple)
    # the JSON document lists steps and notes as JSON arrays, as before the report was frozen
    d = cmp.to_dict()
    assert isinstance(d["steps"], list) and isinstance(d["notes"], list) and len(d["steps"]) == 3
