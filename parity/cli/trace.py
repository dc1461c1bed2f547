"""`v4parity trace`, `v4parity import` and `v4parity convert`: make, import and re-encode traces."""

from __future__ import annotations

from pathlib import Path

import click


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
                   prompt_file: str | None) -> list[int]:
    """Exactly one of the four token sources -> ids (prompts go through the model's chat template)."""
    given = [x is not None for x in (tokens, tokens_file, prompt, prompt_file)]
    if sum(given) != 1:
        raise click.UsageError("give exactly one of --tokens, --tokens-file, --prompt, --prompt-file")
    if tokens is not None:
        return read_token_list(tokens, "--tokens")
    if tokens_file is not None:
        return read_token_list(Path(tokens_file).read_text(), tokens_file)
    from parity.gguf.tokenizer import encode_chat

    # raw bytes as ds4 reads them: no newline translation, always UTF-8
    text = prompt if prompt is not None else Path(prompt_file).read_bytes().decode("utf-8")
    return encode_chat(model, text, system="", thinking=False)


@click.command()
@click.option("--engine", required=True, help="Registered engine: reference | torch | any v4parity.engines plugin.")
@click.option("--model", required=True, type=click.Path(exists=True, dir_okay=False), help="deepseek4 GGUF.")
@click.option("--tokens", help="Prompt token ids, e.g. 0,17,42.")
@click.option("--tokens-file", type=click.Path(exists=True, dir_okay=False), help="File of token ids.")
@click.option("--prompt", help="User text, rendered with the model's chat template (non-thinking).")
@click.option("--prompt-file", type=click.Path(exists=True, dir_okay=False), help="File of user text.")
@click.option("--follow", type=click.Path(exists=True, dir_okay=False),
              help="Replay another trace's run: its prompt, decode tokens (teacher-forced), positions and chunking.")
@click.option("--positions", default="last", show_default=True,
              help="last | all | comma list of positions (not with --follow: it replays the followed trace's).")
@click.option("--full", default=None, help="Also store full vectors: 'all' or e.g. blk.2,blk.2.attn,final_norm,logits.")
@click.option("--decode", default=0, show_default=True, type=click.IntRange(0),
              help="Greedy decode steps (not with --follow).")
@click.option("--chunk", default=None, type=click.IntRange(1),
              help="Prefill chunk size (default: one chunk; not with --follow).")
@click.option("--no-fp8-kv", is_flag=True, help="Turn off the FP8 KV simulation (on in the model definition).")
@click.option("--no-fp4-indexer", is_flag=True, help="Turn off the FP4 indexer simulation.")
@click.option("--dtype", default="float32", show_default=True, type=click.Choice(["float32", "float64", "bfloat16"]),
              help="float64: reference oracle; bfloat16: torch approximate path.")
@click.option("--device", default="cpu", show_default=True, help="torch engine: auto | cuda | cpu.")
@click.option("--inject", multiple=True, metavar="FAULT",
              help="Inject a known porting bug (repeatable); the engine lists its faults (torch: docs/torch-engine.md) "
                   "and refuses unknown names.")
@click.option("--top-k", default=20, show_default=True, type=click.IntRange(1, 100), help="Top logits per position.")
@click.option("--dump-logprobs", type=click.Path(dir_okay=False), help="Also write a ds4 --dump-logprobs JSON.")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False),
              help="Trace file (text; .npz for the binary form). Full vectors go to <stem>.vectors.npz.")
def trace(engine, model, tokens, tokens_file, prompt, prompt_file, follow, positions, full, decode, chunk,
          no_fp8_kv, no_fp4_indexer, dtype, device, inject, top_k, dump_logprobs, output) -> None:
    """Run an engine on a prompt and record every checkpoint (stats + fingerprints) to a trace.

    \b
    Example: v4parity trace --engine reference --model tiny.gguf --tokens 0,5,7 --decode 4 -o ref.trace
             v4parity trace --engine torch --model tiny.gguf --follow ref.trace -o torch.trace
    """
    from rich.progress import Progress

    from parity import api
    from parity.contract.engine import RunOptions

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
        ids = resolve_tokens(model, tokens, tokens_file, prompt, prompt_file)
        run = {"tokens": ids, "decode": decode, "forced": None, "positions": positions, "chunk": chunk}
    ids, decode = run["tokens"], run["decode"]
    options = RunOptions(fp8_kv=not no_fp8_kv, fp4_indexer=not no_fp4_indexer, dtype=dtype, device=device,
                         inject=tuple(inject))
    rows = []
    with Progress(transient=True) as bar:
        task = bar.add_task(f"{engine}: {len(ids)} tokens + {decode} decode",
                            total=api.n_chunks(len(ids), decode, run["chunk"]))

        def on_chunk(r) -> None:
            if dump_logprobs:
                rows.extend(r.logits[max(0, len(ids) - 1 - r.start_pos):])
            bar.advance(task)

        t = api.trace(engine, model, full=full, top_k=top_k, options=options, on_chunk=on_chunk, **run)
    path = api.save_trace(t, output)
    click.echo(f"wrote {path} ({len(t.ckpt)} checkpoint records, {len(t.header.positions)} position(s), "
               f"tokens {len(t.header.tokens)})")
    if dump_logprobs:
        _dump_logprobs(dump_logprobs, model, rows, t.header.n_prompt, top_k)


def _dump_logprobs(path: str, model: str, rows: list, n_prompt: int, top_k: int) -> None:
    """ds4 semantics: step 0 = last prompt row, step i = the row after feeding step i-1's token."""
    import numpy as np

    from parity.gguf.tokenizer import load_tokenizer
    from parity.logprobs.io import write_ds4_dump

    logits = np.stack(rows).astype(np.float32)
    write_ds4_dump(path, logits=logits, selected=logits.argmax(axis=1).tolist(), prompt_tokens=n_prompt,
                   ctx=n_prompt + len(logits) + 1, top_k=top_k, vocab_tokens=load_tokenizer(model).tokens)
    click.echo(f"wrote {path} ({len(logits)} step(s), top {top_k})")


@click.command(name="import")
@click.argument("kind", type=click.Choice(["ds4", "llama.cpp"]))
@click.argument("source", type=click.Path())
@click.option("--model", required=True, type=click.Path(exists=True, dir_okay=False),
              help="The GGUF the engine ran (dimensions + identity).")
@click.option("--tokens", help="Token ids of the run, e.g. 0,17,42.")
@click.option("--tokens-file", type=click.Path(exists=True, dir_okay=False), help="File of token ids.")
@click.option("--start-pos", default=0, show_default=True, type=click.IntRange(0),
              help="llama.cpp: position of the first row.")
@click.option("--top-k", default=20, show_default=True, type=click.IntRange(1, 100))
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="Trace file to write.")
def import_(kind, source, model, tokens, tokens_file, start_pos, top_k, output) -> None:
    """Turn another engine's tensor dumps into a trace.

    \b
    ds4:       SOURCE is the DS4_METAL_GRAPH_DUMP_PREFIX (files SOURCE_<name>-<layer>_pos<pos>.bin)
    llama.cpp: SOURCE is a directory of eval-callback tensors saved as <name>.bin / <name>.npy
               (hc_init, hc_attn_post-N, l_last-N, result_norm, result_output)
    """
    from parity.api import model_identity, save_trace
    from parity.gguf.weights import Weights
    from parity.tracing.importers import import_ds4, import_llamacpp

    ids = resolve_tokens(model, tokens, tokens_file, None, None)
    cfg, ident = Weights(model).config, model_identity(model)
    if kind == "ds4":
        t = import_ds4(source, tokens=ids, config=cfg, model=ident, top_k=top_k)
    else:
        t = import_llamacpp(source, tokens=ids, config=cfg, model=ident, start_pos=start_pos, top_k=top_k)
    path = save_trace(t, output)
    dropped = t.header.flags["import_dropped"]
    click.echo(f"wrote {path}: {len(t.header.checkpoints)} checkpoints x {len(t.header.positions)} position(s)"
               + (f"; dropped (incomplete): {', '.join(dropped)}" if dropped else ""))


@click.command()
@click.argument("source", type=click.Path(exists=True, dir_okay=False))
@click.argument("dest", type=click.Path(dir_okay=False))
def convert(source, dest) -> None:
    """Re-encode a trace: text <-> binary (.npz) by DEST's extension; same content, byte-stable.

    Full vectors are copied to DEST's side file (<stem>.vectors.npz).
    Example: v4parity convert big.trace big.npz
    """
    from parity.api import load_trace, save_trace

    path = save_trace(load_trace(source), dest)
    click.echo(f"wrote {path}")


COMMANDS = [trace, import_, convert]
