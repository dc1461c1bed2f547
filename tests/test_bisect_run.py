"""`v4parity bisect-run` as `git bisect run`'s predicate (issue 28, item 9).

A scratch git repository holds a toy engine plugin (`toyengine.ToyEngine`, registered under the
`v4parity.engines` entry-point group through a `*.dist-info` directory on PYTHONPATH): the reference engine, with
one layer's output scaled in the commits from FAULTY on, and a module that fails to import in commit BROKEN. The
expected first bad commit is the one this test made faulty, never something the harness reports.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ENV_F32 = Path(__file__).resolve().parent.parent / "traces" / "tiny-f32.envelope.json"
TOKENS = "0,5,7,9,11"
PREDICATE = [sys.executable, "-c", "import sys; sys.argv[0] = 'v4parity'; from parity.cli import main; main()",
             "bisect-run"]
# commit 0 good, the last bad; BROKEN is where git tests first (the middle), FAULTY not beside it (a skip beside
# the first bad commit would leave git two candidates)
N_COMMITS, BROKEN, FAULTY = 9, 4, 6

PLUGIN = '''"""Toy engine under bisection: the reference, with layer {layer}'s output scaled by {scale}."""
import numpy as np
from reference_cpu.engine import ReferenceEngine

REVISION = {revision}
{broken}

class ToyEngine(ReferenceEngine):
    name = "toy"

    def forward_layer(self, state, layer, carrier, tokens, start_pos, capture=False):
        out = super().forward_layer(state, layer, carrier, tokens, start_pos, capture)
        if layer == {layer}:
            out.carrier = (out.carrier * np.float32({scale})).astype(np.float32)
        return out
'''


def _plugin(revision: int) -> str:
    broken = 'raise ImportError("libtoy.so: cannot open shared object file")' if revision == BROKEN else ""
    return PLUGIN.format(layer=1, scale="1.01" if revision >= FAULTY else "1.0", revision=revision, broken=broken)


def _git(repo: Path, env: dict, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True, text=True).stdout


@pytest.fixture(scope="module")
def toy_repo(tmp_path_factory):
    """(repo, env, commit ids): the toy plugin's history, and an environment in which `toy` is registered."""
    root = tmp_path_factory.mktemp("bisect_run")
    repo, site = root / "repo", root / "site"
    repo.mkdir()
    info = site / "v4parity_toy-0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: v4parity-toy\nVersion: 0\n")
    (info / "entry_points.txt").write_text("[v4parity.engines]\ntoy = toyengine:ToyEngine\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@t",
               GIT_CONFIG_GLOBAL=os.devnull, GIT_CONFIG_NOSYSTEM="1",
               PYTHONPATH=os.pathsep.join([str(site), str(repo), *filter(None, [os.environ.get("PYTHONPATH")])]))
    _git(repo, env, "init", "-q", "-b", "main")
    commits = []
    for revision in range(N_COMMITS):
        (repo / "toyengine.py").write_text(_plugin(revision))
        _git(repo, env, "add", "toyengine.py")
        _git(repo, env, "commit", "-q", "-m", f"revision {revision}")
        commits.append(_git(repo, env, "rev-parse", "HEAD").strip())
    return repo, env, commits


def _predicate(model: Path) -> list[str]:
    return [*PREDICATE, "-m", str(model), "--engine", "toy", "--tokens", TOKENS, "--decode", "2",
            "--envelope", str(ENV_F32)]


def test_git_bisect_run_finds_the_faulty_commit_and_skips_the_broken_one(tiny_f32, toy_repo):
    repo, env, commits = toy_repo
    _git(repo, env, "bisect", "start", commits[-1], commits[0])
    try:
        run = subprocess.run(["git", "bisect", "run", *_predicate(tiny_f32)], cwd=repo, env=env,
                             capture_output=True, text=True, timeout=300)
        log = _git(repo, env, "bisect", "log")
    finally:
        _git(repo, env, "bisect", "reset")
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"{commits[FAULTY]} is the first bad commit" in run.stdout, run.stdout
    marks = {w[3]: w[2] for w in map(str.split, log.splitlines()) if w[:2] == ["git", "bisect"]
             and w[2] in ("good", "bad", "skip")}
    # every commit git tested was marked by the predicate as this test built it: skip, bad from FAULTY, else good
    for i, c in enumerate(commits[1:-1], 1):
        if c in marks:
            assert marks[c] == ("skip" if i == BROKEN else "bad" if i >= FAULTY else "good"), (i, log)
    assert marks.get(commits[BROKEN]) == "skip", log


def test_skip_says_why_and_setup_errors_abort(tiny_f32, toy_repo, tmp_path):
    repo, env, commits = toy_repo
    _git(repo, env, "checkout", "-q", commits[BROKEN])
    try:
        run = subprocess.run([*_predicate(tiny_f32), "--json"], cwd=repo, env=env, capture_output=True, text=True)
    finally:
        _git(repo, env, "checkout", "-q", "main")
    doc = json.loads(run.stdout)
    assert run.returncode == 125 and doc["outcome"] == "skip" and "libtoy.so" in doc["reason"], run.stdout
    # a setup error (an engine name nobody registered) aborts the bisection: exit 128, not 1 or 125
    run = subprocess.run([*PREDICATE, "-m", str(tiny_f32), "--engine", "nosuch", "--envelope", str(ENV_F32)],
                         cwd=repo, env=env, capture_output=True, text=True)
    assert run.returncode == 128 and "unknown engine 'nosuch'" in run.stderr, run.stderr
    run = subprocess.run([*PREDICATE, "-m", str(tmp_path / "missing.gguf"), "--engine", "toy"], cwd=repo, env=env,
                         capture_output=True, text=True)
    assert run.returncode == 128 and "missing.gguf" in run.stderr, run.stderr
    run = subprocess.run([*PREDICATE, "-m", str(tiny_f32), "--engine", "nosuch", "--json"], cwd=repo, env=env,
                         capture_output=True, text=True)
    assert run.returncode == 128 and json.loads(run.stdout)["exit_code"] == 128, run.stdout
