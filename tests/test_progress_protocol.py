"""The one progress protocol (issue 26.3, `parity.contract.progress`): the silent default prints nothing, every
printer implements it, the API functions take it under one name with SILENT as default, the terminal printer and a
recording receive the same calls from one API call, and validate's API report is the one its CLI prints."""

from __future__ import annotations

import inspect
import io
import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from validate_plugin import install

from parity import api
from parity.cli import cli
from parity.cli.progress import Lines, Progress
from parity.cli.validate import TaskProgress
from parity.contract.progress import SILENT, ProgressSink, Recording
from parity.validate.result import ValidateReport

ROOT = Path(__file__).resolve().parent.parent
ENV_F32 = ROOT / "traces" / "tiny-f32.envelope.json"
PROMPT = [0, 5, 12, 19, 26, 33]


def test_the_silent_default_is_silent(capsys):
    SILENT.note("reference: 8 prompt tokens")
    SILENT.count("trace", 1, 4)
    assert capsys.readouterr() == ("", "")
    assert isinstance(SILENT, ProgressSink)


def test_every_printer_implements_the_protocol():
    sinks = [SILENT, Recording(), Progress(stream=io.StringIO()), Lines(), TaskProgress(Progress(stream=io.StringIO()))]
    assert all(isinstance(s, ProgressSink) for s in sinks)
    assert not isinstance(print, ProgressSink)   # a bare callable is not a progress object


def test_api_functions_take_one_progress_parameter_defaulting_to_silent():
    public = {n: fn for n, fn in vars(api).items()
              if inspect.isfunction(fn) and fn.__module__ == "parity.api" and not n.startswith("_")}
    takes = {n: inspect.signature(fn).parameters for n, fn in public.items()
             if "progress" in inspect.signature(fn).parameters}
    assert {"check", "bisect", "envelope", "measure_envelope", "spec", "spec_candidate", "arbitrate", "bisect_run",
            "validate"} <= set(takes)
    assert {n: p["progress"].default for n, p in takes.items() if p["progress"].default is not SILENT} == {}
    # the older spellings are gone from every API function
    old = {n for n, fn in public.items() if {"counter", "on_progress"} & set(inspect.signature(fn).parameters)}
    assert old == set(), old


def test_no_lambda_stands_in_for_a_silent_default():
    spelled = [f"{p.relative_to(ROOT)}:{i}" for p in sorted((ROOT / "parity").rglob("*.py"))
               for i, line in enumerate(p.read_text().splitlines(), 1)
               if "or (lambda _" in line and ("progress" in line or "counter" in line)]
    assert spelled == []


class _Spy(Progress):
    """The terminal printer, also keeping the calls it receives."""

    def __init__(self) -> None:
        super().__init__(stream=io.StringIO(), terminal=False, interval=0.0)
        self.calls: list[tuple] = []

    def note(self, message: str) -> None:
        self.calls.append(("note", message))
        super().note(message)

    def count(self, stage: str, done: int, total: int | None) -> None:
        self.calls.append(("count", stage, done, total))
        super().count(stage, done, total)


@pytest.fixture(scope="module")
def reference_run(tiny_f32):
    return api.trace("reference", tiny_f32, PROMPT, positions="all", full="all", decode=1)


def test_the_printer_and_a_recording_receive_the_same_calls(tiny_f32, reference_run, capsys):
    rec, spy = Recording(), _Spy()
    a = api.check(reference_run, tiny_f32, envelope=ENV_F32, progress=rec)
    assert capsys.readouterr() == ("", "")                    # the API itself prints nothing
    b = api.check(reference_run, tiny_f32, envelope=ENV_F32, progress=spy)
    assert spy.calls == rec.calls and a.verdict == b.verdict
    kinds = {c[0] for c in rec.calls}
    assert kinds == {"note", "count"}, rec.calls              # both halves of the protocol were used
    assert rec.notes[0].startswith("envelope: ") and str(ENV_F32) in rec.notes[0]
    printed = spy.stream.getvalue()
    assert all(" ".join(m.split()) in " ".join(printed.split()) for m in rec.notes)   # every note, wrapped
    last = [c for c in rec.calls if c[0] == "count"][-1]
    assert f"{last[1]} {last[2]}/{last[3]}" in printed         # interval 0: every count is a line


def test_validate_returns_the_report_its_cli_prints(tiny_f32, tmp_path):
    mp = pytest.MonkeyPatch()
    install(tmp_path / "site", mp)
    try:
        rec = Recording()
        r = api.validate(tmp_path / "api", model=tiny_f32, exact="vfake", approx="vfake:act_quant=q8_0", n=2,
                         decode=1, boundary=True, pins=1, progress=rec)
        res = CliRunner().invoke(cli, ["validate", "-m", str(tiny_f32), "--exact", "vfake", "--approx",
                                       "vfake:act_quant=q8_0", "--boundary", "--n", "2", "--decode", "1", "--pins",
                                       "1", "--json", "-o", str(tmp_path / "cli")])
    finally:
        mp.undo()
    assert isinstance(r, ValidateReport)
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout) == r.to_dict()
    # 2 main tasks + 1 pin: one count before the first task, then one per task
    assert rec.calls == [("count", "validate", i, 3) for i in range(4)]
