"""The round-off null's parts: Monte-Carlo twins of the reference, the binomial exceedance test, op forcing."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

from parity.bisect.search import builtin_prompt
from parity.check.null import Cell, binomial_tail, judge
from parity.contract.engine import OpForcing, RoundoffTwins, RunOptions, load_engine
from parity.contract.errors import ParityError
from reference_cpu.roundoff import SCALE, ULP, jitter


def test_jitter_is_bounded_deterministic_and_seeded():
    y = np.random.default_rng(0).standard_normal((64, 32)).astype(np.float32)
    a, b, c = jitter(y, 1, "op", 100), jitter(y, 1, "op", 100), jitter(y, 2, "op", 100)
    rel = np.abs(a.astype(np.float64) / y - 1)
    # the bound |r| * SCALE * ulp * sqrt(k), plus the float32 rounding of the product (half an ulp)
    assert rel.max() <= SCALE * ULP * math.sqrt(100) + ULP
    assert rel.max() > 0.5 * SCALE * ULP * math.sqrt(100)          # uniform r: the bound is approached
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    assert not np.array_equal(a, jitter(y, 1, "other op", 100))
    ids = np.arange(6).reshape(2, 3)
    assert jitter(ids, 1, "ids", 1) is ids                         # discrete picks are never perturbed


def test_binomial_tail_against_exact_fractions():
    cases = ((96, Fraction(1, 20), 12), (20, Fraction(1, 20), 1), (700, Fraction(1, 20), 60), (5, Fraction(1, 2), 5))
    for n, p, x in cases:
        exact = sum(math.comb(n, k) * p**k * (1 - p) ** (n - k) for k in range(x, n + 1))
        assert binomial_tail(n, float(p), x) == pytest.approx(float(exact), rel=1e-10)
    assert binomial_tail(10, 0.05, 0) == 1.0 and binomial_tail(10, 0.05, 11) == 0.0


def test_judge_counts_cells_outside_every_twin():
    twins = {"a": np.array([[1.0, 2.0, 3.0, 0.0], [2.0, 1.0, 1.0, 0.0]])}    # two twins, four cells
    cand = {"a": np.array([1.5, 2.5, 9.0, 0.0])}
    t = judge(cand, twins, {"a": np.array([10, 11, 12, 13])})
    assert (t.cells, t.exceed, t.twins) == (4, 2, 2)                      # 2.5 > 2 and 9 > 3; 0 is not > 0
    assert t.first == Cell("a", 11, 2.5, 2.0) and t.worst == Cell("a", 12, 9.0, 3.0)
    assert t.p_value == pytest.approx(binomial_tail(4, 1 / 3, 2))


@pytest.fixture(scope="module")
def ref(tiny_f32):
    return load_engine("reference", str(tiny_f32), RunOptions())


def _run(engine, tokens, layer, given=None):
    state = engine.new_state()
    x = engine.embed(tokens)
    for l in range(layer):
        x = engine.forward_layer(state, l, x, tokens, 0).carrier
    if given is None:
        return engine.forward_layer(state, layer, x, tokens, 0, capture=True)
    return engine.forward_ops(state, layer, x, tokens, 0, given)


def test_twins_share_weights_and_differ_by_round_off_only(ref, tiny_f32):
    assert isinstance(ref, RoundoffTwins) and isinstance(ref, OpForcing)
    ref = load_engine("reference", str(tiny_f32), RunOptions(fp8_kv=False, fp4_indexer=False))  # no code flips
    tokens = np.asarray(builtin_prompt(ref.config.vocab_size, ref.config.bos_token_id)[:16])
    twin = ref.roundoff_twin(3)
    assert twin.store.cache is ref.store.cache and twin.options.roundoff_seed == 3
    a, b = _run(ref, tokens, 2).carrier, _run(twin, tokens, 2).carrier
    rel = np.linalg.norm(a - b) / np.linalg.norm(a)
    assert 0 < rel < 1e-5, rel              # measured 4.4e-6 after three layers (seed 1, QAT off)
    assert ref.options.roundoff_seed is None                             # the original is untouched
    with pytest.raises(ParityError, match="roundoff_seed"):
        load_engine("torch", str(ref.weights.paths[0]), RunOptions(roundoff_seed=1))


def test_op_forcing_with_its_own_values_is_the_plain_run_and_substitutes_inputs(ref):
    tokens = np.asarray(builtin_prompt(ref.config.vocab_size, ref.config.bos_token_id)[:16])
    plain = _run(ref, tokens, 2)
    same = _run(ref, tokens, 2, dict(plain.captures))
    for name, arr in plain.captures.items():
        assert np.array_equal(arr, same.captures[name]), name
    assert np.array_equal(plain.carrier, same.carrier)
    # given the attn_norm rows shifted by one position, the row-wise ops after it (q_path, kv_latent) see the
    # shifted rows (bit-identical per row: products run in fixed row blocks), while attn_norm itself is still
    # the reference's own output
    moved = _run(ref, tokens, 2, {"attn_norm": np.roll(plain.captures["attn_norm"], 1, axis=0)})
    assert np.array_equal(moved.captures["attn_norm"], plain.captures["attn_norm"])
    for name in ("q_path", "kv_latent"):
        assert np.array_equal(moved.captures[name][1:], plain.captures[name][:-1]), name


def test_declared_sub_op_inputs_are_sub_op_outputs():
    # the dataflow is declared once, as data: every input of a sub-op is another sub-op's capture, an HC mix or
    # the layer's carrier, and every sub-op is declared
    from parity.contract.checkpoints import SUBOP_INPUTS, SUBOPS

    captures = {c for _, caps in SUBOPS for c in caps}
    mixes = {f"{w}.{m}" for w in ("hc_attn", "hc_ffn") for m in ("post", "comb")}
    assert set(SUBOP_INPUTS) == {name for name, _ in SUBOPS}
    assert {i for inputs in SUBOP_INPUTS.values() for i in inputs} <= captures | mixes | {"carrier"}


def test_a_variant_shares_the_cache_and_computes_as_a_new_engine(ref, tiny_f32):
    from parity.contract.engine import Variants

    assert isinstance(ref, Variants)
    tokens = np.asarray(builtin_prompt(ref.config.vocab_size, ref.config.bos_token_id)[:16])
    options = RunOptions(act_quant="q8_0", rope_angles="recurrence")
    var, new = ref.variant(options), load_engine("reference", str(tiny_f32), options)
    assert var.store.cache is ref.store.cache and var.options == options and ref.options == RunOptions()
    assert np.array_equal(_run(var, tokens, 2).carrier, _run(new, tokens, 2).carrier)
    assert not np.array_equal(_run(var, tokens, 2).carrier, _run(ref, tokens, 2).carrier)
    with pytest.raises(ParityError, match="cannot change dtype"):
        ref.variant(RunOptions(dtype="float64"))
