"""`check --workers N` / `check --ray local` (issue 27 point 3): the per-layer runs (teacher-forced pass, round-off
twins, hypotheses, fault trials) on worker processes or Ray tasks give the serial report byte for byte.

The JSON documents are compared as bytes with the wall-clock field `seconds` set to 0: everything else —
verdict, causes and their evidence, every table value to the last bit, notes (including the count of silenced
engine announcements) — must be the serial run's. Candidates: a clean torch trace and one with
`comb-not-transposed@3` (a fault at one chosen layer, tests/test_inject_layers.py), every position, full vectors.
To stay small the comparisons call `parity.check.check.check` (what `api.check` calls) with 5 round-off twins
instead of 19 and a defect library of three torch faults; the options' way from the command line to it is checked
separately.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from reference_prompt import prompt_and_forced
from requires import require

from parity import api
from parity.check.check import check
from parity.check.check_report import timeless
from parity.check.envelope import load_envelope
from parity.check.parallel import EngineLoader
from parity.cli import cli
from parity.contract.engine import RunOptions
from parity.contract.errors import ParityError
from parity.contract.workpool import WorkPool
from parity.gguf.weights import Weights

ENV_F32 = Path(__file__).resolve().parent.parent / "traces" / "tiny-f32.envelope.json"
DECODE = 2
PROMPT = 20   # tokens of the built-in prompt: past the tiny model's window and compressed blocks, yet quick
TWINS = 5
LIBRARY = ("sink-dropped", "comb-not-transposed", "rope-split-halves")


@pytest.fixture(scope="module")
def candidates(tiny_f32, tmp_path_factory):
    prompt, forced = prompt_and_forced(tiny_f32, DECODE, PROMPT)
    out = {}
    for name, inject in (("clean", ()), ("faulty", ("comb-not-transposed@3",))):
        path = tmp_path_factory.mktemp("workers") / f"{name}.trace"
        api.save_trace(api.trace("torch", tiny_f32, prompt, positions="all", full="all", decode=DECODE,
                                 forced=forced, options=RunOptions(inject=inject)), path)
        out[name] = api.load_trace(path)
    return out


def _judge(model, trace, pool: WorkPool) -> bytes:
    with pool:
        report = check(trace, EngineLoader("reference", str(model)),
                       load_envelope(ENV_F32, "float32"), config=Weights(model).config,
                       fault_engines=[("torch", EngineLoader("torch", str(model)), LIBRARY)], n_twins=TWINS,
                       pool=pool)
    return timeless(report.to_dict()).encode()


@pytest.fixture(scope="module")
def serial(tiny_f32, candidates):
    return {name: _judge(tiny_f32, t, WorkPool()) for name, t in candidates.items()}


def test_serial_verdicts(serial):
    """The two candidates the comparisons below are about: a clean run and a DEFECT at layer 3, named."""
    assert json.loads(serial["clean"])["verdict"] in ("MATCH", "NOISE")
    faulty = json.loads(serial["faulty"])
    assert faulty["verdict"] == "DEFECT" and faulty["culprit"]["layer"] == 3
    assert [(c["name"], c["layer"]) for c in faulty["causes"] if c["kind"] == "defect"] == [("comb-not-transposed", 3)]


def test_two_worker_processes_give_the_serial_json(tiny_f32, candidates, serial):
    for name, t in candidates.items():
        assert _judge(tiny_f32, t, WorkPool(2)) == serial[name], name


def test_local_ray_gives_the_serial_json(tiny_f32, candidates, serial, monkeypatch):
    """`--ray local` (`WorkPool` calls ray.init(address="local")); one instance serves both candidates: a session
    already initialised is used as it is (and left running for the next check)."""
    ray = require("ray")
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:9")   # --ray local must start its own instance, never join this
    from parity.contract.workpool import _start_ray

    assert _start_ray("local", 2) is ray and ray.is_initialized()
    try:
        for name, t in candidates.items():
            assert _judge(tiny_f32, t, WorkPool(2, "local")) == serial[name], name
            assert ray.is_initialized()
    finally:
        ray.shutdown()


@pytest.mark.parametrize("command", ["check", "bisect"])
@pytest.mark.parametrize("flags, pool", [(["--workers", "2"], (2, None)), (["--ray"], (2, "local")),
                                         (["--ray", "--workers", "3"], (3, "local")),
                                         (["--ray", "10.0.0.1:6379"], (1, "10.0.0.1:6379"))])
def test_the_options_reach_the_api(tiny_f32, monkeypatch, command, flags, pool):
    seen = {}

    def stub(*_a, **kw):
        seen.update(workers=kw["workers"], ray=kw["ray"])
        raise ParityError("stub")

    monkeypatch.setattr(api, command, stub)
    args = ["-m", str(tiny_f32), *(["--candidate", "x.trace"] if command == "check" else [])]
    CliRunner().invoke(cli, [command, *args, *flags])
    assert (seen["workers"], seen["ray"]) == pool


def test_workers_with_a_ray_address_is_refused(tiny_f32):
    r = CliRunner().invoke(cli, ["check", "-m", str(tiny_f32), "--candidate", "x.trace", "--workers", "2",
                                 "--ray", "127.0.0.1:9"])
    assert r.exit_code == 2 and "--workers sets the CPUs of a local Ray instance" in r.output


def test_bisect_teacher_forced_pass_on_two_workers_is_the_serial_one(tiny_f32):
    """`bisect --workers 2`: the teacher-forced pass and its round-off twins as units; the report (but for its
    `seconds`) is the serial one."""
    prompt = list(range(1, 14))
    runs = []
    for workers in (1, 2):
        r = api.bisect(tiny_f32, engine="torch", tokens=prompt, decode=1, envelope=ENV_F32,
                       options=RunOptions(inject=("sink-dropped@2",)), workers=workers)
        doc = json.loads(json.dumps(r.to_dict(), default=str))
        doc.pop("seconds")
        for timing in ("seconds", "envelope"):   # the verdict's `check` (its times and envelope lookup time)
            doc["check"].pop(timing)
        runs.append(json.dumps(doc, indent=1).encode())
    assert runs[0] == runs[1]
    assert json.loads(runs[0])["culprit"]["layer"] == 2


def test_a_factory_no_worker_can_rebuild_is_refused_on_a_pool_not_run_serially_unannounced(tiny_f32):
    # the report would be the serial one either way; the user asked for workers, so running serially without a
    # word would be a silent default: the factory is named before any work
    loader = EngineLoader("reference", str(tiny_f32))
    with pytest.raises(ParityError, match="factory of torch cannot be rebuilt in a worker"):
        check(None, loader, None, config=None, fault_engines=[("torch", lambda o: None, ("sink-dropped",))],
              pool=WorkPool(2))
