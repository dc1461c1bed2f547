"""The output directory of a validation: `config.json` (what was asked), `results.jsonl` (one record per
finished task, appended as it arrives), and the reports written at the end.

Each record is one line written with a single `write` on an append-only descriptor and fsync'ed, so a crash
or Ctrl-C leaves every finished record intact and at most one partial last line, which `read_results` drops
(and cuts from the file) on --resume. Whole files are written atomically (temporary file + rename).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from parity.compare.jsonvalues import json_safe
from parity.contract.errors import ParityError
from parity.contract.files import atomic_write_bytes

CONFIG, RESULTS = "config.json", "results.jsonl"


class StoreError(ParityError):
    """An output directory that cannot be started or resumed."""


def dumps(obj: object) -> str:
    """Canonical JSON: sorted keys; a non-finite float becomes the string "inf" / "-inf" / "nan" (as in the
    logprob reports), never the non-JSON NaN token. numpy reads those strings back as floats."""
    return json.dumps(json_safe(obj), sort_keys=True, allow_nan=False)


def start(out: Path, config: dict) -> None:
    """A fresh run: DIR must not hold an earlier run (use --resume for that)."""
    out.mkdir(parents=True, exist_ok=True)
    if (out / CONFIG).exists() or (out / RESULTS).exists():
        raise StoreError(f"{out} already holds a validation run: continue it with --resume {out}, or choose "
                         "another -o")
    atomic_write_bytes(out / CONFIG, (json.dumps(config, indent=2, sort_keys=True) + "\n").encode())
    (out / RESULTS).touch()


def read_config(out: Path) -> dict:
    path = out / CONFIG
    if not path.exists():
        raise StoreError(f"--resume {out}: no {CONFIG} there (not a validation output directory)")
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise StoreError(f"--resume {out}: cannot read {CONFIG} ({e}; the file was edited or corrupted)") from None
    if not isinstance(config, dict):
        raise StoreError(f"--resume {out}: {CONFIG} is not a JSON object (the file was edited or corrupted)")
    return config


def read_results(out: Path) -> list[dict]:
    """Every complete record; a partial last line (a write cut by a crash) is dropped from the file too."""
    path = out / RESULTS
    if not path.exists():
        raise StoreError(f"--resume {out}: no {RESULTS} there")
    data = path.read_bytes()
    lines = data.split(b"\n")
    complete, tail = lines[:-1], lines[-1]
    records = []
    for no, line in enumerate(complete, 1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            raise StoreError(f"{path}:{no}: not a JSON record (the file was edited or corrupted)") from None
    if tail:
        atomic_write_bytes(path, b"".join(line + b"\n" for line in complete))
    return records


class ResultWriter:
    """Appends records to results.jsonl, one atomic line each."""

    def __init__(self, out: Path) -> None:
        self.fd = os.open(out / RESULTS, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def add(self, record: dict) -> None:
        os.write(self.fd, (dumps(record) + "\n").encode())
        os.fsync(self.fd)

    def close(self) -> None:
        os.close(self.fd)
