"""`v4parity quantize`: a GGUF quantized by llama.cpp's own quantizer (what `llama-quantize` runs)."""

from __future__ import annotations

import textwrap

import click

from parity.cli.common import echo_json, json_errors, json_option, model_option


@click.command()
@model_option(help="GGUF file to quantize (e.g. v4parity synth --quant f32).")
@click.option("--type", "file_type", required=True, metavar="TYPE",
              help="llama.cpp file type: F16, BF16, Q8_0, MXFP4_MOE, Q4_K_M, Q2_K, Q6_K, IQ4_XS, ... "
                   "(an unknown name lists them all).")
@click.option("--threads", type=click.IntRange(1), default=None,
              help="Quantizer threads (default: llama.cpp's, every hardware thread).")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="GGUF file to write.")
@json_option()
@json_errors
def quantize(model: str, file_type: str, threads: int | None, output: str, as_json: bool) -> None:
    """Quantize a GGUF with llama.cpp's own quantizer (llama-cpp-python's llama_model_quantize, default
    parameters: llama.cpp picks each tensor's type for the file type, as llama-quantize does), then show the
    written file's type mix and contract problems. Types that need an importance matrix (IQ1_*, IQ2_*,
    IQ3_XXS, Q2_K_S) are refused by llama.cpp with its message.

    \b
    Exit codes: 0 written, 2 a usage error, an unknown type or llama.cpp's refusal.
    Example: v4parity synth --preset tiny --quant f32 -o tiny-f32.gguf
             v4parity quantize -m tiny-f32.gguf --type Q4_K_M -o tiny-q4_k_m.gguf
    """
    from parity import api

    try:
        info = api.quantize_llamacpp(model, output, file_type, threads=threads)
    except api.UnknownFileTypeError as e:   # a usage error, the valid types listed
        raise click.UsageError(textwrap.fill(str(e), 92)) from None
    if as_json:
        echo_json({**info, "path": str(info["path"])})
        return
    click.echo(f"wrote {info['path']} ({info['bytes']:,} bytes; llama.cpp {file_type}, "
               f"{info['seconds']:.2f} s)")
    for r in info["type_mix"]:
        click.echo(f"  {r['type']:<8} {r['count']:>5} tensors {r['bytes']:>15,} bytes")
    n = len(info["problems"])
    click.echo(f"contract: {n} problem(s) (v4parity inspect lists them)" if n else "contract: OK")


COMMANDS = [quantize]
