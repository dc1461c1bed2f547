"""The speculative-path faults of the torch engine (gpu_engine.faults.SPEC_FAULT_TABLE, spec v4-mtp-dspark §4.4,
§4.6) as `v4parity spec` reports them on the tiny F32 trunk (QAT sims off, seed 0): plain decode unchanged, the
first affected round, the differing state component, exit status 1. Expected rounds and components follow from the
tiny config (window 8, compress ratios 0, 0, 4, 128, 4, 128: layer 2 is the first compressed layer, ratio 4) and the
scripted drafts' positions, not from the code under test."""

from __future__ import annotations

from pathlib import Path

import pytest

from parity.bisect.envelope import load_envelope
from parity.contract.engine import RunOptions
from parity.gguf.synth_draft import synthesize_drafter
from parity.spec.report import spec_report

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
