"""`v4parity diff | plot | report | gate | export | golden`: compare traces, draw drift profiles, gate CI."""

from __future__ import annotations

from pathlib import Path

import click

from parity.cli.common import echo_json, html_option, json_errors, json_option, markdown_option, write_text
from parity.compare.textcells import fit_line
from parity.compare.verdict import Verdict
from parity.contract.files import atomic_write_text

a_arg = click.argument("a", metavar="A", type=click.Path(exists=True, dir_okay=False))
b_arg = click.argument("b", metavar="B", type=click.Path(exists=True, dir_okay=False))
force_opt = click.option("--force", is_flag=True,
                         help="Compare even when tokens / model / checkpoints / positions differ (overlap only).")
rel_opt = click.option("--rel-tol", type=float, default=None, help="rel-L2 drift threshold [default: 1e-3].")
norm_opt = click.option("--norm-tol", type=float, default=None, help="|RMS ratio - 1| threshold [default: 1e-3].")
envelope_opt = click.option("--envelope", "envelope_path", type=click.Path(exists=True, dir_okay=False), default=None,
                             help="The noise envelope the --check-model verdict uses (default: the stored one for "
                                  "the model, else measured). Needs --check-model: the verdict is check's round-off "
                                  "null on B's own prompt, never K x the envelope's floor.")
check_opt = click.option("--check-model", "check_model", type=click.Path(exists=True, dir_okay=False), default=None,
                         help="Judge B (the candidate) by `v4parity check` against this model's reference: the "
                              "round-off null on B's own prompt, the verdict `check` gives; the exit status "
                              "follows it (DEFECT 1, MATCH / NOISE 0).")
PLOT_FORMATS = (".png", ".pdf", ".svg")


def _compare(a: str, b: str, as_json: bool, **options: object) -> object:
    """`parity.api.compare` of A and B with `options` (the diff's, --plot's figure, --check-model's check); two
    traces that cannot be compared exit 2, naming both (`_preflight_exit`)."""
    from parity import api
    from parity.compare.differ import PreflightError

    try:
        return api.compare(a, b, **options)
    except PreflightError as e:
        _preflight_exit(e, as_json, a, b)


def _preflight_exit(e: Exception, as_json: bool, a: str, b: str) -> None:
    """Two traces that cannot be compared: the reason, naming both files (as JSON with --json), and exit 2."""
    message = f"preflight (A {a}, B {b}): {e}"
    if as_json:
        echo_json({"error": message, "kind": "PreflightError", "exit_code": 2})
    else:
        click.secho(f"error: {message}", fg="red", err=True)
    raise SystemExit(2) from None


def _plot_path(output: str) -> str:
    if Path(output).suffix.lower() not in PLOT_FORMATS:
        raise click.BadParameter(f"{output}: the figure format comes from the extension; use one of "
                                 f"{', '.join(PLOT_FORMATS)}", param_hint="-o/--output")
    return output


@click.command()
@a_arg
@b_arg
@force_opt
@rel_opt
@norm_opt
@click.option("--wide", is_flag=True, help="Every column (adds SQNR, max-abs, per-stream ratios; ~130 columns).")
@json_option()
@markdown_option()
@html_option()
@click.option("--no-fail", is_flag=True, help="Exit 0 even when a checkpoint drifts (the default exit is 1).")
@envelope_opt
@check_opt
@json_errors
def diff(a, b, force, rel_tol, norm_tol, wide, as_json, markdown_path, html_path, no_fail, envelope_path,
         check_model) -> None:
    """Compare exactly two traces, A (reference) and B (candidate): per checkpoint each metric's worst
    value and the first drifting checkpoint.

    \b
    Exit codes: 0 all checkpoints agree, 1 a checkpoint drifts (0 with --no-fail),
                2 preflight refusal (token ids, model, checkpoint sets or positions differ) or bad input.
    With --check-model the exit status follows `check`'s verdict instead (--envelope: the envelope it uses).
    Example: v4parity diff ref.trace torch.trace --markdown diff.md
    Example: v4parity diff ref.trace torch.trace --check-model tiny-f32.gguf
    """
    from parity.cli.progress import Progress
    from parity.compare.printers import check_hint, print_report, to_markdown, worst_rows

    _envelope_needs_model(envelope_path, check_model)
    done = _compare(a, b, as_json, force=force, rel_tol=rel_tol, norm_tol=norm_tol, check_model=check_model,
                    envelope=envelope_path, progress=Progress())
    report, checked = done.report, done.checked
    if markdown_path:
        write_text(markdown_path, to_markdown(report))
    if html_path:
        from parity.compare.html import write_report

        write_report(html_path, report)
    if as_json:
        echo_json({**report.to_dict(), "worst": worst_rows(report)} | _check_dict(checked))
    elif markdown_path != "-":
        print_report(report, wide=wide)
        _echo_check(checked)
        if not report and checked is None:
            click.echo(fit_line(check_hint(report, b)))
    passed = checked.verdict != Verdict.DEFECT if checked is not None else bool(report)
    if not passed and not no_fail:
        raise SystemExit(1)


@click.command()
@a_arg
@b_arg
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="Figure (.png/.pdf/.svg).")
@force_opt
@rel_opt
@norm_opt
@json_option()
@json_errors
def plot(a, b, output, force, rel_tol, norm_tol, as_json) -> None:
    """Drift profile of B against A: norm ratio and cosine vs depth, position x layer heatmap of rel-L2
    on a fixed log colour scale tied to the thresholds. Exits 0 when the figure is written, drift or not.

    Example: v4parity plot ref.trace torch.trace -o drift.png
    """
    from parity.compare.printers import check_hint, verdict_line

    done = _compare(a, b, as_json, force=force, rel_tol=rel_tol, norm_tol=norm_tol, figure=_plot_path(output))
    report, path = done.report, done.figure
    if as_json:
        echo_json({"wrote": str(path), "agree": bool(report), "verdict": verdict_line(report)})
    else:
        click.echo(f"wrote {path} ({verdict_line(report)})")
        if not report:
            click.echo(fit_line(check_hint(report, b)))


@click.command()
@a_arg
@b_arg
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="HTML file to write.")
@force_opt
@rel_opt
@norm_opt
@json_option()
@click.option("--no-fail", is_flag=True, help="Exit 0 even when a checkpoint drifts (the default exit is 1).")
@json_errors
def report(a, b, output, force, rel_tol, norm_tol, as_json, no_fail) -> None:
    """One self-contained HTML report of B against A (inline CSS and images, no network): verdict, the
    per-checkpoint table, the drift plot, routing/indexer/HC diagnostics, the two run headers.

    \b
    Exit codes as `diff`: 0 agree, 1 drift (0 with --no-fail), 2 preflight refusal.
    Example: v4parity report ref.trace torch.trace -o report.html
    """
    from parity.compare.html import write_report
    from parity.compare.printers import check_hint, verdict_line

    rep = _compare(a, b, as_json, force=force, rel_tol=rel_tol, norm_tol=norm_tol).report
    path = write_report(output, rep)
    if as_json:
        echo_json({"wrote": str(path), "agree": bool(rep), "verdict": verdict_line(rep)})
    else:
        click.echo(f"wrote {path} ({verdict_line(rep)})")
        if not rep:
            click.echo(fit_line(check_hint(rep, b)))
    if not rep and not no_fail:
        raise SystemExit(1)


@click.command()
@click.option("--golden", required=True, type=click.Path(exists=True, dir_okay=False), help="Golden trace.")
@click.option("--candidate", required=True, type=click.Path(exists=True, dir_okay=False), help="Trace to check.")
@click.option("--tolerances", type=click.Path(exists=True, dir_okay=False), help="Tolerance file (JSON or TOML).")
@click.option("--junit", type=click.Path(dir_okay=False), help="Write JUnit XML here.")
@markdown_option()
@json_option(help="Print the result as JSON instead of Markdown (errors too).")
@force_opt
@envelope_opt
@check_opt
@json_errors
def gate(golden, candidate, tolerances, junit, markdown_path, as_json, force, envelope_path, check_model) -> None:
    """CI gate: exit 0 when the candidate matches the golden trace within tolerances, 1 otherwise, 2 if incomparable.
    With --check-model the gate follows `check`'s verdict (the tolerance table stays as evidence).

    Example: v4parity gate --golden traces/tiny-f32.trace --candidate my.trace --junit gate.xml
    Example: v4parity gate --golden traces/tiny-f32.trace --candidate my.trace --check-model tiny-f32.gguf
    """
    from parity import api
    from parity.cli.progress import Progress
    from parity.compare import gate as g
    from parity.compare.differ import PreflightError

    _envelope_needs_model(envelope_path, check_model)
    try:   # with --check-model, check's verdict decides (api.gate_checked)
        done = api.gate_checked(golden, candidate, tolerances, force=force, names=(golden, candidate),
                                check_model=check_model, envelope=envelope_path, progress=Progress())
    except PreflightError as e:
        _preflight_exit(e, as_json, golden, candidate)
    result, checked = done.report, done.checked
    md = g.markdown(result)
    if junit:
        atomic_write_text(junit, g.junit_xml(result))
    if markdown_path:
        write_text(markdown_path, md)
    if as_json:
        echo_json(result.to_dict() | _check_dict(checked))
    elif markdown_path != "-":
        click.echo(md)
    raise SystemExit(0 if result.passed else 1)


def _check_dict(report) -> dict:
    return {"check": report.to_dict()} if report is not None else {}


def _echo_check(report) -> None:
    if report is not None:
        from parity.check.check_report import headline

        click.echo(f"check (decides the exit status): {headline(report)}")


def _envelope_needs_model(envelope_path, check_model) -> None:
    """--envelope only chooses the envelope of --check-model's `check`: alone it would judge by K x floor, a second
    judgement that can disagree with `check` about the same run (docs/check.md, "One judgement")."""
    if envelope_path is not None and check_model is None:
        raise click.UsageError("--envelope needs --check-model MODEL: the verdict is `check`'s round-off null on B's "
                               "own prompt (the envelope only gives its free-running profile), never K x the "
                               "envelope's floor")


@click.command()
@click.argument("trace", type=click.Path(exists=True, dir_okay=False))
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="Output .npz.")
@json_option()
@json_errors
def export(trace, output, as_json) -> None:
    """Write every full vector of TRACE as plain arrays named by checkpoint (+ tokens, positions) to an .npz.

    Example: v4parity export ref.trace -o ref.npz; then np.load('ref.npz')['blk.2'] is [positions, streams, dim].
    """
    import numpy as np

    from parity import api

    if Path(output).suffix != ".npz":
        raise click.BadParameter(f"{output}: the export is an .npz file", param_hint="-o/--output")
    path = api.export(trace, output)
    with np.load(path) as z:
        shapes = {k: list(z[k].shape) for k in z.files}
    if as_json:
        echo_json({"wrote": str(path), "arrays": shapes})
    else:
        click.echo(f"wrote {path}: " + ", ".join(f"{k} {v}" for k, v in shapes.items()))


@click.command()
@click.option("--out", default="traces", show_default=True, type=click.Path(file_okay=False),
              help="Directory for the golden traces.")
def golden(out) -> None:
    """Regenerate the golden traces of the built-in tiny models (reference engine, fingerprints only).

    Example: v4parity golden --out traces    (what `make golden` runs)
    """
    from parity.api import golden as regenerate

    for path in regenerate(out, echo=click.echo):
        click.echo(f"wrote {path}")


COMMANDS = [diff, plot, report, gate, export, golden]
