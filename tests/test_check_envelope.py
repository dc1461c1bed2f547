"""`diff` / `gate` / `arbitrate` judge a run only by `check` (one judgement, issue 22 point 8): `--envelope` chooses
the envelope of that `check` and is refused alone; the verdict and exit status are `check`'s own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from parity import api
from parity.check.check_report import headline
from parity.cli import cli
from parity.contract.engine import RunOptions

ENV_F32 = Path(__file__).resolve().parent.parent / "traces" / "tiny-f32.envelope.json"


@pytest.fixture(scope="module")
def traces(tiny_f32, tmp_path_factory):
    """Reference, clean torch and sink-dropped torch on the golden prompt (no FP8 code flip between the clean
    engines there: `check` calls that pair MATCH), every position with full vectors."""
    out = tmp_path_factory.mktemp("envdiff")
    paths = {}
    runs = (("ref", "reference", ()), ("torch", "torch", ()), ("sink", "torch", ("sink-dropped",)))
    for name, engine, inject in runs:
        t = api.trace(engine, tiny_f32, api.GOLDEN_PROMPT, positions="all", full="all",
                      options=RunOptions(inject=inject))
        paths[name] = api.save_trace(t, out / f"{name}.trace")
    return paths


def _run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


@pytest.mark.parametrize("command", ["diff", "gate", "arbitrate"])
def test_an_envelope_alone_is_refused_it_would_be_a_second_judgement(traces, tiny_f32, command):
    # the K x floor screen could call a run NOISE that `check` calls DEFECT (or the reverse): an envelope only
    # chooses the envelope of the `check` these commands run
    args = {"diff": ("diff", traces["ref"], traces["sink"]),
            "gate": ("gate", "--golden", traces["ref"], "--candidate", traces["sink"]),
            "arbitrate": ("arbitrate", "-m", tiny_f32, "--tokens", "0,5,7", "--engines", "reference,torch")}[command]
    res = _run(*args, "--envelope", ENV_F32)
    assert res.exit_code == 2, res.output
    assert ("--check-model" if command != "arbitrate" else "--check") in res.output
    assert "round-off null" in res.output


def test_envelope_of_another_model_is_refused(traces, tiny_f32):
    other = Path(__file__).resolve().parent.parent / "traces" / "tiny-mxfp4.envelope.json"
    res = _run("diff", traces["ref"], traces["torch"], "--envelope", other, "--check-model", tiny_f32, "--json")
    assert res.exit_code == 2 and "measured on model" in json.loads(res.stdout)["error"]


def test_gate_and_diff_follow_checks_verdict_with_a_model(traces, tiny_f32, tmp_path):
    # one judgement everywhere: with --check-model, `gate` and `diff` give `check`'s verdict on B (the round-off
    # null on its own prompt), whatever the tolerance table says
    tol = tmp_path / "tight.json"
    tol.write_text(json.dumps({"default": {"rel_tol": 1e-9, "norm_tol": 1e-9}}))
    res = _run("gate", "--golden", traces["ref"], "--tolerances", tol, "--candidate", traces["torch"],
               "--check-model", tiny_f32, "--envelope", ENV_F32, "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["passed"] and doc["check"]["verdict"] in ("MATCH", "NOISE")
    own = api.check(traces["torch"], tiny_f32, envelope=ENV_F32)   # the `check` command's own verdict, same run
    assert (doc["check"]["verdict"], doc["cases"][-1]["headline"]) == (own.verdict, headline(own))
    assert doc["cases"][-1]["checkpoint"] == "check" and not all(c["passed"] for c in doc["cases"][:-1])
    res = _run("diff", traces["ref"], traces["sink"], "--check-model", tiny_f32)
    assert res.exit_code == 1, res.output
    line = next(ln for ln in res.output.splitlines() if ln.startswith("check (decides the exit status): DEFECT"))
    assert "sink-dropped" in line and "layer 0" in line, line
