"""`v4parity spec --engine llamacpp` (issue 25): llama.cpp drafts with its own MTP graph, verifies with its own
trunk graph and undoes rejected rows with its own rollback (`llama_memory_seq_rm` into the DSV4 cache's rollback
planes, `lcp_rs_seq`); tiny F32 trunk, a synthesized F32 MTP drafter in llama.cpp's layout, QAT simulations off.

What is checked: the speculative tokens equal plain decode's and the reference's; the labels are those of a correct
engine; the rejected rows leave no trace (two runs that differ only in what they rejected continue bit for bit
alike); the compressed rows llama.cpp's captures show after every commit match the reference's sequential decode;
a rollback deeper than the planes is refused by llama.cpp and named.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from requires import require

from parity.check.envelope import load_envelope
from parity.compare.metrics import rel_l2
from parity.contract.engine import RunOptions
from parity.contract.errors import ParityError
from parity.gguf.synth_draft import synthesize_drafter
from parity.spec.report import spec_report
from parity.tracing.runner import forward_chunk

OPTS = RunOptions(fp8_kv=False, fp4_indexer=False)
# the torch engine's envelope on tiny f32 (seed 0), sims off (tests/test_spec.py measured it; logit_rel 9.6e-7)
ENVELOPE = Path(__file__).parent / "fixtures" / "spec" / "tiny-f32-nosims.envelope.json"
PROMPT = [0, 5, 7, 9, 11, 13]
CORRECT = {"ACCEPT-OK", "DRAFTER-MISS", "NOT-VERIFIED"}
# llama.cpp's committed compressed rows vs the reference's sequential decode, rel-L2 per component and commit:
# measured <= 8.5e-7 (comp rows) and <= 7.7e-7 (index rows) over 24 commits; llama.cpp's plain decode is as far
ROWS_TOL = 2e-6


@pytest.fixture(scope="module")
def drafter(tiny_f32, tmp_path_factory):
    return synthesize_drafter(tmp_path_factory.mktemp("lcp-spec") / "mtp.gguf", tiny_f32, "mtp", "llamacpp-mtp")


@pytest.fixture(scope="module")
def engines(tiny_f32, drafter):
    require("llama_cpp")
    from llamacpp_engine.engine import LlamaCppEngine
    from reference_cpu.engine import ReferenceEngine

    return (LlamaCppEngine(str(tiny_f32), OPTS, draft=str(drafter)),
            ReferenceEngine(str(tiny_f32), OPTS, draft=str(drafter)))


def recording(engine):
    """The trunk states `engine.new_state` hands out from now on, in order (the driver keeps its own)."""
    made, new = [], engine.new_state

    def new_state():
        made.append(new())
        return made[-1]

    engine.new_state = new_state
    return made


def reference_rows(ref, tokens, n_prompt, ends):
    """The reference's compressed rows (`StateView` names) after plain decode of `tokens` (prompt as one chunk, then
    one token at a time) to each position in `ends`."""
    state, out, pos = ref.new_state(), {}, n_prompt
    forward_chunk(ref, state, np.asarray(tokens[:n_prompt], np.int64), 0)
    for end in ends:
        for p in range(pos, end):
            forward_chunk(ref, state, np.asarray(tokens[p : p + 1], np.int64), p)
        pos = max(pos, end)
        out[end] = {k: v for k, v in ref.state_arrays(state).items() if k.endswith((".comp.rows", ".index.rows"))}
    return out


def test_spec_engine_llamacpp_with_its_mtp_runs_end_to_end(tiny_f32, drafter):
    """The command on llama.cpp's MTP file: exact, correct labels, and a rollback in every verified round (a random
    drafter is always rejected: llama.cpp removes every draft row it verified)."""
    require("llama_cpp")
    from parity.cli import cli

    res = CliRunner().invoke(cli, ["spec", "-m", str(tiny_f32), "--draft", str(drafter), "--engine", "llamacpp",
                                   "--depth", "2", "--steps", "10", "--tokens", ",".join(map(str, PROMPT)),
                                   "--no-fp8-kv", "--no-fp4-indexer", "--envelope", str(ENVELOPE), "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["exact"] is True and doc["first_divergence"] is None and not doc["defects"]
    assert doc["tokens"]["spec"] == doc["tokens"]["plain"] == doc["tokens"]["reference"]
    assert {k for k, v in doc["labels"].items() if v} <= CORRECT and doc["labels"]["DRAFTER-MISS"] > 0
    rolled = [r for r in doc["rounds"] if r["verified"] and r["accepted"] < r["verified"]]
    assert len(rolled) >= 8 and all(r["replayed"] == r["accepted"] + 1 for r in rolled)
    assert doc["options"]["engine"] == "llamacpp" and "lcp_rs_seq=16" in doc["options"]["flags"]["engine_args"]
    # llama.cpp shows no full StateView: its compressed rows are compared after every commit, and the report says so
    assert doc["state_checked"] is True and doc["state_divergence"] is None
    assert doc["state_note"].startswith("compressed rows only") and "raw window rows" in doc["state_note"]


def test_partial_rollback_is_exact_and_its_committed_rows_match_sequential_decode(engines):
    """Scripted drafts wrong from the second on (depth 3): llama.cpp keeps 2 of the 4 verify rows and removes 2 with
    `llama_memory_seq_rm`; the compressed rows it shows after every commit are the reference's sequential ones."""
    lcp, ref = engines
    made = recording(lcp)
    env = load_envelope(ENVELOPE, "float32")
    rep = spec_report(lcp, ref, "script", PROMPT, 24, env, depth=3, reject_at=2)
    assert rep.exact and rep.spec_tokens == rep.reference_tokens
    assert {k for k, v in rep.labels.items() if v} <= CORRECT
    full = [r for r in rep.rounds if r.verified == 3]
    assert len(full) >= 5 and all(r.accepted == 1 and r.replayed == 2 for r in full)
    seen = lcp.committed_rows(made[-1])   # the speculative sequence (made after the plain decode's)
    # committed chunks: the prompt, then each round's accepted rows (anchor + a' drafts) at its start position
    assert [end for end, _ in seen] == [len(PROMPT), *(r.start_pos + r.accepted + 1 for r in rep.rounds)]
    tokens = [*PROMPT, *rep.spec_tokens]
    want = reference_rows(ref, tokens, len(PROMPT), [end for end, _ in seen])
    compared = 0
    for end, rows in seen:
        assert set(rows) == set(want[end])
        for name, arr in rows.items():
            assert arr.shape == want[end][name].shape, (end, name)
            if len(arr):
                compared += 1
                assert rel_l2(want[end][name].reshape(1, -1), arr.reshape(1, -1))[0] <= ROWS_TOL, (end, name)
    assert compared >= 4 * (len(seen) - 1)   # both ratio-4 layers' comp and index rows after every commit


def test_state_parity_compares_the_rows_llamacpp_shows_and_names_a_wrong_one(engines, monkeypatch):
    """`spec`'s state parity on llama.cpp (a `PartialStateView`): its committed compressed rows against the
    reference's after every commit; one row moved by 1e-2 in what llama.cpp shows is named after round 0."""
    lcp, ref = engines
    env = load_envelope(ENVELOPE, "float32")
    rep = spec_report(lcp, ref, "script", PROMPT, 8, env, depth=3, reject_at=2)
    assert rep.state_checked and rep.state_divergence is None and rep.state_note.startswith("compressed rows only")
    shown = lcp.visible_state

    def moved(state):
        rows, note = shown(state)
        name = next(k for k, v in rows.items() if len(v))
        return {**rows, name: rows[name] + np.float32(1e-2)}, note

    monkeypatch.setattr(lcp, "visible_state", moved)
    rep = spec_report(lcp, ref, "script", PROMPT, 8, env, depth=3, reject_at=2)
    div = rep.state_divergence
    assert div is not None and div.round == 0 and div.kind == "values" and div.component.endswith(".comp.rows")
    assert rep.defects


def rolled_back_run(lcp, tokens, n_prompt, tails):
    """Feed `tokens` one accepted row a round, each verified in a batch with the two rejected rows `tails[i]`,
    restored by llama.cpp's rollback and fed again (the driver's protocol). Returns every round's verify logits and
    the committed rows."""
    state = lcp.new_state()
    forward_chunk(lcp, state, np.asarray(tokens[:n_prompt], np.int64), 0)
    verify = []
    for i, p in enumerate(range(n_prompt, len(tokens))):
        saved = lcp.snapshot(state)
        batch = np.asarray([tokens[p], *tails[i]], np.int64)
        verify.append(forward_chunk(lcp, state, batch, p).logits)
        state = lcp.restore(state, saved)
        forward_chunk(lcp, state, batch[:1], p)
    return verify, lcp.committed_rows(state)


def test_rejected_rows_leave_no_trace_in_llamacpps_state(engines):
    """Two runs that accept the same tokens but reject different ones: every later verify row and every committed
    compressed row is bit-identical, so `llama_memory_seq_rm` took back all the rejected rows wrote (raw window,
    compressor and indexer accumulators, compressed rows), across block boundaries (ratio 4: every 4th position)."""
    lcp, _ = engines
    rng = np.random.default_rng(7)
    tokens = rng.integers(2, 290, 22)
    tails = [rng.integers(2, 290, (16, 2)) for _ in range(2)]
    runs = [rolled_back_run(lcp, tokens, 6, t) for t in tails]
    (va, ra), (vb, rb) = runs
    assert all(not np.array_equal(a[1:], b[1:]) for a, b in zip(va, vb, strict=True))   # the rejected rows differed
    for a, b in zip(va, vb, strict=True):
        np.testing.assert_array_equal(a[0], b[0])
    assert len(ra) == len(rb) == 17
    for (ea, a), (eb, b) in zip(ra, rb, strict=True):
        assert ea == eb and a.keys() == b.keys()
        for name in a:
            np.testing.assert_array_equal(a[name], b[name], err_msg=f"{name} after position {ea - 1}")


def test_a_rollback_deeper_than_the_planes_is_refused_by_llamacpp(tiny_f32):
    require("llama_cpp")
    from parity.contract.engine import load_engine

    lcp = load_engine("llamacpp", str(tiny_f32), RunOptions(fp8_kv=False, fp4_indexer=False,
                                                            engine_args=("lcp_rs_seq=2",)))
    state = lcp.new_state()
    forward_chunk(lcp, state, np.asarray(PROMPT, np.int64), 0)
    saved = lcp.snapshot(state)
    forward_chunk(lcp, state, np.asarray([3, 4, 5, 6], np.int64), len(PROMPT))
    state = lcp.restore(state, saved)
    forward_chunk(lcp, state, np.asarray([3, 4], np.int64), len(PROMPT))   # 2 rows back: within the planes
    saved = lcp.snapshot(state)
    forward_chunk(lcp, state, np.asarray([5, 6, 7, 8], np.int64), len(PROMPT) + 2)
    state = lcp.restore(state, saved)
    with pytest.raises(ParityError, match=r"llama_memory_seq_rm refused .* at most lcp_rs_seq=2 positions"):
        forward_chunk(lcp, state, np.asarray([5], np.int64), len(PROMPT) + 2)   # 3 rows back


def test_capture_llamacpp_draft_records_what_the_trace_route_records(tiny_f32, drafter, tmp_path):
    """`capture llamacpp --draft` (issue 24 item 4): its draft:<checkpoint> arrays are the draft checkpoints of
    `trace --engine llamacpp --draft` on the same tokens, bit for bit (both run llama.cpp's MTP graph on llama.cpp's
    own carriers of one schedule), at the positions the trace records them."""
    require("llama_cpp")
    from parity import api
    from parity.cli import cli

    tokens, out = [0, 5, 7, 9, 11, 13, 2, 4], tmp_path / "cap.npz"
    args = ["capture", "llamacpp", "-m", str(tiny_f32), "--tokens", ",".join(map(str, tokens)), "--decode", "3",
            "--draft", str(drafter), "--mtp-depth", "2", "-o", str(out), "--json"]
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["n_draft"] == 8
    trace = api.trace("llamacpp", tiny_f32, tokens, decode=3, positions="all", full="all", options=OPTS,
                      draft=str(drafter), mtp_depth=2)
    with np.load(out) as z:
        cap = {k: z[k] for k in z.files}
    assert json.loads(str(cap["meta"]))["draft"] == trace.header.draft
    assert cap["input_ids"].tolist() == trace.header.tokens
    names = [n for n in trace.header.checkpoints if n.startswith("mtp.")]
    assert sorted(names) == sorted(k.removeprefix("draft:") for k in cap if k.startswith("draft:"))
    for name in names:
        np.testing.assert_array_equal(cap[f"draft:{name}"], trace.vectors[name], err_msg=name)
        assert cap[f"draft_positions:{name}"].tolist() == list(range(1, len(cap["input_ids"])))   # prev pairs
    res = CliRunner().invoke(cli, [*args[:8], "--mtp-depth", "2", "-o", str(tmp_path / "x.npz")])
    assert res.exit_code == 2 and "give --draft FILE" in res.output
