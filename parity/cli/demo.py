"""`v4parity demo`: the whole workflow on the tiny model, including a caught porting bug (`parity.api.demo`)."""

from __future__ import annotations

from pathlib import Path

import click


@click.command()
@click.option("--out", default="out/demo", show_default=True, type=click.Path(file_okay=False),
              help="Directory for the model, traces and plot.")
def demo(out) -> None:
    """End-to-end demo on the tiny synthetic model: reference vs torch (agree), then torch with the
    compress-ratios-u32 porting bug (first drift at the first compressed layer), plus the drift plot.

    Exits 0 when both verdicts are the expected ones, 1 otherwise.
    Example: v4parity demo --out out/demo    (what `make demo` runs)
    """
    from parity import api

    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    raise SystemExit(0 if api.demo(out_dir, echo=click.echo) else 1)


COMMANDS = [demo]
