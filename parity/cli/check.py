"""`v4parity check`: MATCH, NOISE (explained) or DEFECT (where and which known bug) for any engine's trace."""

from __future__ import annotations

import click

from parity.cli.common import (
    echo_json,
    html_option,
    json_errors,
    json_option,
    markdown_option,
    model_option,
    pool_args,
    pool_options,
    usage_errors,
    write_text,
)
from parity.compare.verdict import Verdict
from parity.contract.errors import ParityError


class Refused(click.ClickException):
    """A preflight or input error: exit status 2, the message on stderr (or as JSON with --json)."""

    exit_code = 2


@click.command()
@model_option()
@click.option("--candidate", "-c", required=True, type=click.Path(exists=False),
              help="Candidate: a trace (text or binary), a llama.cpp dump directory or capture .npz, or a ds4 dump "
                   "prefix (DIR/RUN for DIR/RUN_<name>-<layer>_pos<pos>.bin).")
@click.option("--envelope", "envelope_path", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Envelope file (default: the stored one measured on this model (size, header and data hash, "
                   "never the file name) with the candidate's dtype and QAT flags, in the user cache "
                   "($XDG_CACHE_HOME/v4parity/envelopes), the model's directory or the repository's traces/; "
                   "else the reference's own, measured now and cached).")
@click.option("--tokens", default=None, help="Token ids of imported dumps, e.g. 0,17,42 (traces carry their own).")
@click.option("--tokens-file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="File with the token ids of imported dumps.")
@click.option("--fault-engine", "fault_engines", multiple=True, default=("torch",), show_default=True,
              help="Engine whose fault switches form the defect library (repeatable).")
@click.option("--draft", type=click.Path(exists=True, dir_okay=False), default=None,
              help="The candidate's drafter GGUF: judge its draft checkpoints (mtp.* / dspark.*) against the "
                   "reference's draft head run on the candidate's trunk carriers (docs/check.md).")
@json_option()
@markdown_option()
@click.option("--plot", type=click.Path(dir_okay=False), default=None,
              help="Write the free-running / local excess per checkpoint as a PNG.")
@html_option()
@pool_options("the per-layer runs (teacher-forced, hypotheses, faults, round-off twins)")
@json_errors
def check(model, candidate, envelope_path, tokens, tokens_file, fault_engines, draft, as_json, markdown_path,
          plot, html_path, workers, ray) -> None:
    """Judge CANDIDATE against the reference on MODEL: the reference follows its tokens and chunks, every
    layer is re-run on the candidate's own inputs (local error), and each difference beyond the noise
    envelope is explained by a benign numerics variant or matched against the known porting bugs.

    \b
    Exit codes: 0 MATCH or NOISE (every excess explained as benign), 1 DEFECT,
                2 usage or preflight error (other model, tokens, shapes, no full vectors).
    Example: v4parity check -m tiny-f32.gguf --candidate torch.trace --markdown check.md
             v4parity check -m tiny-f32.gguf --candidate torch.trace --workers 2
    """
    from parity import api
    from parity.cli.progress import Progress
    from parity.tracing.plan import TokenSource

    workers, ray = pool_args(workers, ray)
    bar = Progress()
    try:
        with usage_errors():  # imported dumps' token ids (a trace carries its own): a bad source is a usage error
            report = api.check(candidate, model, envelope=envelope_path, tokens=TokenSource(tokens, tokens_file),
                               fault_engines=fault_engines,
                               progress=bar, draft=draft, workers=workers, ray=ray)
    except ParityError as e:
        raise Refused(str(e)) from None
    _show(report, as_json, markdown_path, plot, html_path)
    raise SystemExit(1 if report.verdict == Verdict.DEFECT else 0)


def _show(report: object, as_json: bool, markdown_path: str | None, plot: str | None, html_path: str | None) -> None:
    """--markdown FILE ('-': stdout), --plot PNG, --html FILE, then the report as JSON or text on stdout (none when
    the Markdown went there)."""
    from parity.check.check_report import plot as plot_report
    from parity.check.check_report import to_html, to_markdown, to_text

    if markdown_path:
        write_text(markdown_path, to_markdown(report))
    if plot:
        plot_report(report, plot)
    if html_path:
        to_html(html_path, report)
    if as_json:
        echo_json(report.to_dict())
    elif markdown_path != "-":
        click.echo(to_text(report))


COMMANDS = [check]
