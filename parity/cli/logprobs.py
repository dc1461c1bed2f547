"""`v4parity logprobs` (compare two top-k logprob files) and `v4parity tokenize` (prompt ids from a GGUF)."""

from __future__ import annotations

import click

from parity.cli.common import echo_json, json_errors, json_option, markdown_option, model_option, write_text
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
@json_errors
def logprobs(a: str, b: str, as_json: bool, markdown_path: str | None, fail_on: tuple[str, ...], force: bool,
             tie_margin: float, drift_tol: float) -> None:
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
    from parity.logprobs.compare import compare_runs, render_markdown, render_text
    from parity.logprobs.io import read_run

    if tie_margin < 0 or drift_tol < 0:
        raise click.BadParameter("--tie-margin and --drift-tol must be >= 0")
    cmp = compare_runs(read_run(a), read_run(b), tie_margin, drift_tol, force=force)
    failed = cmp.failures(fail_on) + (["incomplete"] if cmp.incomplete else [])
    if markdown_path:
        write_text(markdown_path, render_markdown(cmp))
    if as_json:
        echo_json({**cmp.to_dict(), "fail_on": list(fail_on), "failed": failed})
    elif markdown_path != "-":
        click.echo(render_text(cmp))
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
              help="--chat: one user turn through the chat template (ds4's prompt). --raw: the text as written, "
                   "with ds4's 7 specials recognised (ds4 --dump-tokens).")
@click.option("--system", default="", show_default=True,
              help="System text (--chat). ds4's own default is 'You are a helpful assistant'; '' matches the "
                   "official vectors and ds4_test.")
@click.option("--thinking/--no-thinking", default=False, show_default=True,
              help="--chat: end with <think> (thinking) instead of </think> (ds4 --nothink).")
@json_option(help="Print ids, vocab strings and piece bytes as JSON (errors too).")
@json_errors
def tokenize(model: str, prompt: str | None, prompt_file: str | None, chat: bool, system: str, thinking: bool,
             as_json: bool) -> None:
    """Print the token ids ds4 would feed for a prompt, then one `id  vocab-string` line per token.

    The output matches ds4's --dump-tokens layout, so the two can be diffed.
    """
    from parity.gguf.tokenizer import chat_ids, load_tokenizer

    if (prompt is None) == (prompt_file is None):
        raise click.UsageError("give exactly one of --prompt and --prompt-file")
    if prompt_file is not None:
        try:
            with open(prompt_file, "rb") as f:
                prompt = f.read().decode("utf-8")
        except UnicodeDecodeError as e:
            raise click.BadParameter(f"{prompt_file} is not UTF-8 (byte {e.start})") from None
    tok = load_tokenizer(model)
    ids = chat_ids(tok, prompt, system, thinking) if chat else tok.encode_rendered(prompt)
    if as_json:
        rows = [{"id": i, "token": tok.tokens[i], "bytes": list(tok.piece(i))} for i in ids]
        echo_json({"ids": ids, "n_tokens": len(ids), "tokens": rows})
        return
    click.echo("[" + ", ".join(map(str, ids)) + "]")
    for i in ids:
        click.echo(f"{i:6d}  {tok.tokens[i]}")


COMMANDS = [logprobs, tokenize]
