"""`v4parity logprobs` end to end on the fixtures: ds4-format dumps against official-format vectors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from parity.cli import cli

FIX = Path(__file__).parent / "fixtures" / "logprobs"


def invoke(*args: str):
    return CliRunner().invoke(cli, ["logprobs", *args])


def test_official_vector_against_a_ds4_dump():
    r = invoke(str(FIX / "greedy.official.json"), str(FIX / "ref.ds4.json"))
    assert r.exit_code == 0, r.output
    assert max(len(line) for line in r.output.splitlines()) <= 100, r.output  # long lines wrap (no --wide)
    last = r.output.strip().replace("\n  ", " ").splitlines()[-1]
    assert last == ("logprobs: 2/3 steps compared greedy-only (tokens compared, no logprob metrics): "
                    "MATCH 2, TIE-FLIP 0, DRIFT 0, WRONG 0; first divergent step: none; "
                    "ds4_test: n/a (B lists top 3 < 20)")
    assert "A carries greedy tokens only" in r.output and "(only in B)" in r.output
    wide = invoke(str(FIX / "greedy.official.json"), str(FIX / "ref.ds4.json"), "--wide").output
    assert wide.strip().splitlines()[-1] == last and "JS in" in wide and "JS in" not in r.output


def test_json_report():
    r = invoke(str(FIX / "ref.ds4.json"), str(FIX / "cand_tie.ds4.json"), "--json", "--fail-on", "wrong")
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["counts"] == {"MATCH": 1, "TIE-FLIP": 1, "DRIFT": 0, "WRONG": 0}
    assert d["first_divergent_step"] == 1 and d["failed"] == [] and d["ds4_test"] is None
    assert d["steps"][0]["jaccard"] == 0.5 and d["steps"][0]["divergence"]["kl_upper"] == "inf"


def test_fail_on_gates():
    tie = [str(FIX / "ref.ds4.json"), str(FIX / "cand_tie.ds4.json")]
    assert invoke(*tie).exit_code == 0                   # default gates: wrong, ds4-test (n/a for a top-3 B)
    r = invoke(*tie, "--fail-on", "tie", "--fail-on", "ds4-test")
    assert r.exit_code == 1 and "FAILED: tie\n" in r.output
    r = invoke(str(FIX / "cases.vec#wrong_case"), str(FIX / "ref.ds4.json"))
    assert r.exit_code == 1 and "WRONG 1" in r.output
    assert invoke(*tie, "--tie-margin", "0.04").exit_code == 1          # the 0.05 tie is now WRONG
    assert invoke(str(FIX / "ref.ds4.json"), str(FIX / "cand_drift.ds4.json"), "--fail-on", "drift").exit_code == 1


def test_malformed_file_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.json"
    doc = json.loads((FIX / "ref.ds4.json").read_text())
    doc["steps"][1]["top_logprobs"][0]["logprob"] = "high"
    bad.write_text(json.dumps(doc))
    exe = Path(sys.executable).with_name("v4parity")
    r = subprocess.run([str(exe), "logprobs", str(FIX / "ref.ds4.json"), str(bad)], capture_output=True, text=True)
    assert r.returncode == 2
    assert f"{bad}: step 1: field 'top_logprobs[0].logprob': expected num" in r.stderr
