"""`v4parity logprobs` (compare two top-k logprob files) and `v4parity tokenize` (prompt ids from a GGUF)."""

from __future__ import annotations

import click

from parity.cli.common import (
    echo_json,
    json_errors,
    json_option,
    markdown_option,
    model_option,
    read_prompt,
    tokenizer_option,
    write_text,
)
from parity.logprobs.compare import DRIFT_TOL, FAIL_ON, TIE_MARGIN


@click.command()
@click.argument("a", metavar="A")
@click.argument("b", metavar="B")
@json_option()
@markdown_option()
@click.option("--fail-on", multiple=True, type=click.Choice(FAIL_ON), default=("wrong", "ds4-test"),
              show_default=True,
              help="Exit 1 if any compared step has this verdict (ds4-test: ds4_test's criterion fails). Repeatable; "
                   "giving it replaces the default.")
@click.option("--force", is_flag=True, help="Compare files from different runs (prompt_tokens / top_k / ctx differ).")
@click.option("--tie-margin", type=float, default=TIE_MARGIN, show_default=True,
              help="Reference logprob gap (nats) under which a different token is a TIE-FLIP, not WRONG.")
@click.option("--drift-tol", type=float, default=DRIFT_TOL, show_default=True,
              help="Top-1 logprob difference (nats) above which a same-token step is DRIFT.")
@click.option("--wide", is_flag=True, help="Every column (adds the JS interval and tail masses), lines unwrapped "
                                           "(default: within 100 columns).")
@json_errors
def logprobs(a: str, b: str, as_json: bool, markdown_path: str | None, fail_on: tuple[str, ...], force: bool,
             tie_margin: float, drift_tol: float, wide: bool) -> None:
    """Compare top-k logprobs of A (reference) and B (candidate), step by step.

    A and B may each be a ds4 --dump-logprobs JSON (ours: `v4parity trace --dump-logprobs`), an official
    API vector JSON (ds4-official-logprobs-v1) or an official.vec case (FILE#CASE). Tokens are compared
    by bytes. Prints per-step verdicts (MATCH / TIE-FLIP / DRIFT / WRONG), top-k Jaccard, max |Δlogprob|,
    rank shift, KL/JS bounds with the unseen tail mass, ds4_test's criterion, and a summary line.

    \b
    Exit codes: 0 pass; 1 a --fail-on gate trips or B stops before A (incomplete);
                2 bad file, or two dumps of different runs (prompt_tokens / top_k / ctx differ; --force).
    Example:
      v4parity logprobs official/short_italian_fact.official.json ours.json --fail-on wrong --fail-on tie
    """
    from parity import api
    from parity.logprobs.printers import render_markdown, render_text

    if tie_margin < 0 or drift_tol < 0:
        raise click.BadParameter("--tie-margin and --drift-tol must be >= 0")
    cmp = api.logprobs(a, b, tie_margin=tie_margin, drift_tol=drift_tol, force=force)
    failed = cmp.failures(fail_on) + (["incomplete"] if cmp.incomplete else [])
    if markdown_path:
        write_text(markdown_path, render_markdown(cmp))
    if as_json:
        echo_json({**cmp.to_dict(), "fail_on": list(fail_on), "failed": failed})
    elif markdown_path != "-":
        click.echo(render_text(cmp, wide=wide))
        if failed:
            click.secho(f"FAILED: {', '.join(failed)}", fg="red", err=True)
    if failed:
        raise SystemExit(1)


@click.command()
@model_option()
@click.option("--prompt", "-p", help="Prompt text.")
@click.option("--prompt-file", type=click.Path(exists=True, dir_okay=False),
              help="Read the prompt from a file, raw (a trailing newline is part of the prompt, as in ds4).")
@click.option("--chat/--raw", default=True, show_default=True,
              help="--chat: one user turn through the model's chat template (--tokenizer ds4: ds4's own prompt "
                   "layout). --raw: the text as written, "
                   "with ds4's 7 specials recognised (ds4 --dump-tokens).")
@click.option("--system", default="", show_default=True,
              help="System text (--chat). ds4's own default is 'You are a helpful assistant'; '' matches the "
                   "official vectors and ds4_test.")
@click.option("--thinking/--no-thinking", default=False, show_default=True,
              help="--chat: end with <think> (thinking) instead of </think> (ds4 --nothink).")
@click.option("--think-max", is_flag=True,
              help="--chat: ds4's think max: the reasoning-effort prefix after BOS, then <think> (ds4 applies it "
                   "only with --ctx >= 393216; below that it falls back to plain thinking).")
@tokenizer_option()
@json_option(help="Print ids, vocab strings and piece bytes as JSON (errors too).")
@json_errors
def tokenize(model: str, prompt: str | None, prompt_file: str | None, chat: bool, system: str, thinking: bool,
             think_max: bool, tokenizer: str, as_json: bool) -> None:
    """Print the token ids of a prompt, then one `id  vocab-string` line per token (ds4's --dump-tokens
    layout, so the two can be diffed). When the model's and ds4's tokenizers disagree on the prompt, one
    line on stderr says where.

    \b
    Example: v4parity tokenize -m tiny.gguf -p "abc中文def" --tokenizer ds4
    """
    from parity import api

    t = api.tokenize(model, read_prompt(prompt, prompt_file), tokenizer=tokenizer, chat=chat, system=system,
                     thinking=thinking, think_max=think_max)
    if t.modes_disagree:
        click.secho(f"note: {t.modes_disagree}", fg="yellow", err=True)
    if as_json:
        rows = [{"id": i, "token": s, "bytes": list(b)} for i, s, b in zip(t.ids, t.tokens, t.pieces, strict=True)]
        echo_json({"ids": list(t.ids), "n_tokens": len(t.ids), "tokenizer": tokenizer,
                   "modes_disagree": t.modes_disagree, "tokens": rows})
        return
    click.echo("[" + ", ".join(map(str, t.ids)) + "]")
    for i, s in zip(t.ids, t.tokens, strict=True):
        click.echo(f"{i:6d}  {s}")


COMMANDS = [logprobs, tokenize]
