"""`diff --envelope` and `gate --envelope`: NOISE inside the stored noise envelope, DRIFT outside (issue 12, step 4)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from parity import api
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


def test_diff_envelope_turns_tight_threshold_drift_into_noise(traces):
    tight = ("--rel-tol", "1e-9", "--norm-tol", "1e-9")   # two float32 engines always differ by more
    assert _run("diff", traces["ref"], traces["torch"], *tight).exit_code == 1
    res = _run("diff", traces["ref"], traces["torch"], *tight, "--envelope", ENV_F32)
    assert res.exit_code == 0, res.output
    assert "NOISE blk.0" in res.output and "envelope (float32): NOISE only" in res.output
    doc = json.loads(_run("diff", traces["ref"], traces["torch"], *tight, "--envelope", ENV_F32, "--json").stdout)
    verdicts = {r["checkpoint"]: r["verdict"] for r in doc["envelope"]["checkpoints"]}
    assert doc["envelope"]["passed"] and verdicts.pop("embed") == "OK"   # the embedding lookup is exact
    assert set(verdicts.values()) == {"NOISE"}


def test_diff_envelope_keeps_a_real_defect_as_drift(traces):
    res = _run("diff", traces["ref"], traces["sink"], "--envelope", ENV_F32)
    assert res.exit_code == 1, res.output
    assert "DRIFT blk.0.attn" in res.output and "DRIFT beyond the noise envelope from blk.0.attn" in res.output


def test_gate_envelope(traces, tmp_path):
    tol = tmp_path / "tight.json"
    tol.write_text(json.dumps({"default": {"rel_tol": 1e-9, "norm_tol": 1e-9}}))
    args = ("gate", "--golden", traces["ref"], "--tolerances", tol, "--envelope", ENV_F32, "--candidate")
    assert _run(*args[:-3], "--candidate", traces["torch"]).exit_code == 1   # the tight table alone fails
    assert _run(*args, traces["torch"]).exit_code == 0
    assert _run(*args, traces["sink"]).exit_code == 1


def test_envelope_of_another_model_is_refused(traces):
    other = Path(__file__).resolve().parent.parent / "traces" / "tiny-mxfp4.envelope.json"
    res = _run("diff", traces["ref"], traces["torch"], "--envelope", other, "--json")
    assert res.exit_code == 2 and "measured on model" in json.loads(res.stdout)["error"]


def test_gate_and_diff_follow_checks_verdict_with_a_model(traces, tiny_f32, tmp_path):
    # one judgement everywhere: with --check-model, `gate` and `diff` give `check`'s verdict on B (the round-off
    # null on its own prompt), whatever the tolerance table says
    tol = tmp_path / "tight.json"
    tol.write_text(json.dumps({"default": {"rel_tol": 1e-9, "norm_tol": 1e-9}}))
    res = _run("gate", "--golden", traces["ref"], "--tolerances", tol, "--candidate", traces["torch"],
               "--check-model", tiny_f32, "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["passed"] and doc["check"]["verdict"] in ("MATCH", "NOISE")
    assert doc["cases"][-1]["checkpoint"] == "check" and not all(c["passed"] for c in doc["cases"][:-1])
    res = _run("diff", traces["ref"], traces["sink"], "--check-model", tiny_f32)
    assert res.exit_code == 1, res.output
    line = next(ln for ln in res.output.splitlines() if ln.startswith("check (decides the exit status): DEFECT"))
    assert "sink-dropped" in line and "layer 0" in line, line
