"""`v4parity bisect` takes its run the way `trace` does: --prompt / --prompt-file, or --follow another trace."""

from __future__ import annotations

import json
import re

from click.testing import CliRunner

from parity import api
from parity.cli import cli


def test_bisect_follows_a_trace_and_finds_the_fault(tiny_f32, tmp_path):
    ref = api.trace("reference", tiny_f32, [0, 17, 42, 99, 5, 8], decode=2)
    api.save_trace(ref, tmp_path / "ref.trace")
    r = CliRunner().invoke(cli, ["bisect", "-m", str(tiny_f32), "--follow", str(tmp_path / "ref.trace"),
                                 "--inject", "sink-dropped", "--json"])
    assert r.exit_code == 1, r.output
    doc = json.loads(r.stdout)
    assert doc["verdict"] == "defect" and doc["culprit"]["layer"] == 0 and doc["culprit"]["subop"] == "attention"


def test_bisect_takes_a_prompt_and_refuses_follow_with_other_run_options(tiny_f32, tmp_path):
    ref = api.trace("reference", tiny_f32, [0, 17, 42], decode=1)
    api.save_trace(ref, tmp_path / "ref.trace")
    clash = CliRunner().invoke(cli, ["bisect", "-m", str(tiny_f32), "--follow", str(tmp_path / "ref.trace"),
                                     "--decode", "3"])
    assert clash.exit_code == 2 and "drop --decode" in clash.output
    ok = CliRunner().invoke(cli, ["bisect", "-m", str(tiny_f32), "--prompt", "Hi there", "--decode", "1"])
    # the verdict line is `check`'s on the same run (one judgement); bisect's own screen follows as evidence
    assert ok.exit_code == 0 and ok.stdout.startswith(("MATCH [", "NOISE [")), ok.output
    assert "bisect's localisation (evidence):" in ok.stdout, ok.output


def test_bisect_progress_off_a_terminal_is_timed_stage_and_count_lines(tiny_f32):
    r = CliRunner().invoke(cli, ["bisect", "-m", str(tiny_f32), "--decode", "1"])
    lines = [line for line in re.sub(r"\n  ", " ", r.stderr).splitlines() if line]  # long notes wrap: joined
    stages = [line for line in lines if re.search(r" \[\d+:\d\d\]$", line)]          # message stages, elapsed
    counts = [line for line in lines if re.fullmatch(r".+ \d+/\d+ \d+:\d\d", line)]  # stage done/total elapsed
    assert r.exit_code == 0 and len(stages) >= 3 and len(stages) + len(counts) == len(lines), lines
    assert max(len(line) for line in r.stderr.splitlines()) <= 100, r.stderr
    assert any(line.startswith("reference run ") and "/" in line for line in counts), lines
    assert any(line.startswith("torch run ") for line in counts), lines


def test_envelope_counts_its_runs(tiny_f32, tmp_path):
    r = CliRunner().invoke(cli, ["envelope", "-m", str(tiny_f32), "-o", str(tmp_path / "e.json")])
    assert r.exit_code == 0, r.output
    # after the float32 reference's own run: 19 round-off twins, the float64 reference and the candidate in two
    # chunkings, in lockstep over the 6 layers
    assert "envelope: 22 runs in lockstep, layer after layer" in r.stderr, r.stderr
    assert re.search(r"^envelope layers 6/6 \d+:\d\d$", r.stderr, re.M), r.stderr
