"""`v4parity validate` end to end with test engine plugins (tests/validate_engines.py, real entry points) and
the torch engine: the announce pin, the exactness pin, exit codes, kill + --resume, Ray vs worker processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from requires import require
from validate_plugin import install

from parity import api
from parity.validate.driver import REPORT
from parity.validate.store import RESULTS

CLI = [sys.executable, "-c", "from parity.cli import main; main()", "validate"]


@pytest.fixture(scope="module")
def plugins(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    install(tmp_path_factory.mktemp("site"), mp)
    yield
    mp.undo()


def run(tmp_path, model, approx, exact="vfake", n=6, decode=4, **kw):
    return api.validate(tmp_path / "out", model=model, exact=exact, approx=approx, n=n, decode=decode,
                        boundary=True, pins=2, **kw)


def test_announced_approximation_passes_both_pins(plugins, tmp_path, tiny_f32):
    r = run(tmp_path, tiny_f32, "vfake:act_quant=q8_0")
    assert r.passed, r.findings
    an, ex = r.pins["announce"], r.pins["exactness"]
    assert an["declared"] == {"act_quant": "q8_0"} and an["numerics_differ_on"] == 6 and an["stderr_announced"]
    assert ex["explicit_spec"] == "vfake:act_quant=none" and ex["prompts"] == [0, 1]
    # every field the report promises
    agg = r.aggregates
    for k in ("divergence_rate", "step_divergence_rate", "top1_agreement", "kl_mean", "kl_p50", "kl_p99", "kl_max",
              "rel_l2.blk.0.mean", "rel_l2.blk.5.p99"):
        assert set(agg[k]) == {"value", "ci", "mde", "n"}
    rec = r.records[0]
    assert len(rec["verdict"]) == len(rec["kl"]) == 5 and len(rec["layer_rel_l2"]) == 6
    assert all(x > 0 for x in rec["layer_rel_l2"])      # Q8_0 rounding moves every layer's carrier
    assert {"seconds", "cpu_seconds"}.isdisjoint(rec)
    for f in ("report.md", "validate.png", "timing.json", RESULTS):
        assert (tmp_path / "out" / f).stat().st_size > 0
    md = (tmp_path / "out" / "report.md").read_text()  # no budget: only the pins were judged, and it says so
    assert "**PASS (pins only - no budget given, metrics not judged)**" in md and "declared act_quant=q8_0;" in md
    assert "{'" not in md and "named on stderr: yes" in md


def test_validate_plot_has_a_legend_for_both_axes_and_no_dict_in_titles(plugins, tmp_path, tiny_f32, monkeypatch):
    import matplotlib.pyplot as plt

    from parity.validate.report import plot_report

    r = run(tmp_path, tiny_f32, "vfake:act_quant=q8_0")
    figs = []
    monkeypatch.setattr(plt, "close", figs.append)
    plot_report(r, tmp_path / "v.png")
    legend = figs[0].axes[0].get_legend()
    assert legend is not None and [t.get_text() for t in legend.get_texts()] == ["top-1 differs",
                                                                               "mean KL (lower bound)"]
    titles = [ax.get_title() for ax in figs[0].axes] + [figs[0]._suptitle.get_text()]
    assert not any("{" in t for t in titles), titles
    monkeypatch.undo()
    plt.close(figs[0])


def test_silent_approximate_plugin_fails_the_announce_pin(plugins, tmp_path, tiny_f32):
    r = run(tmp_path, tiny_f32, "vfake-silent")
    an = r.pins["announce"]
    assert not r.passed and not an["passed"]
    assert an["declared"] == {} and an["numerics_differ_on"] == 6
    assert an["failures"][0].startswith("silent approximation: the approximate path's numerics differ")
    assert r.pins["exactness"]["passed"]            # its exact path is the same as vfake's


def test_declared_but_unprinted_mode_fails_the_announce_pin(plugins, tmp_path, tiny_f32):
    r = run(tmp_path, tiny_f32, "vfake-mute:act_quant=q8_0", exact="vfake-mute")
    assert r.findings == ["announce pin: the engine did not name act_quant=q8_0 on stderr (declared in the "
                             "header flags)"]


def test_one_ulp_drift_of_the_exact_path_fails_the_exactness_pin(plugins, tmp_path, tiny_f32):
    # in-process executor: the drift plugin moves one logit by one ulp on a repeated run in the same process
    r = run(tmp_path, tiny_f32, "vfake-drift:act_quant=q8_0", exact="vfake-drift")
    ex = r.pins["exactness"]
    assert not r.passed and not ex["passed"]
    assert ex["failures"] == [
        "prompt 0: a second run of the exact path differs in bits from the first",
        "prompt 0: vfake-drift:act_quant=none (approximate option at its exact value) differs in bits from the "
        "exact path",
        "prompt 1: a second run of the exact path differs in bits from the first",
        "prompt 1: vfake-drift:act_quant=none (approximate option at its exact value) differs in bits from the "
        "exact path"]
    assert r.pins["announce"]["passed"]


def test_exit_codes_and_budget(plugins, tmp_path, tiny_f32):
    budget = tmp_path / "budget.txt"
    budget.write_text("kl_max <= 1e-30\n")
    base = ["--model", str(tiny_f32), "--exact", "vfake", "--boundary", "--n", "3", "--decode", "2", "--pins", "1"]
    ok = subprocess.run([*CLI, *base, "--approx", "vfake:act_quant=q8_0", "-o", str(tmp_path / "a")],
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert "validate: 4/4 tasks (100%)" in ok.stderr     # plain progress lines off a terminal
    bad = subprocess.run([*CLI, *base, "--approx", "vfake:act_quant=q8_0", "--budget", str(budget), "-o",
                          str(tmp_path / "b")], capture_output=True, text=True)
    assert bad.returncode == 1
    assert json.loads((tmp_path / "b" / REPORT).read_text())["budget"][0]["passed"] is False
    usage = subprocess.run([*CLI, *base, "--approx", "vfake:act_quant=q4", "-o", str(tmp_path / "c")],
                           capture_output=True, text=True)
    assert usage.returncode == 2 and "act_quant='q4'" in usage.stderr
    again = subprocess.run([*CLI, "--resume", str(tmp_path / "a"), "--n", "5"], capture_output=True, text=True)
    assert again.returncode == 2 and "drop n" in again.stderr


def test_kill_and_resume_gives_the_uninterrupted_report(plugins, tmp_path, tiny_f32):
    args = ["--model", str(tiny_f32), "--exact", "vfake", "--approx", "vfake:act_quant=q8_0", "--boundary",
            "--n", "30", "--decode", "6", "--pins", "2"]
    whole = subprocess.run([*CLI, *args, "-o", str(tmp_path / "whole")], capture_output=True, text=True)
    assert whole.returncode == 0, whole.stderr
    cut = tmp_path / "cut"
    proc = subprocess.Popen([*CLI, *args, "-o", str(cut)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while time.time() < deadline and not ((cut / RESULTS).exists() and (cut / RESULTS).read_bytes().count(b"\n") >= 5):
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    lines = (cut / RESULTS).read_bytes().count(b"\n")
    assert 5 <= lines < 32 and not (cut / REPORT).exists()   # killed mid-run
    with open(cut / RESULTS, "ab") as f:
        f.write(b'{"kind": "main", "ind')                       # and a record cut half-way
    resumed = subprocess.run([*CLI, "--resume", str(cut)], capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    assert (cut / REPORT).read_bytes() == (tmp_path / "whole" / REPORT).read_bytes()
    assert (cut / RESULTS).read_bytes().count(b"\n") == 32


def test_ray_equals_worker_processes_byte_for_byte(plugins, tmp_path, tiny_f32, monkeypatch):
    require("ray")
    # --ray local once called ray.init() without an address, which joins RAY_ADDRESS or the cluster the last
    # `ray start` on the machine recorded (another test suite's, on a shared machine) instead of starting its own:
    # the test then failed only when such a cluster happened to exist. A bogus RAY_ADDRESS makes that reproducible.
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:9")
    a = api.validate(tmp_path / "w", model=tiny_f32, exact="vfake", approx="vfake:act_quant=q8_0", n=20,
                     decode=4, boundary=True, pins=2, workers=2)
    b = api.validate(tmp_path / "r", model=tiny_f32, exact="vfake", approx="vfake:act_quant=q8_0", n=20,
                     decode=4, boundary=True, pins=2, workers=2, ray="local")
    assert a == b
    assert (tmp_path / "w" / REPORT).read_bytes() == (tmp_path / "r" / REPORT).read_bytes()
    assert json.loads((tmp_path / "r" / "timing.json").read_text())["executor"] == "Ray (local, 2 CPUs)"


def test_torch_act_quant_q8_0_is_announced_and_the_exact_path_pinned(tmp_path, tiny_realmix):
    r = api.validate(tmp_path / "t", model=tiny_realmix, exact="torch", approx="torch:act_quant=q8_0", n=3,
                     decode=2, boundary=True, pins=1)
    assert r.passed, r.findings
    assert r.pins["announce"]["declared"] == {"act_quant": "q8_0"}
    assert r.pins["announce"]["numerics_differ_on"] == 3
    assert r.pins["exactness"]["explicit_spec"] == "torch:act_quant=none"


def test_engines_are_loaded_once_per_worker_not_per_prompt(plugins, tmp_path, tiny_f32):
    # vfake announces itself once per load (and the captured text is passed on to stderr): 8 prompts on 2 worker
    # processes must show at most 2 loads of the approximate engine
    r = subprocess.run([*CLI, "-m", str(tiny_f32), "--exact", "vfake", "--approx", "vfake:act_quant=q8_0",
                        "--boundary", "--n", "8", "--decode", "2", "--pins", "0", "--workers", "2",
                        "-o", str(tmp_path / "o")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert 1 <= r.stderr.count("vfake: APPROXIMATE act_quant=q8_0") <= 2


def test_ray_cluster_at_an_address_equals_worker_processes(tmp_path, tiny_realmix, monkeypatch):
    """A real Ray cluster started with `ray start --head` (its own processes), reached by --ray ADDRESS: the
    report is byte-identical to the --workers run. The head is stopped alone (tests/ray_cluster.py), never by
    `ray stop --force`, which kills every Ray process on the machine: a decoy named like another cluster's raylet
    outlives it."""
    require("ray")
    import shutil

    from ray_cluster import ray_head, ray_processes

    monkeypatch.setenv("RAY_AUTH_MODE", "token")  # `ray start` makes a token (~/.ray/auth_token); clients need it
    ray_bin = shutil.which("ray", path=str(Path(sys.executable).parent))
    decoy_dir = tmp_path / "other-cluster"
    decoy = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", "raylet", "gcs_server",
                              f"--temp-dir={decoy_dir}"], start_new_session=True)
    try:
        with ray_head(ray_bin) as address:
            args = ["-m", str(tiny_realmix), "--exact", "torch", "--approx", "torch:act_quant=q8_0", "--boundary",
                    "--n", "4", "--decode", "2", "--pins", "1"]
            for out, executor in (("w", ["--workers", "2"]), ("r", ["--ray", address])):
                r = subprocess.run([*CLI, *args, *executor, "-o", str(tmp_path / out)], capture_output=True,
                                   text=True, timeout=300)
                assert r.returncode == 0, r.stderr[-2000:]
            assert (tmp_path / "w" / REPORT).read_bytes() == (tmp_path / "r" / REPORT).read_bytes()
        assert decoy.poll() is None and ray_processes(str(decoy_dir)) == [decoy.pid]
    finally:
        decoy.kill()
        decoy.wait()


def test_report_is_typed_and_frozen_and_the_cli_prints_it_not_the_files(plugins, tmp_path, tiny_f32):
    import dataclasses

    from click.testing import CliRunner

    from parity.cli import cli
    from parity.validate.result import ValidateReport

    r = run(tmp_path, tiny_f32, "vfake:act_quant=q8_0", n=2, decode=1)
    assert isinstance(r, ValidateReport) and r.passed is True
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.passed = False  # type: ignore[misc]
    with pytest.raises(TypeError, match="not subscriptable"):   # read by attribute: the report is not a mapping
        _ = r["passed"]  # type: ignore[index]
    stored = json.loads((tmp_path / "out" / REPORT).read_text())
    assert r.to_dict() == stored                      # to_dict() is report.json, key for key
    timing = json.loads((tmp_path / "out" / "timing.json").read_text())
    assert r.timing.to_dict() == timing and timing["tasks"] == 4 and timing["executor"] == "in-process"
    # the CLI prints from the returned report: files removed after they are written do not change its output
    import parity.validate.driver as driver

    def then_remove(report, out):
        real(report, out)
        for f in ("report.json", "report.md", "timing.json"):
            (out / f).unlink()
    real = driver.write_files
    mp = pytest.MonkeyPatch()
    mp.setattr(driver, "write_files", then_remove)
    try:
        res = CliRunner().invoke(cli, ["validate", "-m", str(tiny_f32), "--exact", "vfake", "--approx",
                                       "vfake:act_quant=q8_0", "--boundary", "--n", "2", "--decode", "1",
                                       "--pins", "2", "--json", "-o", str(tmp_path / "cli")])
    finally:
        mp.undo()
    assert res.exit_code == 0, res.output
    printed = json.loads(res.stdout)
    assert printed == stored and not (tmp_path / "cli" / REPORT).exists()
