"""`parity.validate` pure parts: ENGINE:OPTS specs, bootstrap CIs and MDEs against closed forms, budgets,
boundary prompts from the model's constants, the JSONL store."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from parity.gguf.synth import preset_config
from parity.validate import stats
from parity.validate.budget import BudgetError, check_names, judge, parse_budget
from parity.validate.prompts import PromptError, boundary_prompts, boundary_shapes, build_prompts
from parity.validate.spec import SpecError, approx_keys, explicit_exact, parse_spec
from parity.validate.store import CONFIG, RESULTS, ResultWriter, StoreError, read_config, read_results, start
from parity.validate.summary import metric_names, summarize

Z975, Z80 = 1.959963984540054, 0.8416212335729143  # standard normal quantiles (tables)


# ---------------------------------------------------------------- specs

def test_spec_parses_typed_options_in_canonical_order():
    s = parse_spec("torch:act_quant=q8_0,fp8_kv=false,dtype=bfloat16")
    assert s.engine == "torch"
    assert s.text() == "torch:fp8_kv=false,dtype=bfloat16,act_quant=q8_0"
    o = s.options
    assert (o.fp8_kv, o.dtype, o.act_quant, o.fp4_indexer) == (False, "bfloat16", "q8_0", True)
    assert parse_spec("reference").options == parse_spec("reference:act_quant=none").options


@pytest.mark.parametrize("text, words", [
    ("torch:flash=on", "unknown option 'flash'"), ("torch:fp8_kv=no", "expected true or false"),
    ("torch:act_quant=q4", "expected one of none, q8_0"), ("torch:dtype=f16", "expected one of float32"),
    ("torch:act_quant=q8_0,act_quant=none", "given twice"), ("torch:act_quant", "is not key=value"),
    (":dtype=float32", "expected ENGINE"), ("torch:cache_gb=lots", "expected a number"),
    ("torch:inject=x", "unknown option 'inject'"),
])
def test_spec_errors_name_the_problem(text, words):
    with pytest.raises(SpecError, match=words):
        parse_spec(text)


def test_explicit_exact_sets_each_approximate_option_to_the_exact_value():
    exact, approx = parse_spec("torch"), parse_spec("torch:act_quant=q8_0,dtype=bfloat16,fp8_kv=false")
    assert approx_keys(exact, approx) == {"dtype": "bfloat16", "act_quant": "q8_0"}
    e = explicit_exact(exact, approx)
    assert e.text() == "torch:fp8_kv=false,dtype=float32,act_quant=none"


# ---------------------------------------------------------------- CIs and MDE against closed forms

def _binom_cdf(j: int, n: int, p: float) -> float:
    return sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(j + 1))


def _binom_quantile(q: float, n: int, p: float) -> float:
    """Smallest j/n with P(K <= j) >= q, K ~ Binomial(n, p)."""
    return next(j for j in range(n + 1) if _binom_cdf(j, n, p) >= q) / n


def test_bootstrap_ci_of_a_proportion_is_the_binomial_quantiles():
    # the bootstrap distribution of the mean of n 0/1 values with k ones is exactly Binomial(n, k/n)/n, so the
    # percentile CI must sit at its 2.5 % / 97.5 % quantiles up to the Monte Carlo error of B = 2000 resamples:
    # sd of an empirical CDF value sqrt(q(1-q)/B) = 0.0035; the bounds are checked at q -/+ 4 sd
    n, k = 200, 20
    x = np.r_[np.ones(k), np.zeros(n - k)]
    lo, hi = stats.mean_ci(x, stats.resamples(n, seed=3))
    mc = 4 * math.sqrt(0.025 * 0.975 / stats.BOOTSTRAP)
    assert _binom_quantile(0.025 - mc, n, k / n) <= lo <= _binom_quantile(0.025 + mc, n, k / n)
    assert _binom_quantile(0.975 - mc, n, k / n) <= hi <= _binom_quantile(0.975 + mc, n, k / n)


def test_bootstrap_ci_of_a_mean_has_the_normal_half_width():
    # closed form: the bootstrap sd of a mean is s_ML / sqrt(n); the 95 % percentile CI is +-1.96 of it around
    # the mean (CLT). Measured: half-width 2.9 % narrow, centre 0.018 half-widths off (seed 5, n = 400,
    # B = 2000: the Monte Carlo error of two percentiles); bounds 4 % and 0.03
    rng = np.random.default_rng(0)
    x = rng.standard_normal(400)
    lo, hi = stats.mean_ci(x, stats.resamples(len(x), seed=5))
    half = Z975 * x.std() / math.sqrt(len(x))
    assert abs((hi - lo) / 2 / half - 1) < 0.04
    assert abs((hi + lo) / 2 - x.mean()) < 0.03 * half


def test_bootstrap_is_seeded_and_deterministic():
    x = np.random.default_rng(1).standard_normal(50)
    a = stats.mean_ci(x, stats.resamples(50, seed=7))
    assert a == stats.mean_ci(x, stats.resamples(50, seed=7))
    assert a != stats.mean_ci(x, stats.resamples(50, seed=8))
    assert stats.mean_ci(np.full(30, 0.25), stats.resamples(30, seed=0)) == (0.25, 0.25)


def test_mde_of_a_mean_is_the_closed_form():
    x = np.random.default_rng(2).exponential(size=123)
    assert stats.mde_mean(x) == pytest.approx((Z975 + Z80) * x.std(ddof=1) / math.sqrt(123), rel=1e-12)
    assert stats.mde_mean(np.zeros(10)) is None     # no spread: no claim
    assert stats.mde_mean(np.ones(1)) is None


@pytest.mark.parametrize("n", [20, 200, 1000])
def test_mde_of_a_zero_rate_is_one_minus_beta_to_the_one_over_n(n):
    # at p0 = 0 any divergence rejects, so power = 1 - (1 - p)^n = 0.8  =>  p = 1 - 0.2^(1/n)
    assert stats.mde_proportion(0, n) == pytest.approx(1 - 0.2 ** (1 / n), abs=1e-12)


def test_mde_of_a_nonzero_rate_reaches_power_exactly_there():
    n, k = 200, 10
    mde = stats.mde_proportion(k, n)
    p0 = k / n
    c = next(c for c in range(n + 1) if 1 - _binom_cdf(c - 1, n, p0) <= 0.025)  # the test's critical count

    def power(p):
        return 1 - _binom_cdf(c - 1, n, p)
    assert power(p0 + mde) == pytest.approx(0.8, abs=1e-9)
    assert power(p0 + mde - 1e-4) < 0.8
    assert stats.binom_sf(c, n, p0 + mde) == pytest.approx(power(p0 + mde), rel=1e-9)


# ---------------------------------------------------------------- budget

def test_budget_uses_the_ci_bound_not_the_point_estimate():
    bounds = parse_budget("# comment\ndivergence_rate <= 0.05\n\ntop1_agreement >= 0.99  # lower bound\n")
    agg = {"divergence_rate": {"value": 0.03, "ci": [0.01, 0.08]}, "top1_agreement": {"value": 0.995,
                                                                                       "ci": [0.991, 0.999]}}
    rows = judge(bounds, agg)
    assert [(r["metric"], r["ci_bound"], r["passed"]) for r in rows] == [
        ("divergence_rate", 0.08, False), ("top1_agreement", 0.991, True)]


@pytest.mark.parametrize("text, words", [("kl_mean < 1", "expected 'metric <= value'"),
                                         ("kl_mean <= lots", "is not a number"), ("kl_mean <= inf", "not finite"),
                                         ("# nothing\n", "no bounds")])
def test_budget_errors(text, words):
    with pytest.raises(BudgetError, match=words):
        parse_budget(text, "b.txt")


def test_budget_unknown_metric_is_an_error():
    names = metric_names(6)
    assert {"kl_mean", "rel_l2.blk.5.p99", "divergence_rate"} <= names
    check_names(parse_budget("rel_l2.blk.5.p99 <= 1"), names)
    with pytest.raises(BudgetError, match="unknown metric 'kl_avg'"):
        check_names(parse_budget("kl_avg <= 1"), names)


# ---------------------------------------------------------------- summary on hand-made records

def _record(i, verdicts, kl, layers, digest_approx="b", first=None):
    return {"index": i, "verdict": verdicts, "kl": kl, "layer_rel_l2": layers,
            "first_divergent_step": first, "first_divergent_class": None if first is None else verdicts[first],
            "digest_exact": "a", "digest_approx": digest_approx, "announced": {"act_quant": True},
            "flags_exact": {"dtype": "float32", "act_quant": "none", "kv_cache": "f32", "rope_angles": "exact"},
            "flags_approx": {"dtype": "float32", "act_quant": "q8_0", "kv_cache": "f32", "rope_angles": "exact"}}


def test_summary_aggregates_are_the_hand_counted_rates():
    recs = [_record(0, ["MATCH", "TIE-FLIP", "MATCH", "MATCH"], [0.0, 0.4, 0.0, 0.0], [0.1, 0.2], first=1),
            _record(1, ["MATCH", "DRIFT", "WRONG", "MATCH"], [0.0, 0.1, 0.3, 0.0], [0.3, 0.4], first=2),
            _record(2, ["MATCH"] * 4, [0.0, 0.0, 0.0, 0.2], [0.5, 0.6]),
            _record(3, ["MATCH"] * 4, [0.0] * 4, [0.7, 0.8])]
    s = summarize(recs[::-1], [], seed=0, explicit=None, bounds=None)
    a = s["aggregates"]
    assert a["divergence_rate"]["value"] == 0.5
    assert a["wrong_rate"]["value"] == 0.25
    assert a["step_divergence_rate"]["value"] == 2 / 16
    assert a["top1_agreement"]["value"] == 14 / 16
    assert a["step_drift_rate"]["value"] == 1 / 16
    assert a["kl_mean"]["value"] == pytest.approx(1.0 / 16)
    assert a["kl_max"]["value"] == 0.4
    assert a["rel_l2.blk.1.max"]["value"] == 0.8
    assert a["rel_l2.blk.0.mean"]["value"] == pytest.approx(0.4)
    assert s["divergence"]["classes"] == {"TIE-FLIP": 1, "WRONG": 1}
    assert s["divergence"]["first_step_histogram"] == [0, 1, 1, 0]
    assert s["divergence"]["first_step_median"] == 1.5
    assert s["passed"]
    lo, hi = a["divergence_rate"]["ci"]
    assert 0 <= lo <= 0.5 <= hi <= 1


def test_summary_silent_approximation_and_unannounced_mode():
    silent = [{**_record(i, ["MATCH"], [0.0], [0.1]), "flags_approx": _record(0, [], [], [])["flags_exact"],
               "announced": {}} for i in range(3)]
    s = summarize(silent, [], 0, None, None)
    assert not s["passed"] and s["findings"][0].startswith("silent approximation")
    mute = [{**_record(i, ["MATCH"], [0.0], [0.1]), "announced": {"act_quant": False}} for i in range(3)]
    s = summarize(mute, [], 0, None, None)
    assert s["findings"] == ["announce pin: the engine did not name act_quant=q8_0 on stderr (declared in the "
                             "header flags)"]


# ---------------------------------------------------------------- prompts

@pytest.fixture(scope="module")
def tiny_cfg():
    return preset_config("tiny", 385)


def test_boundary_shapes_straddle_the_model_constants(tiny_cfg):
    cfg = tiny_cfg
    W, k = cfg.window_size, cfg.index_topk     # 8, 4; ratios 4 (CSA, indexer) and 128 (HCA)
    listed = boundary_shapes(cfg, decode=8)
    shapes = {name: s for s in listed for name in s.name.split("|")}
    unchunked = {s.length for s in shapes.values() if s.chunk is None}
    assert {W - 1, W, W + 1} <= unchunked
    for r in (4, 128):  # complete and incomplete groups around the first two blocks (duplicates kept once)
        assert {r - 1, r, r + 1, 2 * r - 1, 2 * r, 2 * r + 1} <= unchunked
    first = shapes["indexer4+0"].length
    assert first // 4 == k + 1 and (first - 1) // 4 == k   # the first length with more rows than top-k
    c = shapes[f"chunk{W + 1}"]
    assert c.chunk == W + 1 and c.length == 2 * (W + 1) + 1
    assert shapes["decode-past-window"].length + 8 > W > shapes["decode-past-window"].length
    assert len({(s.length, s.chunk) for s in listed}) == len(listed)


def test_boundary_prompts_are_seeded_distinct_and_start_with_bos(tiny_cfg):
    a = boundary_prompts(tiny_cfg, 40, 8, seed=1)
    assert a == boundary_prompts(tiny_cfg, 40, 8, seed=1)
    assert a != boundary_prompts(tiny_cfg, 40, 8, seed=2)
    assert len({p.tokens for p in a}) == 40
    assert all(p.tokens[0] == tiny_cfg.bos_token_id and min(p.tokens[1:]) >= 2 for p in a)
    assert [p.index for p in a] == list(range(40))


def test_prompt_file_forms_and_errors(tiny_cfg, tmp_path, tiny_f32):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"tokens": [0, 5, 6]}) + "\n\n" + json.dumps({"text": "hello"}) + "\n")
    ps = build_prompts(tiny_cfg, tiny_f32, 2, 4, 0, f, boundary=False)
    assert ps[0].tokens == (0, 5, 6) and ps[0].source == "tokens:p.jsonl:1"
    assert ps[1].source == "text:p.jsonl:3" and len(ps[1].tokens) > 3
    mixed = build_prompts(tiny_cfg, tiny_f32, 5, 4, 0, f, boundary=True)
    assert [p.source.split(":")[0] for p in mixed] == ["tokens", "text", "boundary", "boundary", "boundary"]
    with pytest.raises(PromptError, match="2 prompts, 3 needed"):
        build_prompts(tiny_cfg, tiny_f32, 3, 4, 0, f, boundary=False)
    f.write_text('{"tokens": [0, 999]}\n')
    with pytest.raises(PromptError, match=r"out of range \[0, 385\)"):
        build_prompts(tiny_cfg, tiny_f32, 1, 4, 0, f, boundary=False)
    f.write_text('{"text": "a", "tokens": [1]}\n')
    with pytest.raises(PromptError, match="exactly one of 'text' or 'tokens'"):
        build_prompts(tiny_cfg, tiny_f32, 1, 4, 0, f, boundary=False)
    with pytest.raises(PromptError, match="no prompt source"):
        build_prompts(tiny_cfg, tiny_f32, 1, 4, 0, None, boundary=False)


# ---------------------------------------------------------------- store

def test_results_survive_a_cut_last_line(tmp_path):
    start(tmp_path, {"x": 1})
    w = ResultWriter(tmp_path)
    w.add({"kind": "main", "index": 0})
    w.add({"kind": "main", "index": 1})
    w.close()
    with open(tmp_path / RESULTS, "ab") as f:
        f.write(b'{"kind": "ma')                       # a write cut by a crash
    assert read_results(tmp_path) == [{"kind": "main", "index": 0}, {"kind": "main", "index": 1}]
    assert (tmp_path / RESULTS).read_bytes().endswith(b"}\n")
    with pytest.raises(StoreError, match="already holds a validation run"):
        start(tmp_path, {"x": 1})


def test_a_corrupt_config_is_a_store_error_on_resume(tmp_path):
    start(tmp_path, {"x": 1})
    assert read_config(tmp_path) == {"x": 1}
    (tmp_path / CONFIG).write_text('{"x": ')
    with pytest.raises(StoreError, match="cannot read config.json"):
        read_config(tmp_path)
    (tmp_path / CONFIG).write_text("[1]")
    with pytest.raises(StoreError, match="not a JSON object"):
        read_config(tmp_path)


def test_non_finite_values_are_stored_as_strings_and_never_pass_a_budget(tmp_path):
    start(tmp_path, {"x": 1})
    w = ResultWriter(tmp_path)
    w.add({"kind": "main", "kl": [0.1, float("inf")], "rel": float("nan")})
    w.close()
    assert (tmp_path / RESULTS).read_text() == '{"kind": "main", "kl": [0.1, "inf"], "rel": "nan"}\n'
    recs = [_record(0, ["MATCH", "MATCH"], [0.1, "inf"], ["nan", 0.2]),
            _record(1, ["MATCH"] * 2, [0.0, 0.0], [0.1, 0.2])]
    s = summarize(recs, [], 0, None, parse_budget("kl_max <= 1e9\nrel_l2.blk.0.max <= 1e9\ntop1_agreement >= 0.5\n"))
    assert s["aggregates"]["kl_max"]["value"] == math.inf
    assert math.isnan(s["aggregates"]["rel_l2.blk.0.max"]["value"])
    assert [b["passed"] for b in s["budget"]] == [False, False, True]


def test_indexer_boundary_prompts_cross_the_top_k_in_a_real_engine(tiny_realmix):
    # independent of the shape arithmetic: the torch engine's own diagnostics say how many compressed rows the
    # CSA layer's last prompt position sees; the indexer becomes selective exactly on the "indexer4+0" prompt
    from parity.contract.engine import RunOptions, load_engine
    from parity.gguf.weights import Weights
    from parity.tracing.runner import run_sequence

    cfg = Weights(tiny_realmix).config
    eng = load_engine("torch", str(tiny_realmix), RunOptions())
    csa = next(l for l in range(cfg.n_layers) if cfg.has_indexer(l))
    prompts = {p.source.split(":", 1)[1]: p for p in boundary_prompts(cfg, 19, decode=8, seed=0)}
    seen = {}
    for name in ("indexer4-1", "indexer4+0"):
        res = run_sequence(eng, prompts[name].tokens)
        seen[name] = int(res[-1].diags[csa].n_comp_visible[-1])
    assert seen == {"indexer4-1": cfg.index_topk, "indexer4+0": cfg.index_topk + 1}


def test_validate_report_json_spelling_is_json_safe_under_to_dict():
    """One JSON spelling (issue 26.3): `to_dict()` on the typed report, non-finite values as the strings
    "inf" / "nan" (`parity.compare.jsonvalues.json_safe`), never the non-JSON Infinity/NaN tokens."""
    import dataclasses

    from parity.validate.report import render_json
    from parity.validate.result import Timing, ValidateReport

    timing = Timing("in-process", 1.0, 1, 1, 1.0, 1.0, 1.0, 1.0)
    agg = {"kl_max": {"value": np.float64(np.inf), "ci": (np.float64(np.nan), 1.0), "mde": None, "n": 1}}
    r = ValidateReport(format="v4parity-validate", version=1, model={"file": "m.gguf"}, exact="a", approx="b", n=1,
                       prompt_sources="text 1", decode=0, steps=1, seed=0, top_k=20, tie_margin=0.1, drift_tol=0.1,
                       bootstrap=2000, alpha=0.05, beta=0.2, aggregates=agg, divergence={}, pins={}, budget=None,
                       passed=True, findings=[], records=[], timing=timing)
    d = r.to_dict()
    assert d["aggregates"]["kl_max"] == {"value": "inf", "ci": ["nan", 1.0], "mde": None, "n": 1}
    assert "timing" not in d and set(d) == {f.name for f in dataclasses.fields(r)} - {"timing"}
    text = render_json(r)
    assert json.loads(text) == d and "Infinity" not in text and "NaN" not in text
    assert r == dataclasses.replace(r, timing=Timing("Ray (local, 2 CPUs)", 9.0, 0, 1, 1.0, 1.0, 1.0, 1.0))
