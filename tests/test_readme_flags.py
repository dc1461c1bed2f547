"""The README's run-flag table (issue 28 item 8): every flag it lists is an option of `v4parity trace`, and every
flag not marked `trace` only is an option of `v4parity bisect` too (the table once listed flags bisect lacks)."""

from __future__ import annotations

import re
from pathlib import Path

from parity.cli import cli

README = Path(__file__).resolve().parents[1] / "README.md"


def _options(command: str) -> set[str]:
    return {o for p in cli.commands[command].params for o in getattr(p, "opts", [])}


def _table_rows() -> list[str]:
    text = README.read_text()
    section = text.split("### Run flags", 1)[1].split("\n### ", 1)[0]
    return [line for line in section.splitlines() if line.startswith("| `")]


def test_run_flag_table_matches_trace_and_bisect():
    rows = _table_rows()
    assert len(rows) >= 8, rows
    trace, bisect = _options("trace"), _options("bisect")
    for row in rows:
        flag_cell, meaning = row.split(" | ", 1)
        flags = re.findall(r"`(--[a-z0-9-]+)", flag_cell)
        assert flags, row
        assert set(flags) <= trace, (set(flags) - trace, row)
        if "`trace` only" not in meaning:
            assert set(flags) <= bisect, (set(flags) - bisect, row)
