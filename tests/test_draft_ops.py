"""Draft-head ops (reference_cpu.draft, gpu_engine.draft) on tiny arrays: closed forms computed by hand, then the
torch twins against the NumPy ops on random arrays."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gpu_engine import draft as tdraft
from gpu_engine.attention import sink_attention
from parity.contract.errors import ParityError
from reference_cpu import draft

TWIN_TOL = 1e-6


def test_mtp_input_normalises_each_stream_not_the_flat_carrier():
    # e = (1,1,1,1) has rms 1; stream s is (s+1)·(1,-1,1,-1), whose per-stream RMSNorm is (1,-1,1,-1) for every s
    e = np.ones((1, 4))
    G = np.array([[(s + 1.0) * np.array([1, -1, 1, -1]) for s in range(4)]])
    X0 = draft.mtp_input(e, G, np.ones(4), np.ones(4), 2 * np.eye(4), 3 * np.eye(4), 0.0)
    assert X0.shape == (1, 4, 4)
    np.testing.assert_allclose(X0[0], np.tile([5.0, -1.0, 5.0, -1.0], (4, 1)), rtol=0, atol=1e-15)
    # one norm over the flat 16-vector would scale stream s by (s+1)/rms(flat), rms(flat) = sqrt(7.5): not equal rows
    flat = G.reshape(1, -1) / math.sqrt(np.mean(G**2))
    assert not np.allclose(2 + 3 * flat.reshape(4, 4)[:, 0], 5.0)


def test_mtp_pairs_prev_and_same():
    X, t = np.arange(3)[:, None, None] * np.ones((3, 4, 2)), np.array([10, 11, 12])
    G, tau = draft.mtp_pairs(X, t, "prev")
    assert G[:, 0, 0].tolist() == [0, 1] and tau.tolist() == [11, 12]
    G, tau = draft.mtp_pairs(X, t, "same")
    assert G[:, 0, 0].tolist() == [0, 1, 2] and tau.tolist() == [10, 11, 12]
    with pytest.raises(ParityError, match="mtp_pairing.*'next'"):
        draft.mtp_pairs(X, t, "next")


def test_dspark_taps_are_stream_means_concatenated():
    a = np.array([[[1.0, 2.0], [3.0, 6.0]]])      # T=1, H=2, D=2: mean (2, 4)
    b = np.array([[[-1.0, 0.0], [1.0, 10.0]]])    # mean (0, 5)
    np.testing.assert_array_equal(draft.dspark_taps([a, b]), [[2.0, 4.0, 0.0, 5.0]])


def test_dspark_main_is_rms_norm_of_the_projection():
    T = np.array([[2.0, 4.0, 0.0, 5.0]])
    W = np.array([[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.4]])   # W T = (2, 2): rms 2
    np.testing.assert_allclose(draft.dspark_main(T, W, np.array([1.0, -3.0]), 0.0), [[1.0, -3.0]], rtol=1e-15)


# a 3-token vocabulary, B = 2 slots, rank 1 (worked by hand in the comments)
LOGITS = np.array([[0.0, 1.0, 0.5], [0.5, 0.0, 0.0]])
W1 = np.array([[1.0], [2.0], [-1.0]])
W2 = np.array([[0.0], [-1.0], [1.0]])


def test_markov_chain_by_hand():
    drafts, biased, u = draft.markov_chain(LOGITS, 0, W1, W2)
    # slot 0: u = W1[0] = 1, bias W2·1 = (0,-1,1), biased (0, 0, 1.5) -> 2 (the unbiased argmax would be 1)
    # slot 1: u = W1[2] = -1, bias (0, 1, -1), biased (0.5, 1, -1) -> 1 (conditioned on the anchor it would be 2)
    np.testing.assert_array_equal(biased, [[0.0, 0.0, 1.5], [0.5, 1.0, -1.0]])
    np.testing.assert_array_equal(u, [[1.0], [-1.0]])
    assert drafts.tolist() == [2, 1]


def test_markov_chain_takes_the_first_maximum_on_a_tie():
    logits = np.array([[0.0, 3.0, 3.0], [7.0, 7.0, 7.0]])
    drafts, _, _ = draft.markov_chain(logits, 1, W1, np.zeros((3, 1)))
    assert drafts.tolist() == [1, 0]
    t_drafts, _, _ = tdraft.markov_chain(torch.tensor(logits), 1, torch.tensor(W1), torch.zeros(3, 1).double())
    assert t_drafts.tolist() == [1, 0]


def test_confidence_is_a_raw_dot_product():
    c = draft.confidence(np.array([[1.0, 2.0]]), np.array([[3.0]]), np.array([[0.5, -1.0, 2.0]]))
    np.testing.assert_allclose(c, [4.5], rtol=1e-15)   # 0.5 - 2 + 6: no bias, no sigmoid (a value above 1)


def test_ring_write_lands_at_pos_mod_w_and_keeps_the_last_w():
    ring = draft.Ring.empty(4, 2, np.float64)
    rows = np.arange(6.0).reshape(3, 2)
    r1 = draft.ring_write(ring, rows, np.array([5, 6, 7]))
    assert r1.pos.tolist() == [-1, 5, 6, 7] and r1.rows[1:].tolist() == rows.tolist()
    assert ring.pos.tolist() == [-1, -1, -1, -1]            # pure: the given ring is unchanged
    r2 = draft.ring_write(r1, 100 + np.arange(12.0).reshape(6, 2), np.arange(8, 14))
    assert r2.pos.tolist() == [12, 13, 10, 11]                # 8, 9 overwritten by 12, 13 in their slots
    assert r2.rows[:, 0].tolist() == [108.0, 110.0, 104.0, 106.0]


def test_ring_visible_committed_rows_within_the_window():
    ring = draft.Ring(np.zeros((4, 1)), np.array([8, 5, 6, -1]))
    assert draft.ring_visible(ring, 7, 4).tolist() == [False, True, True, False]   # 8 > p, slot 3 empty
    assert draft.ring_visible(ring, 9, 4).tolist() == [True, False, True, False]   # 5 <= p - W
    mask = tdraft.dspark_mask(torch.tensor(ring.pos), 7, 4, 3)
    assert mask.shape == (3, 7)
    assert mask[:, :4].tolist() == [[False, True, True, False]] * 3
    assert mask[0, 4:].all()                                   # slot 0 sees the noise slots 1, 2


def test_dspark_attend_closed_form_slot0_sees_noise_slots():
    # q = 0: every score is 0, so with sink 0 each slot's output is Σ keys / (1 + n_keys), the same for all slots
    ring = draft.Ring(np.array([[1.0, 0.0], [0.0, 2.0], [9.0, 9.0]]), np.array([3, 4, 5]))
    block_k = np.array([[3.0, 3.0], [0.0, -6.0]])
    o = draft.dspark_attend(np.zeros((2, 1, 2)), block_k, ring, 4, 3, np.zeros(1), 1.0)
    expect = (np.array([1.0, 0.0]) + np.array([0.0, 2.0]) + block_k.sum(axis=0)) / 5   # position 5 > p: not seen
    np.testing.assert_allclose(o[:, 0], [expect, expect], rtol=1e-15)


def _rand(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape)


def _t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(a)


def _close(t: torch.Tensor, a: np.ndarray) -> None:
    np.testing.assert_allclose(t.numpy(), a, rtol=TWIN_TOL, atol=TWIN_TOL * np.abs(a).max())


def test_torch_twins_match_the_numpy_ops():
    rng = np.random.default_rng(0)
    n, H, D, V, r = 3, 4, 8, 11, 5
    args = (_rand(rng, n, D), _rand(rng, n, H, D), _rand(rng, D), _rand(rng, D), _rand(rng, D, D), _rand(rng, D, D))
    _close(tdraft.mtp_input(*map(_t, args), 1e-6), draft.mtp_input(*args, 1e-6))
    carriers = [_rand(rng, n, H, D) for _ in range(3)]
    taps = draft.dspark_taps(carriers)
    _close(tdraft.dspark_taps([_t(c) for c in carriers]), taps)
    proj, norm = _rand(rng, D, 3 * D), _rand(rng, D)
    _close(tdraft.dspark_main(_t(taps), _t(proj), _t(norm), 1e-6), draft.dspark_main(taps, proj, norm, 1e-6))
    logits, w1, w2 = _rand(rng, 5, V), _rand(rng, V, r), _rand(rng, V, r)
    drafts, biased, u = draft.markov_chain(logits, 3, w1, w2)
    t_drafts, t_biased, t_u = tdraft.markov_chain(_t(logits), 3, _t(w1), _t(w2))
    assert t_drafts.tolist() == drafts.tolist()
    _close(t_biased, biased)
    _close(t_u, u)
    z, wc = _rand(rng, 5, D), _rand(rng, 1, D + r)
    _close(tdraft.confidence(_t(z), t_u, _t(wc)), draft.confidence(z, u, wc))


def test_torch_ring_and_block_attention_match_the_numpy_ops():
    rng = np.random.default_rng(1)
    W, B, nh, hd, p = 4, 3, 2, 8, 9
    pos = np.array([6, 7, 8, 9, 10])          # 6 is overwritten by 10; 10 > p stays masked
    rows = _rand(rng, 5, hd)
    ring = draft.ring_write(draft.Ring.empty(W, hd, np.float64), rows, pos)
    t_ring = tdraft.ring_write(tdraft.Ring.empty(W, hd, torch.device("cpu"), torch.float64), _t(rows), _t(pos))
    assert t_ring.pos.tolist() == ring.pos.tolist()
    _close(t_ring.rows, ring.rows)
    q, block_k, sink = _rand(rng, B, nh, hd), _rand(rng, B, hd), _rand(rng, nh)
    o = draft.dspark_attend(q, block_k, ring, p, W, sink, 1.0 / math.sqrt(hd))
    mask = tdraft.dspark_mask(t_ring.pos, p, W, B)
    t_o = sink_attention(_t(q), torch.cat([t_ring.rows, _t(block_k)]), mask, _t(sink), 1 << 20)
    _close(t_o, o)
