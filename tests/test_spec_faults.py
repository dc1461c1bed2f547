"""The speculative-path faults of the torch engine (gpu_engine.faults.SPEC_FAULT_TABLE, spec v4-mtp-dspark §4.4,
§4.6) as `v4parity spec` reports them on the tiny F32 trunk (QAT sims off, seed 0): plain decode unchanged, the
first affected round, the differing state component, exit status 1. Expected rounds and components follow from the
tiny config (window 8, compress ratios 0, 0, 4, 128, 4, 128: layer 2 is the first compressed layer, ratio 4) and the
scripted drafts' positions, not from the code under test."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from parity.bisect.envelope import load_envelope
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
