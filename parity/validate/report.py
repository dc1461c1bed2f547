"""Printers of a `ValidateReport`: JSON (`report.json`), Markdown (`report.md`), the figure (`validate.png`), the
timing (`timing.json`), and `write_files`, which writes all four into a run directory; the `--html` page
(`to_html`). No computation here."""

from __future__ import annotations

import json
from pathlib import Path

from parity.contract.files import atomic_write_bytes
from parity.validate.result import ValidateReport
from parity.validate.store import dumps
from parity.validate.summary import LAYER_STATS, MEAN_METRICS, POOLED

REPORT, MARKDOWN, FIGURE, TIMING = "report.json", "report.md", "validate.png", "timing.json"

DESCRIPTIONS = {
    "divergence_rate": "prompts whose greedy top-1 differs at some step",
    "wrong_rate": "prompts with a WRONG step (not a tie)",
    "step_divergence_rate": "steps whose top-1 differs (TIE-FLIP or WRONG)",
    "step_wrong_rate": "WRONG steps",
    "step_drift_rate": "DRIFT steps (same top-1, top-1 logprob moved)",
    "top1_agreement": "steps with the same top-1",
    "kl_mean": "KL(exact || approx) per step, top-k lower bound",
    "kl_p50": "KL per step, median",
    "kl_p99": "KL per step, 99th percentile",
    "kl_max": "KL per step, max",
}


def _g(x: float | None) -> str:
    return "-" if x is None else f"{x:.4g}"


NO_BUDGET = "pins only - no budget given, metrics not judged"  # what a PASS without --budget rests on


def verdict_words(report: ValidateReport) -> str:
    """PASS / FAIL in words: a PASS without a budget says that only the pins were judged."""
    if not report.passed:
        return "FAIL"
    return "PASS" if report.budget else f"PASS ({NO_BUDGET})"


def counts_words(counts: dict, none: str = "none") -> str:
    """{'WRONG': 3, 'TIE-FLIP': 1} -> 'WRONG 3, TIE-FLIP 1' (no Python dict repr in a report)."""
    return ", ".join(f"{k} {v}" for k, v in counts.items()) or none


def render_markdown(report: ValidateReport) -> str:
    """report.md: settings, verdict, findings, the metric table with CIs and budget, per-layer rel-L2, pins."""
    agg = report.aggregates
    budget = {b["metric"]: b for b in report.budget or []}
    pins = report.pins
    lines = [f"# v4parity validate: `{report.approx}` vs `{report.exact}`", "",
             f"Model `{report.model['file']}`, n = {report.n} prompts ({report.prompt_sources}), "
             f"{report.decode} decode steps ({report.steps} greedy steps per prompt), seed {report.seed}, "
             f"top-k {report.top_k}. CIs: percentile bootstrap over prompts, {report.bootstrap} resamples; "
             f"MDE at alpha = {report.alpha}, beta = {report.beta}.", "",
             f"**{verdict_words(report)}**", ""]
    lines += [f"- {f}" for f in report.findings] + ([""] if report.findings else [])
    lines += ["| metric | value | 95% CI | MDE | budget | |", "|---|---:|---|---:|---|---|"]
    for name in (*MEAN_METRICS, *POOLED):
        a = agg[name]
        b = budget.get(name)
        verdict = "" if b is None else f"{b['op']} {b['value']:g}: {'pass' if b['passed'] else 'FAIL'}"
        lines.append(f"| {name} | {_g(a['value'])} | [{_g(a['ci'][0])}, {_g(a['ci'][1])}] | {_g(a['mde'])} | "
                     f"{verdict} | {DESCRIPTIONS[name]} |")
    n_layers = sum(k.endswith(".mean") for k in agg)
    lines += ["", "Carrier rel-L2 at the last prompt position, per layer:", "",
              "| layer | " + " | ".join(LAYER_STATS) + " | 95% CI of the mean |", "|---|" + "---:|" * 5]
    for l in range(n_layers):
        row = [agg[f"rel_l2.blk.{l}.{s}"] for s in LAYER_STATS]
        ci = row[0]["ci"]
        lines.append(f"| blk.{l} | " + " | ".join(_g(r["value"]) for r in row) + f" | [{_g(ci[0])}, {_g(ci[1])}] |")
    div = report.divergence
    ex, an = pins["exactness"], pins["announce"]
    median = "" if div["first_step_median"] is None else f", median first divergent step {div['first_step_median']:g}"
    lines += ["", f"First divergent step classes: {counts_words(div['classes'])}{median}.", "",
              f"Exactness pin ({len(ex['prompts'])} prompts: exact twice"
              + (f", and `{ex['explicit_spec']}`" if ex["explicit_spec"] else "") + f"): "
              f"{'pass' if ex['passed'] else 'FAIL'}.",
              f"Announce pin (declared {', '.join(f'{k}={v}' for k, v in an['declared'].items()) or 'nothing'}; "
              f"numerics differ on {an['numerics_differ_on']}/{report.n} prompts; named on stderr: "
              f"{'yes' if an['stderr_announced'] else 'no'}): "
              f"{'pass' if an['passed'] else 'FAIL'}."]
    lines += [f"Note: {n}" for n in an["notes"]]
    return "\n".join(lines) + "\n"


def plot_report(report: ValidateReport, path: Path) -> Path:
    """validate.png: per-step divergence and KL, the first-divergence histogram, per-layer rel-L2."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    div, agg = report.divergence, report.aggregates
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    steps = range(len(div["per_step_divergence_rate"]))
    ax = axes[0]
    ax.plot(steps, div["per_step_divergence_rate"], label="top-1 differs")
    ax.set_xlabel("greedy step")
    ax.set_ylabel("fraction of prompts")
    ax2 = ax.twinx()
    ax2.plot(steps, div["per_step_kl_mean"], color="tab:red", label="mean KL (lower bound)")
    ax2.set_ylabel("KL (nats)")
    handles = [h for a in (ax, ax2) for h in a.get_legend_handles_labels()[0]]  # one legend for both axes
    ax.legend(handles, [h.get_label() for h in handles], loc="upper left")
    ax.set_title("per-step divergence and KL")
    axes[1].bar(steps, div["first_step_histogram"])
    axes[1].set_xlabel("first divergent step")
    axes[1].set_ylabel("prompts")
    axes[1].set_title(f"first divergence ({counts_words(div['classes'])})")
    n_layers = sum(k.endswith(".mean") for k in agg)
    for s in ("mean", "p99", "max"):
        axes[2].plot(range(n_layers), [agg[f"rel_l2.blk.{l}.{s}"]["value"] for l in range(n_layers)], marker="o",
                     label=s)
    axes[2].set_yscale("symlog", linthresh=1e-9)
    axes[2].set_xlabel("layer")
    axes[2].set_ylabel("carrier rel-L2, last prompt position")
    axes[2].legend()
    fig.suptitle(f"{report.approx} vs {report.exact} (n = {report.n})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def render_json(report: ValidateReport) -> str:
    """report.json as written and as `validate --json` prints it: sorted keys, indent 1, strict JSON."""
    return json.dumps(json.loads(dumps(report.to_dict())), indent=1, sort_keys=True) + "\n"


def to_html(path: str, report: ValidateReport) -> Path:
    """`validate --html`: one self-contained page, pass/fail with the findings, the Markdown report as text, the
    per-step figure, all from the report (nothing is read back from the run directory)."""
    from parity.compare.html import Section, image, plot_png, preformatted, write_html

    judged = "every budget bound and pin holds" if report.budget else NO_BUDGET
    verdict = judged if report.passed else "; ".join(report.findings)
    sections = [Section("Report", preformatted(render_markdown(report))),
                Section("Per step", image(plot_png(plot_report, report), "validation plot"))]
    return write_html(path, "v4parity validate", verdict, report.passed, sections)


def write_files(report: ValidateReport, out: Path) -> None:
    """report.json, report.md, validate.png and timing.json into the run directory `out` (each atomically)."""
    atomic_write_bytes(out / REPORT, render_json(report).encode())
    atomic_write_bytes(out / MARKDOWN, render_markdown(report).encode())
    plot_report(report, out / FIGURE)
    atomic_write_bytes(out / TIMING, (json.dumps(report.timing.to_dict(), indent=2) + "\n").encode())
