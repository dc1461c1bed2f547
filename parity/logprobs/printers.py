"""Printers of a logprob `Comparison`: the summary line, plain text and Markdown (its JSON document is
`Comparison.to_dict`). No computation here beyond formatting (the numbers are the comparison's own)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from parity.compare.textcells import fit_line, md_cell

if TYPE_CHECKING:
    from parity.logprobs.compare import Comparison


def summary_line(cmp: Comparison) -> str:
    """One line: steps compared, the verdict counts, the first divergent step, ds4_test's verdict."""
    c = cmp.counts()
    fd = cmp.first_divergent_step()
    ds4 = {True: "PASS", False: "FAIL", None: "n/a"}[cmp.ds4_test()]
    if cmp.ds4_test_na:
        ds4 += f" ({cmp.ds4_test_na})"
    cut = sum(s.cand_token is None for s in cmp.steps)
    tail = f"; INCOMPLETE: B lacks {cut} of A's {len(cmp.steps)} steps" if cmp.incomplete else ""
    mode = " greedy-only (tokens compared, no logprob metrics)" if cmp.greedy_only else ""
    return (f"logprobs: {len(cmp.compared)}/{len(cmp.steps)} steps compared{mode}: "
            f"MATCH {c['MATCH']}, TIE-FLIP {c['TIE-FLIP']}, DRIFT {c['DRIFT']}, WRONG {c['WRONG']}; "
            f"first divergent step: {'none' if fd is None else fd}; ds4_test: {ds4}{tail}")


def _fmt(x: float | None, spec: str = ".3g") -> str:
    if x is None:
        return "-"
    return "inf" if math.isinf(x) else format(x, spec)


def render_text(cmp: Comparison, wide: bool = False) -> str:
    """The console report: header, one row per step, notes, the summary line. Within 100 columns (long lines wrap,
    words are never cut); `wide` adds the JS interval and the tail masses and never wraps."""
    lines = [f"A (reference): {cmp.ref}", f"B (candidate): {cmp.cand}",
             f"tie margin {cmp.tie_margin} nats, drift tolerance {cmp.drift_tol} nats", ""]
    extra = f" {'JS in':>19} {'tail A/B':>15}" if wide else ""
    head = (f"{'step':>4}  {'verdict':<8} {'A token':<16} {'B token':<16} {'jacc':>5} {'max|Δlp|':>8} "
            f"{'rank±':>5} {'KL≥':>8}{extra}  ds4_test")
    lines += [head, "-" * len(head)]
    for s in cmp.steps:
        dv = s.divergence
        js = f"[{_fmt(dv.js_lower)}, {_fmt(dv.js_upper)}]" if dv else "-"
        tails = f"{_fmt(dv.tail_ref, '.2g')}/{_fmt(dv.tail_cand, '.2g')}" if dv else "-"
        ds4 = {True: "ok", False: "FAIL " + s.ds4_test_detail, None: "-"}[s.ds4_test]
        lines.append(f"{s.step:>4}  {s.verdict or '-':<8} {s.ref_token or '-':<16.16} {s.cand_token or '-':<16.16} "
                     f"{_fmt(s.jaccard, '.2f'):>5} {_fmt(s.max_abs_dlogprob):>8} {_fmt(s.max_rank_shift, 'd'):>5} "
                     f"{_fmt(dv.kl_lower if dv else None):>8}" + (f" {js:>19} {tails:>15}" if wide else "")
                     + f"  {ds4}" + (f"  ({s.note})" if s.note else ""))
    lines += [""] + [f"note: {n}" for n in cmp.notes] + [summary_line(cmp)]
    return "\n".join(lines if wide else [fit_line(line) for line in lines])


def render_markdown(cmp: Comparison) -> str:
    """The report as GitHub Markdown: the summary line, one table row per step, the notes."""
    lines = [f"**v4parity logprobs**: A = `{cmp.ref}`, B = `{cmp.cand}`", "", f"**{summary_line(cmp)}**", "",
             "| step | verdict | A token | B token | Jaccard | max abs Δlogprob | KL lower bound | ds4_test |",
             "|---|---|---|---|---|---|---|---|"]
    for s in cmp.steps:
        ds4 = {True: "ok", False: "FAIL " + s.ds4_test_detail, None: "-"}[s.ds4_test]
        kl = _fmt(s.divergence.kl_lower) if s.divergence else "-"
        cells = [str(s.step), s.verdict or "-", s.ref_token or "-", s.cand_token or "-", _fmt(s.jaccard, ".2f"),
                 _fmt(s.max_abs_dlogprob), kl, ds4 + (f" ({s.note})" if s.note else "")]
        lines.append("| " + " | ".join(md_cell(c) for c in cells) + " |")
    lines += [""] + [f"> note: {n}" for n in cmp.notes]
    return "\n".join(lines) + "\n"
