"""The harness's one progress protocol: what a long API call reports while it runs, defined once.

A long call (`api.check`, `api.bisect`, `api.envelope`, `api.spec`, `api.validate`, `api.trace_to_file`, ...) takes
one `progress` object and reports through two methods:

- `note(message)`: a stage announced in words ("reference: following 8 tokens ...");
- `count(stage, done, total)`: `done` of `total` units of `stage` finished (`total` None: unknown).

`SILENT` (the default everywhere) drops both; `parity.cli.progress.Progress` prints them (a bar on a terminal,
timed lines in a log); `Recording` keeps every call in order (tests, or a caller that prints later); `Notes(show)`
hands the notes to a one-message printer (scripts, stage-only commands). The API never prints: the command that
wants output passes a printer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

Note = Callable[[str], None]                       # a bound `progress.note`, as the private stages take it
Count = Callable[[str, int, "int | None"], None]   # a bound `progress.count`


@runtime_checkable
class ProgressSink(Protocol):
    """Where a long call reports: `note(message)` for a stage in words, `count(stage, done, total)` for units."""

    def note(self, message: str) -> None:
        """A stage announced in words."""

    def count(self, stage: str, done: int, total: int | None) -> None:
        """`done` of `total` units of `stage` are finished (`total` None: not known)."""


class _Silent:
    """Drops every report (the default of every API function)."""

    def note(self, message: str) -> None:
        """Nothing."""

    def count(self, stage: str, done: int, total: int | None) -> None:
        """Nothing."""

    def __repr__(self) -> str:
        return "SILENT"


SILENT: ProgressSink = _Silent()


class Recording:
    """Keeps every report in order: `calls` holds ('note', message) and ('count', stage, done, total) tuples."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def note(self, message: str) -> None:
        """Record a stage message."""
        self.calls.append(("note", message))

    def count(self, stage: str, done: int, total: int | None) -> None:
        """Record a count."""
        self.calls.append(("count", stage, done, total))

    @property
    def notes(self) -> list[str]:
        """The stage messages, in order."""
        return [c[1] for c in self.calls if c[0] == "note"]


class Notes:
    """The protocol over a one-message printer: `note(message)` calls `show(message)`; counts are not shown (for
    the commands and scripts that print stage lines only, each in its own style)."""

    def __init__(self, show: Note) -> None:
        self.show = show

    def note(self, message: str) -> None:
        """`show(message)`."""
        self.show(message)

    def count(self, stage: str, done: int, total: int | None) -> None:
        """Not shown."""
