"""The speculative-path faults of the torch engine (gpu_engine.faults.SPEC_FAULT_TABLE, spec v4-mtp-dspark §4.4,
§4.6) as `v4parity spec` reports them on the tiny F32 trunk (QAT sims off, seed 0): plain decode unchanged, the
first affected round, the differing state component, exit status 1. Expected rounds and components follow from the
tiny config (window 8, compress ratios 0, 0, 4, 128, 4, 128: layer 2 is the first compressed layer, ratio 4) and the
scripted drafts' positions, not from the code under test."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from parity.check.envelope import load_envelope
from parity.contract.engine import RunOptions
from parity.gguf.synth_draft import synthesize_drafter
from parity.spec.report import spec_report
from parity.tracing.runner import run_sequence

OPTS = RunOptions(fp8_kv=False, fp4_indexer=False)
ENV = load_envelope(Path(__file__).parent / "fixtures" / "spec" / "tiny-f32-nosims.envelope.json", "float32")
PROMPT = [0, 5, 7, 9, 11, 13]   # 6 tokens: round 0's verify batch sits at positions 6..6+γ


@pytest.fixture(scope="module")
def mtp_file(tiny_f32, tmp_path_factory):
    return synthesize_drafter(tmp_path_factory.mktemp("spec-faults") / "mtp.gguf", tiny_f32, "mtp", "ds4-mtp")


@pytest.fixture(scope="module")
def reference(tiny_f32, mtp_file):
    from reference_cpu.engine import ReferenceEngine

    return ReferenceEngine(str(tiny_f32), OPTS, draft=str(mtp_file))


def torch_engine(model, draft, *faults):
    from gpu_engine.engine import TorchEngine

    return TorchEngine(str(model), RunOptions(fp8_kv=False, fp4_indexer=False, inject=faults), draft=str(draft))


def scripted(cand, ref, steps=8, depth=3, reject_at=None, prompt=PROMPT, env=ENV):
    return spec_report(cand, ref, "script", prompt, steps, env, depth=depth, reject_at=reject_at)


def test_commit_verify_frontier_is_named_by_state_parity_at_the_first_block_a_verify_batch_completes(
        tiny_f32, mtp_file, reference):
    cand = torch_engine(tiny_f32, mtp_file, "spec-commit-verify-frontier")
    rep = scripted(cand, reference, reject_at=3)
    assert rep.plain_tokens == rep.reference_tokens            # plain decode: one row a step, never batched
    # round 0 verifies positions 6..9 and accepts 2 (replay 6..8): block 1 of layer 2 (positions 4..7) completes
    # inside both the verify batch and the replay, so the first commit already holds the batched path's row
    assert rep.rounds[0].accepted == 2
    d = rep.state_divergence
    assert (d.round, d.component, d.kind) == (0, "blk.2.comp.rows", "values")
    assert "state blk.2.comp.rows after round 0" in rep.defects
    # the verify rows themselves stay right: no verifier label, the state check is what finds it (spec §6.3.2)
    assert not {"VERIFIER-DEFECT", "FALSE-REJECT", "FALSE-ACCEPT"} & set(rep.attribution[0].labels)


def test_commit_verify_frontier_needs_a_batch_that_completes_a_block(tiny_f32, mtp_file, reference):
    # depth 1 from a 6-token prompt: round 0 verifies positions 6..7 (completes block 1 at 7), so it acts at once;
    # with a 5-token prompt round 0 verifies 5..6 (no block end) and accepting everything round 1 verifies 7..8:
    # the first affected round is the first that contains position 7
    cand = torch_engine(tiny_f32, mtp_file, "spec-commit-verify-frontier")
    rep = scripted(cand, reference, steps=6, depth=1, prompt=PROMPT[:5])
    first = next(i for i, r in enumerate(rep.rounds) if r.start_pos <= 7 <= r.start_pos + r.verified)
    assert first == 1 and rep.state_divergence.round == first
    assert rep.state_divergence.component == "blk.2.comp.rows"


def test_ring_exact_window_is_a_false_reject_in_round_0_with_the_anchor_named(tiny_f32, mtp_file, reference):
    # W = 8, round 0's batch at positions 6..9 written into an 8-slot ring before attending: positions 8 and 9
    # overwrite the slots of 0 and 1, which the query at 6 still attends (its window: positions 0..6), so already
    # v_0 is wrong and the first draft, the reference's own token, is rejected
    cand = torch_engine(tiny_f32, mtp_file, "spec-ring-exact-window")
    rep = scripted(cand, reference, steps=4)
    assert rep.plain_tokens == rep.reference_tokens
    assert rep.first_round(["FALSE-REJECT", "VERIFIER-DEFECT"]) == 0
    d = rep.state_divergence
    assert (d.round, d.component) == (0, "anchor") and "state anchor after round 0" in rep.defects


def test_logits_row_stale_commits_a_rejected_rows_token_named_as_the_anchor(tiny_f32, mtp_file, reference):
    cand = torch_engine(tiny_f32, mtp_file, "spec-logits-row-stale")
    rep = scripted(cand, reference, reject_at=2)
    assert rep.plain_tokens == rep.reference_tokens
    r0, a0 = rep.rounds[0], rep.attribution[0]
    # round 0: d_1 right, d_2 made wrong -> a' = 1; the bonus must be v_1 but comes from the last row v_3
    assert (r0.accepted, r0.verified) == (1, 3) and r0.verify == a0.reference   # the verify rows are right
    assert r0.next_anchor == r0.verify[3] != r0.verify[1]
    d = rep.state_divergence
    assert (d.round, d.component, d.kind) == (0, "anchor", "token")
    # committed as step 2 (prefill's token, d_1, then the bonus): WRONG on its own prefix and against plain decode
    assert rep.committed[2].cls == "WRONG" and rep.committed[2].token == r0.verify[3]
    assert rep.divergence.step == 2 and rep.divergence.cls == "WRONG" and rep.divergence.spec_induced
    assert "state anchor after round 0" in rep.defects


def test_logits_row_stale_cannot_act_when_every_draft_is_accepted(tiny_f32, mtp_file, reference):
    cand = torch_engine(tiny_f32, mtp_file, "spec-logits-row-stale")
    rep = scripted(cand, reference)                        # accept-all: row a' = row γ, the last
    assert rep.exact and rep.state_divergence is None and not rep.defects


class Tied:
    """An engine whose vocabulary holds two tokens with equal output rows: logits column `dup` is a copy of column
    `src` (src < dup), so wherever `src` is a row's maximum it ties exactly with `dup` (spec §4.2)."""

    def __init__(self, inner, src: int, dup: int) -> None:
        self.inner, self.src, self.dup = inner, src, dup

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def head(self, carrier):
        final, logits = self.inner.head(carrier)
        logits = logits.copy()
        logits[:, self.dup] = logits[:, self.src]
        return final, logits


def test_tie_last_max_acts_only_on_an_exact_tie_and_is_no_near_tie(tiny_f32, mtp_file, reference):
    cand = torch_engine(tiny_f32, mtp_file, "spec-tie-last-max")
    assert scripted(cand, reference).exact   # the tiny model's own logits have no exact tie at a maximum
    # step 3 of the reference's greedy decode is its token `src`: tie it with the last token of the vocabulary
    plain = tuple(int(np.argmax(r.logits[-1])) for r in run_sequence(reference, PROMPT, 3))
    src, dup = plain[3], reference.config.vocab_size - 1
    assert src < dup and src not in plain[:3]
    rep = scripted(Tied(cand, src, dup), Tied(reference, src, dup))
    assert rep.plain_tokens == rep.reference_tokens == tuple(plain) + rep.reference_tokens[4:]
    # accept-all, depth 3 from step 0: round 0 verifies steps 1..4 (rows v_0..v_3), step 3 is row v_2; its draft
    # d_3 = src (the script is the reference's continuation) is rejected for dup: a right draft rejected
    r0, a0 = rep.rounds[0], rep.attribution[0]
    assert r0.verify[2] == dup and a0.reference[2] == src and a0.margins[2] == 0.0
    assert r0.not_first_max == (2,) and r0.accepted == 2
    assert a0.labels == ("ACCEPT-OK", "ACCEPT-OK", "FALSE-REJECT")
    assert rep.divergence.step == 3 and rep.divergence.cls == "TIE"          # margin 0: a tie, not WRONG
    d = rep.state_divergence
    assert (d.round, d.component, d.kind) == (0, "anchor", "tie-break")
    assert "state anchor after round 0" in rep.defects   # exit 1: the committed token itself is only a TIE


# ---------------------------------------------------------------- drafter faults (the draft-heads issue)
# fault -> the first draft checkpoint its op moves, from where the op sits in the head (spec §2.2, §3.3-§3.4): the
# pairing and hnorm build the MTP input, HC_post ends the block, the HC head makes the logits; the DSpark block mask
# acts in stage 0's attention, the Markov chain makes the bias
FIRST_CHECKPOINT = {"mtp-pairing-same": "mtp.0.in", "mtp-hnorm-flat": "mtp.0.in", "mtp-no-hc-post": "mtp.0",
                    "mtp-trunk-hc-head": "mtp.0.logits", "dspark-causal-block": "dspark.0",
                    "dspark-markov-unconditioned": "dspark.bias"}


@pytest.fixture(scope="module")
def dspark_file(tiny_f32, tmp_path_factory):
    return synthesize_drafter(tmp_path_factory.mktemp("spec-faults") / "dspark.gguf", tiny_f32, "dspark",
                              "ds4-dspark")


@pytest.fixture(scope="module")
def dspark_reference(tiny_f32, dspark_file):
    from reference_cpu.engine import ReferenceEngine

    return ReferenceEngine(str(tiny_f32), OPTS, draft=str(dspark_file))


def drafted(cand, ref, kind, steps, prompt=PROMPT):
    return spec_report(cand, ref, kind, prompt, steps, ENV, depth=2, drafter=ref.drafter.config)


def test_every_draft_head_fault_is_tabled_here_or_below():
    from gpu_engine.faults import DRAFT_FAULTS, SPEC_FAULTS

    assert set(DRAFT_FAULTS) == set(FIRST_CHECKPOINT) | {"dspark-stale-ring", "dspark-tap-sum"}
    assert set(SPEC_FAULTS) == {"spec-ring-exact-window", "spec-no-compressor-restore", "spec-commit-verify-frontier",
                                "spec-logits-row-stale", "spec-tie-last-max"}


@pytest.mark.parametrize("fault", list(FIRST_CHECKPOINT))
def test_a_drafter_fault_is_named_at_its_first_draft_checkpoint(tiny_f32, mtp_file, dspark_file, reference,
                                                                dspark_reference, fault):
    kind = fault.split("-")[0]
    draft, ref = (mtp_file, reference) if kind == "mtp" else (dspark_file, dspark_reference)
    rep = drafted(torch_engine(tiny_f32, draft, fault), ref, kind, steps=3)
    assert rep.exact                                   # drafts never change the committed tokens
    d = rep.drafter_divergence
    assert (d.round, d.component, d.kind) == (0, FIRST_CHECKPOINT[fault], "values")
    drift = rep.labels["DRAFTER-DRIFT"]
    # exit 1 either way: a DRAFTER-DRIFT label names the checkpoint, or (drafts unchanged) the departure itself
    assert (f"DRAFTER-DRIFT x{drift} (drafter departs at {d.component} from round 0)" if drift else
            f"drafter {d.component} from round 0") in rep.defects


def test_correct_drafters_do_not_depart(tiny_f32, mtp_file, dspark_file, reference, dspark_reference):
    for draft, ref, kind in ((mtp_file, reference, "mtp"), (dspark_file, dspark_reference, "dspark")):
        rep = drafted(torch_engine(tiny_f32, draft), ref, kind, steps=3)
        assert rep.drafter_divergence is None and not rep.defects


def test_stale_dspark_ring_departs_the_round_after_the_first_accepted_draft(tiny_f32, dspark_file,
                                                                             dspark_reference):
    # the random drafter accepts rarely: on this prompt only round 9 accepts a draft (16 steps), so round 10 is the
    # first that should write two ring rows and writes one (spec §3.5, D9)
    rep = drafted(torch_engine(tiny_f32, dspark_file, "dspark-stale-ring"), dspark_reference, "dspark", steps=16)
    assert rep.exact
    first = 1 + next(i for i, r in enumerate(rep.rounds) if r.accepted >= 1)
    d = rep.drafter_divergence
    assert (d.round, d.component) == (first, "dspark.0")
    assert (rep.state_divergence.round, rep.state_divergence.component) == (first, "dspark.0.rows")


def test_dspark_tap_sum_cannot_act_in_spec(tiny_f32, dspark_file, dspark_reference):
    # the driver forms the taps itself from the trunk carriers (the stream mean, parity.spec.drafts.dspark_taps), so
    # the engine's tap op, the one the fault replaces, is never called by a speculative run
    rep = drafted(torch_engine(tiny_f32, dspark_file, "dspark-tap-sum"), dspark_reference, "dspark", steps=3)
    assert rep.exact and rep.drafter_divergence is None and not rep.defects


# The three faults whose drafts stay the reference drafter's on PROMPT (above) change a verified draft elsewhere:
# prompt, steps and the first round with DRAFTER-DRIFT measured over 10 prompts x 16 steps (docs/spec.md, drafter
# faults); the random MTP head, depth 2. The test re-derives which positions must carry the label from the rule
# (spec §6.2) on the report's own drafts, reference drafts and verify rows.
ACTING_MTP = {"mtp-trunk-hc-head": ([137, 148, 219, 275, 11, 42], 3, 0),
              "mtp-hnorm-flat": ([18, 82, 144, 141, 34, 284], 8, 5)}


def drift_positions(rep):
    """(round, slot) of every verified draft that is neither the reference verifier's token nor the reference
    drafter's (on the candidate's inputs), the verify row agreeing with the reference: DRAFTER-DRIFT by the rule."""
    return [(n, i) for n, (r, a) in enumerate(zip(rep.rounds, rep.attribution, strict=True))
            for i, d in enumerate(r.drafts) if i < r.verified and i <= r.accepted
            and r.verify[i] == a.reference[i] and d != a.reference[i] and d != a.reference_drafts[i]]


def assert_drift_named(rep, checkpoint, first_round):
    assert rep.exact                                    # the drafts change, never the committed tokens
    want = drift_positions(rep)
    got = [(n, i) for n, a in enumerate(rep.attribution) for i, lab in enumerate(a.labels) if lab == "DRAFTER-DRIFT"]
    assert got == want and want and want[0][0] == first_round
    d = rep.drafter_divergence
    assert (d.round, d.component) == (0, checkpoint)   # the checkpoint departs from round 0, the drafts later
    assert f"DRAFTER-DRIFT x{len(got)} (drafter departs at {checkpoint} from round 0)" in rep.defects
    return got


@pytest.mark.parametrize("fault", list(ACTING_MTP))
def test_a_small_mtp_fault_changes_a_verified_draft_on_another_prompt(tiny_f32, mtp_file, reference, fault):
    prompt, steps, first = ACTING_MTP[fault]
    rep = drafted(torch_engine(tiny_f32, mtp_file, fault), reference, "mtp", steps, prompt=prompt)
    assert_drift_named(rep, FIRST_CHECKPOINT[fault], first)


@pytest.fixture(scope="module")
def fitted_dspark(tiny_f32, tmp_path_factory):
    """A DSpark drafter fitted on PROMPT's greedy continuation (20 Adam steps, 8 tokens: 8-18 s at load 8-19): its
    slot 0 is accepted, so slot 1, the first the Markov chain conditions on a draft, gets verified. The random
    drafter's slot 0 is almost never accepted (1 of 149 rounds over 10 prompts x 16 steps, and there the fault left
    slot 1 as it was), so its changed slot >= 1 drafts stay NOT-VERIFIED."""
    from parity.spec.fit import fit_drafter
    from reference_cpu.engine import ReferenceEngine

    path = fit_drafter(tiny_f32, tmp_path_factory.mktemp("spec-faults") / "dspark-fit.gguf", "dspark", steps=20,
                       train_prompts=[PROMPT], decode=8, heldout=1).path
    return path, ReferenceEngine(str(tiny_f32), OPTS, draft=str(path))


def test_unconditioned_markov_chain_drifts_at_slot_1_once_slot_0_is_accepted(tiny_f32, fitted_dspark):
    path, ref = fitted_dspark
    clean = drafted(torch_engine(tiny_f32, path), ref, "dspark", steps=4)
    assert clean.drafter_divergence is None and not clean.defects and clean.rounds[0].accepted >= 1
    rep = drafted(torch_engine(tiny_f32, path, "dspark-markov-unconditioned"), ref, "dspark", steps=4)
    got = assert_drift_named(rep, "dspark.bias", 0)     # measured: d_1 accepted, d_2 changed in round 0
    # slot 0's bias is W2 W1[anchor] with or without the fault: it never changes, only slots after an accepted d_1
    assert all(r.drafts[0] == a.reference_drafts[0] for r, a in zip(rep.rounds, rep.attribution, strict=True))
    assert all(i >= 1 and rep.rounds[n].accepted >= i for n, i in got)


# ---------------------------------------------------------------- MTP pairings (spec §2.3)
class OwnRowFirst:
    """An MTP head whose `same` pair (X^(L)_p, t_p) predicts what the trunk's own row p predicts, as a well-fitted
    head's would: the last pair's logits are the trunk head's logits of X^(L)_p (ds4's draft 0, checked against the
    anchor for free, then passes); the chain is the drafter's own."""

    def __init__(self, inner) -> None:
        self.inner, self.ring = inner, None

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def new_mtp_state(self):
        self.ring = self.inner.new_mtp_state()    # the committed ring (chains run on copies of it)
        return self.ring

    def mtp_forward(self, state, carriers, tokens, start_pos, pairing="prev"):
        out = self.inner.mtp_forward(state, carriers, tokens, start_pos, pairing)
        if pairing == "same" and state is self.ring:   # the trunk rows' pairs, not a chain step
            out.logits = out.logits.copy()
            out.logits[-1] = self.inner.head(np.asarray(carriers[-1:]))[1][0]
        return out


@pytest.mark.parametrize("pairing", ["prev", "same"])
def test_both_pairings_are_exact_on_correct_engines(tiny_f32, mtp_file, reference, pairing):
    cand, ref = OwnRowFirst(torch_engine(tiny_f32, mtp_file)), OwnRowFirst(reference)
    rep = spec_report(cand, ref, "mtp", PROMPT, 8, ENV, depth=3, pairing=pairing)
    assert rep.exact and rep.state_divergence is None and rep.drafter_divergence is None and not rep.defects
    assert {k for k, v in rep.labels.items() if v} <= {"ACCEPT-OK", "DRAFTER-MISS", "NOT-VERIFIED"}
    assert rep.options["pairing"] == pairing
    # prev drafts depth (3) a round; same drafts depth - 1 (2): its first MTP output predicts the anchor itself
    assert {len(r.drafts) for r in rep.rounds} == {3 if pairing == "prev" else 2}
    assert all(r.verified == len(r.drafts) or r.cut == "budget" for r in rep.rounds)


def test_same_pairing_without_the_free_check_drafts_nothing(tiny_f32, mtp_file, reference):
    # the synthesized (random) MTP head never predicts the anchor from (X^(L)_c, t_c): no round speculates (ds4)
    rep = spec_report(torch_engine(tiny_f32, mtp_file), reference, "mtp", PROMPT, 4, ENV, depth=2, pairing="same")
    assert rep.exact and all(len(r.drafts) == 0 for r in rep.rounds) and not rep.defects


def test_pairing_options_are_checked(tiny_f32, mtp_file, reference):
    from parity.contract.errors import ParityError

    with pytest.raises(ParityError, match="--depth 1 with pairing same never drafts"):
        spec_report(reference, reference, "mtp", PROMPT, 4, ENV, depth=1, pairing="same")
    with pytest.raises(ParityError, match="MTP pairing 'next'"):
        spec_report(reference, reference, "mtp", PROMPT, 4, ENV, depth=2, pairing="next")
    with pytest.raises(ParityError, match="applies to an MTP drafter only"):
        spec_report(reference, reference, "script", PROMPT, 4, ENV, depth=2, pairing="same")


def cli(*args):
    from click.testing import CliRunner

    from parity.cli import cli as group

    return CliRunner().invoke(group, ["spec", *map(str, args)])


def test_cli_names_the_anchor_and_exits_1_and_checks_the_pairing(tiny_f32, mtp_file):
    import json

    env = Path(__file__).parent / "fixtures" / "spec" / "tiny-f32-nosims.envelope.json"
    common = ["-m", tiny_f32, "--tokens", " ".join(map(str, PROMPT)), "--envelope", env, "--steps", 4,
              "--no-fp8-kv", "--no-fp4-indexer"]
    res = cli(*common, "--script", "reject-at:2", "--depth", 3, "--engine", "torch", "--inject",
              "spec-logits-row-stale", "--json")
    assert res.exit_code == 1, res.output
    doc = json.loads(res.stdout)
    assert (doc["state_divergence"]["round"], doc["state_divergence"]["component"]) == (0, "anchor")
    r0 = doc["rounds"][0]   # 4 steps: the budget leaves 2 drafts; d_2 rejected, the bonus from the last row
    assert r0["accepted"] == 1 < r0["verified"] == 2 and r0["bonus"] == r0["verify"][2] != r0["verify"][1]
    res = cli(*common, "--draft", mtp_file, "--engine", "reference", "--depth", 2, "--mtp-pairing", "same", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["options"]["pairing"] == "same"
    for bad in (["--script", "accept-all", "--mtp-pairing", "same"], ["--draft", mtp_file, "--mtp-pairing", "next"]):
        res = cli(*common, *bad)
        assert res.exit_code == 2, (bad, res.output)
