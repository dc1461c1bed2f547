"""Atomic outputs: one file mode for every writer, and a trace never loads beside another run's vectors.

The kill test runs a writer in a subprocess that rewrites one trace + side file pair in a loop (alternating two
runs whose vectors differ), SIGKILLs it at random moments and reads the pair back: the reader either loads a
matching pair or refuses with a TraceError naming the side file's `trace_sha256`; it never loads a mixed pair.
"""

from __future__ import annotations

import json
import os
import random
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from trace_samples import toy_trace

from parity.contract.errors import TraceError
from parity.contract.files import OUTPUT_MODE, atomic_write, atomic_write_bytes
from parity.tracing import io as trace_io
from parity.tracing.io import read_trace, vectors_path, write_trace

TESTS = Path(__file__).parent
KILLS = 40


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def strict_umask():
    old = os.umask(0o077)  # a umask that would leave mkstemp-style files at 0600
    yield
    os.umask(old)


def test_every_writer_gives_mode_0644(tmp_path, strict_umask):
    from parity.check.envelope import Envelope, save_envelope
    from parity.gguf.container import VT, TensorData, Value, write_gguf
    from parity.logprobs.io import write_ds4_dump
    from parity.tracing.export import export_npz

    trace = toy_trace(1, with_vectors=True)
    text, binary = write_trace(trace, tmp_path / "t.trace"), write_trace(trace, tmp_path / "b.npz")
    gguf = tmp_path / "m.gguf"
    write_gguf(gguf, {"general.architecture": Value(VT.STRING, "x")},
               [TensorData("w", (4,), 0, np.zeros(4, np.float32).tobytes())])
    dump = tmp_path / "d.json"
    write_ds4_dump(dump, logits=np.zeros((1, 3), np.float32), selected=[0], prompt_tokens=1, ctx=8, top_k=2,
                   vocab_tokens=["a", "b", "c"], eos_id=2)
    exported = export_npz(trace, tmp_path / "e.npz")
    env_path = save_envelope(tmp_path / "x.envelope.json", Envelope("float32", {}, {}, {}, 0.0), {"file": "m"})
    outputs = [text, vectors_path(text), binary, vectors_path(binary), gguf, dump, exported, env_path]
    assert {str(p): oct(_mode(p)) for p in outputs} == {str(p): oct(OUTPUT_MODE) for p in outputs}
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]  # no temp file left behind


def test_atomic_write_leaves_the_old_file_when_the_writer_fails(tmp_path):
    path = atomic_write_bytes(tmp_path / "f", b"old")

    def broken(f):
        f.write(b"half")
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError):
        atomic_write(path, broken)
    assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["f"]


def test_side_file_of_another_run_is_refused(tmp_path, monkeypatch):
    """Deterministic form of the kill: the new side file is renamed into place, the new trace never is."""
    a, b = toy_trace(1, with_vectors=True), toy_trace(2, with_vectors=True)
    for name in ("x.trace", "x.npz"):
        path = write_trace(a, tmp_path / name)
        real = trace_io.atomic_write_bytes

        def side_only(p, data, path=path, real=real):
            if Path(p) == path:
                raise KeyboardInterrupt("killed between the two renames")
            return real(p, data)

        monkeypatch.setattr(trace_io, "atomic_write_bytes", side_only)
        with pytest.raises(KeyboardInterrupt):
            write_trace(b, path)
        monkeypatch.setattr(trace_io, "atomic_write_bytes", real)
        with pytest.raises(TraceError, match=r"vectors\.npz: field 'trace_sha256': this side file was not written"):
            read_trace(path)
        assert read_trace(path, load_vectors=False).header == a.header


WRITER = """
import sys
from trace_samples import toy_trace
from parity.tracing.io import write_trace
runs = [toy_trace(1, with_vectors=True), toy_trace(2, with_vectors=True)]
print("ready", flush=True)
i = 0
while True:
    write_trace(runs[i % 2], sys.argv[1])
    i += 1
"""


@pytest.mark.parametrize("name", ["k.trace", "k.npz"])
def test_sigkill_during_writes_never_loads_a_mixed_pair(tmp_path, name):
    path = tmp_path / name
    runs = {t.header.engine_version: t for t in (toy_trace(1, with_vectors=True), toy_trace(2, with_vectors=True))}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    rng = random.Random(16)
    outcomes = {"matching pair": 0, "refused": 0}
    for _ in range(KILLS // 2):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], env=env, stdout=subprocess.PIPE)
        assert proc.stdout.readline().strip() == b"ready"
        time.sleep(rng.uniform(0.0, 0.05))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if not path.exists():
            continue  # killed before the first trace was renamed into place
        try:
            t = read_trace(path)
        except TraceError as e:
            assert "field 'trace_sha256'" in str(e), str(e)
            outcomes["refused"] += 1
            continue
        want = runs[t.header.engine_version]
        for key, arr in want.vectors.items():
            np.testing.assert_array_equal(t.vectors[key], arr)
        outcomes["matching pair"] += 1
    assert sum(outcomes.values()) > 0
    print(json.dumps(outcomes))


def test_an_interrupted_trace_run_leaves_no_older_logprob_dump(tmp_path, tiny_f32, monkeypatch):
    """The dump is written after the trace: a run that dies while writing the trace must not leave the previous
    run's dump beside it."""
    from click.testing import CliRunner

    from parity import api
    from parity.cli import cli

    dump = tmp_path / "d.json"
    dump.write_text("previous run")

    def killed(*args, **kwargs):
        raise KeyboardInterrupt("killed while writing the trace")

    monkeypatch.setattr(api, "save_trace", killed)
    CliRunner().invoke(cli, ["trace", "--engine", "reference", "-m", str(tiny_f32), "--tokens", "0,5",
                             "--dump-logprobs", str(dump), "--dump-ctx", "4096", "-o", str(tmp_path / "t.trace")])
    assert not dump.exists() and not (tmp_path / "t.trace").exists()
