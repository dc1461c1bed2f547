"""`v4parity synth` and `v4parity inspect`: make and examine deepseek4 GGUF files."""

from __future__ import annotations

import click

from parity.cli.common import echo_json, json_errors, json_option, model_option
from parity.gguf.synth import PRESETS, QUANTS


@click.command()
@click.option("--preset", type=click.Choice(sorted(PRESETS)), default="tiny", show_default=True,
              help="Model dimensions (tiny: 6 layers, every feature fires in ~300 tokens).")
@click.option("--quant", type=click.Choice(QUANTS), default="f32", show_default=True,
              help="f32: all F32; real-mix: the real release's per-class types; mxfp4: MXFP4 experts.")
@click.option("--seed", type=int, default=0, show_default=True, help="Weights seed (same seed -> same bytes).")
@click.option("-o", "--output", type=click.Path(dir_okay=False), required=True, help="GGUF file to write.")
@json_option()
@json_errors
def synth(preset: str, quant: str, seed: int, output: str, as_json: bool) -> None:
    """Write a synthetic deepseek4 GGUF with the real key names, value types and tensor names.

    Example: v4parity synth --preset tiny --quant real-mix -o tiny.gguf
    """
    from parity.gguf.synth import synthesize

    path = synthesize(output, preset, quant, seed)
    size = path.stat().st_size
    if as_json:
        echo_json({"wrote": str(path), "bytes": size, "preset": preset, "quant": quant, "seed": seed})
    else:
        click.echo(f"wrote {path} ({size:,} bytes; preset={preset} quant={quant} seed={seed})")


@click.command()
@model_option()
@click.option("--tensors", is_flag=True, help="Also list every tensor (name, shape, type, bytes).")
@json_option(help="Print the whole report (tensors included) as JSON (errors too).")
@json_errors
def inspect(model: str, tensors: bool, as_json: bool) -> None:
    """Show config (derived values marked), layer schedule, the tensor count and validation result.

    \b
    Exit codes: 0 valid, 1 the file does not satisfy the deepseek4 contract, 2 unreadable metadata.
    Example: v4parity inspect -m tiny.gguf --tensors
    """
    from parity.gguf.report import inspect_model, print_inspection

    report = inspect_model(model)
    if as_json:
        echo_json(report)
    else:
        print_inspection(report, tensors=tensors)
    if not report["validation"]["ok"]:
        raise SystemExit(1)


COMMANDS = [synth, inspect]
