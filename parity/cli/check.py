"""`v4parity check`: MATCH, NOISE (explained) or DEFECT (where and which known bug) for any engine's trace."""

from __future__ import annotations

from collections.abc import Callable

import click

from parity.cli.common import (
    echo_json,
    html_option,
    json_errors,
    json_option,
    markdown_option,
    model_option,
    write_text,
)
from parity.contract.errors import ParityError
from parity.contract.workpool import LOCAL_RAY_CPUS


def pool_options(what: str) -> Callable[[Callable], Callable]:
    """--workers N and --ray [ADDRESS] (as `validate` takes them) for `what` runs (`parity.contract.workpool`)."""
    def deco(f: Callable) -> Callable:
        f = click.option("--ray", "ray", is_flag=False, flag_value="local", default=None, metavar="[ADDRESS]",
                         help=f"Run {what} as Ray tasks on the cluster at ADDRESS (host:port, auto); --ray alone "
                              "starts a local instance. The model must be readable at this path on every node.")(f)
        return click.option("--workers", default=1, show_default=True, type=click.IntRange(1),
                            help=f"Worker processes for {what}; with --ray and no address: the local instance's "
                                 f"CPUs ({LOCAL_RAY_CPUS} if not given). The report is the serial one.")(f)
    return deco


def pool_args(workers: int, ray: str | None) -> tuple[int, str | None]:
    """(workers, ray) as the pool takes them: --workers with --ray ADDRESS is refused (the cluster decides);
    --ray alone gets LOCAL_RAY_CPUS unless --workers is given."""
    ctx = click.get_current_context()
    given = ctx.get_parameter_source("workers") is not click.core.ParameterSource.DEFAULT
    if ray not in (None, "local") and given:
        raise click.UsageError("--workers sets the CPUs of a local Ray instance; with --ray ADDRESS the cluster "
                               "decides")
    return (LOCAL_RAY_CPUS if ray == "local" and not given else workers), ray


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
    from pathlib import Path

    from parity import api
    from parity.bisect.check_report import plot as plot_report
    from parity.bisect.check_report import to_json, to_markdown, to_text
    from parity.cli.trace import read_token_list

    if tokens is not None and tokens_file is not None:
        raise click.UsageError("give --tokens or --tokens-file, not both")
    ids = (read_token_list(tokens, "--tokens") if tokens is not None else
           read_token_list(Path(tokens_file).read_text(), tokens_file) if tokens_file is not None else None)
    from parity.cli.progress import Progress

    workers, ray = pool_args(workers, ray)
    bar = Progress()
    try:
        report = api.check(candidate, model, envelope=envelope_path, tokens=ids, fault_engines=fault_engines,
                           progress=bar.note, counter=bar, draft=draft, workers=workers, ray=ray)
    except ParityError as e:
        raise Refused(str(e)) from None
    if markdown_path:
        write_text(markdown_path, to_markdown(report))
    if plot:
        plot_report(report, plot)
    if html_path:
        from parity.cli.html_pages import check_page

        check_page(html_path, report)
    if as_json:
        echo_json(to_json(report))
    elif markdown_path != "-":
        click.echo(to_text(report))
    raise SystemExit(1 if report.verdict == "DEFECT" else 0)


COMMANDS = [check]
