"""`v4parity diff | plot | gate | export | golden`: compare traces, draw drift profiles, gate CI."""

from __future__ import annotations

import json
from pathlib import Path

import click

trace_arg = click.argument("traces", nargs=2, type=click.Path(exists=True, dir_okay=False))
force_opt = click.option("--force", is_flag=True,
                         help="Compare even when tokens / model / checkpoints / positions differ (overlap only).")
rel_opt = click.option("--rel-tol", type=float, default=None, help="rel-L2 drift threshold [default: 1e-3].")
norm_opt = click.option("--norm-tol", type=float, default=None, help="|RMS ratio - 1| threshold [default: 1e-3].")


def _diff(traces, force, rel_tol, norm_tol):
    from parity import api
    from parity.compare.differ import PreflightError

    try:
        return api.diff(*traces, force=force, rel_tol=rel_tol, norm_tol=norm_tol)
    except PreflightError as e:
        click.secho(f"preflight: {e}", fg="red", err=True)
        raise SystemExit(2) from None


@click.command()
@trace_arg
@force_opt
@rel_opt
@norm_opt
@click.option("--json", "as_json", is_flag=True, help="Print the full report as JSON.")
@click.option("--markdown", "as_md", is_flag=True, help="Print a Markdown report.")
@click.option("--fail-on-drift", is_flag=True, help="Exit 1 when a checkpoint drifts.")
def diff(traces, force, rel_tol, norm_tol, as_json, as_md, fail_on_drift) -> None:
    """Compare trace A (reference) with trace B: metrics per checkpoint and the first drifting checkpoint.

    Preflight refuses (exit 2) when token ids, model identity, checkpoint sets or positions differ.
    Example: v4parity diff ref.trace torch.trace --markdown
    """
    from parity.compare.differ import print_report, to_markdown

    report = _diff(traces, force, rel_tol, norm_tol)
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=1))
    elif as_md:
        click.echo(to_markdown(report))
    else:
        print_report(report)
    if fail_on_drift and not report:
        raise SystemExit(1)


@click.command()
@trace_arg
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="Figure (.png/.pdf/.svg).")
@force_opt
@rel_opt
@norm_opt
def plot(traces, output, force, rel_tol, norm_tol) -> None:
    """Drift profile of B against A: norm ratio and cosine vs depth, position x layer heatmap of rel-L2.

    Example: v4parity plot ref.trace torch.trace -o drift.png
    """
    from parity import api
    from parity.compare.differ import verdict_line

    report = _diff(traces, force, rel_tol, norm_tol)
    path = api.plot(report, output)
    click.echo(f"wrote {path} ({verdict_line(report)})")


@click.command()
@click.option("--golden", required=True, type=click.Path(exists=True, dir_okay=False), help="Golden trace.")
@click.option("--candidate", required=True, type=click.Path(exists=True, dir_okay=False), help="Trace to check.")
@click.option("--tolerances", type=click.Path(exists=True, dir_okay=False), help="Tolerance file (JSON or TOML).")
@click.option("--junit", type=click.Path(dir_okay=False), help="Write JUnit XML here.")
@click.option("--markdown", "md_path", type=click.Path(dir_okay=False), help="Write the Markdown summary here.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON instead of Markdown.")
@force_opt
def gate(golden, candidate, tolerances, junit, md_path, as_json, force) -> None:
    """CI gate: exit 0 when the candidate matches the golden trace within tolerances, 1 otherwise, 2 if incomparable.

    Example: v4parity gate --golden traces/tiny-f32.trace --candidate my.trace --junit gate.xml
    """
    from parity.api import load_trace
    from parity.compare import gate as g
    from parity.compare.differ import PreflightError

    try:
        result = g.run_gate(load_trace(golden), load_trace(candidate), tolerances, force=force,
                            names=(golden, candidate))
    except PreflightError as e:
        click.secho(f"preflight: {e}", fg="red", err=True)
        raise SystemExit(2) from None
    md = g.markdown(result)
    if junit:
        Path(junit).write_text(g.junit_xml(result))
    if md_path:
        Path(md_path).write_text(md)
    click.echo(json.dumps(result.to_dict(), indent=1) if as_json else md)
    raise SystemExit(0 if result else 1)


@click.command()
@click.argument("trace", type=click.Path(exists=True, dir_okay=False))
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="Output .npz.")
def export(trace, output) -> None:
    """Write every full vector of TRACE as plain arrays named by checkpoint (+ tokens, positions) to an .npz.

    Example: v4parity export ref.trace -o ref.npz; then np.load('ref.npz')['blk.2'] is [positions, streams, dim].
    """
    import numpy as np

    from parity import api

    path = api.export(trace, output)
    with np.load(path) as z:
        shapes = ", ".join(f"{k} {list(z[k].shape)}" for k in z.files)
    click.echo(f"wrote {path}: {shapes}")


@click.command()
@click.option("--out", default="traces", show_default=True, type=click.Path(file_okay=False),
              help="Directory for the golden traces.")
def golden(out) -> None:
    """Regenerate the golden traces of the built-in tiny models (reference engine, fingerprints only)."""
    from parity.api import golden as regenerate

    for path in regenerate(out, echo=click.echo):
        click.echo(f"wrote {path}")


COMMANDS = [diff, plot, gate, export, golden]
