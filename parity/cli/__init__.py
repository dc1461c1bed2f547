"""The `v4parity` command line. Each command lives in `parity/cli/<noun>.py` and only parses,
calls one API function and prints; heavy imports (torch, engines) happen inside the commands."""

from __future__ import annotations

import importlib
import sys

import click

from parity.cli.common import echo_json
from parity.contract.errors import ParityError

COMMAND_MODULES = ("model", "trace", "compare", "demo", "bisect", "logprobs", "bench", "validate", "check", "capture",
                   "arbitrate", "quantize", "spec", "bisect_run")


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="v4parity")
def cli() -> None:
    """v4parity: find where a DeepSeek-V4 (deepseek4 GGUF) engine stops agreeing with the model.

    \b
    Typical session:
      v4parity synth -o m.gguf
      v4parity trace --engine reference -m m.gguf --prompt "Hello" --decode 4 -o ref.trace
      v4parity trace --engine torch -m m.gguf --follow ref.trace --full all -o cand.trace
      v4parity diff ref.trace cand.trace          (exit 1 on drift: may be benign float noise)
      v4parity check -m m.gguf --candidate cand.trace   (the verdict: MATCH / NOISE 0, DEFECT 1)
      v4parity report ref.trace cand.trace -o report.html
      v4parity bisect -m m.gguf
    Exit codes everywhere: 0 ok, 1 a finding, 2 usage or preflight error; --json prints errors as JSON too.
    """


for _name in COMMAND_MODULES:
    for _cmd in importlib.import_module(f"parity.cli.{_name}").COMMANDS:
        cli.add_command(_cmd)


def show_error(e: click.ClickException) -> None:
    """A click error as click shows it (usage and help hint first for a usage error), with the one prefix every
    error of this CLI has: `error: `."""
    ctx = e.ctx if isinstance(e, click.UsageError) else None
    if ctx is not None:
        names = ctx.command.get_help_option_names(ctx) if ctx.command.get_help_option(ctx) is not None else []
        hint = f"Try '{ctx.command_path} {max(names, key=len)}' for help.\n" if names else ""
        click.echo(f"{ctx.get_usage()}\n{hint}", err=True)
    click.secho(f"error: {e.format_message()}", fg="red", err=True)


def main() -> None:
    as_json = "--json" in sys.argv[1:]  # errors raised before a command runs (parsing) are JSON too
    try:
        cli(standalone_mode=False)
    except click.exceptions.Abort:
        raise SystemExit(130) from None
    except click.ClickException as e:
        if as_json:
            echo_json({"error": e.format_message(), "kind": type(e).__name__, "exit_code": e.exit_code})
        else:
            show_error(e)
        raise SystemExit(e.exit_code) from None
    except ParityError as e:
        if as_json:
            echo_json({"error": str(e), "kind": type(e).__name__, "exit_code": 2})
        else:
            click.secho(f"error: {e}", fg="red", err=True)
        raise SystemExit(2) from None
    except click.exceptions.Exit as e:
        raise SystemExit(e.exit_code) from None
