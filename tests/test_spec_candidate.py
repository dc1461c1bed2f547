"""`v4parity spec --candidate TRACE` (issue 25 point 4): a foreign engine's speculative run, read from the `spec`
records of its trace, is attributed as a live run of the same rounds is.

The foreign engine is `imitate_c_engine`: a loop of its own (numpy, plain file I/O, none of v4parity's writers) that
takes per round only what an engine's kernels would give it (the drafts, the verify rows' argmaxes; here those of a
torch run), cuts the drafts at the step budget, accepts by the greedy rule of spec v4-mtp-dspark §4.1, keeps its
own committed tokens and round positions and prints the header and `spec` lines as docs/trace-format.md shows.
Independent expectations: the torch engine's live report (labels per round, exactness, acceptance), and for the
changed verify argmax the label the §6.2 table gives by construction (v ≠ ρ, d ∉ {ρ, v}: VERIFIER-DEFECT).
Tiny F32 trunk, QAT sims off, the committed sims-off envelope of tests/test_spec.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from parity import api
from parity.check.envelope import load_envelope
from parity.cli import cli as main
from parity.contract.engine import RunOptions
from parity.contract.errors import TraceError
from parity.gguf.synth_draft import synthesize_drafter
from parity.spec.accept import DEFECT_LABELS
from parity.spec.candidate import candidate_report, read_candidate, spec_trace
from parity.spec.report import spec_report
from parity.tracing.io import format_text, read_trace, write_trace

OPTS = RunOptions(fp8_kv=False, fp4_indexer=False)
ENVELOPE = Path(__file__).parent / "fixtures" / "spec" / "tiny-f32-nosims.envelope.json"
ENV = load_envelope(ENVELOPE, "float32")
PROMPT = [0, 5, 7, 9, 11, 13]
STEPS = 12
NOSIMS = ["--no-fp8-kv", "--no-fp4-indexer"]


@pytest.fixture(scope="module")
def mtp(tiny_f32, tmp_path_factory):
    return synthesize_drafter(tmp_path_factory.mktemp("cand") / "mtp.gguf", tiny_f32, "mtp", "ds4-mtp")


@pytest.fixture(scope="module")
def engines(tiny_f32, mtp):
    from gpu_engine.engine import TorchEngine
    from reference_cpu.engine import ReferenceEngine

    return ReferenceEngine(str(tiny_f32), OPTS, draft=str(mtp)), TorchEngine(str(tiny_f32), OPTS, draft=str(mtp))


@pytest.fixture(scope="module")
def live(engines):
    """The torch engine's live run: scripted drafts of depth 3 whose second is always wrong (accepts and rejects)."""
    ref, torch = engines
    return spec_report(torch, ref, "script", PROMPT, STEPS, ENV, depth=3, reject_at=2)


def imitate_c_engine(path: Path, first: int, outputs: list[tuple[list[int], list[int]]], identity: dict,
                     change: tuple[int, int] | None = None) -> list[str]:
    """A foreign engine's speculative loop writing its trace by hand. `first`: its prefill's argmax; `outputs`: per
    round its drafts d_1..d_k and verify argmaxes v_0..v_γ; `change` (round, token): that round's bonus verify
    argmax replaced by the token (a wrong verify row). Returns the spec lines it wrote."""
    tokens, lines = [*PROMPT, first], []
    for r, (drafts, verify) in enumerate(outputs):
        start = len(tokens) - 1                                # the anchor's position c + 1
        d = np.asarray(drafts)
        gamma = min(len(d), STEPS - (len(tokens) - len(PROMPT)) - 1)    # cut at the step budget
        v = np.asarray(verify[: gamma + 1]).copy()
        same = np.append(d[:gamma] == v[:gamma], False)
        a = int(np.argmin(same))                               # the longest prefix with d_i = v_(i-1)
        if change is not None and change[0] == r:
            v[a] = change[1]
        tokens += [int(t) for t in d[:a]] + [int(v[a])]
        lines.append(f"spec {r} pos {start}: drafts={','.join(str(int(t)) for t in d)} verified={gamma} "
                     f"cut={'-' if gamma == len(d) else 'budget'} verify={','.join(str(int(t)) for t in v)} "
                     f"accepted={a} conf=-")
    tokens = tokens[: len(PROMPT) + STEPS]
    header = ["v4parity-trace 1", "engine c-imitation 0.1 (numpy)",
              f"model {identity['size']} {identity['header_sha256']} {identity['file']}",
              f"model_data {identity['data_sha256']}", "dtype float32", "hc 4", "dim 256", "top_k 20",
              "tokens " + " ".join(map(str, tokens)), f"n_prompt {len(PROMPT)}",
              f"chunks {len(PROMPT)}" + " 1" * STEPS, f"decode {STEPS}", "positions", "checkpoints", "full -",
              'flags {"fp4_indexer":false,"fp8_kv":false}', "end"]
    with open(path, "w") as f:
        f.write("\n".join(header + lines) + "\n")
    return lines


def outputs_of(report) -> list[tuple[list[int], list[int]]]:
    return [(list(r.drafts), list(r.verify)) for r in report.rounds]


def same_attribution(a, b) -> None:
    assert [x.labels for x in a.attribution] == [x.labels for x in b.attribution]
    assert [x.reference for x in a.attribution] == [x.reference for x in b.attribution]
    assert a.exact == b.exact and a.committed_counts == b.committed_counts and a.defects == b.defects
    assert a.per_slot == b.per_slot and a.reference_per_slot == b.reference_per_slot
    assert a.spec_tokens == b.spec_tokens and a.cost == b.cost


def test_an_imitated_c_engine_is_attributed_as_the_torch_run(tiny_f32, engines, live, tmp_path):
    ref, torch = engines
    assert live.exact and not live.defects and live.labels["ACCEPT-OK"] > 0 and live.labels["DRAFTER-MISS"] > 0
    path = tmp_path / "c.trace"
    lines = imitate_c_engine(path, live.spec_tokens[0], outputs_of(live), api.model_identity(tiny_f32))
    # the doc's line is the writer's, byte for byte
    assert lines == format_text(spec_trace(live, torch)).split("\nend\n", 1)[1].splitlines()
    cand = candidate_report(read_candidate(path), path, ref, "script", ENV, None)
    same_attribution(cand, live)
    assert cand.state_divergence is None and not cand.state_checked and "records no engine state" in cand.state_note
    assert cand.plain_tokens is None


def test_a_changed_verify_argmax_is_a_defect_label_at_that_round(tiny_f32, engines, live, tmp_path):
    j = next(i for i, r in enumerate(live.rounds) if r.accepted < r.verified)
    r, rho = live.rounds[j], live.attribution[j].reference
    a = r.accepted
    wrong = next(t for t in range(300) if t not in (r.drafts[a], rho[a]))     # v ≠ ρ and d ∉ {ρ, v}
    path = tmp_path / "bad.trace"
    imitate_c_engine(path, live.spec_tokens[0], outputs_of(live), api.model_identity(tiny_f32), change=(j, wrong))
    res = CliRunner().invoke(main, ["spec", "-m", str(tiny_f32), "--candidate", str(path), "--envelope",
                                    str(ENVELOPE), "--json"])
    assert res.exit_code == 1, res.output
    out = json.loads(res.stdout)
    assert out["rounds"][j]["labels"][a] == "VERIFIER-DEFECT"
    assert [x["labels"] for x in out["rounds"][:j]] == [list(x.labels) for x in live.attribution[:j]]
    assert not any(set(x["labels"]) & set(DEFECT_LABELS) for x in out["rounds"][:j])
    assert out["committed"]["counts"]["WRONG"] >= 1 and out["first_divergence"]["class"] == "WRONG"
    assert out["first_divergence"]["spec_induced"] is None and out["tokens"]["plain"] is None
    assert out["state_divergence"] is None and out["state_note"]


def test_trace_out_and_candidate_give_the_live_report(tiny_f32, mtp, tmp_path):
    """The CLI both ways with the MTP drafter: `spec --engine torch --trace-out` then `spec --candidate`."""
    out = tmp_path / "live.trace"
    common = ["spec", "-m", str(tiny_f32), "--draft", str(mtp), "--envelope", str(ENVELOPE), "--json"]
    res = CliRunner().invoke(main, [*common, "--engine", "torch", "--depth", "2", "--steps", "10", "--tokens",
                                    ",".join(map(str, PROMPT)), *NOSIMS, "--trace-out", str(out)])
    assert res.exit_code == 0, res.output
    live = json.loads(res.stdout)
    res = CliRunner().invoke(main, [*common, "--candidate", str(out), "--markdown", str(tmp_path / "c.md")])
    assert res.exit_code == 0, res.output
    cand = json.loads(res.stdout)
    md = (tmp_path / "c.md").read_text()
    assert "EXACT: speculative == reference tokens" in md and "plain" not in md.splitlines()[2]
    assert "state parity: not checked: a trace records no engine state" in md
    assert "drafter parity (candidate vs reference drafter on the candidate's inputs): not checked" in md
    for key in ("exact", "labels", "acceptance", "committed", "cost", "defects"):
        assert cand[key] == live[key], key
    assert [x["labels"] for x in cand["rounds"]] == [x["labels"] for x in live["rounds"]]
    assert [x["reference_drafts"] for x in cand["rounds"]] == [x["reference_drafts"] for x in live["rounds"]]
    assert cand["state_divergence"] is None and not cand["state_checked"] and live["state_checked"]
    res = CliRunner().invoke(main, [*common, "--candidate", str(out), "--steps", "4"])
    assert res.exit_code == 2 and "drop --steps" in res.output
    res = CliRunner().invoke(main, [*common, "--candidate", str(out), "--mtp-pairing", "same"])
    assert res.exit_code == 2 and "drop --mtp-pairing" in res.output


HEADER = """v4parity-trace 1
engine c 1
model 1 0123456789abcdef0123456789abcdef m.gguf
dtype float32
hc 4
dim 8
top_k 4
tokens 0 1 2 5 6 7 8
n_prompt 3
chunks 3 1 1 1 1
decode 4
positions
checkpoints
full -
flags {"fp4_indexer":false,"fp8_kv":false}
end
"""
GOOD = ["spec 0 pos 3: drafts=6,9 verified=2 cut=- verify=6,7,4 accepted=1 conf=-",
        "spec 1 pos 5: drafts=8,1,3 verified=0 cut=budget verify=8 accepted=0 conf=0.5,-1,2e3"]
FIRST = 17     # the line number of GOOD[0] after HEADER


@pytest.mark.parametrize("line, old, new, field, message", [
    (0, "accepted=1", "accepted=0", "accepted", "greedy rule .* accepts 1"),
    (0, "verified=2 cut=-", "verified=1 cut=-", "cut", "cut is '-' exactly when all are"),
    (1, "verified=0 cut=budget", "verified=3 cut=budget", "cut", "cut is '-' exactly when all are"),
    (1, "cut=budget", "cut=later", "cut", "expected -, gate, max-draft, budget"),
    (0, "verify=6,7,4", "verify=6,7", "verify", "expected 3 comma-separated integers"),
    (0, "verify=6,7,4", "verify=6,3,4", "verify", "commits token 3 at position 5, but the header's tokens say 7"),
    (0, "pos 3", "pos 4", "pos", "starts at position 4, but the prompt ends at 3"),
    (1, "spec 1", "spec 2", "round", "round 2, expected 1"),
    (0, "drafts=6,9", "drafts=6,-9", "drafts", "must be in"),
    (1, "conf=0.5,-1,2e3", "conf=0.5,x,2e3", "conf", "expected a number"),
    (1, "conf=0.5,-1,2e3", "conf=0.5,2e3", "conf", "expected 3 comma-separated numbers"),
    (1, " accepted=0", "", "accepted", "required field missing"),
    (0, "conf=-", "conf=- speed=3", "speed", "unknown field"),
])
def test_spec_records_are_checked_line_by_line(tmp_path, line, old, new, field, message):
    lines = [*GOOD]
    assert old in lines[line]
    lines[line] = lines[line].replace(old, new)
    path = tmp_path / "t.trace"
    path.write_text(HEADER + "\n".join(lines) + "\n")
    with pytest.raises(TraceError, match=rf"t\.trace:{FIRST + line}: field '{field}': .*{message}"):
        read_trace(path, allow_spec_only=True)


def test_a_round_without_drafts(tmp_path):
    """A round that drafted nothing (e.g. an MTP pairing `same` whose anchor check failed) commits the anchor row's
    argmax alone: `drafts=-`."""
    path = tmp_path / "t.trace"
    lines = [GOOD[0], "spec 1 pos 5: drafts=- verified=0 cut=- verify=8 accepted=0 conf=-"]
    path.write_text(HEADER + "\n".join(lines) + "\n")
    t = read_trace(path, allow_spec_only=True)
    assert (t.spec[1].drafts, t.spec[1].verify, t.spec[1].accepted) == ((), (8,), 0)
    assert format_text(t) == path.read_text()
    path.write_text(HEADER + "\n".join([GOOD[0], lines[1].replace("drafts=-", "drafts=")]) + "\n")
    with pytest.raises(TraceError, match=rf"t\.trace:{FIRST + 1}: field 'drafts': .* or '-' for none"):
        read_trace(path, allow_spec_only=True)


def test_spec_only_traces_and_their_limits(tmp_path):
    path = tmp_path / "t.trace"
    path.write_text(HEADER + "\n".join(GOOD) + "\n")
    t = read_trace(path, allow_spec_only=True)
    assert [(r.start_pos, r.accepted, r.cut, r.conf) for r in t.spec] == [(3, 1, "", None),
                                                                         (5, 0, "budget", (0.5, -1.0, 2000.0))]
    assert format_text(t) == HEADER + "\n".join(GOOD).replace("2e3", "2000") + "\n"
    with pytest.raises(TraceError, match="spec records alone .* the other commands need checkpoint records"):
        read_trace(path)
    with pytest.raises(TraceError, match="text form only"):
        write_trace(t, tmp_path / "t.npz")
    path.write_text(HEADER + GOOD[0] + "\n")
    with pytest.raises(TraceError, match="commit tokens up to position 5, .* on to 6: a round is missing"):
        read_trace(path, allow_spec_only=True)
    path.write_text(HEADER)
    with pytest.raises(TraceError, match="no checkpoints listed"):
        read_trace(path, allow_spec_only=True)


def test_a_trace_of_another_model_or_vocabulary_is_refused(tiny_f32, tmp_path):
    path = tmp_path / "t.trace"
    path.write_text(HEADER + "\n".join(GOOD) + "\n")
    res = CliRunner().invoke(main, ["spec", "-m", str(tiny_f32), "--candidate", str(path), "--envelope",
                                    str(ENVELOPE)])
    assert res.exit_code == 2 and "field 'model': size 1 is not the model's" in res.output
