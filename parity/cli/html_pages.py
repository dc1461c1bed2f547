"""The `--html FILE` page of `validate`: one self-contained file (inline CSS and images, no script, no network),
verdict first, built from the command's report with `parity.compare.html`. The pages of `check` and `bisect` are
printers beside their other ones (`parity.bisect.check_report.to_html`, `parity.bisect.bisect_report.to_html`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from parity.compare.html import Section, image, preformatted, write_html

if TYPE_CHECKING:
    from parity.validate.result import ValidateReport


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
