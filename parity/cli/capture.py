"""`v4parity capture llamacpp`: run llama.cpp in-process and write its tensors as a capture file."""

from __future__ import annotations

import click

from parity.cli.common import check_draft_options, draft_options, echo_json, json_errors, json_option, model_option

KV_CHOICES = ("f32", "f16")


def lcp_options(f):
    """--lcp-kv, --lcp-flash-attn, --lcp-threads: how llama.cpp runs (recorded in the header / capture meta)."""
    f = click.option("--lcp-threads", type=click.IntRange(1), default=None,
                     help="llama.cpp: CPU threads (default 1; the header records it).")(f)
    f = click.option("--lcp-flash-attn", is_flag=True, help="llama.cpp: flash attention on (default off).")(f)
    return click.option("--lcp-kv", type=click.Choice(KV_CHOICES), default=None,
                        help="llama.cpp: K/V cache type (default f32).")(f)


def lcp_run_options(engine: str, lcp_kv: str | None, lcp_flash_attn: bool, lcp_threads: int | None) -> dict:
    """RunOptions fields for the --lcp-* options; refused for an engine other than llamacpp."""
    given = lcp_kv is not None or lcp_flash_attn or lcp_threads is not None
    if not given:
        return {}
    if engine != "llamacpp":
        raise click.UsageError(f"--lcp-kv/--lcp-flash-attn/--lcp-threads set how llama.cpp runs; engine is {engine}")
    args = (*(("lcp_flash_attn=on",) if lcp_flash_attn else ()),
            *((f"lcp_threads={lcp_threads}",) if lcp_threads is not None else ()))
    return {"engine_args": args, **({"kv_cache": lcp_kv} if lcp_kv else {})}


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
@lcp_options
@draft_options("llama.cpp's MTP file (blk.L.nextn.*), run by llama.cpp's MTP graph on the captured run; its "
               "draft checkpoints are stored as draft:<checkpoint> arrays")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="Capture file (.npz).")
@json_option()
@json_errors
def llamacpp(model, tokens, tokens_file, prompt, decode, chunk, lcp_kv, lcp_flash_attn, lcp_threads, draft, mtp_depth,
             mtp_pairing, output, as_json) -> None:
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
    from parity.cli.trace import resolve_tokens
    from parity.contract.engine import RunOptions

    check_draft_options(draft)
    ids = resolve_tokens(model, tokens, tokens_file, prompt, None)
    options = RunOptions(fp8_kv=False, fp4_indexer=False,
                         **lcp_run_options("llamacpp", lcp_kv, lcp_flash_attn, lcp_threads))
    info = api.capture_llamacpp(model, ids, output, decode=decode, chunk=chunk, options=options, draft=draft,
                                mtp_depth=mtp_depth, mtp_pairing=mtp_pairing)
    if as_json:
        echo_json({**info, "path": str(info["path"])})
    else:
        drafted = f" + {info['n_draft']} draft checkpoints" if info["draft"] else ""
        click.echo(f"wrote {info['path']}: {info['n_tensors']} tensors{drafted}, {len(info['tokens'])} tokens "
                   f"({len(ids)} prompt + {decode} decode); {', '.join(info['flags'].get('engine_args', []))}")


COMMANDS = [capture]
