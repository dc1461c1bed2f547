"""`v4parity demo` (what `make demo` runs): both reports printed, the fault located at blk.2, plot written."""

from __future__ import annotations

from click.testing import CliRunner

from parity import api
from parity.cli import cli


def test_demo_end_to_end(tmp_path):
    res = CliRunner().invoke(cli, ["demo", "--out", str(tmp_path)])
    assert res.exit_code == 0, (res.output, res.exception)
    out = res.output
    assert "all 14 checkpoints agree" in out
    assert "first drifting checkpoint: blk.2.attn (layer 2)" in out
    assert "demo verdict: OK" in out
    assert (tmp_path / "drift.png").stat().st_size > 20_000
    tokens = api.load_trace(tmp_path / "reference.trace").header.tokens
    for name in ("torch.trace", "torch-fault.trace"):
        assert api.load_trace(tmp_path / name).header.tokens == tokens


def _walkthrough() -> list[tuple[str, int]]:
    """The README's "Using it" shell block: (command, documented exit code) per command line."""
    import re
    from pathlib import Path

    text = (Path(__file__).parents[1] / "README.md").read_text()
    block = text.split("## Using it", 1)[1].split("```sh\n", 1)[1].split("```", 1)[0]
    out = []
    for line in block.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        m = re.search(r"#\s*exit (\d+)", line)
        out.append((line, int(m.group(1)) if m else 0))
    return out


def test_readme_walkthrough_runs_in_a_scratch_directory_with_the_documented_exit_codes(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).parents[1]
    steps = _walkthrough()
    assert steps[0][0].startswith(". .venv/bin/activate") and 'cd "$(mktemp -d)"' in steps[1][0]
    env = {**os.environ, "TMPDIR": str(tmp_path), "OMP_NUM_THREADS": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    # one shell, so REPO and the scratch directory carry over; each command's exit code is checked in turn
    script = [f"cd {repo}", steps[0][0], steps[1][0]]
    script += [f'{cmd} ; rc=$?; [ $rc -eq {rc} ] || {{ echo "README step exited $rc, documented {rc}: {cmd}" >&2;'
               f' exit 99; }}' for cmd, rc in steps[2:]]
    script.append("echo '--- ls'; ls -A")
    res = subprocess.run(["bash", "-c", "\n".join(script)], capture_output=True, text=True, env=env, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    made = set(res.stdout.rsplit("--- ls\n", 1)[1].split())  # the files only (the commands print words too)
    assert {"tiny.gguf", "ref.trace", "drift.png", "report.html", "gate.xml", "gate.md", "diff.md"} <= made
    assert [name for name in made if (repo / name).exists()] == []  # nothing it wrote landed in the repo root
