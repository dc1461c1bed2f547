"""Printers of a `SpecReport`: the headline, plain text and Markdown (its JSON document is `SpecReport.to_dict`). No
computation here."""

from __future__ import annotations

from typing import TYPE_CHECKING

from parity.compare.textcells import fit_line, table_lines
from parity.spec.accept import DEFECT_LABELS

if TYPE_CHECKING:
    from parity.spec.report import SpecReport


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def headline(report: SpecReport) -> str:
    """The verdict in words (first output line)."""
    d = report.divergence
    plain = "" if report.plain_tokens is None else " == plain"
    if d is None:
        what = f"EXACT: speculative{plain} == reference tokens"
    else:
        who = ("no plain decode in a trace: spec-induced or not is unknown" if d.spec_induced is None else
               "spec-induced" if d.spec_induced else "not spec-induced (plain decode diverges too)")
        plain_at = "" if d.plain is None else f", plain {d.plain}"
        what = (f"{d.cls} at step {d.step} (position {d.position}): spec {d.spec}{plain_at}, reference "
                f"{d.reference}; reference margin {d.margin:.3g} ({d.margin_ulps:.0f} ulps) vs tie threshold "
                f"{d.tie:.3g} ({d.tie_ulps:.0f} ulps); {who}")
    labels = [x for x in report.defects if x.split()[0] in DEFECT_LABELS]
    sd = report.state_divergence
    flip = " (QAT sims on: possibly a code flip, not judged a defect)" if report.state_flip_possible else ""
    state = (f"; STATE differs after round {sd.round} (position {sd.start_pos}): {sd.component}, {sd.why}{flip}"
             if sd is not None else "")
    return what + state + (f"; DEFECT labels: {', '.join(labels)}" if labels else "")


def summary_lines(report: SpecReport) -> list[str]:
    o, c = report.options, report.cost
    labels = ", ".join(f"{k} {v}" for k, v in report.labels.items() if v)
    max_draft = "none" if o["max_draft"] is None else o["max_draft"]
    return [f"engine {o['engine']}, drafter {o['drafter']} (depth/B {o['depth']}, gate {o['gate']}, max-draft "
            f"{max_draft}), {len(report.spec_tokens)} steps, {c['rounds']} rounds",
            f"labels: {labels or 'none (no drafts)'}",
            "committed tokens on their own prefix (teacher-forced): "
            + ", ".join(f"{k} {v}" for k, v in report.committed_counts.items())
            + "".join(f"; {x.cls} at step {x.step} ({x.token} vs {x.reference}, gap {x.margin:.3g}, tie {x.tie:.3g})"
                      for x in report.committed if x.cls != "MATCH")[:2000],
            f"acceptance per slot: candidate {' '.join(map(_pct, report.per_slot))}; reference drafter (offline) "
            f"{' '.join(map(_pct, report.reference_per_slot))}; {report.mean_accepted:.2f} drafts accepted per round",
            f"cost: {c['verify_rows']} verify rows + {c['replayed_rows']} replayed rows for {c['plain_rows']} plain "
            f"decode rows; {c['drafted']} drafted, {c['accepted']} accepted; {c['snapshots']} state snapshots",
            "state parity: " + (report.state_note or "not checked (the engine has no StateView)"
                                if not report.state_checked else
                                ("every commit equal to the reference's" if report.state_divergence is None else
                                 f"first difference after round {report.state_divergence.round}: "
                                 f"{report.state_divergence.component} ({report.state_divergence.why})")
                                + (f"; compared: {report.state_note}" if report.state_note else "")),
            "drafter parity (candidate vs reference drafter on the candidate's inputs): " + (
                "no draft checkpoints (scripted drafts)" if not any(report.options.get("drafter") == k
                                                                     for k in ("mtp", "dspark")) else
                "not checked: a trace records no draft checkpoints" if "candidate" in report.options else
                "every round's draft checkpoints equal" if report.drafter_divergence is None else
                f"first departure in round {report.drafter_divergence.round}: {report.drafter_divergence.component} "
                f"({report.drafter_divergence.why})"),
            "time: " + ", ".join(f"{k} {v:.2f} s" for k, v in report.seconds.items())]


def round_cells(i: int, report: SpecReport) -> list[str]:
    r, a = report.rounds[i], report.attribution[i]
    return [str(i), str(r.start_pos), " ".join(map(str, r.drafts)), " ".join(map(str, r.verify)),
            " ".join(map(str, a.reference)), str(r.accepted), str(r.replayed), r.cut or "-", " ".join(a.labels)]


COLUMNS = ["round", "start_pos", "drafts", "verify", "reference", "accepted", "replayed", "cut", "labels"]


def to_text(report: SpecReport) -> str:
    """The plain-text report: prose lines wrapped at 100 columns, the round table's columns one space apart when two
    would pass 100 (a table of long drafts can still pass it: its rows are never wrapped)."""
    lines = [fit_line(headline(report)), *(fit_line("  " + x) for x in summary_lines(report))]
    lines += table_lines([COLUMNS, *(text_cells(round_cells(i, report)) for i in range(len(report.rounds)))])
    return "\n".join(lines)


def text_cells(cells: list[str]) -> list[str]:
    """A round's cells for the text table: the token lists (drafts, verify, reference) comma-joined, so that one
    space between columns still tells them apart."""
    return [*cells[:2], *(c.replace(" ", ",") for c in cells[2:5]), *cells[5:]]


def to_markdown(report: SpecReport) -> str:
    out = [f"# v4parity spec: {'EXACT' if report.exact else report.divergence.cls}", "", headline(report), ""]
    out += [f"- {x}" for x in summary_lines(report)] + [""]
    out += ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    out += ["| " + " | ".join(round_cells(i, report)) + " |" for i in range(len(report.rounds))]
    return "\n".join(out) + "\n"
