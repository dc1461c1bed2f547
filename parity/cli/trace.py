"""`v4parity trace`, `v4parity import` and `v4parity convert`: make, import and re-encode traces."""

from __future__ import annotations

from pathlib import Path

import click

from parity.cli.common import (
    check_draft_options,
    device_option,
    draft_options,
    dtype_option,
    echo_json,
    engine_arg_option,
    inject_option,
    json_errors,
    json_option,
    model_option,
    numerics_options,
    tokenizer_option,
    usage_errors,
    warn,
)

TRACE_FORMATS = (".trace", ".npz")


def _trace_path(output: str, option: str = "-o/--output") -> str:
    if Path(output).suffix not in TRACE_FORMATS:
        raise click.BadParameter(f"{output}: a trace is .trace (text) or .npz (binary)", param_hint=option)
    return output


@click.command()
@click.option("--engine", required=True, help="Registered engine: reference | torch | any v4parity.engines plugin.")
@model_option()
@click.option("--tokens", help="Prompt token ids, e.g. 0,17,42.")
@click.option("--tokens-file", type=click.Path(exists=True, dir_okay=False), help="File of token ids.")
@click.option("--prompt", help="User text as one chat turn (non-thinking, no system text).")
@click.option("--prompt-file", type=click.Path(exists=True, dir_okay=False), help="File of user text (read raw).")
@tokenizer_option()
@click.option("--follow", type=click.Path(exists=True, dir_okay=False),
              help="Replay another trace's run: its prompt, decode tokens (teacher-forced), positions and chunking.")
@click.option("--positions", default=None,
              help="last | all | comma list of positions. Default: last; with --decode N > 0, the prompt's last "
                   "position and every decode position. Not with --follow (it replays the followed trace's).")
@click.option("--full", default=None, help="Also store full vectors: 'all' or e.g. blk.2,blk.2.attn,final_norm,logits.")
@click.option("--subops", is_flag=True,
              help="Also store every layer's sub-op outputs (side file; `check` then judges op by op). Needs "
                   "--positions all; engines that capture sub-ops: reference, torch, llamacpp.")
@draft_options("also record the draft checkpoints (mtp.* / dspark.*, docs/trace-format.md) of its head run on this "
               "run's trunk carriers")
@click.option("--decode", default=None, type=click.IntRange(0),
              help="Greedy decode steps (not with --follow).  [default: 0]")
@click.option("--chunk", default=None, type=click.IntRange(1),
              help="Prefill chunk size (default: one chunk; not with --follow).")
@click.option("--no-fp8-kv", is_flag=True, help="Turn off the FP8 KV simulation (on in the model definition).")
@click.option("--no-fp4-indexer", is_flag=True, help="Turn off the FP4 indexer simulation.")
@dtype_option()
@device_option()
@inject_option()
@numerics_options
@engine_arg_option()
@click.option("--top-k", default=20, show_default=True, type=click.IntRange(1, 100), help="Top logits per position.")
@click.option("--dump-logprobs", type=click.Path(dir_okay=False), help="Also write a ds4 --dump-logprobs JSON.")
@click.option("--dump-ctx", type=click.IntRange(1), default=None,
              help="With --dump-logprobs: the `ctx` the dump records (the --ctx of the ds4 run it is compared "
                   "with; `v4parity logprobs` refuses two dumps whose ctx differ).")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False),
              help="Trace file (.trace text; .npz binary). Full vectors go to <stem>.vectors.npz.")
@json_option()
@json_errors
def trace(engine, model, tokens, tokens_file, prompt, prompt_file, tokenizer, follow, positions, full, subops, draft,
          mtp_depth, mtp_pairing, decode, chunk,
          no_fp8_kv, no_fp4_indexer, dtype, device, inject, act_quant, kv_cache, rope_angles, engine_arg, top_k,
          dump_logprobs, dump_ctx, output, as_json) -> None:
    """Run an engine on a prompt and record every checkpoint (stats + fingerprints) to a trace.

    Progress goes to stderr: a bar with ETA on a terminal, `stage done/total elapsed` lines otherwise.

    \b
    Example: v4parity trace --engine reference -m tiny.gguf --tokens 0,5,7 --decode 4 -o ref.trace
             v4parity trace --engine torch -m tiny.gguf --follow ref.trace -o torch.trace
             v4parity trace --engine torch -m tiny.gguf --tokens 0,5,7 --positions all --full all --subops -o t.trace
    """
    from parity import api
    from parity.cli.progress import Progress
    from parity.contract.engine import RunOptions
    from parity.tracing.plan import TokenSource

    output = _trace_path(output)
    _pairs(draft, subops, follow, positions, dump_logprobs, dump_ctx)
    options = RunOptions(fp8_kv=not no_fp8_kv, fp4_indexer=not no_fp4_indexer, dtype=dtype, device=device,
                         inject=tuple(inject), act_quant=act_quant, kv_cache=kv_cache, rope_angles=rope_angles,
                         engine_args=tuple(engine_arg))
    with usage_errors(), Progress() as bar:   # the plan's errors (and the token range) are usage errors
        report = api.trace_to_file(engine, model, TokenSource(tokens, tokens_file, prompt, prompt_file, tokenizer),
                                   output, follow=follow, decode=decode, chunk=chunk, positions=positions, note=warn,
                                   options=options, full=full, top_k=top_k, subops=subops, draft=draft,
                                   mtp_depth=mtp_depth, mtp_pairing=mtp_pairing, progress=bar,
                                   dump_logprobs=None if dump_logprobs is None else (dump_logprobs, dump_ctx))
    if as_json:
        echo_json(report)
        return
    click.echo(f"wrote {report['wrote']} ({report['checkpoint_records']} checkpoint records, "
               f"{len(report['positions'])} position(s), tokens {report['tokens']})")
    if dump_logprobs:
        click.echo(f"wrote {dump_logprobs} ({report['logprobs']['steps']} step(s), top {top_k})")


def _pairs(draft: str | None, subops: bool, follow: str | None, positions: str | None, dump_logprobs: str | None,
           dump_ctx: int | None) -> None:
    """Options that need another: --mtp-* need --draft, --subops needs --positions all (unless following),
    --dump-logprobs and --dump-ctx go together (usage errors naming them)."""
    check_draft_options(draft)
    if subops and not follow and positions != "all":
        raise click.UsageError("--subops needs --positions all (op-level forcing runs each sub-op at every position)")
    if (dump_logprobs is None) != (dump_ctx is None):
        raise click.UsageError("--dump-logprobs and --dump-ctx go together (the dump records its run's ctx)")


@click.command(name="import")
@click.argument("kind", type=click.Choice(["ds4", "llama.cpp"]))
@click.argument("source", type=click.Path())
@model_option(help="The GGUF the engine ran (dimensions + identity).")
@click.option("--tokens", help="Token ids of the run, e.g. 0,17,42.")
@click.option("--tokens-file", type=click.Path(exists=True, dir_okay=False), help="File of token ids.")
@click.option("--start-pos", default=0, show_default=True, type=click.IntRange(0),
              help="llama.cpp: position of the first row.")
@click.option("--top-k", default=20, show_default=True, type=click.IntRange(1, 100),
              help="Top logits kept per position (from the imported logits).")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="Trace file to write.")
@json_option()
@json_errors
def import_(kind, source, model, tokens, tokens_file, start_pos, top_k, output, as_json) -> None:
    """Turn another engine's tensor dumps into a trace.

    \b
    ds4:       SOURCE is the DS4_METAL_GRAPH_DUMP_PREFIX (files SOURCE_<name>-<layer>_pos<pos>.bin; a prefix
               ending in / names a directory: SOURCE<name>-...)
    llama.cpp: SOURCE is a capture file (.npz from `v4parity capture llamacpp` or docs/peers.md's script; it
               carries its token ids) or a directory of eval-callback tensors saved as <name>.bin / <name>.npy
               (hc_init, hc_attn_post-N, l_last-N, result_norm, result_output)
    Example:   v4parity import ds4 dumps/run -m ds4flash.gguf --tokens-file ids.txt -o ds4.trace
    """
    from parity import api
    from parity.tracing.plan import TokenSource

    with usage_errors():   # the token sources (none only for a llama.cpp capture file, which carries its ids)
        done = api.import_trace(kind, source, model, _trace_path(output), tokens=TokenSource(tokens, tokens_file),
                                start_pos=start_pos, top_k=top_k)
    if as_json:
        echo_json(done)
        return
    dropped = done["dropped"]
    click.echo(f"wrote {done['wrote']}: {len(done['checkpoints'])} checkpoints x {len(done['positions'])} position(s)"
               + (f"; dropped (incomplete): {', '.join(dropped)}" if dropped else ""))


@click.command()
@click.argument("source", type=click.Path(exists=True, dir_okay=False))
@click.argument("dest", type=click.Path(dir_okay=False))
@json_option()
@json_errors
def convert(source, dest, as_json) -> None:
    """Re-encode a trace: text (.trace) <-> binary (.npz) by DEST's extension; same content, byte-stable.

    Full vectors are copied to DEST's side file (<stem>.vectors.npz).
    Example: v4parity convert big.trace big.npz
    """
    from parity import api

    path = api.convert(source, _trace_path(dest, "DEST"))
    if as_json:
        echo_json({"wrote": str(path)})
    else:
        click.echo(f"wrote {path}")


COMMANDS = [trace, import_, convert]
