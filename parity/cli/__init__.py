"""The `v4parity` command line. Each command lives in `parity/cli/<noun>.py` and only parses,
calls one API function and prints; heavy imports (torch, engines) happen inside the commands."""

from __future__ import annotations

import importlib

import click

from parity.contract.errors import ParityError

COMMAND_MODULES = ("model", "trace", "compare", "demo", "bisect", "logprobs", "bench", "validate", "check", "capture")


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="v4parity")
def cli() -> None:
    """v4parity: find where a DeepSeek-V4 (deepseek4 GGUF) engine stops agreeing with the model.

    Typical session: `v4parity synth -o m.gguf`, `v4parity trace --engine reference ...`,
    `v4parity trace --engine torch ...`, `v4parity diff A B`, `v4parity bisect --model m.gguf`.
    """


for _name in COMMAND_MODULES:
    for _cmd in importlib.import_module(f"parity.cli.{_name}").COMMANDS:
        cli.add_command(_cmd)


def main() -> None:
    try:
        cli(standalone_mode=False)
    except click.exceptions.Abort:
        raise SystemExit(130) from None
    except click.ClickException as e:
        e.show()
        raise SystemExit(e.exit_code) from None
    except ParityError as e:
        click.secho(f"error: {e}", fg="red", err=True)
        raise SystemExit(2) from None
    except click.exceptions.Exit as e:
        raise SystemExit(e.exit_code) from None
