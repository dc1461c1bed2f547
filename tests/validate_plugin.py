"""Register tests/validate_engines.py as real `v4parity.engines` entry points: a `*.dist-info` directory in a
temporary site directory, put on sys.path (this process) and PYTHONPATH (worker processes, Ray workers)."""

from __future__ import annotations

import os
from pathlib import Path

from validate_engines import ENTRY_POINTS

from parity.contract.engine import available_engines

TESTS = Path(__file__).parent


def install(site: Path, monkeypatch) -> None:
    info = site / "v4parity_validate_test_engines-0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: v4parity-validate-test-engines\nVersion: 0\n")
    (info / "entry_points.txt").write_text(
        "[v4parity.engines]\n" + "".join(f"{k} = validate_engines:{v}\n" for k, v in ENTRY_POINTS.items()))
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.syspath_prepend(str(TESTS))
    parts = [str(site), str(TESTS), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(parts))
    missing = set(ENTRY_POINTS) - set(available_engines())
    assert not missing, f"test engine entry points not found: {missing}"
