"""A Ray head (`ray start --head`) started for one test and stopped alone.

`ray stop --force` kills every Ray process on the machine — another test suite's cluster, a user's — so a test
must never run it. `ray_head` starts the head in a new session with its own temporary directory; at the end it
kills that process group, then any process whose command line names the directory (a worker started outside the
group), and fails when one of them is still alive. Nothing else is touched (`ray_processes` lists what it would
kill).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path


def ray_processes(marker: str) -> list[int]:
    """PIDs (other than this one) whose command line contains `marker` (the head's temporary directory)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace")
        except OSError:
            continue
        if marker in cmd:
            out.append(int(d.name))
    return out


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"   # a zombie has exited (its parent has not reaped it yet)


def stop_head(pgid: int, temp: str, timeout: float = 30.0) -> None:
    """SIGTERM then SIGKILL the head's process group and the processes naming `temp`; AssertionError if any of
    them is alive after `timeout` seconds."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [p for p in ray_processes(temp) if _alive(p)]
        if not left:
            break
        if time.monotonic() > deadline - timeout / 2:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
            for p in left:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(p, signal.SIGKILL)
        time.sleep(0.2)
    left = [p for p in ray_processes(temp) if _alive(p)]
    assert not left, f"Ray processes of the test's head still alive: {left}"


@contextlib.contextmanager
def ray_head(ray_bin: str, num_cpus: int = 2) -> Iterator[str]:
    """A Ray head on 127.0.0.1 at a free port with `num_cpus` CPUs; yields its address; stops only it."""
    temp = tempfile.mkdtemp(prefix="rt", dir="/tmp")   # short: Ray's socket paths must fit in 107 bytes
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([ray_bin, "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port),
                             "--num-cpus", str(num_cpus), "--temp-dir", temp, "--include-dashboard=false",
                             "--disable-usage-stats"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err
        yield f"127.0.0.1:{port}"
    finally:
        if proc.poll() is None:
            proc.kill()
        stop_head(proc.pid, temp)
        shutil.rmtree(temp, ignore_errors=True)
