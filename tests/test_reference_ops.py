"""Per-op checks of reference_cpu against closed forms, invariants, hand-computed values and second implementations."""

from __future__ import annotations

import math

import numpy as np
import pytest

from reference_cpu.attention import attend, grouped_output, key_set, sink_attention
from reference_cpu.compressor import compressor_project, compressor_update, csa_pool, hca_pool
from reference_cpu.hc import hc_post, hc_pre, sinkhorn
from reference_cpu.indexer import indexer_scores, select_rows, topk_lowest_index
from reference_cpu.moe import hash_select, routing_weights, select_topk, swiglu_clamped
from reference_cpu.quant_sim import (
    count_code_flips,
    e2m1_codes,
    e2m1_round,
    e4m3_codes,
    e4m3_round,
    fp4_e2m1_roundtrip,
    fp8_e4m3_roundtrip,
    fp8_sim_nope,
    hadamard,
    hadamard_matrix,
)
from reference_cpu.rope import RopeSpec, RopeTable, apply_rope, rope_frequencies, rotate_pairs, yarn_ramp_bounds
from reference_cpu.state import CompressorState
from reference_cpu.threads import Workers

RNG = np.random.default_rng(1234)
SERIAL = Workers(1)


# ---------------------------------------------------------------------------------------- hyper-connections


def sinkhorn_loops(Z: np.ndarray, iters: int, eps: float) -> np.ndarray:
    """Element-by-element Sinkhorn written from the spec text (§8.1 step 6), one 4x4 matrix."""
    n = Z.shape[0]
    C = np.zeros_like(Z)
    for r in range(n):
        mx = max(Z[r])
        den = sum(math.exp(Z[r][c] - mx) for c in range(n))
        for c in range(n):
            C[r][c] = math.exp(Z[r][c] - mx) / den + eps
    for it in range(iters):
        if it > 0:
            rows = [sum(C[r]) for r in range(n)]
            C = np.array([[C[r][c] / (rows[r] + eps) for c in range(n)] for r in range(n)])
        cols = [sum(C[r][c] for r in range(n)) for c in range(n)]
        C = np.array([[C[r][c] / (cols[c] + eps) for c in range(n)] for r in range(n)])
    return C


def test_sinkhorn_matches_loop_version_and_columns_sum_to_one():
    Z = RNG.normal(0, 2, (5, 4, 4))
    C = sinkhorn(Z, 20, 1e-6)
    for i in range(5):
        np.testing.assert_allclose(C[i], sinkhorn_loops(Z[i], 20, 1e-6), rtol=1e-12, atol=0)
    # last step is a column normalisation: every column sums to S/(S+eps), i.e. 1 to ~1e-6
    np.testing.assert_allclose(C.sum(axis=-2), 1.0, atol=2e-6)
    assert (C > 0).all()


def test_sinkhorn_converges_to_doubly_stochastic():
    Z = RNG.normal(0, 2, (20, 4, 4))
    dev = [np.abs(sinkhorn(Z, k, 1e-6).sum(axis=-1) - 1).max() for k in (1, 5, 20, 300)]
    assert dev[0] > dev[1] > dev[2] > dev[3]
    assert dev[3] < 1e-5


def test_hc_post_uses_transposed_comb():
    """With streams X[r] = e_r (D = H), X'[c][r] = C[r, c]: the result is Cᵀ, not C."""
    H = 4
    C = RNG.uniform(0, 1, (1, H, H))
    X = np.eye(H)[None]
    out = hc_post(np.zeros((1, H)), X, np.zeros((1, H)), C)
    np.testing.assert_allclose(out[0], C[0].T, rtol=0, atol=0)
    assert not np.allclose(out[0], C[0])
    y = RNG.normal(size=(1, H))
    post = np.array([[0.5, 1.0, 1.5, 2.0]])
    out = hc_post(y, np.zeros((1, H, H)), post, C)
    np.testing.assert_allclose(out[0], post[0][:, None] * y[0][None, :], rtol=1e-15)


def test_hc_pre_collapses_equal_streams_to_pre_sum_times_row():
    H, D = 4, 32
    e = RNG.normal(size=D)
    X = np.repeat(e[None, None, :], H, axis=1)
    fn = RNG.normal(0, 0.1, (24, H * D))
    u, pre, post, _ = hc_pre(X, fn, np.array([1.0, 1.0, 1.0]), RNG.normal(size=24), 1e-6, 1e-6, 20)
    np.testing.assert_allclose(u[0], pre[0].sum() * e, rtol=1e-12)
    assert ((pre > 1e-6) & (pre < 1 + 1e-6)).all() and ((post > 0) & (post < 2)).all()
    # the mix norm is over the flattened carrier (ε_rms = 0 here): scaling all of X leaves the gates unchanged,
    # scaling one stream does not
    X2 = RNG.normal(size=(1, H, D))
    one = np.array([1.0, 1.0, 1.0])
    pre1 = hc_pre(X2, fn, one, np.zeros(24), 0.0, 1e-6, 20)[1]
    np.testing.assert_allclose(hc_pre(3 * X2, fn, one, np.zeros(24), 0.0, 1e-6, 20)[1], pre1, rtol=1e-12)
    X3 = X2.copy()
    X3[0, 0] *= 3
    manual = (X3.reshape(-1) @ fn.T) / math.sqrt(np.mean(X3**2))
    np.testing.assert_allclose(hc_pre(X3, fn, one, np.zeros(24), 0.0, 0.0, 20)[1][0], 1 / (1 + np.exp(-manual[:4])),
                               rtol=1e-12)


# ---------------------------------------------------------------------------------------------------- RoPE

YARN = dict(yarn=True, factor=16.0, original_seq_len=65536, beta_fast=32.0, beta_slow=1.0)


def table(rope_dim: int, base: float, **yarn) -> RopeTable:
    """A float64 exact-angle table (the oracle's: float32 recipe frequencies, angles in float64)."""
    return RopeTable.build(RopeSpec(rope_dim, base, **(yarn or {"yarn": False})), np.dtype(np.float64), "exact")


def test_yarn_frequencies_match_the_spec_table():
    comp = rope_frequencies(RopeSpec(64, 160000.0, **YARN))
    swa = rope_frequencies(RopeSpec(64, 10000.0, yarn=False))
    idx = [0, 8, 15, 16, 20, 24, 25, 31]
    table_comp = [1, 0.05, 3.63553858e-3, 2.265625e-3, 2.96977778e-4, 1.953125e-5, 5.37231267e-6, 5.68052904e-7]
    table_swa = [1, 0.1, 1.33352143e-2, 0.01, 3.16227766e-3, 1e-3, 7.49894209e-4, 1.33352143e-4]
    # the spec's table is fp64; the float32 recipe is off the fp64 values by at most 1.64e-7 (YaRN) / 7.0e-8 (SWA)
    # relative over all 32 pairs (measured: 9 and 10 pairs are 1-2 float32 ulps away from fp64 rounded once)
    np.testing.assert_allclose(comp[idx], table_comp, rtol=2e-7)
    np.testing.assert_allclose(swa[idx], table_swa, rtol=1e-7)
    assert yarn_ramp_bounds(64, 160000.0, 65536, 32.0, 1.0) == (15, 25)


def test_rope_inverse_is_identity_and_norm_preserving():
    x = RNG.normal(size=(6, 3, 96))
    pos = np.arange(6) * 1000 + 7
    f = table(32, 160000.0, **YARN)
    y = apply_rope(x, pos, f)
    np.testing.assert_allclose(apply_rope(y, pos, f, inverse=True), x, atol=1e-12)
    np.testing.assert_allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-12)
    np.testing.assert_array_equal(y[..., :64], x[..., :64])  # nope dims untouched


def test_rope_interleaved_pairs_hand_case():
    x = np.zeros((1, 8))
    x[0, 4] = 1.0                       # pair 0 of the trailing 4 dims: (a, b) = (1, 0)
    x[0, 7] = 1.0                       # pair 1: (a, b) = (0, 1)
    y = rotate_pairs(x, np.array([[1.0, 0.5]]))
    np.testing.assert_allclose(y[0], [0, 0, 0, 0, math.cos(1.0), math.sin(1.0), -math.sin(0.5), math.cos(0.5)],
                               atol=1e-15)


def test_rope_scores_depend_only_on_relative_offset():
    f = table(32, 10000.0)
    q, k = RNG.normal(size=(1, 96)), RNG.normal(size=(1, 96))
    dots = [(apply_rope(q, np.array([s + d]), f) @ apply_rope(k, np.array([t + d]), f).T).item()
            for s, t in ((9, 4),) for d in (0, 17, 1000)]
    np.testing.assert_allclose(dots, dots[0], rtol=1e-10)


# ------------------------------------------------------------------------------------------ quantization sims


def e4m3_grid() -> np.ndarray:
    """The 127 non-negative e4m3fn values, listed from the format definition."""
    sub = [k * 2.0**-9 for k in range(8)]
    normal = [(1 + k / 8) * 2.0**e for e in range(-6, 9) for k in range(8)]
    return np.array(sorted(v for v in sub + normal if v <= 448))


def test_e4m3_grid_is_fixed_by_round_and_hand_ties():
    grid = e4m3_grid()
    assert len(grid) == 127 and grid[-1] == 448
    np.testing.assert_array_equal(e4m3_round(grid), grid)
    np.testing.assert_array_equal(e4m3_round(-grid), -grid)
    # ties go to the even mantissa
    cases = {1.0625: 1.0, 1.1875: 1.25, 17.0: 16.0, 19.0: 20.0, 400.0: 384.0, 432.0: 448.0,
             2.0**-10: 0.0, 3 * 2.0**-10: 2.0**-8, 5 * 2.0**-10: 2.0**-8, 0.3: 0.3125, 100.0: 96.0}
    got = e4m3_round(np.array(list(cases)))
    np.testing.assert_array_equal(got, list(cases.values()))


def test_e4m3_round_is_nearest_grid_value():
    grid = e4m3_grid()
    v = RNG.uniform(0, 448, 20000) * RNG.choice([1e-3, 1e-1, 1.0], 20000)
    got = e4m3_round(v)
    d = np.abs(v[:, None] - grid[None, :])
    np.testing.assert_allclose(np.abs(got - v), d.min(axis=1), rtol=0, atol=0)


def test_e2m1_hand_values():
    v = np.array([0.25, 0.75, 1.75, 2.5, 3.5, 5.0, 6.0, -0.75, -5.0, 1.25, 0.2])
    np.testing.assert_array_equal(e2m1_round(v), [0.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -1.0, -4.0, 1.0, 0.0])


def test_fp8_roundtrip_scales_are_powers_of_two_and_values_on_grid():
    x = RNG.normal(0, 3, (10, 128)).astype(np.float32)
    y = fp8_e4m3_roundtrip(x)
    for blk_x, blk_y in zip(x.reshape(-1, 64), y.reshape(-1, 64), strict=True):
        s = 2.0 ** math.ceil(math.log2(np.abs(blk_x).max() / 448))
        assert np.isin(np.abs(blk_y.astype(np.float64)) / s, e4m3_grid()).all()
    np.testing.assert_array_equal(fp8_e4m3_roundtrip(np.zeros((1, 64), np.float32)), 0)  # amax floor, no NaN
    kv = RNG.normal(size=(3, 96))
    out = fp8_sim_nope(kv, 64)
    np.testing.assert_array_equal(out[:, 64:], kv[:, 64:])
    assert not np.array_equal(out[:, :64], kv[:, :64])


def test_fp4_roundtrip_values_on_scaled_grid():
    x = RNG.normal(size=(7, 64))
    y = fp4_e2m1_roundtrip(x)
    grid = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])
    for blk_x, blk_y in zip(x.reshape(-1, 32), y.reshape(-1, 32), strict=True):
        s = 2.0 ** math.ceil(math.log2(np.abs(blk_x).max() / 6))
        assert np.isin(np.abs(blk_y) / s, grid).all()
        assert np.abs(blk_y).max() <= 6 * s


def test_codes_index_the_grid_and_count_flips():
    grid = e4m3_grid()
    block = np.concatenate([grid[:63], [448.0]])[None]  # amax 448 -> scale 2^0
    codes, k = e4m3_codes(block)
    np.testing.assert_array_equal(codes[0, :63], np.arange(63))
    assert codes[0, 63] == 126 and k[0, 0] == 0
    neg_codes, _ = e4m3_codes(-block)
    np.testing.assert_array_equal(neg_codes[0, 1:63], 128 + np.arange(1, 63))
    other = block.copy()
    other[0, 10] = grid[11]
    assert count_code_flips(e4m3_codes(block), e4m3_codes(other)) == 1
    c4, _ = e2m1_codes(np.array([[0, 0.5, 1, 1.5, 2, 3, 4, 6] * 4]))
    np.testing.assert_array_equal(c4[0, :8], np.arange(8))


def butterfly(u: np.ndarray) -> np.ndarray:
    """In-place Walsh-Hadamard butterfly with strides 1, 2, 4, ... then 1/√n (spec §6.2, second implementation)."""
    u = u.copy()
    n, h = len(u), 1
    while h < n:
        for i in range(0, n, 2 * h):
            for j in range(i, i + h):
                u[j], u[j + h] = u[j] + u[j + h], u[j] - u[j + h]
        h *= 2
    return u / math.sqrt(n)


def test_hadamard_orthonormal_symmetric_and_equals_butterfly():
    H = hadamard_matrix(128)
    np.testing.assert_allclose(H @ H.T, np.eye(128), atol=1e-13)
    np.testing.assert_array_equal(H, H.T)
    u = RNG.normal(size=128)
    np.testing.assert_allclose(hadamard(u), butterfly(u), atol=1e-13)
    np.testing.assert_allclose(hadamard(hadamard(u)), u, atol=1e-13)


# ------------------------------------------------------------------------------------------------ attention


def test_sink_attention_weights_sum_below_one_and_softmax_without_sink():
    keys = RNG.normal(size=(9, 16))
    keys[:, -1] = 1.0  # value column of ones reads out Σ_s p_s
    q = RNG.normal(size=(3, 16))
    sink = np.array([0.5, -1.0, 2.0])
    o = sink_attention(q, keys, sink, 0.25)
    assert ((o[:, -1] > 0) & (o[:, -1] < 1)).all()
    z = q @ keys.T * 0.25
    p = np.exp(z) / (np.exp(sink)[:, None] + np.exp(z).sum(-1, keepdims=True))
    np.testing.assert_allclose(o, p @ keys, rtol=1e-12)
    o_inf = sink_attention(q, keys, np.full(3, -np.inf), 0.25)
    soft = np.exp(z) / np.exp(z).sum(-1, keepdims=True)
    np.testing.assert_allclose(o_inf, soft @ keys, rtol=1e-12)
    # every logit far below the sink: the output vanishes instead of turning into NaN (spec §14.7)
    vanish = sink_attention(-1e4 * np.abs(q), np.abs(keys), np.zeros(3), 1.0)
    assert np.isfinite(vanish).all() and np.abs(vanish).max() < 1e-30


def test_key_set_window_and_compressed_visibility():
    W, hd = 8, 4
    raw = np.arange(40)[:, None] * np.ones((1, hd))       # row value = its position
    comp = 1000 + np.arange(10)[:, None] * np.ones((1, hd))
    for t in (0, 3, 7, 8, 30):
        keys = key_set(t, raw, 0, W, comp, 4, None)
        raw_part = keys[keys[:, 0] < 1000, 0]
        np.testing.assert_array_equal(raw_part, np.arange(max(0, t - W + 1), t + 1))  # W tokens incl. self
        comp_part = keys[keys[:, 0] >= 1000, 0] - 1000
        np.testing.assert_array_equal(comp_part, [j for j in range(10) if (j + 1) * 4 <= t + 1])
    keys = key_set(9, raw[2:], 2, W, comp, 4, np.array([2, 0, -1]))
    np.testing.assert_array_equal(keys[:, 0], [*range(2, 10), 1002, 1000])


def test_attend_chunk_equals_single_queries_exactly():
    """Same q and the same (quantized) rows: a chunk and one-query calls give bit-identical outputs."""
    n, nh, hd, W = 12, 3, 16, 5
    q = RNG.normal(size=(n, nh, hd)).astype(np.float32)
    raw = RNG.normal(size=(n + 4, hd)).astype(np.float32)
    comp = RNG.normal(size=(4, hd)).astype(np.float32)
    sink = RNG.normal(size=nh).astype(np.float32)
    pos = 4 + np.arange(n)
    full = attend(q, pos, raw, 0, W, comp, 4, None, sink, 0.25, SERIAL)
    for i in range(n):
        one = attend(q[i : i + 1], pos[i : i + 1], raw[: pos[i] + 1], 0, W, comp, 4, None, sink, 0.25, SERIAL)
        np.testing.assert_array_equal(one[0], full[i])


def test_grouped_output_is_block_diagonal_projection():
    n, nh, hd, G, R, D = 3, 4, 6, 2, 5, 7
    o = RNG.normal(size=(n, nh, hd))
    wo_a, wo_b = RNG.normal(size=(G * R, nh * hd // G)), RNG.normal(size=(D, G * R))
    dense = np.zeros((G * R, nh * hd))
    gw = nh * hd // G
    for g in range(G):
        dense[g * R : (g + 1) * R, g * gw : (g + 1) * gw] = wo_a[g * R : (g + 1) * R]
    np.testing.assert_allclose(grouped_output(o, wo_a, wo_b, G, SERIAL), (o.reshape(n, -1) @ dense.T) @ wo_b.T,
                               rtol=1e-12)


# ---------------------------------------------------------------------------------------------- compressor


def test_hca_pool_of_constant_sequence_returns_projected_constant():
    D, d, m = 12, 8, 128
    x = np.repeat(RNG.normal(size=(1, D)), m, axis=0)
    w_kv, w_gate = RNG.normal(size=(d, D)), RNG.normal(size=(d, D))
    kv, score = compressor_project(x, w_kv, w_gate, np.zeros((m, d)), np.arange(m))
    row = hca_pool(kv[None], score[None])
    np.testing.assert_allclose(row[0], w_kv @ x[0], rtol=1e-12)


def test_compressor_ape_biases_gate_only_by_in_block_index():
    D, w, m = 5, 6, 4
    x = RNG.normal(size=(6, D))
    ape = RNG.normal(size=(m, w))
    kv, score = compressor_project(x, np.eye(w, D), np.zeros((w, D)), ape, np.arange(3, 9))
    np.testing.assert_array_equal(kv, x @ np.eye(w, D).T)
    np.testing.assert_array_equal(score, ape[np.arange(3, 9) % 4])


def test_csa_row0_ignores_a_halves_and_later_rows_overlap():
    d, m = 3, 4
    kv, score = RNG.normal(size=(2, m, 2 * d)), RNG.normal(size=(2, m, 2 * d))
    rows = csa_pool(kv, score, np.zeros((m, 2 * d)), np.full((m, 2 * d), -np.inf))
    w0 = np.exp(score[0, :, d:]) / np.exp(score[0, :, d:]).sum(0)
    np.testing.assert_allclose(rows[0], (w0 * kv[0, :, d:]).sum(0), rtol=1e-12)
    s8 = np.concatenate([score[0, :, :d], score[1, :, d:]])
    k8 = np.concatenate([kv[0, :, :d], kv[1, :, d:]])
    w1 = np.exp(s8) / np.exp(s8).sum(0)
    np.testing.assert_allclose(rows[1], (w1 * k8).sum(0), rtol=1e-12)


@pytest.mark.parametrize("ratio", [4, 8])
def test_compressor_streaming_equals_batch_for_any_split(ratio):
    d, T = 3, 45
    w = (2 if ratio == 4 else 1) * d
    kv, score = RNG.normal(size=(T, w)), RNG.normal(size=(T, w))
    batch = CompressorState.empty(ratio, d, np.float64)
    rows_b, first_b = compressor_update(batch, kv, score)
    assert first_b == 0 and len(rows_b) == T // ratio
    for cuts in ([1] * T, [3] * 15, [7, 1, 13, 2, 22]):
        st, got, start = CompressorState.empty(ratio, d, np.float64), [], 0
        for c in cuts:
            rows, first = compressor_update(st, kv[start : start + c], score[start : start + c])
            assert first == sum(len(g) for g in got)
            got.append(rows)
            st.rows = np.concatenate([st.rows, rows])
            start += c
        np.testing.assert_allclose(np.concatenate(got), rows_b, rtol=1e-14, atol=1e-15)
        np.testing.assert_array_equal(st.pend_kv, kv[T - T % ratio :])


# ------------------------------------------------------------------------------------------------- indexer


def test_indexer_relu_per_head_before_weighted_sum():
    q = np.array([[1.0, 0.0], [0.0, 1.0]])
    rows = np.array([[2.0, -3.0]])
    w = np.array([1.0, 1.0])
    # per head: ReLU(2) + ReLU(-3) = 2, whereas ReLU after the sum would give ReLU(-1) = 0
    np.testing.assert_array_equal(indexer_scores(q, w, rows), [2.0])
    np.testing.assert_array_equal(indexer_scores(q, np.array([-1.0, 1.0]), rows), [-2.0])  # ω is not ReLU'd


def test_indexer_selects_all_visible_rows_when_fewer_than_topk():
    rows = RNG.normal(size=(10, 8))
    q = np.full((3, 2, 8), np.nan)   # scores must not even be needed
    sel = select_rows(q, np.full((3, 2), np.nan), rows, np.array([3, 9, 15]), 4, 4, SERIAL)
    np.testing.assert_array_equal(sel, [[0, -1, -1, -1], [0, 1, -1, -1], [0, 1, 2, 3]])


def test_indexer_topk_lowest_index_wins_ties_and_respects_causality():
    np.testing.assert_array_equal(topk_lowest_index(np.array([1.0, 3.0, 3.0, 2.0, 3.0]), 2), [1, 2])
    rows = np.eye(8)[:6]
    q = np.zeros((1, 1, 8))
    q[0, 0, 5] = 10.0       # row 5 would score highest but is not visible yet at t = 19 (n_t = 5)
    q[0, 0, 1] = 1.0
    sel = select_rows(q, np.ones((1, 1)), rows, np.array([19]), 4, 2, SERIAL)
    np.testing.assert_array_equal(sel, [[0, 1]])  # row 1 scores 1, rows 0,2,3,4 tie at 0 -> lowest index 0


# ----------------------------------------------------------------------------------------------------- MoE


def test_swiglu_clamp_hand_values():
    c = 1.5
    g = np.array([2.0, 1.5, -5.0, 0.5, 10.0])
    u = np.array([-3.0, 1.5, 2.0, -1.6, 1.0])
    silu = lambda z: z / (1 + math.exp(-z))  # noqa: E731
    want = [silu(1.5) * -1.5, silu(1.5) * 1.5, silu(-5.0) * 1.5, silu(0.5) * -1.5, silu(1.5) * 1.0]
    np.testing.assert_allclose(swiglu_clamped(g, u, c), want, rtol=1e-14)
    np.testing.assert_allclose(swiglu_clamped(g, u, 0.0), [silu(a) * b for a, b in zip(g, u, strict=True)],
                               rtol=1e-14)


def test_topk_selection_order_ties_and_margin():
    keys = np.array([[0.1, 0.9, 0.5, 0.9, 0.2]])
    ids, margin = select_topk(keys, 3)
    np.testing.assert_array_equal(ids, [[1, 3, 2]])
    np.testing.assert_allclose(margin, [0.5 - 0.2])


def test_routing_weights_come_from_unbiased_scores():
    scores = np.array([[1.0, 2.0, 3.0, 4.0]])
    bias = np.array([10.0, 0.0, 0.0, 0.0])
    ids, _ = select_topk(scores + bias, 2)
    np.testing.assert_array_equal(ids, [[0, 3]])
    np.testing.assert_allclose(routing_weights(scores, ids, 1.5), [[1.5 * 1 / 5, 1.5 * 4 / 5]])


def test_hash_routing_is_the_token_row_of_the_table():
    table = np.array([[3, 1], [0, 2], [2, 3]])
    np.testing.assert_array_equal(hash_select(table, np.array([2, 0, 2])), [[2, 3], [3, 1], [2, 3]])
