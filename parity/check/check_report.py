"""Printers of a `CheckReport`: the headline, a cause's evidence in words, plain text, Markdown, JSON, a figure and
an HTML page. No computation here: the report and its causes hold data (`parity.check.evidence`); every sentence
about them is made here."""

from __future__ import annotations

import json
import textwrap
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from parity.check.evidence import (
    DrafterDefect,
    Drift,
    EmbeddingDiffers,
    LayerDefect,
    Library,
    Reproduced,
    Tie,
    TieRule,
)
from parity.check.words import discrete_words, null_words
from parity.compare.jsonvalues import json_safe
from parity.compare.textcells import md_cell, table_lines
from parity.compare.verdict import CauseKind, Judged, RowStatus, Verdict
from parity.contract.checkpoints import checkpoint_layer

if TYPE_CHECKING:
    from parity.check.check import Cause, CheckReport, CheckRow
    from parity.check.hypotheses import Fit


# Checkpoints outside every block: where a cause without a layer (layer None) lies.
_OUTSIDE_BLOCKS = {"embed": "the embedding (embed, before layer 0)",
                   "final_norm": "the output norm (final_norm, after the last layer)",
                   "logits": "the logits (after the last layer)"}


def layer_words(layer: int | str | None, report: CheckReport) -> str:
    """'layer 3'; for a cause outside every block (layer None), the first checkpoint outside any block whose
    free-running error leaves the envelope, in words ('the embedding (embed, before layer 0)')."""
    if layer is not None:
        return f"layer {layer}" if isinstance(layer, int) else str(layer)
    out = [r.checkpoint for r in report.table
           if r.free_excess is not None and r.free_excess > 1 and checkpoint_layer(r.checkpoint) is None]
    return _OUTSIDE_BLOCKS.get(out[0], out[0]) if out else "no single layer"


def _where(report: CheckReport) -> str:
    c = report.culprit
    if c is None:
        return ""
    parts = [layer_words(c.layer, report)] + ([f"sub-op {c.subop}"] if c.subop else [])
    if c.decode_step is not None:
        parts.append(f"decode step {c.decode_step} (position {c.position})")
    elif c.position is not None:
        parts.append(f"prefill position {c.position}")
    return ", ".join(parts)


def _benign_summary(report: CheckReport) -> str:
    groups: dict[tuple[str, str | None], list[int | None]] = {}
    for c in report.causes:
        if c.kind == CauseKind.BENIGN:
            groups.setdefault((c.name, c.subop), []).append(c.layer)

    def at(layers: list[int | None]) -> str:
        nums = [str(x) for x in layers if isinstance(x, int)]
        words = [f"layer{'s' if len(nums) > 1 else ''} {', '.join(nums)}"] if nums else []
        return " and ".join(words + [layer_words(x, report) for x in layers if not isinstance(x, int)])

    return "; ".join(f"{n} at {at(ls)}" + (f" ({s})" if s else "") for (n, s), ls in groups.items())


def _structural(fit: Fit) -> str:
    return f"; {discrete_words(fit.structural)}" if fit.structural is not None else ""


def _reproduced(e: Reproduced) -> str:
    x, v = e.exact, e.variant
    return (f"exact path: {x.test.exceed} of {x.test.cells} cells outside all {x.test.twins} round-off twins "
            f"(p = {x.test.p_value:.2g}, rel-L2 {x.worst:.3g}) -> with the variant: {v.test.exceed} "
            f"(p = {v.test.p_value:.2g}, rel-L2 {v.worst:.3g})" + _structural(x)
            + ("; the candidate's expert picks differ only at router margins within noise" if e.routing else "")
            + (f" (together with {e.stack})" if e.stack else ""))


def _drift(e: Drift) -> str:
    from parity.check.subops import subop_words

    base = (f"free-running excess {e.excess:.3g} at {e.checkpoint} with every layer inside the envelope on the "
            "candidate's own inputs: amplified sub-envelope drift")
    if not e.local:
        return base + " (no local error available)"
    if e.flip is None:
        return base + f"; no isolated QAT code flip at layer {e.layer} (near-ties or amplification)"
    return base + f"; the reference's layer {e.layer} on the candidate's inputs: {subop_words(e.flip)}"


def _layer_defect(e: LayerDefect) -> str:
    x, f = e.exact, e.fault_fit
    if f is not None and e.library is Library.MATCHED:
        return (f"matches {e.fault}: residual {f.worst:.3g} vs unexplained {x.worst:.3g}, {f.test.exceed} vs "
                f"{x.test.exceed} of {x.test.cells} cells outside the round-off twins" + _structural(x))
    closest = ("; no engine offers fault switches" if f is None else
               f"; the closest known fault, {e.fault}, explains part of it ({f.test.exceed} cells outside, residual "
               f"{f.worst:.3g})" if e.library is Library.PARTIAL else "; no known fault explains any of it")
    return f"{null_words(x.test)} (rel-L2 {x.worst:.3g})" + _structural(x) + closest


def _drafter_defect(e: DrafterDefect) -> str:
    exact = f"{null_words(e.test)} (rel-L2 {e.rel_l2:.3g}; teacher-forced on the candidate's trunk carriers)"
    m = e.fault
    if m is None:
        return exact + ("; no engine offers drafter faults" if e.library is Library.NONE_OFFERED else
                        "; no drafter fault of this head was tried")
    if e.library is Library.MATCHED:
        return (f"matches {m.name}: {m.exceed} of {m.cells} draft cells outside the round-off twins around its run "
                f"(residual {m.worst:.3g}); exact path: {exact}")
    return exact + f"; the closest drafter fault, {m.name}, leaves {m.exceed} of {m.cells} cells outside"


def cause_words(cause: Cause) -> str:
    """A cause's evidence in words (the text's, Markdown's, HTML's and the JSON's "evidence"), from its record."""
    e = cause.evidence
    if isinstance(e, Reproduced):
        return _reproduced(e)
    if isinstance(e, Tie):
        return discrete_words(e.tie)
    if isinstance(e, Drift):
        return _drift(e)
    if isinstance(e, EmbeddingDiffers):
        return (f"the candidate's embedding of the same tokens differs from the reference's lookup (rel-L2 "
                f"{e.rel_l2:.3g}, excess {e.excess:.3g} over the envelope, first at position {e.position}); every "
                "later difference may be inherited from it")
    if isinstance(e, TieRule):
        return (f"matches {e.fault}: it breaks all {e.ties} ties as the candidate does (the exact rule and the "
                "round-off twins break them otherwise)")
    if isinstance(e, LayerDefect):
        return _layer_defect(e)
    if isinstance(e, DrafterDefect):
        return _drafter_defect(e)
    raise TypeError(f"cause {cause.name!r}: no printer for evidence {type(e).__name__}")


def headline(report: CheckReport) -> str:
    """The verdict in words a person reads (first output line), rendered from the report's verdict, culprit and
    causes (never stored)."""
    local = {Judged.OP_LEVEL: "every op on the candidate's own inputs is within its round-off twins",
             Judged.LAYER_LEVEL: "every layer on the candidate's own inputs is within its round-off twins",
             Judged.FREE_RUNNING: "free-running only (no teacher-forced verdict)"}[Judged(report.judged)]
    if report.verdict == Verdict.MATCH:
        worst = max((r for r in report.table if r.free_excess is not None), key=lambda r: r.free_excess)
        return (f"MATCH [{report.judged}]: {local}, and every checkpoint is inside the noise envelope (largest "
                f"excess {worst.free_excess:.2g} at {worst.checkpoint})")
    if report.verdict == Verdict.NOISE:
        return f"NOISE [{report.judged}]: every departure is explained as benign: {_benign_summary(report)}"
    d = next(c for c in report.causes if c.kind == CauseKind.DEFECT)
    what = f"matches known fault {d.name}" if d.name != "unexplained" else "unexplained by every known fault"
    return f"DEFECT at {_where(report)}: {what} ({cause_words(d)}) [{report.judged}]"


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def row_cells(r: CheckRow) -> list[str]:
    return [r.checkpoint, _num(r.free), _num(r.free_excess), _num(r.local), _num(r.local_twins), _num(r.floor),
            "-" if r.position is None else str(r.position), r.status]


COLUMNS = ["checkpoint", "free rel-L2", "free excess", "local rel-L2", "local / twins", "floor", "position",
           "status"]


TEXT_WIDTH = 100   # columns of `check`'s plain-text output


def wrap(line: str, indent: str, width: int = TEXT_WIDTH) -> list[str]:
    """One logical line as lines of at most `width` columns (words kept whole; a word longer than a line, e.g. a
    path, is cut), continuation lines indented by `indent`."""
    return textwrap.wrap(line, width, subsequent_indent=indent, break_on_hyphens=False) or [""]


def to_text(report: CheckReport) -> str:
    """The plain-text report, every line within TEXT_WIDTH columns (long lines wrapped here, never in the data)."""
    lines = wrap(headline(report), "  ")
    for c in report.causes:
        lines += wrap(f"  cause ({c.kind}): {c.name} at {layer_words(c.layer, report)}"
                      + (f", {c.subop}" if c.subop else "") + f": {cause_words(c)}", "      ")
    for n in report.notes:
        lines += wrap(f"  note: {n}", "      ")
    cost = ", ".join(f"{k} {v}" for k, v in report.layer_runs.items() if v)
    lines += wrap(f"  cost: {sum(report.layer_runs.values())} layer-runs ({cost}); {report.seconds:.1f} s"
                  + envelope_cost(report), "      ")
    lines += table_lines([COLUMNS, *(row_cells(r) for r in report.table)])
    return "\n".join(lines)


def envelope_cost(report: CheckReport) -> str:
    """The envelope's share of the cost line: measured now (the reference's own) or read from a stored file."""
    if not report.envelope_source:
        return ""
    how = "measured now" if report.envelope_source == "measured" else "stored"
    return f" + envelope {report.envelope_seconds:.1f} s ({how})"


def to_markdown(report: CheckReport) -> str:
    out = [f"# v4parity check: {report.verdict}", "", headline(report), ""]
    if report.causes:
        out += ["| kind | name | layer | sub-op | evidence |", "|---|---|---|---|---|"]
        out += [f"| {c.kind} | {c.name} | {layer_words(c.layer, report)} | {c.subop or '-'} | "
                f"{md_cell(cause_words(c))} |" for c in report.causes]
        out.append("")
    out += ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    out += ["| " + " | ".join(row_cells(r)) + " |" for r in report.table]
    out += ["", *(f"- {n}" for n in report.notes)]
    return "\n".join(out) + "\n"


def json_document(report: CheckReport) -> dict[str, Any]:
    """`CheckReport.to_dict`, the JSON document: verdict, judged (op-level / layer-level / free-running), seconds,
    envelope {source (a path, or "measured"), seconds}, culprit {layer, subop, position, decode_step}, causes {kind,
    name, layer, subop, evidence}, notes, table."""
    return json_safe({"verdict": report.verdict, "judged": report.judged, "notes": list(report.notes),
                      "seconds": report.seconds, "envelope": {"source": report.envelope_source,
                                                              "seconds": report.envelope_seconds},
                   "culprit": asdict(report.culprit) if report.culprit else None,
                   "causes": [{"kind": c.kind, "name": c.name, "layer": c.layer, "subop": c.subop,
                               "evidence": cause_words(c)} for c in report.causes],
                   "table": [asdict(r) for r in report.table]})


def timeless(doc: dict[str, Any]) -> str:
    """A `json_document` as indented JSON text with its wall-clock fields (`seconds`, the envelope's `seconds`) set
    to 0: what two runs of the same check must print alike."""
    doc = json.loads(json.dumps(doc))
    doc["seconds"] = 0
    if isinstance(doc.get("envelope"), dict) and "seconds" in doc["envelope"]:
        doc["envelope"]["seconds"] = 0
    return json.dumps(doc, indent=1)


def plot(report: CheckReport, path: str) -> None:
    """Per checkpoint: the free-running excess over the envelope and the local worst cell over the largest
    round-off twin (both outside above 1), the culprit marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 3.8))
    xs = range(len(report.table))
    for attr, style, label in (("free_excess", "o-", "free-running / envelope"),
                               ("local_twins", "s--", "local worst cell / largest twin")):
        ys = [getattr(r, attr) for r in report.table]
        ax.semilogy([x for x, y in zip(xs, ys, strict=True) if y is not None],
                    [max(y, 1e-3) for y in ys if y is not None], style, label=label)
    ax.axhline(1, color="gray", lw=1)
    ax.set_xticks(list(xs), [r.checkpoint for r in report.table], rotation=60, fontsize=7)
    ax.set_ylabel("ratio (outside above 1)")
    from parity.compare.plot import wrapped_title
    from parity.contract.files import save_figure

    ax.set_title(wrapped_title(headline(report)), fontsize=8)  # wrapped, never cut
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path, dpi=110)


def to_html(path: str, report: CheckReport) -> Path:
    """`check --html`: one self-contained page, the verdict first, the causes, the per-checkpoint table (status
    colours), the figure of `plot`, the notes."""
    from parity.compare.html import Section, esc, image, plot_png, table, write_html

    sections = []
    if report.causes:
        sections.append(Section("Causes", table(
            ["kind", "name", "layer", "sub-op", "evidence"],
            [[c.kind, c.name, c.layer, c.subop or "-", cause_words(c)] for c in report.causes],
            ["pass" if c.kind == CauseKind.BENIGN else "fail" for c in report.causes], left=["name", "evidence"])))
    rows = [row_cells(r) for r in report.table]
    sections.append(Section("Per checkpoint (free-running and teacher-forced local error, excess over the envelope)",
                            table(COLUMNS, rows, ["pass" if r.status == RowStatus.OK else "fail" for r in report.table],
                                  left=["checkpoint", "status"])))
    sections.append(Section("Excess per checkpoint", image(plot_png(plot, report), "excess over the envelope")))
    if report.notes:
        sections.append(Section("Notes", "".join(f'<p class="note">{esc(n)}</p>' for n in report.notes)))
    return write_html(path, "v4parity check", headline(report), report.verdict != Verdict.DEFECT, sections)
