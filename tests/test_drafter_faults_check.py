"""Acceptance of issue 24: `check` locates each drafter fault of the torch engine at the draft checkpoint it breaks
(`parity.check.draft_check`: the reference's drafter on the candidate's own trunk carriers, judged against its
round-off twins), with every draft checkpoint before it and the whole trunk judged fine.

Tiny F32 model, synthesized drafters, QAT sims on (the committed tiny-f32 envelope is measured with them), a 12-token
prompt traced at every position with full vectors. `dspark-tap-sum` is not located (benign by construction:
tests/test_drafter_faults.py, docs/drafters.md). `dspark-stale-ring` acts at the first round whose ring write
starts after position 0 and holds more than one row (`parity.tracing.drafts.dspark_commit_bases`, B = 5: rounds
1..5 write rows 0..p, rounds 6..11 rows 6..p, so the round at 7 is the first to miss a row, row 6).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from parity import api
from parity.check.check_report import headline
from parity.contract.checkpoints import dspark_checkpoints, mtp_checkpoints
from parity.contract.engine import RunOptions
from parity.gguf.synth_draft import synthesize_drafter

PROMPT = [0, 5, 7, 9, 11, 13, 2, 4, 6, 8, 10, 12]
ENV_F32 = Path(__file__).parent.parent / "traces" / "tiny-f32.envelope.json"
CULPRIT = {   # fault -> the first draft checkpoint check judges a local departure and its position
    "mtp-pairing-same": ("mtp.0.in", 1),   # MTP: the first pair; DSpark: the first round (module doc)
    "mtp-hnorm-flat": ("mtp.0.in", 1),
    "mtp-no-hc-post": ("mtp.0", 1),
    "mtp-trunk-hc-head": ("mtp.0.logits", 1),
    "dspark-causal-block": ("dspark.0", 1),
    "dspark-markov-unconditioned": ("dspark.bias", 1),
    "dspark-stale-ring": ("dspark.0", 7),
}
# check's defect library (torch's drafter faults of the head, each a draft-head run on the candidate's carriers) must
# name these; the other two DSpark faults are judged without it (each DSpark library costs 5 head runs x 11 rounds,
# about a third of such a check; test_draft_trace.py::test_drafter_faults_are_named tests the library itself)
NAMED = {"mtp-pairing-same", "mtp-hnorm-flat", "mtp-no-hc-post", "mtp-trunk-hc-head", "dspark-stale-ring"}


@pytest.fixture(scope="module")
def drafters(tiny_f32, tmp_path_factory):
    d = tmp_path_factory.mktemp("drafter-faults-check")
    return {"mtp": synthesize_drafter(d / "mtp.gguf", tiny_f32, "mtp", "ds4-mtp"),
            "dspark": synthesize_drafter(d / "dspark.gguf", tiny_f32, "dspark", "ds4-dspark")}


@pytest.mark.parametrize("fault", sorted(CULPRIT))
def test_check_locates_the_drafter_fault_at_its_checkpoint(fault, tiny_f32, drafters, tmp_path):
    kind = fault.split("-")[0]
    cand = api.trace("torch", tiny_f32, PROMPT, positions="all", full="all", draft=drafters[kind],
                     options=RunOptions(inject=(fault,)))
    r = api.check(api.save_trace(cand, tmp_path / "cand.trace"), tiny_f32, envelope=ENV_F32, draft=drafters[kind],
                  fault_engines=("torch",) if fault in NAMED else ())
    culprit, position = CULPRIT[fault]
    assert r.verdict == "DEFECT", headline(r)
    assert (r.culprit.layer, r.culprit.position) == (f"drafter {culprit}", position), headline(r)
    assert [c.name for c in r.causes] == [fault if fault in NAMED else "unexplained"], headline(r)
    status = {row.checkpoint: row.status for row in r.table}
    names = mtp_checkpoints(1) if kind == "mtp" else dspark_checkpoints(3)
    assert [status[n] for n in names[: names.index(culprit)]] == ["ok"] * names.index(culprit)
    assert status[culprit] == "local"
    assert all(s == "ok" for n, s in status.items() if n not in names), status   # the trunk, embed .. logits
