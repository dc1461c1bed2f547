"""`v4parity bisect-run`: `git bisect run`'s predicate (exit 0 good, 1 bad, 125 skip, 128 abort)."""

from __future__ import annotations

from typing import Any

import click

from parity.cli.common import echo_json, json_errors, json_option, model_option
from parity.contract.errors import ParityError

ABORT = 128   # git bisect run aborts on an exit status above 127: a setup error must not mark a commit bad


class SetupError(click.ClickException):
    """A problem that is the same on every commit (options, model, engine name, tokens, envelope): exit 128."""

    exit_code = ABORT


class _AbortOnUsageError(click.Command):
    """A click command whose usage errors exit 128, not 2 (which `git bisect run` would take for a bad commit)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as e:
            e.exit_code = ABORT
            raise


@click.command("bisect-run", cls=_AbortOnUsageError)
@model_option()
@click.option("--engine", required=True, help="Registered engine (any v4parity.engines plugin) to judge.")
@click.option("--tokens", default=None, help="Prompt token ids, e.g. 0,17,42 (default: the built-in prompt).")
@click.option("--decode", default=4, show_default=True, type=click.IntRange(0), help="Greedy decode steps.")
@click.option("--engine-arg", "engine_arg", multiple=True, metavar="NAME=VALUE",
              help="An engine-specific setting (repeatable), validated by the engine.")
@click.option("--envelope", "envelope_path", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Envelope file (default: as `check`: the stored one for this model in the user cache, the "
                   "model's directory or the repository's traces/, else the reference's own, measured now and "
                   "cached).")
@json_option("Print the outcome as JSON on stdout: outcome, exit_code, reason, verdict (errors too).")
@json_errors
def bisect_run(model: str, engine: str, tokens: str | None, decode: int, engine_arg: tuple[str, ...],
               envelope_path: str | None, as_json: bool) -> None:
    """Trace ENGINE on MODEL (every position, full vectors) and judge it with `check`: the exit status is
    `git bisect run`'s.

    \b
    Exit codes: 0 good (MATCH or NOISE), 1 bad (DEFECT, or the engine raised during its run),
                125 skip (the engine did not import or construct; check's preflight refused the run),
                128 abort (usage or setup error, the same on every commit: stops the bisection).
    Example: git bisect start BAD GOOD
             git bisect run v4parity bisect-run -m tiny-f32.gguf --engine myengine
    """
    from parity import api
    from parity.cli.progress import Lines
    from parity.contract.engine import RunOptions
    from parity.tracing.plan import TokenSource

    try:   # a token list that does not read is a setup error (a PlanError), as every other one
        result = api.bisect_run(model, engine, tokens=TokenSource(tokens), decode=decode,
                                options=RunOptions(engine_args=tuple(engine_arg)), envelope=envelope_path,
                                progress=Lines())
    except (ParityError, click.ClickException) as e:   # --json: printed as JSON by json_errors, exit kept
        raise SetupError(e.format_message() if isinstance(e, click.ClickException) else str(e)) from None
    if as_json:
        echo_json(_as_json(result))
    else:
        if result.report is not None:
            from parity.check.check_report import to_text

            click.echo(to_text(result.report))
        click.echo(f"bisect-run: {result.outcome} (exit {result.exit_code}): {result.reason}")
    raise SystemExit(result.exit_code)


def _as_json(result: Any) -> dict[str, Any]:
    verdict = None if result.report is None else result.report.verdict
    return {"outcome": result.outcome, "exit_code": result.exit_code, "reason": result.reason, "verdict": verdict}


COMMANDS = [bisect_run]
