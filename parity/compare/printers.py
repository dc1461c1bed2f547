"""Printers of a `DiffReport` (pure functions of the report and its `CheckpointRow`s, `parity.compare.rows`).

Per checkpoint each metric shows its OWN worst value over the compared positions: the largest rel-L2,
the RMS ratio farthest from 1, the smallest cosine. The position shown (`pos`) is the worst position of
the metric that fails (non-finite values first, then rel-L2, then the RMS ratio), else rel-L2's worst, so
an RMS fault at one position is never hidden behind another position's larger rel-L2. The console table
is plain fixed-width text: the compact form (default) fits 100 columns for V4-Flash's checkpoint names,
`wide=True` adds SQNR, max-abs and the per-stream ratios; no cell is ever cut.
"""

from __future__ import annotations

import json
import textwrap
from collections.abc import Callable

import click
import numpy as np

from parity.compare.differ import DiffReport
from parity.compare.jsonvalues import json_safe
from parity.compare.rows import WORST_FIELDS, CheckpointRow, by_depth
from parity.compare.textcells import md_cell


def checkpoint_rows(r: DiffReport) -> list[CheckpointRow]:
    """The report's rows (`DiffReport.rows`, computed once by the differ) in depth order."""
    return by_depth(r.rows)


def worst_rows(r: DiffReport) -> list[dict]:
    """`checkpoint_rows` as JSON-ready dicts (`WORST_FIELDS`), with each row's status."""
    return [{**{k: json_safe(getattr(row, k), nan=None) for k in WORST_FIELDS}, "status": row.status}
            for row in checkpoint_rows(r)]


def verdict_line(r: DiffReport) -> str:
    th = r.thresholds
    if r.first_drift is None:
        kind = "bit-exact" if r.exact else f"within rel-L2 <= {th.rel_tol:g} and RMS ratio 1 +- {th.norm_tol:g}"
        return f"all {len(r.rows)} checkpoints agree ({kind})"
    f = r.first_drift
    where = f"layer {f['layer']}" if f["layer"] is not None else f["checkpoint"]
    return (f"first drifting checkpoint: {f['checkpoint']} ({where}) from position {f['first_pos']}: {f['reason']} "
            f"[{f['method']}]")


def departure_line(r: DiffReport) -> str | None:
    """Where B departs (the largest rel-L2 jump from one checkpoint to the next), when it is not where the
    threshold is first crossed; None without drift or when both are the same checkpoint."""
    d, f = r.departure, r.first_drift
    if d is None or f is None or d["checkpoint"] == f["checkpoint"]:
        return None
    where = f"layer {d['layer']}" if d["layer"] is not None else d["checkpoint"]
    return (f"departure: {d['checkpoint']} ({where}), the largest jump: rel-L2 {_fmt(d['rel_l2_before'], '.3g')} at "
            f"{d['after']} -> {_fmt(d['rel_l2'], '.3g')} ({_fmt(d['jump'], '.3g')}x); the drift grows from there "
            f"and crosses the threshold at {f['checkpoint']}")


def check_hint(r: DiffReport, candidate: str) -> str:
    """What to run for the verdict on a drift (`check` judges the candidate `candidate` against its model)."""
    return (f"this may be benign float noise: run `v4parity check -m {r.b['model']['file']} --candidate {candidate}` "
            "for the verdict: MATCH, NOISE or DEFECT")


def _fmt(v: float, spec: str) -> str:
    return "-" if v is None or np.isnan(v) else format(v, spec)


COMPACT = ("checkpoint", "method", "pos", "rel-L2", "norm ratio", "cosine", "status")
WIDE = ("checkpoint", "method", "pos", "rel-L2", "norm ratio", "cosine", "SQNR dB", "max-abs", "stream ratios",
        "status")
_LEFT = {"checkpoint", "method", "status"}


def cells(row: CheckpointRow, wide: bool = False) -> list[str]:
    """The row's cells in COMPACT (or WIDE) column order; the failing metric's value is marked with '*'."""
    mark = {"rel-L2": "", "norm ratio": ""}
    if row.failing in mark:
        mark[row.failing] = "*"
    c = {"checkpoint": row.checkpoint, "method": row.method, "pos": str(row.pos),
         "rel-L2": _fmt(row.rel_l2, ".3e") + mark["rel-L2"],
         "norm ratio": _fmt(row.norm_ratio, ".6f") + mark["norm ratio"],
         "cosine": _fmt(row.cosine, ".8f"), "SQNR dB": _fmt(row.sqnr_db, ".1f"), "max-abs": _fmt(row.max_abs, ".3e"),
         "stream ratios": f"{_fmt(row.stream_min, '.4f')}..{_fmt(row.stream_max, '.4f')}",
         "status": row.status if row.failing != "non-finite" else row.status + " NaN/inf"}
    return [c[h] for h in (WIDE if wide else COMPACT)]


def text_table(r: DiffReport, wide: bool = False, style: Callable[[str, CheckpointRow], str] | None = None) -> str:
    """The per-checkpoint table as fixed-width text (two spaces between columns, nothing truncated)."""
    heads = WIDE if wide else COMPACT
    rows = checkpoint_rows(r)
    body = [cells(row, wide) for row in rows]
    width = [max(len(h), *(len(b[j]) for b in body)) for j, h in enumerate(heads)]

    def line(parts: list[str] | tuple[str, ...]) -> str:
        return "  ".join(p.ljust(w) if h in _LEFT else p.rjust(w) for p, w, h in zip(parts, width, heads, strict=True))

    out = [line(heads).rstrip(), "  ".join("-" * w for w in width)]
    for row, b in zip(rows, body, strict=True):
        text = line(b).rstrip()
        out.append(style(text, row) if style else text)
    return "\n".join(out)


# Every per-layer diagnostic that differs, worded (the differ's columns; a column at its no-difference value is
# not shown).
_LAYER_WORDS = (
    ("expert_flips", lambda e: f"{e.expert_flips} expert-set flip(s) from position {e.first_flip_pos}"),
    ("order_mismatch", lambda e: f"{e.order_mismatch} row(s) with the same experts in another order"),
    ("weight_max_abs", lambda e: f"expert weights max |diff| {e.weight_max_abs:.3g}"),
    ("margin_max_abs", lambda e: f"router margins max |diff| {e.margin_max_abs:.3g}"),
    ("hc_max_abs", lambda e: f"HC mixes max |diff| {e.hc_max_abs:.3g}"),
    ("n_comp_mismatch", lambda e: f"{e.n_comp_mismatch} visible-compressed-row count mismatch(es)"),
    ("sel_mismatch", lambda e: f"{e.sel_mismatch} indexer selection mismatch(es)"),
    ("unmatched", lambda e: f"{e.unmatched} diagnostic row(s) only one trace holds"),
    ("sel_dup_a", lambda e: f"A selects a compressed row twice in {e.sel_dup_a} indexer selection(s)"),
    ("sel_dup_b", lambda e: f"B selects a compressed row twice in {e.sel_dup_b} indexer selection(s)"),
)


_CONTINUOUS = ("weight_max_abs", "margin_max_abs", "hc_max_abs")


def layer_differences(r: DiffReport, continuous: bool = True) -> list[tuple[int, list[str]]]:
    """(layer, worded differences) for every layer whose recorded diagnostics differ; without `continuous`
    only the discrete ones (flips, order, counts, selections, unmatched rows)."""
    words = [(c, w) for c, w in _LAYER_WORDS if continuous or c not in _CONTINUOUS]
    out = []
    for e in r.layers.itertuples():
        parts = [word(e) for col, word in words if getattr(e, col) != 0]
        if parts:
            out.append((int(e.layer), parts))
    return out


def logit_lines(r: DiffReport) -> list[str]:
    """The side files' full logits, when both traces carry them: worst rel-L2 and the drifting positions."""
    lg = r.logits
    if not len(lg):
        return []
    bad = lg[lg["drift"]]
    worst = f"full logits: worst rel-L2 {lg['rel_l2'].max():.3e} over {len(lg)} position(s)"
    return [worst + (f", drifting at position(s) {', '.join(map(str, bad['pos'].tolist()[:8]))}" if len(bad) else "")]


def continuous_line(r: DiffReport) -> list[str]:
    """One line: the largest HC-mix, expert-weight and router-margin difference over all layers, with its layer."""
    if not len(r.layers):
        return []
    names = {"hc_max_abs": "HC mixes", "weight_max_abs": "expert weights", "margin_max_abs": "router margins"}
    parts = [f"{names[c]} {r.layers[c].max():.3g} (layer {int(r.layers.loc[r.layers[c].idxmax(), 'layer'])})"
             for c in _CONTINUOUS if r.layers[c].max() > 0]
    return ["diagnostics max |diff|: " + ", ".join(parts)] if parts else []


def _flagged_layers(r: DiffReport) -> list[str]:
    discrete = [f"layer {layer}: " + ", ".join(parts) for layer, parts in layer_differences(r, continuous=False)]
    return discrete + continuous_line(r) + logit_lines(r)


def thresholds_line(r: DiffReport) -> str:
    th = r.thresholds
    return (f"thresholds: rel-L2 <= {th.rel_tol:g}, |RMS ratio - 1| <= {th.norm_tol:g}; * = the failing metric "
            "(each value is that metric's worst position); method fp = fingerprint estimate, full = full vectors")


def flags_line(r: DiffReport) -> str | None:
    """The run flags that differ, on one line (None when they agree): `key: A=value B=value` in JSON spelling, `-`
    where a side lacks the key; a side that records no flags at all (`flags {}`) is said once."""
    if not r.flags_differ:
        return None
    fa, fb = r.a["flags"], r.b["flags"]
    spell = lambda d, k: json.dumps(d[k], separators=(",", ":")) if k in d else "-"  # noqa: E731
    if not fa or not fb:
        empty, other, flags = ("A", "B", fb) if not fa else ("B", "A", fa)
        return (f"{empty} records no flags; {other}'s: " + ", ".join(f"{k}={spell(flags, k)}" for k in sorted(flags)))
    return "; ".join(f"{k}: A={spell(fa, k)} B={spell(fb, k)}" for k in r.flags_differ)


def print_report(r: DiffReport, wide: bool = False, echo: Callable[..., None] = click.echo) -> None:
    """Console rendering: warnings, the per-checkpoint table, layer diagnostics, verdict (colour on a terminal)."""
    for w in r.warnings:
        echo(click.style("warning (forced): ", fg="yellow") + w)
    if (flags := flags_line(r)) is not None:
        text = textwrap.fill(f"flags differ: {flags}", 100, subsequent_indent="  ")
        echo(click.style("flags differ:", fg="cyan") + text[len("flags differ:"):])
    first = r.first_drift["checkpoint"] if r.first_drift else None

    def style(text: str, row: CheckpointRow) -> str:
        if row.checkpoint == first:
            return click.style(text, fg="red", bold=True)
        return click.style(text, fg="red") if row.drifting else text

    echo(f"A = {r.a['engine']} ({r.a['dtype']})  vs  B = {r.b['engine']} ({r.b['dtype']})")
    echo(text_table(r, wide, style))
    for line in _flagged_layers(r):
        echo(textwrap.fill(line, 100, subsequent_indent="  "))
    echo(click.style(textwrap.fill(verdict_line(r), 100, subsequent_indent="  "), fg="green" if r else "red",
                     bold=not r))
    if (dep := departure_line(r)) is not None:
        echo(textwrap.fill(dep, 100, subsequent_indent="  "))
    echo(textwrap.fill(thresholds_line(r), 100, subsequent_indent="  "))


def to_markdown(r: DiffReport) -> str:
    """The report as GitHub Markdown: verdict, warnings, the wide table, layer diagnostics with differences."""
    lines = [f"**v4parity diff**: A = {r.a['engine']} {r.a['version']}, B = {r.b['engine']} {r.b['version']}", "",
             f"**{verdict_line(r)}**", ""]
    lines += [departure_line(r), ""] if departure_line(r) is not None else []
    lines += [f"> warning (forced): {w}" for w in r.warnings]
    lines += [f"> flags differ: {flags}"] if (flags := flags_line(r)) is not None else []
    lines += ["", "| " + " | ".join(WIDE) + " |", "|" + "---|" * len(WIDE)]
    lines += ["| " + " | ".join(md_cell(c) for c in cells(row, wide=True)) + " |" for row in checkpoint_rows(r)]
    differing = layer_differences(r)
    if differing:
        lines += ["", "| layer | diagnostics that differ |", "|---|---|"]
        lines += [f"| {layer} | {md_cell('; '.join(parts))} |" for layer, parts in differing]
    lines += ["", *logit_lines(r)] if len(r.logits) else []
    cos = f" (cosine >= {r.thresholds.cos_tol:.10g} for equal norms)."
    lines += ["", thresholds_line(r).replace("* =", "`*` =") + cos]
    return "\n".join(lines) + "\n"
