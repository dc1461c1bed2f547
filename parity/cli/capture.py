"""`v4parity capture llamacpp`: run llama.cpp in-process and write its tensors as a capture file."""

from __future__ import annotations

import click

from parity.cli.common import (
    check_draft_options,
    draft_options,
    echo_json,
    engine_arg_option,
    json_errors,
    json_option,
    model_option,
    usage_errors,
    warn,
)
from parity.contract.engine import NUMERICS_CHOICES


@click.group()
def capture() -> None:
    """Capture another engine's tensors to a file (to check on another machine: `v4parity check -c FILE`)."""


@capture.command(name="llamacpp")
@model_option()
@click.option("--tokens", help="Prompt token ids, e.g. 0,17,42.")
@click.option("--tokens-file", type=click.Path(exists=True, dir_okay=False), help="File of token ids.")
@click.option("--prompt", help="User text, rendered with the model's chat template (non-thinking).")
@click.option("--decode", default=0, show_default=True, type=click.IntRange(0), help="Greedy decode steps.")
@click.option("--chunk", default=None, type=click.IntRange(1), help="Prefill chunk size (default: one chunk).")
@click.option("--kv-cache", type=click.Choice(NUMERICS_CHOICES["kv_cache"]), default="f32", show_default=True,
              help="llama.cpp's K/V cache type.")
@engine_arg_option()
@draft_options("llama.cpp's MTP file (blk.L.nextn.*), run by llama.cpp's MTP graph on the captured run; its "
               "draft checkpoints are stored as draft:<checkpoint> arrays")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="Capture file (.npz).")
@json_option()
@json_errors
def llamacpp(model, tokens, tokens_file, prompt, decode, chunk, kv_cache, engine_arg, draft, mtp_depth, mtp_pairing,
             output, as_json) -> None:
    """Run llama.cpp (llama-cpp-python, CPU, all logits) and write every tensor v4parity maps, keyed by llama.cpp's
    eval-callback names (docs/peers.md), with input_ids, output_positions, the chunk schedule and the run's
    settings. QAT simulations do not exist in llama.cpp; compare with a reference run with them off.

    \b
    With --draft (llama.cpp's MTP layout), the MTP graph runs on the run's final carriers as `trace --engine
    llamacpp --draft` runs it, and every draft checkpoint (mtp.k.in, mtp.k.attn, mtp.k, mtp.k.logits) is stored as
    draft:<checkpoint> with draft_positions:<checkpoint>; `import llama.cpp` lists them as unmapped.

    \b
    Example: v4parity capture llamacpp -m tiny-f32.gguf --tokens 0,5,7,9 --decode 4 -o cap.npz
             v4parity import llama.cpp cap.npz --model tiny-f32.gguf -o lcp.trace
             v4parity capture llamacpp -m tiny-f32.gguf --draft tiny-mtp.gguf --mtp-depth 2 --tokens 0,5,7 -o c.npz
    """
    from parity import api
    from parity.contract.engine import RunOptions
    from parity.tracing.plan import TokenSource

    check_draft_options(draft)
    options = RunOptions(fp8_kv=False, fp4_indexer=False, kv_cache=kv_cache, engine_args=tuple(engine_arg))
    with usage_errors():   # the run plan's errors (token sources, token range) are usage errors
        info = api.capture_llamacpp(model, TokenSource(tokens, tokens_file, prompt), output, decode=decode,
                                    chunk=chunk, options=options, draft=draft, mtp_depth=mtp_depth,
                                    mtp_pairing=mtp_pairing, note=warn)
    if as_json:
        echo_json({**info, "path": str(info["path"])})
    else:
        drafted = f" + {info['n_draft']} draft checkpoints" if info["draft"] else ""
        click.echo(f"wrote {info['path']}: {info['n_tensors']} tensors{drafted}, {len(info['tokens'])} tokens "
                   f"({info['n_prompt']} prompt + {info['decode']} decode); "
                   f"{', '.join(info['flags'].get('engine_args', []))}")


COMMANDS = [capture]
