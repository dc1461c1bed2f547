"""`v4parity synth` and `v4parity inspect`: make and examine deepseek4 GGUF files."""

from __future__ import annotations

import json

import click

from parity.gguf.synth import PRESETS, QUANTS


@click.command()
@click.option("--preset", type=click.Choice(sorted(PRESETS)), default="tiny", show_default=True,
              help="Model dimensions (tiny: 6 layers, every feature fires in ~300 tokens).")
@click.option("--quant", type=click.Choice(QUANTS), default="f32", show_default=True,
              help="f32: all F32; real-mix: the real release's per-class types; mxfp4: MXFP4 experts.")
@click.option("--seed", type=int, default=0, show_default=True, help="Weights seed (same seed -> same bytes).")
@click.option("-o", "--output", type=click.Path(dir_okay=False), required=True, help="GGUF file to write.")
def synth(preset: str, quant: str, seed: int, output: str) -> None:
    """Write a synthetic deepseek4 GGUF with the real key names, value types and tensor names."""
    from parity.gguf.synth import synthesize

    path = synthesize(output, preset, quant, seed)
    click.echo(f"wrote {path} ({path.stat().st_size:,} bytes; preset={preset} quant={quant} seed={seed})")


@click.command()
@click.argument("model", type=click.Path(exists=True, dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print a JSON report instead of tables.")
def inspect(model: str, as_json: bool) -> None:
    """Show config (derived values marked), layer schedule, tensor table and validation result.

    Exits non-zero when the file does not satisfy the deepseek4 contract.
    """
    from parity.gguf.report import inspect_model, print_inspection

    report = inspect_model(model)
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        print_inspection(report)
    if not report["validation"]["ok"]:
        raise SystemExit(1)


COMMANDS = [synth, inspect]
