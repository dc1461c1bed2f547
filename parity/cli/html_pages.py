"""The `--html FILE` pages of `check`, `bisect` and `validate`: one self-contained file each (inline CSS and
images, no script, no network), verdict first, built from the command's report with `parity.compare.html`."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING
from typing import Any

from parity.compare.html import Section, esc, image, preformatted, table, write_html

if TYPE_CHECKING:
    from parity.validate.result import ValidateReport
from parity.compare.verdict import BisectVerdict, CauseKind, RowStatus, Verdict


def _png(plot: Callable[[Any, str], object], report: Any) -> bytes:
    """A report's plot function (which writes a file) rendered to PNG bytes for inlining."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "plot.png"
        plot(report, str(path))
        return path.read_bytes()


def check_page(path: str, report: Any) -> Path:
    """`check`: verdict, causes, the per-checkpoint table (status colours), the excess plot, notes."""
    from parity.bisect.check_report import COLUMNS, plot, row_cells

    sections = []
    if report.causes:
        sections.append(Section("Causes", table(
            ["kind", "name", "layer", "sub-op", "evidence"],
            [[c.kind, c.name, c.layer, c.subop or "-", c.evidence] for c in report.causes],
            ["pass" if c.kind == CauseKind.BENIGN else "fail" for c in report.causes], left=["name", "evidence"])))
    rows = [row_cells(r) for r in report.table]
    sections.append(Section("Per checkpoint (free-running and teacher-forced local error, excess over the envelope)",
                            table(COLUMNS, rows, ["pass" if r.status == RowStatus.OK else "fail" for r in report.table],
                                  left=["checkpoint", "status"])))
    sections.append(Section("Excess per checkpoint", image(_png(plot, report), "excess over the envelope")))
    if report.notes:
        sections.append(Section("Notes", "".join(f'<p class="note">{esc(n)}</p>' for n in report.notes)))
    return write_html(path, "v4parity check", report.headline, report.verdict != Verdict.DEFECT, sections)


def bisect_page(path: str, report: Any) -> Path:
    """`bisect`: verdict, the full summary, the step x layer / per-layer plot."""
    from parity.bisect.search import plot_report

    sections = [Section("Summary", preformatted(report.summary)),
                Section("Excess map", image(_png(plot_report, report), "bisect excess map"))]
    return write_html(path, "v4parity bisect", report.summary.splitlines()[0], report.verdict != BisectVerdict.DEFECT,
                      sections)


def validate_page(path: str, report: ValidateReport) -> Path:
    """`validate`: pass/fail with the findings, the Markdown report as text, the per-step figure, all from the
    report (`parity.validate.report`'s printers; nothing is read back from the run directory)."""
    from parity.compare.html import plot_png
    from parity.validate.report import NO_BUDGET, plot_report, render_markdown

    judged = "every budget bound and pin holds" if report.budget else NO_BUDGET
    verdict = judged if report.passed else "; ".join(report.findings)
    sections = [Section("Report", preformatted(render_markdown(report))),
                Section("Per step", image(plot_png(plot_report, report), "validation plot"))]
    return write_html(path, "v4parity validate", verdict, report.passed, sections)
