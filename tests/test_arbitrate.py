"""`v4parity arbitrate`: per checkpoint, which engines agree with which; the odd one out is named."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner
from fake_engine import FakeEngine
from requires import require

from parity.cli import cli
from parity.compare.arbitration import Arbitration, CheckpointClusters, arbitrate_runs, clusters
from parity.tracing.runner import all_tokens, run_sequence

PROMPT = [0, 5, 7, 9, 11, 13, 15, 17]


def test_clusters_are_connected_groups_largest_first():
    agree = {("a", "b"), ("c", "d"), ("d", "e")}
    got = clusters(["a", "b", "c", "d", "e", "f"], lambda x, y: (x, y) in agree)
    assert got == (("c", "d", "e"), ("a", "b"), ("f",))


def test_the_perturbed_engine_is_the_odd_one_out(tiny_f32):
    """Three fake engines, one with a fault acting at layer 3's attention output: the split is first seen at
    blk.3.attn, the faulty engine alone outside the majority; the clean ones agree everywhere (bit-identical)."""
    a, b = FakeEngine(str(tiny_f32)), FakeEngine(str(tiny_f32))
    bad = FakeEngine(str(tiny_f32), perturb={3: 0.05})
    first = run_sequence(a, PROMPT, 3, chunk=4)
    forced = all_tokens(first)[len(PROMPT):]
    runs = {"ref": first, "faulty": run_sequence(bad, PROMPT, 3, chunk=4, forced=forced),
            "other": run_sequence(b, PROMPT, 3, chunk=4, forced=forced)}
    r = arbitrate_runs(runs, len(PROMPT), lambda _name: 1e-4)
    assert r.first_split == "blk.3.attn" and r.odd_ones_out == ("faulty",)
    by_name = {c.name: c for c in r.checkpoints}
    assert by_name["blk.2"].clusters == (("ref", "faulty", "other"),)
    assert by_name["blk.3.attn"].clusters == (("ref", "other"), ("faulty",))
    assert by_name["logits"].pairs["ref~other"] == 0.0 and by_name["blk.3.attn"].pairs["ref~faulty"] > 1e-4


def test_arbitrate_cli_peers_agree(tiny_f32):
    """reference, llama.cpp and transformers on the tiny F32 model: one cluster everywhere (measured worst pair
    1.2e-6 against the 1e-4 tolerance), exit 0, JSON report."""
    for mod in ("llama_cpp", "transformers"):   # in CI a missing peer is a failure, not a skip
        require(mod)
    r = CliRunner().invoke(cli, ["arbitrate", "-m", str(tiny_f32), "--tokens", ",".join(map(str, PROMPT)),
                                 "--decode", "2", "--engines", "reference,llamacpp,hf", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output[r.output.index("{"):])
    assert doc["first_split"] is None and doc["greedy_disagreements"] == {"llamacpp": 0, "hf": 0}
    assert all(c["clusters"] == [["reference", "llamacpp", "hf"]] for c in doc["checkpoints"])
    assert max(v for c in doc["checkpoints"] for v in c["pairs"].values()) < 1e-5


def test_json_of_a_non_finite_pair_is_strict_json():
    """rel_l2 is inf on a non-finite candidate; strict JSON (the CLI's) spells it "inf" instead of failing."""
    c = CheckpointClusters("blk.0", 1e-4, (("a",), ("b",)), {"a~b": float("inf")})
    a = Arbitration(("a", "b"), (0,), 1, (c,), "blk.0", ("b",), {})
    assert json.loads(json.dumps(a.to_dict(), allow_nan=False))["checkpoints"][0]["pairs"] == {"a~b": "inf"}


def test_arbitrate_needs_two_engines(tiny_f32):
    r = CliRunner().invoke(cli, ["arbitrate", "-m", str(tiny_f32), "--tokens", "0,5", "--engines", "reference"])
    assert r.exit_code == 2 and "at least two distinct engines" in r.output


def _arbitrate_check(model, engines: str, *extra: str):
    """`arbitrate --check` on the tiny F32 model with the QAT sims on (the committed envelope was measured so)."""
    envelope = Path(__file__).resolve().parent.parent / "traces" / "tiny-f32.envelope.json"
    return CliRunner().invoke(cli, ["arbitrate", "-m", str(model), "--tokens", ",".join(map(str, PROMPT)),
                                    "--decode", "2", "--engines", engines, "--qat-sims", "--envelope", str(envelope),
                                    "--check", *extra])


def test_arbitrate_check_judges_each_engine(tiny_f32):
    """reference, torch and torch with the attention sink left out of the softmax (a fault acting in every
    layer's attention, so first at layer 0): `check` calls the faulty run DEFECT at layer 0 naming sink-dropped,
    the clean ones MATCH or NOISE, and the exit status is 1; the clustering stays in the report as evidence."""
    r = _arbitrate_check(tiny_f32, "reference,torch,torch+sink-dropped", "--json")
    assert r.exit_code == 1, r.output
    doc = json.loads(r.stdout)
    assert set(doc["check"]) == {"reference", "torch", "torch+sink-dropped"}
    for e, c in doc["check"].items():
        assert {"headline", "verdict", "judged", "culprit", "causes", "notes", "table"} <= set(c), e
    assert doc["check"]["reference"]["verdict"] in ("MATCH", "NOISE")
    assert doc["check"]["torch"]["verdict"] in ("MATCH", "NOISE"), doc["check"]["torch"]["headline"]
    bad = doc["check"]["torch+sink-dropped"]
    assert bad["verdict"] == "DEFECT" and bad["culprit"]["layer"] == 0
    assert bad["causes"][-1]["name"] == "sink-dropped" and "sink-dropped" in bad["headline"]
    assert doc["first_split"] == "blk.0.attn" and doc["odd_ones_out"] == ["torch+sink-dropped"]


def test_arbitrate_check_text_and_clean_exit(tiny_f32):
    """Two clean engines: one verdict line per engine before the clusters, exit 0."""
    r = _arbitrate_check(tiny_f32, "reference,torch")
    assert r.exit_code == 0, r.output
    lines = [x for x in r.stdout.splitlines() if x.startswith("check ")]
    assert [x.split(" (")[0] for x in lines] == ["check reference", "check torch"]
    assert all(x.split(": ", 1)[1].split(" ")[0] in ("MATCH", "NOISE") for x in lines), lines


def test_arbitrate_refuses_an_unknown_fault(tiny_f32):
    """A fault the engine does not offer is refused before anything runs, naming it (exit 2, JSON error)."""
    r = CliRunner().invoke(cli, ["arbitrate", "-m", str(tiny_f32), "--tokens", "0,5", "--engines",
                                 "reference,torch+no-such-fault", "--json"])
    assert r.exit_code == 2 and "'no-such-fault'" in json.loads(r.stdout)["error"], r.output
