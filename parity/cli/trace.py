"""`v4parity trace`, `v4parity import` and `v4parity convert`: make, import and re-encode traces."""

from __future__ import annotations

from pathlib import Path

import click

from parity.cli.capture import lcp_options, lcp_run_options
from parity.cli.common import (
    check_draft_options,
    device_option,
    draft_options,
    dtype_option,
    echo_json,
    inject_option,
    json_errors,
    json_option,
    model_option,
    numerics_options,
    read_prompt,
    tokenizer_option,
)


def read_token_list(text: str, source: str) -> list[int]:
    """'1,2,3' or whitespace/comma separated ids -> list of ints (clear error on anything else)."""
    parts = [p for p in text.replace(",", " ").split() if p]
    try:
        ids = [int(p) for p in parts]
    except ValueError:
        raise click.BadParameter(f"{source}: token ids must be integers, got {text[:60]!r}") from None
    if not ids:
        raise click.BadParameter(f"{source}: no token ids")
    return ids


def resolve_tokens(model: str, tokens: str | None, tokens_file: str | None, prompt: str | None,
                   prompt_file: str | None, tokenizer: str = "model") -> list[int]:
    """Exactly one of the four token sources -> ids (prompts go through `tokenizer`'s chat layout; when the
    model's and ds4's tokenizers disagree on the prompt, one line on stderr says so)."""
    given = [x is not None for x in (tokens, tokens_file, prompt, prompt_file)]
    if sum(given) != 1:
        raise click.UsageError("give exactly one of --tokens, --tokens-file, --prompt, --prompt-file")
    if tokens is not None:
        return read_token_list(tokens, "--tokens")
    if tokens_file is not None:
        return read_token_list(Path(tokens_file).read_text(), tokens_file)
    from parity.gguf.tokenizer import chat_ids, load_tokenizer, mode_difference

    # raw bytes as ds4 reads them: no newline translation, always UTF-8
    text = read_prompt(prompt, prompt_file)
    tok = load_tokenizer(model)
    ids = {mode: chat_ids(tok, text, mode=mode) for mode in ("model", "ds4")}
    note = mode_difference(tok, ids["model"], ids["ds4"])
    if note:
        click.secho(f"note: {note}", fg="yellow", err=True)
    return ids[tokenizer]


def default_positions(n_prompt: int, decode: int) -> str | list[int]:
    """--positions when not given: the last position without decode; with decode, the prompt's last position
    and every decode position (so 'which decode step' is never lost)."""
    return "last" if decode == 0 else list(range(n_prompt - 1, n_prompt + decode))


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
@click.option("--decode", default=0, show_default=True, type=click.IntRange(0),
              help="Greedy decode steps (not with --follow).")
@click.option("--chunk", default=None, type=click.IntRange(1),
              help="Prefill chunk size (default: one chunk; not with --follow).")
@click.option("--no-fp8-kv", is_flag=True, help="Turn off the FP8 KV simulation (on in the model definition).")
@click.option("--no-fp4-indexer", is_flag=True, help="Turn off the FP4 indexer simulation.")
@dtype_option()
@device_option()
@inject_option()
@numerics_options
@lcp_options
@click.option("--engine-arg", "engine_arg", multiple=True, metavar="NAME=VALUE",
              help="An engine-specific setting (repeatable), validated by the engine; e.g. torch: "
                   "cpu_kernels=torch (torch ops instead of the compiled CPU kernels).")
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
          no_fp8_kv, no_fp4_indexer, dtype, device, inject, act_quant, kv_cache, rope_angles, lcp_kv, lcp_flash_attn,
          lcp_threads, engine_arg, top_k, dump_logprobs, dump_ctx,
          output, as_json) -> None:
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

    output = _trace_path(output)
    check_draft_options(draft)
    if subops and not follow and positions != "all":
        raise click.UsageError("--subops needs --positions all (op-level forcing runs each sub-op at every position)")
    if (dump_logprobs is None) != (dump_ctx is None):
        raise click.UsageError("--dump-logprobs and --dump-ctx go together (the dump records its run's ctx)")
    if follow:
        if any(x is not None for x in (tokens, tokens_file, prompt, prompt_file)):
            raise click.UsageError("--follow takes the tokens from the followed trace; drop --tokens/--prompt")
        ctx = click.get_current_context()
        given = [f"--{n}" for n in ("positions", "decode", "chunk")
                 if ctx.get_parameter_source(n) is not click.core.ParameterSource.DEFAULT]
        if given:
            raise click.UsageError(f"--follow replays the followed trace's positions, decode steps and chunking; "
                                   f"drop {', '.join(given)}")
        run = api.follow(follow)
    else:
        ids = resolve_tokens(model, tokens, tokens_file, prompt, prompt_file, tokenizer)
        run = {"tokens": ids, "decode": decode, "forced": None, "chunk": chunk,
               "positions": positions if positions is not None else default_positions(len(ids), decode)}
    ids, decode = run["tokens"], run["decode"]
    lcp = lcp_run_options(engine, lcp_kv, lcp_flash_attn, lcp_threads)
    options = RunOptions(fp8_kv=not no_fp8_kv, fp4_indexer=not no_fp4_indexer, dtype=dtype, device=device,
                         inject=tuple(inject), act_quant=act_quant, kv_cache=kv_cache, rope_angles=rope_angles,
                         **{**lcp, "engine_args": (*lcp.get("engine_args", ()), *engine_arg)})
    rows = []
    total = api.n_chunks(len(ids), decode, run["chunk"])
    stage = f"trace {engine}: {len(ids)} tokens + {decode} decode"
    with Progress() as progress:
        done = [0]

        def on_chunk(r) -> None:
            if dump_logprobs:
                rows.extend(r.logits[max(0, len(ids) - 1 - r.start_pos):])
            done[0] += 1
            progress(stage, done[0], total)

        progress(stage, 0, total)
        t = api.trace(engine, model, full=full, top_k=top_k, options=options, on_chunk=on_chunk, subops=subops,
                      draft=draft, mtp_depth=mtp_depth, mtp_pairing=mtp_pairing, **run)
    if dump_logprobs:  # an older dump never stays beside the new trace (a run killed before the dump leaves none)
        Path(dump_logprobs).unlink(missing_ok=True)
    path = api.save_trace(t, output)
    report = {"wrote": str(path), "checkpoint_records": len(t.ckpt), "positions": t.header.positions,
              "tokens": len(t.header.tokens), "n_prompt": t.header.n_prompt, "decode": t.header.decode}
    if dump_logprobs:
        report["logprobs"] = _dump_logprobs(dump_logprobs, model, rows, t.header.n_prompt, top_k, dump_ctx)
    if as_json:
        echo_json(report)
        return
    click.echo(f"wrote {path} ({len(t.ckpt)} checkpoint records, {len(t.header.positions)} position(s), "
               f"tokens {len(t.header.tokens)})")
    if dump_logprobs:
        click.echo(f"wrote {dump_logprobs} ({report['logprobs']['steps']} step(s), top {top_k})")


def _dump_logprobs(path: str, model: str, rows: list, n_prompt: int, top_k: int, ctx: int) -> dict:
    """ds4 semantics: step 0 = last prompt row, step i = the row after feeding step i-1's token."""
    import numpy as np

    from parity.gguf.tokenizer import load_tokenizer
    from parity.logprobs.io import ds4_argmax, write_ds4_dump

    logits = np.stack(rows).astype(np.float32)
    write_ds4_dump(path, logits=logits, selected=[ds4_argmax(r) for r in logits], prompt_tokens=n_prompt,
                   ctx=ctx, top_k=top_k, vocab_tokens=load_tokenizer(model).tokens)
    return {"wrote": path, "steps": len(logits), "top_k": top_k, "ctx": ctx}


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
    from parity.api import model_identity, save_trace
    from parity.gguf.weights import Weights
    from parity.tracing.importers import import_ds4, import_llamacpp

    output = _trace_path(output)
    capture_file = kind == "llama.cpp" and Path(source).is_file()  # a capture carries its input_ids
    ids = (None if capture_file and tokens is None and tokens_file is None
           else resolve_tokens(model, tokens, tokens_file, None, None))
    cfg, ident = Weights(model).config, model_identity(model)
    if kind == "ds4":
        t = import_ds4(source, tokens=ids, config=cfg, model=ident, top_k=top_k)
    else:
        t = import_llamacpp(source, tokens=ids, config=cfg, model=ident, start_pos=start_pos, top_k=top_k)
    path = save_trace(t, output)
    dropped = t.header.flags["import_dropped"]
    if as_json:
        echo_json({"wrote": str(path), "checkpoints": t.header.checkpoints, "positions": t.header.positions,
                   "dropped": dropped})
        return
    click.echo(f"wrote {path}: {len(t.header.checkpoints)} checkpoints x {len(t.header.positions)} position(s)"
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
    from parity.api import load_trace, save_trace

    path = save_trace(load_trace(source), _trace_path(dest, "DEST"))
    if as_json:
        echo_json({"wrote": str(path)})
    else:
        click.echo(f"wrote {path}")


COMMANDS = [trace, import_, convert]
