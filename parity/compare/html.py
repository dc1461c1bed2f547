"""A self-contained HTML report: one file, inline CSS, images as base64 `data:` URIs, no script, no network.

Verdict first, then the sections in order. `diff_sections(report)` gives the sections of a trace diff (the
per-checkpoint table with pass/fail colours, the drift plot, routing/indexer/HC diagnostics, the two run
headers side by side); other commands (check, bisect, validate) build their own `Section`s with `table`,
`image` (`plot_png` renders a report's figure), `preformatted` and `headers_side_by_side`, and call `write_html`
(or pass `extra=` to `write_report` to append them to a diff): their pages are printers beside their other ones
(`parity.check.check_report.to_html`, `parity.bisect.bisect_report.to_html`).
"""

from __future__ import annotations

import base64
import html
import json
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from parity.compare.differ import DiffReport
from parity.compare.printers import (
    WIDE,
    cells,
    checkpoint_rows,
    departure_line,
    flags_line,
    thresholds_line,
    verdict_line,
)
from parity.contract.files import atomic_write_text

CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 1.5rem; color: #1b1b1b; }
h1 { font-size: 1.3rem; margin: 0 0 .6rem 0; }
h2 { font-size: 1.05rem; margin: 1.6rem 0 .5rem 0; border-bottom: 1px solid #ddd; }
.verdict { font-size: 1.15rem; font-weight: 600; padding: .7rem 1rem; border-radius: 6px; }
.verdict.pass { background: #e3f4e6; color: #11521f; border: 1px solid #7cc58b; }
.verdict.fail { background: #fbe4e4; color: #7a1010; border: 1px solid #e08b8b; }
table { border-collapse: collapse; font-size: .85rem; font-variant-numeric: tabular-nums; }
th, td { border: 1px solid #ccc; padding: .2rem .5rem; text-align: right; white-space: nowrap; }
th { background: #f2f2f2; }
td.l, th.l { text-align: left; }
tr.pass td { background: #f3fbf4; }
tr.fail td { background: #fdecec; color: #7a1010; }
tr.first td { background: #f8caca; font-weight: 600; }
.side { display: flex; gap: 1.5rem; flex-wrap: wrap; }
.side pre { flex: 1 1 28rem; }
pre { background: #f7f7f7; padding: .6rem; overflow-x: auto; font-size: .8rem; }
img { max-width: 100%; height: auto; border: 1px solid #ddd; }
.note { color: #555; font-size: .85rem; }
"""


@dataclass(frozen=True)
class Section:
    """One titled block of the page; `body` is HTML (build it with the helpers below, which escape)."""

    title: str
    body: str


def esc(text: Any) -> str:
    return html.escape(str(text), quote=True)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], row_classes: Sequence[str] | None = None,
          left: Sequence[str] = ()) -> str:
    """An HTML table; `row_classes` (pass | fail | first | '') colour rows, `left` names left-aligned columns."""
    cls = lambda h: ' class="l"' if h in left else ""  # noqa: E731
    head = "".join(f"<th{cls(h)}>{esc(h)}</th>" for h in headers)
    body = []
    for i, row in enumerate(rows):
        rc = row_classes[i] if row_classes else ""
        tds = "".join(f"<td{cls(h)}>{esc(v)}</td>" for h, v in zip(headers, row, strict=True))
        body.append(f'<tr class="{esc(rc)}">{tds}</tr>')
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def image(png: bytes, alt: str) -> str:
    """A PNG inlined as a data: URI."""
    return f'<img alt="{esc(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode("ascii")}">'


def plot_png(plot: Callable[[Any, str], object], report: Any) -> bytes:
    """A report's figure as PNG bytes for `image`: `plot(report, path)` (a printer that writes a file) run into a
    temporary directory."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "plot.png"
        plot(report, str(path))
        return path.read_bytes()


def preformatted(text: str) -> str:
    return f"<pre>{esc(text)}</pre>"


def headers_side_by_side(a: dict[str, Any], b: dict[str, Any], names: tuple[str, str] = ("A", "B")) -> str:
    """Two run headers as JSON blocks next to each other."""
    blocks = [f"<div><strong>{esc(n)}</strong>{preformatted(json.dumps(h, indent=1, default=str))}</div>"
              for n, h in zip(names, (a, b), strict=True)]
    return f'<div class="side">{"".join(blocks)}</div>'


def page(title: str, verdict: str, ok: bool, sections: Sequence[Section]) -> str:
    """The whole document: title, the verdict box, then every section."""
    parts = [f"<h2>{esc(s.title)}</h2>\n{s.body}" for s in sections]
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{esc(title)}</title><style>{CSS}</style></head><body>\n"
            f"<h1>{esc(title)}</h1>\n<div class=\"verdict {'pass' if ok else 'fail'}\" id=\"verdict\">"
            f"{'PASS' if ok else 'FAIL'}: {esc(verdict)}</div>\n" + "\n".join(parts) + "\n</body></html>\n")


def write_html(path: str | os.PathLike, title: str, verdict: str, ok: bool, sections: Sequence[Section]) -> Path:
    """Write `page(...)` to `path` (parent directories created) and return the path."""
    return atomic_write_text(path, page(title, verdict, ok, sections))


def checkpoint_table(report: DiffReport) -> str:
    """The per-checkpoint table (every column), rows coloured pass / fail, the first drift highlighted."""
    rows = checkpoint_rows(report)
    first = report.first_drift["checkpoint"] if report.first_drift else None
    classes = ["first" if r.checkpoint == first else "fail" if r.drifting else "pass" for r in rows]
    body = table(WIDE, [cells(r, wide=True) for r in rows], classes, ("checkpoint", "method", "status"))
    return f'<div id="checkpoints">{body}</div><p class="note">{esc(thresholds_line(report))}</p>'


def diagnostics(report: DiffReport) -> str:
    """Per-layer routing / indexer / HC differences (layers with any difference), else a one-line note."""
    lay = report.layers
    if not len(lay):
        return '<p class="note">no per-layer diagnostics in these traces</p>'
    bad = lay[(lay[["expert_flips", "n_comp_mismatch", "sel_mismatch"]].sum(axis=1) > 0) | (lay["hc_max_abs"] > 0)]
    if not len(bad):
        return '<p class="note">routing, compressed rows, indexer selections and HC mixes are identical</p>'
    heads = ["layer", "HC max-abs", "expert-set flips", "first flip pos", "weight max-abs (same ids)",
             "n_comp mismatches", "indexer mismatches"]
    rows = [[e.layer, f"{e.hc_max_abs:.3e}", e.expert_flips, e.first_flip_pos if e.expert_flips else "-",
             f"{e.weight_max_abs:.3e}", e.n_comp_mismatch, e.sel_mismatch] for e in bad.itertuples()]
    classes = ["fail" if r[2] or r[5] or r[6] else "" for r in rows]
    return table(heads, rows, classes)


def diff_sections(report: DiffReport, plot: bool = True) -> list[Section]:
    """The sections of a trace diff: checkpoints, plot, diagnostics, warnings, run headers."""
    from parity.compare.plot import png_bytes

    out = [Section("Per-checkpoint metrics", checkpoint_table(report))]
    if plot:
        out.append(Section("Drift profile", image(png_bytes(report), "drift profile")))
    out.append(Section("Routing, indexer and HC diagnostics", diagnostics(report)))
    notes = [f"warning (forced): {w}" for w in report.warnings]
    notes += [f"flags differ: {flags}"] if (flags := flags_line(report)) is not None else []
    notes += [dep] if (dep := departure_line(report)) is not None else []
    if notes:
        out.append(Section("Warnings and notes", preformatted("\n".join(notes))))
    out.append(Section("Run headers", headers_side_by_side(report.a, report.b,
                                                           (f"A = {report.a['engine']}", f"B = {report.b['engine']}"))))
    return out


def write_report(path: str | os.PathLike, report: DiffReport, title: str | None = None,
                 extra: Sequence[Section] = (), plot: bool = True) -> Path:
    """The HTML report of a trace diff (plus any `extra` sections) at `path`."""
    title = title or f"v4parity: A = {report.a['engine']} vs B = {report.b['engine']}"
    return write_html(path, title, verdict_line(report), bool(report), [*diff_sections(report, plot), *extra])
