"""CLI commands of the harness, run in-process with CliRunner: trace, convert, diff, plot, gate, export, golden."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from parity import api
from parity.cli import cli

TOKENS = "0,5,12,19,26,33,40,47"
GOLDEN_DIR = Path(__file__).parents[1] / "traces"


def run(*args, ok=True):
    res = CliRunner().invoke(cli, [str(a) for a in args])
    if ok:
        assert res.exit_code == 0, (res.output, res.exception)
    return res


@pytest.fixture(scope="module")
def traces(tiny_f32, tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    ref, tor, bad = d / "ref.trace", d / "torch.trace", d / "bad.trace"
    run("trace", "--engine", "reference", "--model", tiny_f32, "--tokens", TOKENS, "--decode", 2, "--positions",
        "all", "--full", "blk.2,final_norm,logits", "--dump-logprobs", d / "ref.json", "--dump-ctx", 4096, "--top-k", 5,
        "-o", ref)
    run("trace", "--engine", "torch", "-m", tiny_f32, "--follow", ref, "--full", "blk.2,final_norm,logits",
        "--top-k", 5, "-o", tor)
    run("trace", "--engine", "torch", "-m", tiny_f32, "--follow", ref, "--inject", "compress-ratios-u32",
        "--top-k", 5, "-o", bad)
    return {"dir": d, "ref": ref, "torch": tor, "bad": bad, "model": tiny_f32}


def test_every_command_has_help():
    for cmd in ("trace", "import", "convert", "diff", "plot", "gate", "export", "golden", "demo"):
        out = run(cmd, "--help").output
        assert "Usage:" in out and len(out) > 200


def test_trace_writes_trace_vectors_and_logprob_dump(traces):
    t = api.load_trace(traces["ref"])
    assert t.header.engine == "reference" and t.header.decode == 2 and len(t.header.tokens) == 10
    assert t.header.full == ["blk.2", "final_norm", "logits"] and t.vectors["blk.2"].shape == (10, 4, 256)
    dump = json.loads((traces["dir"] / "ref.json").read_text())
    assert dump["prompt_tokens"] == 8 and len(dump["steps"]) == 3 and dump["top_k"] == 5
    assert dump["ctx"] == 4096  # the ds4 run's --ctx as given, not a length made up from the run
    # ds4 semantics: step i's selected token is the one fed at position 8 + i
    assert [s["selected"]["id"] for s in dump["steps"][:2]] == t.header.tokens[8:10]
    assert dump["steps"][0]["selected"]["id"] == t.ckpt["argmax"][t.checkpoint_rows("final_norm")][7]


def test_dump_logprobs_needs_its_ctx(traces, tmp_path):
    res = run("trace", "--engine", "reference", "-m", traces["model"], "--tokens", "0,5", "--dump-logprobs",
              tmp_path / "d.json", "-o", tmp_path / "t.trace", ok=False)
    assert res.exit_code == 2 and "--dump-logprobs and --dump-ctx go together" in res.output
    assert not (tmp_path / "d.json").exists()


def test_trace_token_sources(traces, tmp_path):
    (tmp_path / "ids.txt").write_text("0 5\n12, 19\n")
    run("trace", "--engine", "reference", "--model", traces["model"], "--tokens-file", tmp_path / "ids.txt",
        "-o", tmp_path / "f.trace")
    assert api.load_trace(tmp_path / "f.trace").header.tokens == [0, 5, 12, 19]
    run("trace", "--engine", "reference", "--model", traces["model"], "--prompt", "the model", "-o",
        tmp_path / "p.trace")
    toks = api.load_trace(tmp_path / "p.trace").header.tokens
    assert toks[0] == 0 and len(toks) > 3  # BOS + chat template + text
    res = run("trace", "--engine", "reference", "--model", traces["model"], "--tokens", "1", "--prompt", "x",
              "-o", tmp_path / "x.trace", ok=False)
    assert res.exit_code == 2 and "exactly one of" in res.output
    res = run("trace", "--engine", "reference", "--model", traces["model"], "--tokens", "1,99999", "-o",
              tmp_path / "x.trace", ok=False)
    assert res.exit_code == 2 and "out of range" in res.output   # a usage error, as bisect's
    res = run("trace", "--engine", "reference", "--model", traces["model"], "--follow", traces["ref"], "--decode", 0,
              "-o", tmp_path / "x.trace", ok=False)
    assert res.exit_code == 2 and "drop --decode" in res.output
    res = run("trace", "--engine", "nope", "--model", traces["model"], "--tokens", "1", "-o", tmp_path / "x.trace",
              ok=False)
    assert "unknown engine 'nope'" in str(res.exception)


def test_convert_round_trip_is_byte_identical(traces, tmp_path):
    run("convert", traces["ref"], tmp_path / "r.npz")
    run("convert", tmp_path / "r.npz", tmp_path / "r.trace")
    assert (tmp_path / "r.trace").read_bytes() == traces["ref"].read_bytes()
    assert (tmp_path / "r.vectors.npz").read_bytes() == (traces["dir"] / "ref.vectors.npz").read_bytes()


def test_diff_reports(traces, tmp_path):
    out = run("diff", traces["ref"], traces["torch"]).output
    assert "all 14 checkpoints agree" in out and "full" in out  # blk.2 and final_norm compared on full vectors
    res = run("diff", traces["ref"], traces["bad"], "--json", ok=False)
    assert res.exit_code == 1  # drift exits 1 by default
    d = json.loads(res.output)
    assert d["first_drift"]["checkpoint"] == "blk.2.attn" and d["first_drift"]["layer"] == 2
    md = run("diff", traces["ref"], traces["bad"], "--markdown", "-", ok=False).output
    assert md.startswith("**v4parity diff**") and "| blk.2.attn |" in md
    run("diff", traces["ref"], traces["bad"], "--markdown", tmp_path / "d.md", "--no-fail")
    assert "| blk.2.attn |" in (tmp_path / "d.md").read_text()
    assert run("diff", traces["ref"], traces["bad"], "--no-fail").exit_code == 0
    loose = run("diff", traces["ref"], traces["bad"], "--rel-tol", "10", "--norm-tol", "1").output
    assert "all 14 checkpoints agree (within rel-L2 <= 10 and RMS ratio 1 +- 1)" in loose


def test_diff_usage_names_exactly_two_traces(traces):
    assert "Usage: cli diff [OPTIONS] A B" in run("diff", "--help").output
    res = run("diff", traces["ref"], ok=False)
    assert res.exit_code == 2 and "Missing argument 'B'" in res.output


def test_diff_preflight_refusal_exits_2(traces, tmp_path):
    run("trace", "--engine", "reference", "--model", traces["model"], "--tokens", "0,5,12", "-o", tmp_path / "s.trace")
    res = run("diff", traces["ref"], tmp_path / "s.trace", ok=False)
    assert res.exit_code == 2 and "token ids differ" in res.output
    assert "traced positions differ" in res.output and "--force" in res.output
    forced = run("diff", traces["ref"], tmp_path / "s.trace", "--force")
    assert "warning (forced)" in forced.output


def test_plot_writes_a_figure(traces, tmp_path):
    out = run("plot", traces["ref"], traces["bad"], "-o", tmp_path / "drift.png").output
    assert (tmp_path / "drift.png").stat().st_size > 20_000 and "first drifting checkpoint: blk.2.attn" in out


def test_gate_pass_fail_junit_markdown(traces, tmp_path):
    junit, md = tmp_path / "gate.xml", tmp_path / "gate.md"
    ok = run("gate", "--golden", traces["ref"], "--candidate", traces["torch"], "--junit", junit, "--markdown", md)
    assert "PASSED" in ok.output and md.read_text().startswith("### v4parity gate: PASSED")
    suite = ET.parse(junit).getroot()
    assert suite.get("tests") == "15" and suite.get("failures") == "0"  # 14 checkpoints + the side-file logits
    bad = run("gate", "--golden", traces["ref"], "--candidate", traces["bad"], "--junit", junit, ok=False)
    assert bad.exit_code == 1 and "FAILED" in bad.output and "would pass at rel_tol >=" in bad.output
    failed = [tc.get("name") for tc in ET.parse(junit).getroot() if tc.find("failure") is not None]
    assert failed[0] == "blk.2.attn" and "blk.1" not in failed
    loose = tmp_path / "loose.json"
    loose.write_text(json.dumps({"default": {"rel_tol": 10, "norm_tol": 1}, "require_top1": False}))
    assert run("gate", "--golden", traces["ref"], "--candidate", traces["bad"], "--tolerances", loose).exit_code == 0
    per = tmp_path / "per.toml"
    per.write_text('[checkpoints."blk.*"]\nrel_tol = 10\nnorm_tol = 1\n[checkpoints.final_norm]\nrel_tol = 10\n'
                   'norm_tol = 1\n')
    res = run("gate", "--golden", traces["ref"], "--candidate", traces["bad"], "--tolerances", per, "--json", ok=False)
    assert res.exit_code == 1 and json.loads(res.output)["cases"][-1]["problems"][0].startswith("top-1 token differs")


def test_gate_bad_tolerances_and_preflight(traces, tmp_path):
    bad = tmp_path / "t.json"
    bad.write_text(json.dumps({"default": {"rel_tool": 1}}))
    res = run("gate", "--golden", traces["ref"], "--candidate", traces["torch"], "--tolerances", bad, ok=False)
    assert "unknown key(s) ['rel_tool']" in str(res.exception)
    typo = tmp_path / "typo.json"
    typo.write_text(json.dumps({"checkpoints": {"blk.*.atn": {"rel_tol": 1}}}))
    res = run("gate", "--golden", traces["ref"], "--candidate", traces["torch"], "--tolerances", typo, ok=False)
    assert "pattern(s) ['blk.*.atn'] match no compared checkpoint" in str(res.exception)
    res = run("gate", "--golden", GOLDEN_DIR / "tiny-f32.trace", "--candidate", traces["torch"], ok=False)
    assert res.exit_code == 2 and "preflight" in res.output


def test_export_arrays(traces, tmp_path):
    out = run("export", traces["ref"], "-o", tmp_path / "e.npz").output
    assert "blk.2 [10, 4, 256]" in out
    with np.load(tmp_path / "e.npz") as z:
        assert z["final_norm"].shape == (10, 256) and z["logits"].shape == (10, 290)
        assert z["tokens"].tolist() == api.load_trace(traces["ref"]).header.tokens
    res = run("export", traces["bad"], "-o", tmp_path / "x.npz", ok=False)
    assert "--full all" in str(res.exception)


def test_golden_traces_regenerate_and_gate(tmp_path):
    run("golden", "--out", tmp_path)
    for name in ("tiny-f32.trace", "tiny-real-mix.trace", "tiny-mxfp4.trace"):
        committed = GOLDEN_DIR / name
        assert committed.stat().st_size < 150_000 and not api.load_trace(committed).header.full
        res = run("gate", "--golden", committed, "--candidate", tmp_path / name)
        assert "PASSED" in res.output


def test_trace_decode_records_every_decode_position_by_default(traces, tmp_path):
    assert "every decode position" in run("trace", "--help").output
    res = run("trace", "--engine", "reference", "-m", traces["model"], "--tokens", TOKENS, "--decode", 2,
              "-o", tmp_path / "d.trace", "--json")
    d = json.loads(res.stdout)
    # 8 prompt tokens: the prompt's last position 7, then the two decode positions 8 and 9
    assert d["positions"] == [7, 8, 9] and api.load_trace(tmp_path / "d.trace").header.positions == [7, 8, 9]
    # not a terminal: plain progress lines on stderr (stage, done/total, elapsed)
    assert "trace reference: 8 tokens + 2 decode 3/3 0:0" in res.stderr
    run("trace", "--engine", "reference", "-m", traces["model"], "--tokens", TOKENS, "-o", tmp_path / "l.trace")
    assert api.load_trace(tmp_path / "l.trace").header.positions == [7]


def test_bad_output_extensions_are_clean_errors(traces, tmp_path):
    res = run("plot", traces["ref"], traces["bad"], "-o", tmp_path / "x.txt", ok=False)
    assert res.exit_code == 2 and "use one of .png, .pdf, .svg" in res.output and not (tmp_path / "x.txt").exists()
    res = run("convert", traces["ref"], tmp_path / "x.json", ok=False)
    assert res.exit_code == 2 and "a trace is .trace (text) or .npz (binary)" in res.output
    res = run("plot", traces["ref"], traces["bad"], "-o", tmp_path / "x.txt", "--json", ok=False)
    assert res.exit_code == 2 and "use one of .png" in json.loads(res.output)["error"]


def _commands(group, prefix=()):
    import click

    for name, cmd in group.commands.items():
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, (*prefix, name))
        else:
            yield " ".join((*prefix, name)), cmd


def test_one_cli_options_are_spelled_and_chosen_the_same_everywhere():
    import click

    from parity.cli.common import DEVICES, DTYPES

    seen, problems = {}, []
    for name, cmd in _commands(cli):
        for p in cmd.params:
            if not isinstance(p, click.Option) or p.name in ("help", "version"):
                continue
            seen.setdefault(p.name, []).append(name)
            checks = [(bool(p.help), "no help text"),
                      (p.name != "model" or set(p.opts) == {"-m", "--model"}, "not -m/--model"),
                      (p.name != "dtype" or tuple(p.type.choices) == DTYPES, f"choices {DTYPES}"),
                      (p.name != "device" or tuple(p.type.choices) == DEVICES, f"choices {DEVICES}"),
                      (p.name != "inject" or (not isinstance(p.type, click.Choice) and p.multiple), "free text"),
                      ("--markdown" not in p.opts or not p.is_flag, "--markdown takes a FILE"),
                      ("--system" not in p.opts or "-sys" not in p.opts, "no -sys")]
            problems += [f"{name} {'/'.join(p.opts)}: {want}" for ok, want in checks if not ok]
    for name in ("trace", "plot", "import", "synth", "inspect", "diff", "gate", "logprobs", "tokenize", "convert",
                 "export", "report", "envelope", "bisect"):
        if name not in seen["as_json"]:
            problems.append(f"{name}: no --json")
    assert problems == []


def test_progress_bar_on_a_terminal_and_periodic_lines_otherwise():
    import io

    from parity.cli.progress import Progress

    now = [0.0]
    log = io.StringIO()
    p = Progress(stream=log, interval=10.0, terminal=False, clock=lambda: now[0])
    for done in range(0, 101):
        now[0] = done * 0.5            # 0.5 s per unit: 50 s in all
        p("bisect: splice", done, 100)
    # the first line, one per 10 s, and the last one
    assert log.getvalue().splitlines() == ["bisect: splice 0/100 0:00", "bisect: splice 20/100 0:10",
                                           "bisect: splice 40/100 0:20", "bisect: splice 60/100 0:30",
                                           "bisect: splice 80/100 0:40", "bisect: splice 100/100 0:50"]
    tty = io.StringIO()
    bar = Progress(stream=tty, terminal=True, clock=lambda: now[0], width=10)
    now[0] = 0.0
    bar("trace", 0, 4)
    now[0] = 30.0
    bar("trace", 1, 4)                # 30 s for 1 of 4 -> 90 s to go
    assert tty.getvalue().endswith("\rtrace [##........] 1/4 0:30 ETA 1:30")  # 2.5 cells -> 2
    now[0] = 120.0
    bar("trace", 4, 4)
    assert tty.getvalue().endswith("\rtrace [##########] 4/4 2:00 ETA 0:00\n")


def test_json_errors_from_the_entry_point_include_parse_errors(tmp_path):
    import subprocess
    import sys

    exe = Path(sys.executable).with_name("v4parity")
    r = subprocess.run([str(exe), "diff", "--json", str(tmp_path / "missing.trace")], capture_output=True, text=True)
    err = json.loads(r.stdout)
    assert r.returncode == 2 and err["exit_code"] == 2 and "missing.trace" in err["error"] and r.stderr == ""


def test_every_json_command_reports_its_errors_as_json():
    from parity.cli.common import json_errors

    wrapped = json_errors(lambda: None).__code__

    def has_json_errors(fn):
        while fn is not None:
            if getattr(fn, "__code__", None) is wrapped:
                return True
            fn = getattr(fn, "__wrapped__", None)
        return False

    json_commands = [(name, cmd) for name, cmd in _commands(cli) if any(p.name == "as_json" for p in cmd.params)]
    assert "capture llamacpp" in dict(json_commands)
    assert [name for name, cmd in json_commands if not has_json_errors(cmd.callback)] == []


def test_capture_usage_error_with_json_is_a_json_object(traces, tmp_path):
    res = run("capture", "llamacpp", "-m", traces["model"], "--tokens", "1", "--prompt", "x", "-o",
              tmp_path / "c.npz", "--json", ok=False)
    assert res.exit_code == 2 and "exactly one of" in json.loads(res.output)["error"]


def test_every_command_help_has_an_example():
    assert [name for name, cmd in _commands(cli) if "Example" not in (cmd.help or "")] == []


def test_progress_note_times_message_stages():
    import io

    from parity.cli.progress import Progress

    now, log = [5.0], io.StringIO()
    p = Progress(stream=log, terminal=False, clock=lambda: now[0])
    p.note("reference: 8 prompt tokens")
    now[0] = 80.0
    p.note("drill-down: layer 2")
    assert log.getvalue() == "reference: 8 prompt tokens [0:00]\ndrill-down: layer 2 [1:15]\n"
