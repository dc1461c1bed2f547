"""Progress of long commands: a bar with ETA on a terminal, plain periodic lines in a log.

`Progress` implements the harness's progress protocol (`parity.contract.progress.ProgressSink`): a command passes
one instance as an API function's `progress` and the API never prints. `count(stage, done, total)` (also spelled
`progress(stage, done, total)`) draws the counts. On a terminal (stderr is a TTY) it redraws one
line: `stage [#####.....] done/total elapsed ETA`; otherwise it writes `stage done/total elapsed` lines,
at most one per `interval` seconds per stage, plus the first and the last of each stage, so a CI log shows
progress without flooding. `note(message)` serves callbacks that report stages by message only: each
message on its own line with the time since the first.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


class Progress:
    """The terminal printer of the progress protocol: `count(stage, done, total)` draws a bar or a timed line,
    `note(message)` prints a timed line."""

    def __init__(self, stream: TextIO | None = None, interval: float = 10.0, terminal: bool | None = None,
                 clock: Callable[[], float] = time.monotonic, width: int = 30) -> None:
        self.stream = stream or sys.stderr
        self.terminal = self.stream.isatty() if terminal is None else terminal
        self.interval, self.clock, self.width = interval, clock, width
        self.stage: str | None = None
        self.started = self.last_line = 0.0
        self.drawn = False
        self.shown = 0  # length of the terminal line on screen
        self.first: float | None = None  # clock of the first message (`note`)

    def count(self, stage: str, done: int, total: int | None) -> None:
        """Report that `done` of `total` units of `stage` are finished."""
        now = self.clock()
        if stage != self.stage:
            self._end_line()
            self.stage, self.started, self.last_line = stage, now, -float("inf")
        elapsed = now - self.started
        finished = total is not None and done >= total
        if self.terminal:
            line = self._bar(stage, done, total, elapsed)
            self.stream.write("\r" + line.ljust(self.shown) + ("\n" if finished else ""))
            self.drawn, self.shown = not finished, 0 if finished else len(line)
            self.stream.flush()
        elif finished or now - self.last_line >= self.interval:
            count = f"{done}/{total}" if total is not None else str(done)
            self.stream.write(f"{stage} {count} {_clock(elapsed)}\n")
            self.stream.flush()
            self.last_line = now

    __call__ = count

    def note(self, message: str) -> None:
        """A stage announced in words: the message with the time since the first report, on its own line (wrapped
        within 100 columns, continuation lines indented)."""
        from parity.compare.textcells import fit_line

        now = self.clock()
        self._end_line()
        self.first = now if self.first is None else self.first
        self.stream.write(fit_line(f"{message} [{_clock(now - self.first)}]") + "\n")
        self.stream.flush()

    def _bar(self, stage: str, done: int, total: int | None, elapsed: float) -> str:
        if not total:
            return f"{stage} {done} {_clock(elapsed)}"
        frac = min(done / total, 1.0)
        fill = int(frac * self.width)  # whole cells only
        eta = _clock(elapsed / done * (total - done)) if done else "?"
        return f"{stage} [{'#' * fill}{'.' * (self.width - fill)}] {done}/{total} {_clock(elapsed)} ETA {eta}"

    def _end_line(self) -> None:
        if self.drawn:
            self.stream.write("\n")
            self.drawn, self.shown = False, 0

    def close(self) -> None:
        """End an unfinished terminal line (call when a command stops early)."""
        self._end_line()
        self.stream.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Lines:
    """The plain printer of the progress protocol: each note on its own stderr line as given (no time, no wrap);
    counts are not shown (the commands that use it, `bisect-run` and `arbitrate`, report stages only)."""

    def note(self, message: str) -> None:
        """The message on its own stderr line."""
        import click

        click.echo(message, err=True)

    def count(self, stage: str, done: int, total: int | None) -> None:
        """Not shown."""
