"""The paper cuts of a new user's first hour (issue 28, item 7), one test each: no Python `None` in a verdict,
a mistyped path named as such, Markdown tables that keep their cells, `flags {}` said once, misspelt fault
names refused before any work, preflight errors naming both files, one `error:` spelling, one `--tokens`
example, output within 100 columns."""

from __future__ import annotations

import copy
import json
import re
import sys

import click
import numpy as np
import pytest
from click.testing import CliRunner
from trace_samples import toy_trace

from parity.check.check import Cause, CheckReport, CheckRow
from parity.check.check_report import headline, to_markdown, to_text
from parity.check.evidence import Drift
from parity.cli import cli, main
from parity.tracing.io import write_trace


def _traces(tmp_path, edit_b=None):
    a, b = toy_trace(7), toy_trace(7)
    if edit_b:
        edit_b(b)
    return write_trace(a, tmp_path / "a.trace"), write_trace(b, tmp_path / "b.trace")


def _invoke(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


# ----------------------------------------------------------------------------------------------
# check: a cause outside every block is named, never "layer None"

def _report_outside_blocks(verdict: str) -> CheckReport:
    rows = (CheckRow("embed", 1e-3, 4.0, None, None, 2.5e-4, 0, "outside"),
            CheckRow("blk.0.attn", 1e-3, 3.0, 1e-7, 0.0, 3e-4, 0, "outside"))
    cause = Cause("benign", "amplified-drift", None, None, Drift(4.0, "embed", None, False))
    return CheckReport(verdict, None, (cause,), rows, {"follow": 2}, (), 3)


def test_a_cause_without_a_layer_names_the_embedding():
    r = _report_outside_blocks("NOISE")
    text, md = to_text(r), to_markdown(r)
    for out in (text, md):
        assert "None" not in out, out
    assert "amplified-drift at the embedding (embed, before layer 0)" in headline(r)
    assert "cause (benign): amplified-drift at the embedding (embed, before layer 0)" in text
    assert "| benign | amplified-drift | the embedding (embed, before layer 0) |" in md


# ----------------------------------------------------------------------------------------------
# check --candidate: a mistyped path is "no such file", not a question about ds4 token ids

def test_a_mistyped_candidate_path_is_no_such_file(tiny_f32, tmp_path):
    r = _invoke("check", "-m", tiny_f32, "--candidate", tmp_path / "torhc.trace")
    assert r.exit_code == 2
    assert f"{tmp_path / 'torhc.trace'}: no such file or directory" in r.output, r.output
    assert "token ids" not in r.output


# ----------------------------------------------------------------------------------------------
# diff: Markdown cells escape '|', flags {} is one line

def test_diff_markdown_escapes_pipes_in_cells(tmp_path):
    pa, pb = _traces(tmp_path, lambda t: t.moe["w"].__setitem__((1, 0), t.moe["w"][1, 0] + 0.25))
    md = tmp_path / "d.md"
    r = _invoke("diff", pa, pb, "--markdown", md, "--no-fail")
    assert r.exit_code == 0, r.output
    rows = [line for line in md.read_text().splitlines() if line.startswith("| 0 |")]  # moe row 1: layer 0
    assert len(rows) == 1 and "max |diff|" in rows[0].replace("\\|", "|"), md.read_text()
    cells = re.split(r"(?<!\\)\|", rows[0])
    assert len(cells) == 4 and cells[2].strip().startswith("expert weights max \\|diff\\| 0.25"), cells


def test_empty_flags_are_said_once(tmp_path):
    def many_flags(t):
        t.header.flags = {f"f{i}": i for i in range(8)}

    a = toy_trace(7)
    many_flags(a)
    b = copy.deepcopy(a)
    b.header.flags = {}
    pa, pb = write_trace(a, tmp_path / "a.trace"), write_trace(b, tmp_path / "b.trace")
    r = _invoke("diff", pa, pb)
    lines = [line for line in r.output.splitlines() if "flags differ" in line]
    assert len(lines) == 1 and "None" not in r.output, r.output
    assert lines[0].startswith("flags differ: B records no flags; A's: f0=0, f1=1"), lines
    same = _invoke("diff", pa, pa)
    assert "flags differ" not in same.output


# ----------------------------------------------------------------------------------------------
# bisect: misspelt fault or engine refused before any work (no progress line first)

@pytest.mark.parametrize(("args", "words"), [
    (("--inject", "nosuch"), "--inject 'nosuch': engine 'torch' has no such fault (it offers: "),
    (("--engine", "nosuch"), "unknown engine 'nosuch'; registered: "),
])
def test_bisect_refuses_bad_names_before_any_work(tiny_f32, args, words):
    r = _invoke("bisect", "-m", tiny_f32, *args)
    assert r.exit_code != 0 and words in str(r.exception), (r.output, r.exception)
    assert r.output == "", r.output  # no stage line (envelope, reference run) before the refusal


# ----------------------------------------------------------------------------------------------
# preflight errors name both files

def test_diff_and_gate_preflight_errors_name_both_files(tmp_path):
    pa, pb = _traces(tmp_path, lambda t: t.header.model.__setitem__("size", 999))
    for args in (("diff", pa, pb), ("gate", "--golden", pa, "--candidate", pb)):
        r = _invoke(*args)
        assert r.exit_code == 2 and f"preflight (A {pa}, B {pb}): " in r.output, r.output
        assert r.output.startswith("error: "), r.output


def test_check_preflight_names_candidate_and_model(tiny_f32, tmp_path):
    path = write_trace(toy_trace(7), tmp_path / "toy.trace")
    r = _invoke("check", "-m", tiny_f32, "--candidate", path)
    assert r.exit_code == 2 and f"preflight (candidate {path}, model {tiny_f32}): model identity differs" in r.output


# ----------------------------------------------------------------------------------------------
# one `error:` spelling from the entry point, usage errors included

@pytest.mark.parametrize("args", [["diff", "only-one.trace"], ["diff", "--no-such-option"], ["check", "-m"]])
def test_errors_are_spelled_error_colon(monkeypatch, capsys, args):
    monkeypatch.setattr(sys, "argv", ["v4parity", *args])
    with pytest.raises(SystemExit) as e:
        main()
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Error:" not in err and re.search(r"^error: \S", err, re.M), err


# ----------------------------------------------------------------------------------------------
# one --tokens example

def _commands(group: click.Group, prefix: str = "") -> dict[str, click.Command]:
    out = {}
    for name, cmd in group.commands.items():
        out[prefix + name] = cmd
        if isinstance(cmd, click.Group):
            out |= _commands(cmd, f"{prefix}{name} ")
    return out


def test_every_tokens_option_gives_the_same_example():
    helps = {name: p.help for name, cmd in _commands(cli).items() for p in cmd.params
             if isinstance(p, click.Option) and "--tokens" in p.opts}
    assert len(helps) >= 6 and all("e.g. 0,17,42" in h for h in helps.values()), helps


# ----------------------------------------------------------------------------------------------
# item 2: diff names the departure as well as the threshold crossing, and points to `check`

SCALES = {"embed": 0.0, "blk.0.attn": 1e-6, "blk.0": 2e-6, "blk.1.attn": 4e-4, "blk.1": 3e-3, "final_norm": 5e-3}


def _drifting(tmp_path):
    """B's fingerprints scaled per checkpoint by 1 + s * noise: a 200x jump at blk.1.attn (4e-4, under the
    threshold), the crossing at blk.1."""
    a = toy_trace(7)
    b = copy.deepcopy(a)
    rng = np.random.default_rng(0)
    names = a.header.checkpoints
    for i, ck in enumerate(b.ckpt["ck"].tolist()):
        b.ckpt["fp"][i] = a.ckpt["fp"][i] * (1 + SCALES[names[ck]] * rng.standard_normal(a.ckpt["fp"].shape[1]))
    return a, b, write_trace(a, tmp_path / "a.trace"), write_trace(b, tmp_path / "b.trace")


def test_diff_names_the_departure_and_the_crossing(tmp_path):
    a, b, pa, pb = _drifting(tmp_path)
    doc = json.loads(_invoke("diff", pa, pb, "--json").output)
    names = a.header.checkpoints  # second implementation: worst rel-L2 per checkpoint, then the largest ratio
    worst = [max(float(np.linalg.norm(b.ckpt["fp"][i].astype(np.float64) - a.ckpt["fp"][i]) /
                       np.linalg.norm(a.ckpt["fp"][i].astype(np.float64)))
                 for i in np.flatnonzero(a.ckpt["ck"] == k)) for k in range(len(names))]
    eps = float(np.finfo(np.float32).eps)
    ratios = [max(worst[k], eps) / max(worst[k - 1], eps) for k in range(1, len(names))]
    k = 1 + int(np.argmax(ratios))
    assert names[k] == "blk.1.attn" and doc["first_drift"]["checkpoint"] == "blk.1"
    d = doc["departure"]
    assert (d["checkpoint"], d["after"], d["layer"]) == ("blk.1.attn", "blk.0", 1)
    assert d["jump"] == pytest.approx(ratios[k - 1], rel=1e-6) and d["rel_l2"] == pytest.approx(worst[k], rel=1e-6)
    text = _invoke("diff", pa, pb).output.replace("\n  ", " ")
    assert "departure: blk.1.attn (layer 1), the largest jump: rel-L2" in text
    assert "crosses the threshold at blk.1" in text
    assert json.loads(_invoke("diff", pa, pa, "--json").output)["departure"] is None  # no drift: no departure


def test_drift_output_points_to_check(tmp_path):
    _, _, pa, pb = _drifting(tmp_path)
    hint = f"this may be benign float noise: run `v4parity check -m toy.gguf --candidate {pb}`"
    for args in (("diff", pa, pb), ("plot", pa, pb, "-o", tmp_path / "d.png"),
                 ("report", pa, pb, "-o", tmp_path / "r.html", "--no-fail")):
        assert hint in _invoke(*args).output.replace("\n  ", " "), args
    for args in (("diff", pa, pa), ("plot", pa, pa, "-o", tmp_path / "s.png")):
        assert "benign float noise" not in _invoke(*args).output, args


def test_the_typical_session_includes_check():
    session = _invoke("--help").output.split("Typical session:", 1)[1].split("Exit codes", 1)[0]
    lines = [line.strip() for line in session.splitlines() if line.strip()]
    diff = next(i for i, line in enumerate(lines) if line.startswith("v4parity diff "))
    assert lines[diff + 1].startswith("v4parity check -m m.gguf --candidate cand.trace"), lines
