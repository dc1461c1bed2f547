"""The draft heads' faults of the torch engine (gpu_engine/faults.py DRAFT_FAULT_TABLE) on the tiny F32 trunk and
synthesized tiny drafters (QAT sims off). Each fault's alternative op by hand; then, through
`TorchEngine(inject=(fault,))`, each changes the draft output against the clean torch engine and the reference first
at the quantity it breaks, leaves every quantity before it bit for bit, and leaves the trunk bit for bit.

MTP: the prev pairs of 20 reference trunk rows in one call. DSpark: taps from each engine's own `dspark_taps`, a prompt
round of 12 rows, then rounds writing 3 and 1 rows (as tests/test_dspark_engines.py).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gpu_engine import draft as tdraft
from gpu_engine.faults import DRAFT_FAULTS, FAULTS, Faults
from parity.compare.metrics import rel_l2
from parity.contract.engine import RunOptions
from parity.contract.errors import ParityError
from parity.gguf.synth_draft import synthesize_drafter

N = 20
ROUNDS = [(0, 12), (12, 3), (15, 1)]   # (first position written, rows written); anchor = the token after them
MOVED = 1e-3   # a quantity "changes" when each row asserted moves more than this: >= 1500x the clean torch engine's
#                difference from the reference (<= 6.4e-7), <= 1/10 of the smallest fault effect asserted (1.1e-2,
#                mtp-hnorm-flat's input)
MTP_FIELDS = ("input", "attn_carrier", "carrier", "logits")


def opts(*inject: str) -> RunOptions:
    return RunOptions(fp8_kv=False, fp4_indexer=False, inject=inject)


# -- the alternative ops by hand ---------------------------------------------------------------------------------

def test_mtp_pairs_same_pairs_each_carrier_with_its_own_token_when_prev_is_asked():
    X, t = torch.arange(3.0)[:, None, None] * torch.ones(3, 4, 2), torch.tensor([10, 11, 12])
    G, tau = tdraft.mtp_pairs_same(X, t, "prev")
    assert G[:, 0, 0].tolist() == [1.0, 2.0] and tau.tolist() == [11, 12]      # prev would give carriers 0, 1
    G, tau = tdraft.mtp_pairs_same(X, t, "same")
    assert G[:, 0, 0].tolist() == [0.0, 1.0, 2.0] and tau.tolist() == [10, 11, 12]
    with pytest.raises(ParityError, match="mtp_pairing.*'next'"):
        tdraft.mtp_pairs_same(X, t, "next")


def test_mtp_input_hnorm_flat_normalises_the_flat_carrier():
    # stream s = (s+1)·(1,-1,1,-1): the flat 16-vector has rms sqrt(mean((s+1)^2)) = sqrt(7.5); e = (1,1,1,1), rms 1
    G = torch.stack([(s + 1.0) * torch.tensor([1.0, -1.0, 1.0, -1.0]) for s in range(4)])[None]
    X0 = tdraft.mtp_input_hnorm_flat(torch.ones(1, 4), G, torch.ones(4), torch.ones(4), 2 * torch.eye(4),
                                     3 * torch.eye(4), 0.0)
    want = [[2 + 3 * (s + 1) / math.sqrt(7.5) * v for v in (1, -1, 1, -1)] for s in range(4)]
    np.testing.assert_allclose(X0[0].numpy(), want, rtol=1e-6)


def test_mtp_carrier_no_ffn_post_hands_on_the_attention_half():
    Y, X1 = torch.zeros(2, 4, 3), torch.ones(2, 4, 3)
    assert tdraft.mtp_carrier(Y, X1) is X1 and tdraft.mtp_carrier_no_ffn_post(Y, X1) is Y


def test_dspark_taps_summed_are_stream_sums():
    a = torch.tensor([[[1.0, 2.0], [3.0, 6.0]]])      # sums (4, 8)
    b = torch.tensor([[[-1.0, 0.0], [1.0, 10.0]]])    # sums (0, 10)
    assert tdraft.dspark_taps_summed([a, b]).tolist() == [[4.0, 8.0, 0.0, 10.0]]


def test_dspark_mask_causal_by_hand():
    # ring slots hold positions 3, 0, 2; p = 3, W = 3: visible 0 < q <= 3, so slot 1 (position 0) is out
    mask = tdraft.dspark_mask_causal(torch.tensor([3, 0, 2]), 3, 3, 3)
    assert mask.int().tolist() == [[1, 0, 1, 1, 0, 0], [1, 0, 1, 1, 1, 0], [1, 0, 1, 1, 1, 1]]
    assert tdraft.dspark_mask(torch.tensor([3, 0, 2]), 3, 3, 3).int().tolist() == [[1, 0, 1, 1, 1, 1]] * 3


def test_markov_chain_unconditioned_by_hand():
    # V = 3, B = 2, r = 1. Anchor 0: u = W1[0] = 1, bias = W2·1 = (0, -1, 1) in both slots:
    # slot 0: (0, 1, 0.5) + (0, -1, 1) = (0, 0, 1.5) -> 2;  slot 1: (0.5, 0, 0) + (0, -1, 1) = (0.5, -1, 1) -> 2.
    # The conditioned chain biases slot 1 with W1[2] = -1: (0.5, 1, -1) -> 1.
    logits = torch.tensor([[0.0, 1.0, 0.5], [0.5, 0.0, 0.0]])
    w1, w2 = torch.tensor([[1.0], [2.0], [-1.0]]), torch.tensor([[0.0], [-1.0], [1.0]])
    drafts, biased, u = tdraft.markov_chain_unconditioned(logits, 0, w1, w2)
    assert drafts.tolist() == [2, 2] and u.tolist() == [[1.0], [1.0]]
    assert biased.tolist() == [[0.0, 0.0, 1.5], [0.5, -1.0, 1.0]]
    assert tdraft.markov_chain(logits, 0, w1, w2)[0].tolist() == [2, 1]


def test_ring_write_newest_row_writes_the_prompt_then_one_row_per_round():
    ring = tdraft.Ring.empty(4, 1, torch.device("cpu"), torch.float32)
    rows = torch.arange(6.0)[:, None]
    prompt = tdraft.ring_write_newest_row(ring, rows[:3], torch.arange(3))
    assert prompt.pos.tolist() == [0, 1, 2, -1]
    stale = tdraft.ring_write_newest_row(prompt, rows[3:], torch.arange(3, 6))
    assert stale.pos.tolist() == [0, 5, 2, -1] and stale.rows[1].item() == 5.0
    assert tdraft.ring_write(prompt, rows[3:], torch.arange(3, 6)).pos.tolist() == [4, 5, 2, 3]


# -- through the engines -----------------------------------------------------------------------------------------

def test_the_drafter_faults_are_switches_of_their_own():
    """Faults.parse takes them; the engine offers them as `draft_faults`, not in the trunk's defect library."""
    from gpu_engine.engine import TorchEngine

    assert set(DRAFT_FAULTS) == set(MTP_EXPECT) | {"dspark-tap-sum", "dspark-causal-block",
                                                   "dspark-markov-unconditioned", "dspark-stale-ring"}
    assert not set(DRAFT_FAULTS) & set(FAULTS)
    assert Faults.parse(list(DRAFT_FAULTS)).active == DRAFT_FAULTS
    assert TorchEngine.draft_faults == DRAFT_FAULTS and TorchEngine.faults == FAULTS


@pytest.fixture(scope="module")
def drafters(tiny_f32, tmp_path_factory):
    d = tmp_path_factory.mktemp("drafter-faults")
    return {"mtp": synthesize_drafter(d / "mtp.gguf", tiny_f32, "mtp", "ds4-mtp"),
            "dspark": synthesize_drafter(d / "dspark.gguf", tiny_f32, "dspark", "ds4-dspark")}


def torch_engine(model, drafter, *inject: str):
    """The torch engine on one intra-op thread: the tests below compare slots bit for bit, and torch's matmul
    reduces a row in an order that depends on the batch shape once it splits work over 2 threads (2.4e-7 apart)."""
    from dataclasses import replace

    from gpu_engine.engine import TorchEngine

    return TorchEngine(str(model), replace(opts(*inject), engine_args=("threads=1",)), draft=str(drafter))


def reference_engine(model, drafter):
    from reference_cpu.engine import ReferenceEngine

    return ReferenceEngine(str(model), opts(), draft=str(drafter))


@pytest.fixture(scope="module")
def trunk(tiny_f32, drafters):
    """Tokens and the reference's output carriers X^(l+1) [N, H, D] of every trunk layer (all engines draft from
    these rows)."""
    eng = reference_engine(tiny_f32, drafters["mtp"])
    tokens = np.random.default_rng(4).integers(2, 289, N)
    state, X, outs = eng.new_state(), eng.embed(tokens), []
    for layer in range(eng.config.n_layers):
        X = eng.forward_layer(state, layer, X, tokens, 0).carrier
        outs.append(X)
    return tokens, outs


# -- MTP ---------------------------------------------------------------------------------------------------------

def mtp_run(eng, trunk):
    tokens, outs = trunk
    return eng.mtp_forward(eng.new_mtp_state(), outs[-1], tokens, 0, "prev")


@pytest.fixture(scope="module")
def mtp_clean(tiny_f32, drafters, trunk):
    return {"reference": mtp_run(reference_engine(tiny_f32, drafters["mtp"]), trunk),
            "torch": mtp_run(torch_engine(tiny_f32, drafters["mtp"]), trunk)}


# fault -> (quantities left bit for bit, first quantity changed)
MTP_EXPECT = {
    "mtp-pairing-same": ((), "input"),
    "mtp-hnorm-flat": ((), "input"),
    "mtp-no-hc-post": (("input", "attn_carrier"), "carrier"),
    "mtp-trunk-hc-head": (("input", "attn_carrier", "carrier"), "logits"),
}


@pytest.mark.parametrize("fault", sorted(MTP_EXPECT))
def test_mtp_fault_changes_its_quantity_first(fault, tiny_f32, drafters, trunk, mtp_clean):
    bad = mtp_run(torch_engine(tiny_f32, drafters["mtp"], fault), trunk)
    kept, first = MTP_EXPECT[fault]
    for name in kept:
        np.testing.assert_array_equal(getattr(bad, name), getattr(mtp_clean["torch"], name), err_msg=name)
    for against in ("torch", "reference"):
        moved = rel_l2(getattr(mtp_clean[against], first), getattr(bad, first))
        assert moved.min() > MOVED, f"{fault}: {first} vs clean {against} moves only {moved.min():.3g}"
    if kept:   # the block itself is untouched: the same experts
        np.testing.assert_array_equal(bad.expert_ids, mtp_clean["torch"].expert_ids)


def test_mtp_pairing_same_is_the_same_pairing_of_the_later_rows(tiny_f32, drafters, trunk):
    """Asked for prev on rows 0..N-1, the fault drafts exactly what the clean `same` pairing does on rows 1..N-1."""
    tokens, outs = trunk
    a = mtp_run(torch_engine(tiny_f32, drafters["mtp"], "mtp-pairing-same"), trunk)
    clean = torch_engine(tiny_f32, drafters["mtp"])
    b = clean.mtp_forward(clean.new_mtp_state(), outs[-1][1:], tokens[1:], 0, "same")
    for name in (*MTP_FIELDS, "expert_ids"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)


def test_mtp_hnorm_flat_input_against_numpy(tiny_f32, drafters, trunk):
    """X0 = W_e enorm(E[t_p]) + W_h (hnorm over the flat H·D vector of X_{p-1}), restated in float64 NumPy."""
    tokens, outs = trunk
    ref = reference_engine(tiny_f32, drafters["mtp"])
    s, eps = ref.store, ref.config.norm_eps
    G = outs[-1][:-1].astype(np.float64)
    n, H, D = G.shape

    def norm(x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w

    e = norm(s.rows("token_embd.weight", tokens[1:]).astype(np.float64), s.dense("mtp.enorm.weight"))
    h = norm(G.reshape(n, H * D), np.tile(s.dense("mtp.hnorm.weight"), H)).reshape(n, H, D)
    want = (e @ s.dense("mtp.e_proj.weight").T)[:, None, :] + h @ s.dense("mtp.h_proj.weight").T
    got = mtp_run(torch_engine(tiny_f32, drafters["mtp"], "mtp-hnorm-flat"), trunk).input
    assert rel_l2(want, got).max() <= 1e-6   # float32 vs float64 (measured 2.3e-7)


def test_mtp_no_hc_post_hands_on_the_attention_half_carrier(tiny_f32, drafters, trunk, mtp_clean):
    bad = mtp_run(torch_engine(tiny_f32, drafters["mtp"], "mtp-no-hc-post"), trunk)
    np.testing.assert_array_equal(bad.carrier, mtp_clean["torch"].attn_carrier)


def test_mtp_trunk_hc_head_logits_against_the_reference_head(tiny_f32, drafters, trunk, mtp_clean):
    """logits = W_out mtp.norm(HC_head(X1; the trunk's output_hc_*)), with reference_cpu's HC head and norm."""
    from reference_cpu.hc import hc_head
    from reference_cpu.norms import rms_norm

    ref = reference_engine(tiny_f32, drafters["mtp"])
    s, cfg = ref.store, ref.config
    z = hc_head(mtp_clean["torch"].carrier, s.matrix("output_hc_fn.weight"),
                float(s.dense("output_hc_scale.weight")[0]), s.dense("output_hc_base.weight"), cfg.norm_eps,
                cfg.hc_eps)
    want = rms_norm(z, s.dense("mtp.norm.weight"), cfg.norm_eps) @ s.dense("output.weight").T
    got = mtp_run(torch_engine(tiny_f32, drafters["mtp"], "mtp-trunk-hc-head"), trunk).logits
    assert rel_l2(want, got).max() <= 1e-6   # torch vs NumPy float32 (measured 3.4e-7)


# -- DSpark ------------------------------------------------------------------------------------------------------

def dspark_run(eng, trunk):
    """The taps of the engine's own `dspark_taps`, then the ROUNDS -> (taps, rings, rounds)."""
    tokens, outs = trunk
    taps = eng.dspark_taps([outs[l] for l in eng.drafter.config.target_layer_ids])
    state, rounds = eng.new_dspark_state(), []
    for first, c in ROUNDS:
        rounds.append(eng.dspark_round(state, taps[first : first + c], first, int(tokens[first + c])))
    return taps, state, rounds


@pytest.fixture(scope="module")
def dspark_clean(tiny_f32, drafters, trunk):
    return {"reference": dspark_run(reference_engine(tiny_f32, drafters["dspark"]), trunk),
            "torch": dspark_run(torch_engine(tiny_f32, drafters["dspark"]), trunk)}


def test_both_engines_make_the_same_taps_and_refuse_wrong_carriers(tiny_f32, drafters, trunk, dspark_clean):
    np.testing.assert_array_equal(dspark_clean["reference"][0], dspark_clean["torch"][0])   # measured: equal
    _, outs = trunk
    for eng in (reference_engine(tiny_f32, drafters["dspark"]), torch_engine(tiny_f32, drafters["dspark"])):
        with pytest.raises(ParityError, match=r"dspark_taps: carriers of shapes \[\(20, 4, 256\), \(20, 4, 256\)\], "
                                              r"expected 3 \(the output carriers of layers 3, 4, 5\)"):
            eng.dspark_taps(outs[-2:])
        with pytest.raises(ParityError, match="dspark_taps"):
            eng.dspark_taps([outs[3], outs[4], outs[5][:, :2]])


def rels(a, b, name):
    """Per-row rel-L2 of a DSparkRound quantity: stages -> [S, B], the rest -> [B] or [1]."""
    if name == "stages":
        return np.stack([rel_l2(x, y) for x, y in zip(a.stages, b.stages, strict=True)])
    x, y = getattr(a, name), getattr(b, name)
    return rel_l2(x[None], y[None]) if x.ndim == 1 else rel_l2(x, y)


def assert_rounds_equal(a, b, names=("main", "stages", "base_logits", "bias", "logits", "confidence", "drafts")):
    for name in names:
        for x, y in zip(np.atleast_1d(getattr(a, name)) if name != "stages" else a.stages,
                        np.atleast_1d(getattr(b, name)) if name != "stages" else b.stages, strict=True):
            np.testing.assert_array_equal(x, y, err_msg=name)


def test_dspark_tap_sum_is_invisible_after_main_norm(tiny_f32, drafters, trunk, dspark_clean):
    """Spec §3.2: the sum is H times the mean (exactly, in binary floating point), W_main is linear and main_norm is
    scale-invariant but for its eps: M moves by (1 - 1/H²)·eps/(2·ms(W_main T)) in exact arithmetic (<= 1.9e-7 here,
    ms >= 2.4), the float32 rounding level. Every draft quantity moves less than the clean torch engine differs from
    the reference, and the drafts are identical: no draft checkpoint can locate this fault on the tiny model."""
    eng = torch_engine(tiny_f32, drafters["dspark"], "dspark-tap-sum")
    taps, _, bad = dspark_run(eng, trunk)
    ref, (clean_taps, _, clean) = dspark_clean["reference"][2], dspark_clean["torch"]
    np.testing.assert_array_equal(taps, eng.config.hc_mult * clean_taps)
    for name in ("main", "stages", "base_logits", "logits"):
        fault = max(rels(c, b, name).max() for c, b in zip(clean, bad, strict=True))
        noise = max(rels(r, c, name).max() for r, c in zip(ref, clean, strict=True))
        assert 0 < fault < noise, f"{name}: the fault moves it {fault:.3g}, torch vs reference {noise:.3g}"
    for c, b in zip(clean, bad, strict=True):
        np.testing.assert_array_equal(c.drafts, b.drafts)


def test_dspark_causal_block_changes_every_slot_but_the_last_in_stage_0(tiny_f32, drafters, trunk, dspark_clean):
    """Slot B-1 sees every block row in both masks: stage 0 leaves it bit for bit; the later stages read the other
    slots' stage-0 rows, so there every slot moves."""
    _, _, bad = dspark_run(torch_engine(tiny_f32, drafters["dspark"], "dspark-causal-block"), trunk)
    for against in ("torch", "reference"):
        for c, b in zip(dspark_clean[against][2], bad, strict=True):
            assert rels(c, b, "stages")[0, :-1].min() > MOVED
            assert rels(c, b, "stages")[1:].min() > MOVED
    for c, b in zip(dspark_clean["torch"][2], bad, strict=True):
        np.testing.assert_array_equal(c.main, b.main)
        np.testing.assert_array_equal(c.stages[0][-1], b.stages[0][-1])


def test_dspark_markov_unconditioned_biases_every_slot_by_the_anchor(tiny_f32, drafters, trunk, dspark_clean):
    """Base logits and slot 0's bias bit for bit; every slot's bias = the anchor's (clean slot 0's); slot j >= 1
    moves where the clean chain conditions on a draft other than the anchor."""
    tokens, _ = trunk
    _, _, bad = dspark_run(torch_engine(tiny_f32, drafters["dspark"], "dspark-markov-unconditioned"), trunk)
    for (first, c), ok, b, ref in zip(ROUNDS, dspark_clean["torch"][2], bad, dspark_clean["reference"][2],
                                       strict=True):
        assert_rounds_equal(ok, b, ("main", "stages", "base_logits"))
        for j in range(len(b.bias)):
            np.testing.assert_array_equal(b.bias[j], ok.bias[0])
        conditioned_on = np.concatenate([[tokens[first + c]], ok.drafts[:-1]])
        moved = conditioned_on != tokens[first + c]
        assert moved[1:].any()
        for against in (ok, ref):
            assert (rels(against, b, "bias")[moved] > MOVED).all()


def test_dspark_stale_ring_leaves_the_first_round_and_moves_the_later_ones(tiny_f32, drafters, trunk, dspark_clean):
    _, rings, bad = dspark_run(torch_engine(tiny_f32, drafters["dspark"], "dspark-stale-ring"), trunk)
    clean_rings, clean = dspark_clean["torch"][1:]
    assert_rounds_equal(clean[0], bad[0])
    for k in (1, 2):
        np.testing.assert_array_equal(clean[k].main, bad[k].main)
        for against in (clean[k], dspark_clean["reference"][2][k]):
            assert rels(against, bad[k], "stages")[0].min() > MOVED
    # W = 8: the prompt fills positions 4..11; the clean rounds add 12, 13, 14 and 15, the stale ones 14 and 15 only
    for ring, clean_ring in zip(rings, clean_rings, strict=True):
        assert clean_ring.pos.tolist() == [8, 9, 10, 11, 12, 13, 14, 15]
        assert ring.pos.tolist() == [8, 9, 10, 11, 4, 5, 14, 15]


# -- the trunk ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def trunk_clean(tiny_f32, drafters):
    return {kind: trunk_run(torch_engine(tiny_f32, drafters[kind])) for kind in ("mtp", "dspark")}


def trunk_run(eng):
    tokens = np.random.default_rng(4).integers(2, 289, N)
    state, X, out = eng.new_state(), eng.embed(tokens), []
    for layer in range(eng.config.n_layers):
        res = eng.forward_layer(state, layer, X, tokens, 0, capture=True)
        out += [res.attn_carrier, res.carrier, res.diag.expert_ids, *res.captures.values()]
        X = res.carrier
    return [*out, *eng.head(X)]


@pytest.mark.parametrize("fault", DRAFT_FAULTS)
def test_a_drafter_fault_leaves_the_trunk_bit_for_bit(fault, tiny_f32, drafters, trunk_clean):
    kind = fault.split("-")[0]
    got = trunk_run(torch_engine(tiny_f32, drafters[kind], fault))
    assert len(got) == len(trunk_clean[kind])
    for a, b in zip(got, trunk_clean[kind], strict=True):
        np.testing.assert_array_equal(a, b)


# -- located by `diff` on traces with draft checkpoints (trace --draft) -------------------------------------------

SPARSE = [1, 5, 9, 10, 14, 19]   # traced positions; DSpark commit bases -1, -1, 5, 5, 10, 14 (dspark_commit_bases)
LOCATED = {   # fault -> (first drifting checkpoint, its first drifting position); None: not located (above)
    "mtp-pairing-same": ("mtp.0.in", 1),
    "mtp-hnorm-flat": ("mtp.0.in", 1),
    "mtp-no-hc-post": ("mtp.0", 1),
    "mtp-trunk-hc-head": ("mtp.0.logits", 1),
    "dspark-tap-sum": None,
    "dspark-causal-block": ("dspark.0", 1),
    "dspark-markov-unconditioned": ("dspark.bias", 1),
    "dspark-stale-ring": ("dspark.0", 9),    # rounds at 1 and 5 write rows 0..p from 0 (a prefill: in full);
}                                            # the one at 9 writes rows 6..9 (base 5), the fault row 9 only


@pytest.fixture(scope="module")
def reference_traces(tiny_f32, drafters, trunk):
    from parity import api

    tokens, _ = trunk
    return {kind: api.trace("reference", tiny_f32, [int(t) for t in tokens], positions=SPARSE, draft=drafters[kind],
                            options=opts()) for kind in ("mtp", "dspark")}


@pytest.mark.parametrize("fault", DRAFT_FAULTS)
def test_diff_locates_each_drafter_fault_at_its_draft_checkpoint(fault, tiny_f32, drafters, trunk, reference_traces):
    from parity import api

    tokens, _ = trunk
    kind = fault.split("-")[0]
    cand = api.trace("torch", tiny_f32, [int(t) for t in tokens], positions=SPARSE, draft=drafters[kind],
                     options=opts(fault))
    first = api.diff(reference_traces[kind], cand).first_drift
    if LOCATED[fault] is None:
        assert first is None, first
        return
    assert first is not None and (first["checkpoint"], first["first_pos"]) == LOCATED[fault], first


def test_a_trunk_fault_traced_with_a_drafter_still_drifts_first_in_its_layer(tiny_f32, drafters, trunk,
                                                                               reference_traces):
    from parity import api

    tokens, _ = trunk
    cand = api.trace("torch", tiny_f32, [int(t) for t in tokens], positions=SPARSE, draft=drafters["mtp"],
                     options=opts("sink-dropped"))
    first = api.diff(reference_traces["mtp"], cand).first_drift
    assert first is not None and (first["checkpoint"], first["first_pos"]) == ("blk.0.attn", 1), first
