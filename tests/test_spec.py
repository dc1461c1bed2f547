"""`v4parity spec`: the speculative driver on the tiny F32 trunk (QAT sims off) with synthesized random drafters and
scripted drafts (spec v4-mtp-dspark §4, §6): speculative tokens == plain greedy == the reference's; the labels of
correct engines; a hand-made case for every label through engines wrapped to misbehave; the accept rule and the
gates on hand-computed numbers; the CLI's JSON keys and exit codes."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from parity.check.envelope import Envelope, load_envelope
from parity.contract.engine import RunOptions
from parity.contract.errors import ParityError
from parity.gguf.synth_draft import synthesize_drafter
from parity.spec.accept import Gate, Slot, accept_length, label
from parity.spec.report import spec_report

OPTS = RunOptions(fp8_kv=False, fp4_indexer=False)
# the torch engine's envelope on tiny f32 (seed 0), sims off, as `v4parity envelope --no-fp8-kv --no-fp4-indexer`
# measured it (15 s; logit_rel 9.6e-7)
ENVELOPE = Path(__file__).parent / "fixtures" / "spec" / "tiny-f32-nosims.envelope.json"
ENV = load_envelope(ENVELOPE, "float32")
WIDE = Envelope("float32", {}, {}, {}, 1.0)   # every reordering counts as noise: tie threshold 10 |logit|
PROMPTS = ([0, 5, 7, 9, 11, 13], [0, 200, 3, 77, 140, 9, 31, 250], [0, 42, 42, 17, 260, 3, 99, 5, 120, 64])
CORRECT = {"ACCEPT-OK", "DRAFTER-MISS", "NOT-VERIFIED"}


@pytest.fixture(scope="module")
def drafts(tiny_f32, tmp_path_factory):
    d = tmp_path_factory.mktemp("spec")
    return {kind: synthesize_drafter(d / f"{kind}.gguf", tiny_f32, kind, layout)
            for kind, layout in (("mtp", "ds4-mtp"), ("dspark", "ds4-dspark"))}


@pytest.fixture(scope="module")
def engines(tiny_f32, drafts):
    from gpu_engine.engine import TorchEngine
    from reference_cpu.engine import ReferenceEngine

    return {(name, kind): cls(str(tiny_f32), OPTS, draft=str(drafts[kind]))
            for name, cls in (("reference", ReferenceEngine), ("torch", TorchEngine)) for kind in drafts}


def run(engines, name, kind, prompt=PROMPTS[0], steps=16, env=ENV, cand=None, **kw):
    ref = engines[("reference", "mtp" if kind == "script" else kind)]
    cand = cand or engines[(name, "mtp" if kind == "script" else kind)]
    return spec_report(cand, ref, kind, prompt, steps, env, drafter=ref.drafter.config, **kw)


# ---------------------------------------------------------------- pure rules, hand-computed


def test_accept_rule_takes_the_longest_prefix_matching_the_previous_row():
    assert accept_length(np.array([4, 5, 6]), np.array([4, 5, 6, 7])) == 3
    assert accept_length(np.array([4, 9, 6]), np.array([4, 5, 6, 7])) == 1   # d_2 != v_1: d_3 is not looked at
    assert accept_length(np.array([3]), np.array([4, 5])) == 0
    assert accept_length(np.array([], np.int64), np.array([4])) == 0
    with pytest.raises(ParityError, match="2 drafts need 3 verify rows"):
        accept_length(np.array([1, 2]), np.array([1, 2]))


def test_gates_cut_where_the_confidences_say():
    c = np.log(np.array([0.9, 0.8, 0.4, 0.95]) / (1 - np.array([0.9, 0.8, 0.4, 0.95])))   # σ(c) = those numbers
    assert Gate.parse("none").keep(c, 4) == 4
    assert Gate.parse("first-below:0.5").keep(c, 4) == 2          # σ_3 = 0.4 < 0.5
    assert Gate.parse("first-below:0.3").keep(c, 4) == 4
    assert Gate.parse("cumulative:0.7").keep(c, 4) == 2           # 0.9, 0.72, 0.288
    assert Gate.parse("cumulative:0.75").keep(c, 4) == 1
    with pytest.raises(ParityError, match="no confidence head"):
        Gate.parse("first-below:0.5").keep(None, 3)
    for bad in ("first-below", "cumulative:1.5", "first-below:x", "always"):
        with pytest.raises(ParityError, match="expected none, first-below:P or cumulative:P"):
            Gate.parse(bad)


def test_the_gate_then_max_draft_then_the_step_budget_cut_the_drafts():
    from parity.spec.drafts import Proposal
    from parity.spec.driver import cut_drafts

    sig = np.array([0.9, 0.8, 0.4, 0.95, 0.9])
    p = Proposal(np.arange(5), np.log(sig / (1 - sig)), None)
    assert cut_drafts(p, Gate.parse("none"), None, 10) == (5, "")
    assert cut_drafts(p, Gate.parse("first-below:0.5"), None, 10) == (2, "gate")
    assert cut_drafts(p, Gate.parse("first-below:0.5"), 1, 10) == (1, "max-draft")
    assert cut_drafts(p, Gate.parse("none"), 3, 1) == (1, "budget")
    assert cut_drafts(p, Gate.parse("none"), None, 0) == (0, "budget")


@pytest.mark.parametrize("slot, expected", [
    (None, "NOT-VERIFIED"),
    (Slot(7, 7, 7, 2.0, 0.1, 7, 0.0, 0.1), "ACCEPT-OK"),
    (Slot(7, 8, 7, 2.0, 0.1, 7, 0.0, 0.1), "FALSE-REJECT"),
    (Slot(8, 8, 7, 2.0, 0.1, 8, 0.0, 0.1), "FALSE-ACCEPT"),
    (Slot(9, 8, 7, 2.0, 0.1, 9, 0.0, 0.1), "VERIFIER-DEFECT"),
    (Slot(9, 8, 7, 0.05, 0.1, 9, 0.0, 0.1), "NEAR-TIE"),        # the verifier's flip is inside the noise
    (Slot(9, 7, 7, 2.0, 0.1, 9, 0.0, 0.1), "DRAFTER-MISS"),
    (Slot(9, 7, 7, 2.0, 0.1, 5, 3.0, 0.1), "DRAFTER-DRIFT"),
    (Slot(9, 7, 7, 2.0, 0.1, 5, 0.01, 0.1), "NEAR-TIE"),        # the drafters' flip is inside the noise
])
def test_each_label_by_its_condition(slot, expected):
    assert label(slot) == expected


# ---------------------------------------------------------------- correct engines: exact, only benign labels


@pytest.mark.parametrize("name, kind, kw, prompt", [
    ("reference", "mtp", {"depth": 1}, 0),
    ("torch", "mtp", {"depth": 2}, 1),
    ("reference", "dspark", {}, 2),
    ("torch", "dspark", {"gate": Gate.parse("first-below:0.5")}, 0),
    ("reference", "script", {"depth": 3}, 2),
    ("torch", "script", {"depth": 3, "reject_at": 2}, 0),
])
def test_speculative_tokens_equal_plain_and_reference_with_benign_labels(engines, name, kind, kw, prompt):
    rep = run(engines, name, kind, prompt=PROMPTS[prompt], **kw)
    assert rep.exact and rep.divergence is None
    assert rep.spec_tokens == rep.plain_tokens == rep.reference_tokens and len(rep.spec_tokens) == 16
    assert {k for k, v in rep.labels.items() if v} <= CORRECT and not rep.defects
    assert rep.state_checked and rep.state_divergence is None   # every commit's caches equal the reference's
    assert rep.committed_counts == {"MATCH": 16, "TIE": 0, "WRONG": 0}
    assert [x.token for x in rep.committed] == list(rep.spec_tokens)
    for r, a in zip(rep.rounds, rep.attribution, strict=True):
        assert r.verify == a.reference                  # the candidate's verifier rows pick the reference's tokens
        assert len(a.labels) == len(r.drafts)
        assert r.replayed == (r.accepted + 1 if r.accepted < r.verified else 0)
    if kind == "dspark":
        assert all(len(r.drafts) == 5 for r in rep.rounds)
    if "gate" in kw:   # γ = the drafts before the first σ(c) < 0.5, unless the step budget cut first
        assert all(r.verified == min(kw["gate"].keep(np.array(r.confidence), 5), 16) for r in rep.rounds
                   if r.cut != "budget")
        assert any(r.cut == "gate" for r in rep.rounds)


def test_scripted_drafts_accept_all_and_reject_at_a_depth(engines):
    full = run(engines, "reference", "script", depth=3, prompt=PROMPTS[1])
    assert full.exact and all(r.accepted == r.verified for r in full.rounds)
    assert full.labels["ACCEPT-OK"] == sum(r.verified for r in full.rounds)
    assert len(full.rounds) == 4    # 16 tokens at 4 a round (3 drafts + the bonus)
    assert full.per_slot == full.reference_per_slot == (1.0, 1.0, 1.0)
    cut = run(engines, "torch", "script", depth=3, reject_at=2, prompt=PROMPTS[1])
    assert cut.exact and len(cut.rounds) == 8       # 2 tokens a round (d_1 and the bonus) after the prefill's 1
    for r, a in zip(cut.rounds[:-1], cut.attribution[:-1], strict=True):
        assert r.accepted == 1 and r.replayed == 2
        assert a.labels == ("ACCEPT-OK", "DRAFTER-MISS", "NOT-VERIFIED")
    last = cut.rounds[-1]   # one token left to generate: no draft verified, the anchor's row gives it
    assert (last.verified, last.cut, last.replayed) == (0, "budget", 0)
    assert set(cut.attribution[-1].labels) == {"NOT-VERIFIED"}
    assert cut.per_slot[:2] == (1.0, 0.0)


# ---------------------------------------------------------------- misbehaving engines: one label each


class Wrapped:
    """The reference engine with its verify rows (chunks of >= 2 rows, past the prompt) or its drafts altered."""

    def __init__(self, inner, verify_shift=None, boost=50.0, roll_drafts=False):
        self.inner, self.verify_shift, self.boost, self.roll_drafts = inner, verify_shift, boost, roll_drafts
        self.in_verify = False

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def forward_layer(self, state, layer, carrier, tokens, start_pos, capture=False):
        self.in_verify = start_pos > 0 and len(tokens) > 1
        return self.inner.forward_layer(state, layer, carrier, tokens, start_pos, capture)

    def head(self, carrier):
        final, logits = self.inner.head(carrier)
        if self.verify_shift is not None and self.in_verify:
            logits = logits.copy()   # row 1 (v_1) picks top-1 + shift (mod V) by `boost` over the top-1
            logits[1, (logits[1].argmax() + self.verify_shift) % len(logits[1])] = logits[1].max() + self.boost
        return final, logits

    def mtp_forward(self, state, carriers, tokens, start_pos, pairing="prev"):
        out = self.inner.mtp_forward(state, carriers, tokens, start_pos, pairing)
        if self.roll_drafts:
            out.logits = np.roll(out.logits, 3, axis=1)
        return out


@pytest.mark.parametrize("shift, reject_at, env, expected, cls", [
    (1, None, ENV, "FALSE-REJECT", "WRONG"),      # d_2 = ρ_1, v_1 wrong
    (1, 2, ENV, "FALSE-ACCEPT", "WRONG"),         # d_2 = ρ_1 + 1 = v_1
    (2, 2, ENV, "VERIFIER-DEFECT", "WRONG"),      # d_2 = ρ_1 + 1, v_1 = ρ_1 + 2
    (1, None, WIDE, "NEAR-TIE", "TIE"),           # the same wrong v_1 inside a (wide) noise envelope
])
def test_a_wrong_verifier_row_gets_its_label_and_the_divergence_its_class(engines, shift, reject_at, env, expected,
                                                                          cls):
    ref = engines[("reference", "mtp")]
    rep = run(engines, "reference", "script", steps=8, env=env, depth=3, reject_at=reject_at,
              cand=Wrapped(ref, verify_shift=shift))
    assert rep.attribution[0].labels[:2] == ("ACCEPT-OK", expected)
    assert rep.rounds[0].verify[1] != rep.attribution[0].reference[1]
    d = rep.divergence
    assert d is not None and d.cls == cls and d.spec_induced and d.step == 2   # v_1 is committed as step 2
    assert d.plain == d.reference != d.spec
    assert (d.margin <= d.tie) == (cls == "TIE") and d.margin_ulps > 0
    assert bool(rep.defects) == (cls == "WRONG")
    # teacher-forced, every committed token on its own prefix: step 2 (v_1) is the altered one, and every later
    # round's v_1 too when its d_1 is accepted
    step2 = rep.committed[2]
    assert (step2.cls, step2.token, step2.reference) == (cls, d.spec, d.reference)
    assert rep.committed_counts[cls] >= 1 and rep.committed_counts["TIE" if cls == "WRONG" else "WRONG"] == 0


def test_a_drafter_that_departs_from_the_reference_drafter_is_drafter_drift(engines):
    ref = engines[("reference", "mtp")]
    rep = run(engines, "reference", "mtp", steps=8, depth=1, cand=Wrapped(ref, roll_drafts=True))
    assert rep.exact   # drafts never change the tokens
    n = rep.labels["DRAFTER-DRIFT"]
    # the wrapper moves the MTP logits only: the first departing draft checkpoint is mtp.0.logits
    assert n > 0 and rep.defects == [f"DRAFTER-DRIFT x{n} (drafter departs at mtp.0.logits from round 0)"]
    for r, a in zip(rep.rounds, rep.attribution, strict=True):
        assert r.drafts[0] != a.reference_drafts[0]


class SharedCompressors(Wrapped):
    """A snapshot that copies the raw windows but shares the compressor and indexer states (spec §4.4, D2): the
    verify batch's rejected rows stay in the accumulators after the restore."""

    def snapshot(self, state):
        from dataclasses import replace

        return type(state)([replace(layer) for layer in state.layers])


def test_an_incomplete_snapshot_is_named_by_state_parity(engines):
    ref = engines[("reference", "mtp")]
    rep = run(engines, "reference", "script", steps=8, depth=3, reject_at=2, cand=SharedCompressors(ref))
    d = rep.state_divergence
    assert d is not None and d.round == 0 and d.component.startswith("blk.2.comp.")   # layer 2: the first CSA layer
    assert rep.attribution[0].labels == ("ACCEPT-OK", "DRAFTER-MISS", "NOT-VERIFIED")   # round 0 verified right
    assert f"state {d.component} after round 0" in rep.defects


@pytest.fixture(scope="module")
def faulty(tiny_f32, drafts):
    from gpu_engine.engine import TorchEngine

    return {f: TorchEngine(str(tiny_f32), RunOptions(fp8_kv=False, fp4_indexer=False, inject=(f,)),
                           draft=str(drafts["mtp"])) for f in ("spec-ring-exact-window", "spec-no-compressor-restore")}


def test_spec_faults_leave_plain_decode_alone_and_are_found_where_they_act(engines, faulty):
    from gpu_engine.faults import SPEC_FAULTS

    assert set(faulty) <= set(SPEC_FAULTS)   # the others: tests/test_spec_faults.py
    # a verify batch in a W-slot ring: round 0's rows 1.. read later rows (W = 8, batch of 4 at positions 6..9)
    ring = run(engines, "torch", "script", steps=8, depth=3, reject_at=3, cand=faulty["spec-ring-exact-window"])
    assert ring.plain_tokens == ring.reference_tokens
    assert ring.attribution[0].labels[0] in ("FALSE-REJECT", "VERIFIER-DEFECT")
    assert ring.divergence.cls == "WRONG" and ring.divergence.spec_induced and ring.defects
    # a restore that keeps the emitted rows: round 0 accepts 2 of 3 (positions 6..9 complete block 1 of the
    # ratio-4 layer 2 at position 7, replayed: a phantom row)
    rows = run(engines, "torch", "script", steps=8, depth=3, reject_at=3, cand=faulty["spec-no-compressor-restore"])
    assert rows.plain_tokens == rows.reference_tokens
    assert rows.rounds[0].accepted == 2 and rows.rounds[0].replayed == 3
    d = rows.state_divergence
    assert (d.round, d.component, d.kind) == (0, "blk.2.comp.rows", "shape")
    assert d.why == "shape (3, 96) vs reference (2, 96)" and "state blk.2.comp.rows after round 0" in rows.defects
    # with a QAT simulation on, a difference of values only may be one code flip (spec §4.5.2): noted, not a defect
    flags = {**rows.options["flags"], "fp8_kv": True}
    noted = replace(rows, state_divergence=replace(d, kind="values"), options={**rows.options, "flags": flags})
    assert noted.state_flip_possible and not any(x.startswith("state") for x in noted.defects)
    assert not replace(rows, options={**rows.options, "flags": flags}).state_flip_possible   # a shape: a defect


def test_state_differences_by_kind():
    from parity.spec.stateparity import component_difference, first_difference

    a = np.array([[1.0, 2.0], [3.0, -np.inf]])
    assert component_difference(a, a.copy(), 1e-6) is None
    assert component_difference(a[:1], a, 1e-6) == ("shape", "shape (1, 2) vs reference (2, 2)")
    assert component_difference(np.nan_to_num(a, neginf=0.0), a, 1e-6)[0] == "non-finite"
    b = a.copy()
    b[0, 0] += 1e-3     # rel-L2 = 1e-3 / sqrt(1 + 4 + 9) over the finite entries
    assert component_difference(b, a, 2e-4)[0] == "values"
    assert component_difference(b, a, 3e-4) is None
    assert first_difference({"x": a}, {"x": a, "y": a}, 1e-6) == ("y", "shape", "missing in the candidate")


# ---------------------------------------------------------------- the command


def cli(*args):
    from parity.cli import cli as group

    return CliRunner().invoke(group, ["spec", *map(str, args)])


def test_cli_json_keys_and_exit_codes(tiny_f32, drafts):
    base = ["-m", tiny_f32, "--tokens", "0 5 7 9 11 13", "--envelope", ENVELOPE, "--steps", 6]
    common = [*base, "--no-fp8-kv", "--no-fp4-indexer"]
    res = cli(*common, "--draft", drafts["mtp"], "--engine", "reference", "--depth", 2, "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert {"exact", "first_divergence", "labels", "rounds", "acceptance", "state_divergence"} <= set(doc)
    assert doc["exact"] is True and doc["first_divergence"] is None and doc["state_divergence"] is None
    assert set(doc["rounds"][0]) >= {"start_pos", "drafts", "verify", "accepted", "labels"}
    assert set(doc["acceptance"]) == {"per_slot", "reference_per_slot", "mean"}
    assert doc["committed"] == {"counts": {"MATCH": 6, "TIE": 0, "WRONG": 0}, "divergent": []}
    assert sum(doc["labels"].values()) == sum(len(r["drafts"]) for r in doc["rounds"])
    # a trunk fault: plain and speculative decodes both leave the reference (not spec-induced), WRONG -> 1
    res = cli(*common, "--script", "accept-all", "--engine", "torch", "--inject", "sink-dropped", "--json")
    assert res.exit_code == 1, res.output
    div = json.loads(res.stdout)["first_divergence"]
    assert div["class"] == "WRONG" and div["spec_induced"] is False and div["step"] == 0
    res = cli(*common, "--script", "accept-all", "--engine", "torch", "--inject", "sink-dropped")   # the text report
    assert res.exit_code == 1 and res.stdout.startswith("WRONG at step 0 (position 5)"), res.output
    assert max(map(len, res.stdout.splitlines())) <= 100, res.stdout   # wrapped at 100 columns (the rule of output)
    for bad in ([*common, "--script", "accept-all", "--draft", drafts["mtp"]], [*common, "--script", "reject-at:0"],
                [*common, "--draft", drafts["mtp"], "--gate", "first-below:0.5"],
                [*base, "--draft", drafts["mtp"], "--no-fp4-indexer"]):   # FP8 sim on, the envelope measured off
        res = cli(*bad)
        assert res.exit_code == 2, (bad, res.output)
    assert "measured with fp8_kv=False" in res.output
