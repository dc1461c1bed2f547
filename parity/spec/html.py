"""`v4parity spec --html FILE`: a self-contained page (inline CSS, the plot as a data: URI, no script, no network)
printed from a frozen `SpecReport`, in the style of the other commands' pages (parity.compare.html).

Verdict first (the text headline), then the summary, a per-round timeline (one cell per drafted position: the draft,
coloured by its label, a check mark where it was accepted, the bonus token and the cut), the per-slot acceptance
plot (candidate online vs reference drafter offline) with its numbers, the round table of the text output and the
run options. Nothing here computes: every number and label is read off the report.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Sequence
from pathlib import Path

from parity.compare.html import Section, esc, image, preformatted, table, write_html
from parity.spec.accept import LABELS
from parity.spec.printers import COLUMNS, headline, round_cells, summary_lines
from parity.spec.report import SpecReport

# background colour per label: correct engines only paint the first, second and last
COLOURS = {"ACCEPT-OK": "#9fd8a8", "DRAFTER-MISS": "#f5d58a", "DRAFTER-DRIFT": "#e07b7b", "FALSE-REJECT": "#e9a0c9",
           "FALSE-ACCEPT": "#c0504d", "NEAR-TIE": "#a9cdee", "VERIFIER-DEFECT": "#b03a8e", "NOT-VERIFIED": "#dddddd"}
CANDIDATE, REFERENCE = "#2f6db5", "#f08a24"   # the two bar colours of the acceptance plot
ACCEPTED_MARK = "\u2713"                        # after an accepted draft's token


DARK = ("FALSE-ACCEPT", "VERIFIER-DEFECT")     # white text on these


def _style(lab: str) -> str:
    return f"background:{COLOURS[lab]}" + (";color:#fff" if lab in DARK else "")


def _cell(text: str, lab: str, title: str, cls: str) -> str:
    return f'<td class="{esc(cls)}" style="{_style(lab)};text-align:center" title="{esc(title)}">{esc(text)}</td>'


def legend(report: SpecReport) -> str:
    """One swatch per label with its count in this run."""
    spans = [f'<span class="swatch" style="{_style(k)};padding:.1rem .4rem;margin-right:.4rem;'
             f'border:1px solid #bbb" data-label="{k}">{esc(k)} {report.labels[k]}</span>' for k in LABELS]
    return f'<p class="note" id="legend">{"".join(spans)}</p>'


def timeline(report: SpecReport) -> str:
    """Rounds down, drafted slots across: each cell the draft d_i coloured by its label (class lab-LABEL), marked
    where accepted (i <= a'); then a', the committed bonus token v_{a'} and why the batch was cut."""
    width = max((len(r.drafts) for r in report.rounds), default=0)
    heads = ["round", "start_pos", "anchor", *(f"d{i + 1}" for i in range(width)), "accepted", "bonus", "cut"]
    rows = []
    for i, (r, a) in enumerate(zip(report.rounds, report.attribution, strict=True)):
        cells = [f"<td>{i}</td><td>{r.start_pos}</td><td>{r.anchor}</td>"]
        for j in range(width):
            if j >= len(r.drafts):
                cells.append('<td class="empty"></td>')
                continue
            lab, ok = a.labels[j], j < r.accepted
            verify, ref = ((f"v={r.verify[j]}", f"reference={a.reference[j]}") if j < r.verified
                          else ("not verified", "reference -"))
            text = f"{r.drafts[j]}{' ' + ACCEPTED_MARK if ok else ''}"
            cells.append(_cell(text, lab, f"{lab}: draft {r.drafts[j]}, {verify}, {ref}",
                               f"lab-{lab}{' accepted' if ok else ''}"))
        cells.append(f"<td>{r.accepted}</td><td>{r.verify[r.accepted]}</td><td>{esc(r.cut or '-')}</td>")
        rows.append(f"<tr>{''.join(cells)}</tr>")
    head = "".join(f"<th>{esc(h)}</th>" for h in heads)
    return (f'{legend(report)}<div id="timeline"><table><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}'
            f'</tbody></table></div><p class="note">cell: the draft token ({ACCEPTED_MARK}: accepted), colour: its '
            "label; bonus: the verifier's token committed after the accepted drafts (the next anchor)</p>")


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def acceptance_png(per_slot: Sequence[float | None], reference: Sequence[float | None]) -> bytes:
    """Grouped bars per slot, in percent: candidate online (CANDIDATE) and reference drafter offline (REFERENCE);
    a slot without a value (no round verified it) has no bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = max(len(per_slot), len(reference))
    fig, ax = plt.subplots(figsize=(max(4.0, 1.1 * n + 2), 3.2))
    for k, (values, colour, name, dx) in enumerate(((per_slot, CANDIDATE, "candidate (online)", -0.2),
                                                      (reference, REFERENCE, "reference drafter (offline)", 0.2))):
        xs = [i + 1 + dx for i, v in enumerate(values) if v is not None]
        ys = [100 * v for v in values if v is not None]
        ax.bar(xs, ys, width=0.38, color=colour, label=name, zorder=2 + k)
    ax.set_xticks(range(1, n + 1))
    ax.set_xlabel("draft slot")
    ax.set_ylabel("accepted, %")
    ax.set_ylim(0, 125)
    ax.set_yticks(range(0, 101, 20))
    ax.grid(axis="y", color="#e5e5e5", zorder=0)
    ax.legend(loc="upper center", ncol=2, fontsize=8, frameon=False)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()


def acceptance(report: SpecReport) -> str:
    """The plot, then its numbers (one row per slot) and the mean drafts accepted per round."""
    n = max(len(report.per_slot), len(report.reference_per_slot))
    get = lambda xs, i: xs[i] if i < len(xs) else None  # noqa: E731
    rows = [[i + 1, _pct(get(report.per_slot, i)), _pct(get(report.reference_per_slot, i))] for i in range(n)]
    body = table(["slot", "candidate (online)", "reference drafter (offline)"], rows)
    return (image(acceptance_png(report.per_slot, report.reference_per_slot), "per-slot acceptance")
            + f'<div id="acceptance">{body}</div><p class="note">{report.mean_accepted:.2f} drafts accepted per '
            "round; online: of the rounds that verified the slot, the share that accepted it; offline: of the "
            "rounds whose trajectory reaches the slot, the share where the reference drafter's drafts equal the "
            "committed tokens (docs/spec.md)</p>")


def spec_sections(report: SpecReport) -> list[Section]:
    rows = [round_cells(i, report) for i in range(len(report.rounds))]
    return [Section("Summary", preformatted("\n".join(summary_lines(report)))),
            Section("Per-round timeline", timeline(report)),
            Section("Per-slot acceptance", acceptance(report)),
            Section("Rounds", table(COLUMNS, rows, left=["drafts", "verify", "reference", "labels"])),
            Section("Options", preformatted(json.dumps(report.options, indent=1, default=str)))]


def write_spec_html(path: str | os.PathLike, report: SpecReport) -> Path:
    """The page at `path`; the verdict box is green when nothing makes the exit status 1 (`report.defects`)."""
    return write_html(path, "v4parity spec", headline(report), not report.defects, spec_sections(report))
