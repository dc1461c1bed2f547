"""`v4parity spec`: speculative greedy decoding that must change no token, and who is to blame for rejections."""

from __future__ import annotations

import click

from parity.cli.common import (
    device_option,
    echo_json,
    html_option,
    inject_option,
    json_errors,
    json_option,
    markdown_option,
    model_option,
    tokenizer_option,
    warn,
    write_text,
)
from parity.contract.errors import ParityError


class Refused(click.ClickException):
    """A usage or preflight error: exit status 2, the message on stderr (or as JSON with --json)."""

    exit_code = 2


@click.command()
@model_option(help="deepseek4 GGUF file (the trunk).")
@click.option("--draft", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Drafter GGUF (MTP or DSpark; `v4parity inspect -m TRUNK --draft FILE` shows which).")
@click.option("--script", default=None, metavar="accept-all|reject-at:I",
              help="Scripted drafts instead of a drafter (spec §6.4): the reference's greedy continuation, depth "
                   "--depth, the I-th draft of every round made wrong.")
@click.option("--engine", default="torch", show_default=True, help="Candidate engine (registered name).")
@click.option("--depth", type=int, default=1, show_default=True,
              help="Drafts per round: MTP chain depth, or scripted drafts (a DSpark round drafts its block of B).")
@click.option("--mtp-pairing", "pairing", type=click.Choice(["prev", "same"]), default=None,
              help="MTP pairing (spec §2.3; default prev): prev pairs X_{p-1} with t_p (llama.cpp, vLLM); same pairs "
                   "X_p with t_p (ds4: the first MTP output predicts the anchor, checked for free, so a round drafts "
                   "depth - 1 and none when that check fails).")
@click.option("--steps", type=int, default=32, show_default=True, help="Tokens to generate.")
@click.option("--tokens", default=None, help="Prompt token ids, e.g. 0,17,42.")
@click.option("--tokens-file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="File of prompt token ids.")
@click.option("--prompt", help="User text as one chat turn (non-thinking, no system text).")
@click.option("--prompt-file", type=click.Path(exists=True, dir_okay=False), help="File of user text (read raw).")
@tokenizer_option()
@click.option("--gate", default="none", show_default=True, metavar="none|first-below:P|cumulative:P",
              help="Confidence gate on the DSpark confidences σ(c_j): cut at the first σ < P, or where the "
                   "running product drops below P (spec §4.3).")
@click.option("--max-draft", type=int, default=None, help="Verify at most N drafts a round.")
@click.option("--no-fp8-kv", is_flag=True, help="Turn off the FP8 KV simulation (on in the model definition).")
@click.option("--no-fp4-indexer", is_flag=True, help="Turn off the FP4 indexer simulation.")
@device_option()
@inject_option()
@click.option("--envelope", "envelope_path", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Envelope file for the tie threshold (default: the stored one of this model with these QAT "
                   "flags and engine, in the user cache, the model's directory or the repository's traces/; "
                   "else measured now and cached).")
@click.option("--candidate", type=click.Path(dir_okay=False), default=None,
              help="A foreign engine's trace with spec records (docs/trace-format.md): attribute its run instead of "
                   "running an engine; the prompt, tokens, rounds and QAT flags come from the trace.")
@click.option("--trace-out", type=click.Path(dir_okay=False), default=None,
              help="Also write the run's rounds as a trace of spec records (what --candidate reads).")
@json_option()
@markdown_option()
@html_option(help="Also write a self-contained HTML page to FILE: per-round timeline (label colours), per-slot "
                   "acceptance plot.")
@json_errors
def spec(model, draft, script, engine, depth, pairing, steps, tokens, tokens_file, prompt, prompt_file, tokenizer, gate,
         max_draft, no_fp8_kv, no_fp4_indexer, device, inject, envelope_path, as_json, markdown_path,
         html_path, candidate, trace_out) -> None:
    """Decode speculatively with ENGINE and a drafter, decode plainly with ENGINE and the reference, and check
    that the tokens agree (a divergence is TIE when the reference's top-1/top-2 margin is inside the noise
    envelope, else WRONG); label every drafted position (ACCEPT-OK, DRAFTER-MISS, DRAFTER-DRIFT, FALSE-REJECT,
    FALSE-ACCEPT, NEAR-TIE, VERIFIER-DEFECT, NOT-VERIFIED) from the reference's verifier rows and drafter on the
    same committed prefix; compare the caches after every commit with the reference's (state parity).
    docs/spec.md explains the labels, the tie threshold and the cost.

    \b
    Exit codes: 0 exact (or the first divergence a TIE), no committed token WRONG, states equal, no defect label,
                1 WRONG (first divergence or a committed token on its own prefix), a state divergence after a
                commit, or a VERIFIER-DEFECT / DRAFTER-DRIFT / FALSE-ACCEPT label, 2 usage or preflight error.
    Example: v4parity spec -m TRUNK --draft FILE --engine torch --depth 2 --steps 64 --prompt "..."
    A foreign engine's run (its trace's spec records): v4parity spec -m TRUNK --draft FILE --candidate run.trace
    """
    from parity import api
    from parity.cli.progress import Progress
    from parity.contract.engine import RunOptions
    from parity.tracing.plan import TokenSource

    if candidate is not None:
        _candidate_only(click.get_current_context())
    options = RunOptions(fp8_kv=not no_fp8_kv, fp4_indexer=not no_fp4_indexer, device=device, inject=tuple(inject))
    bar = Progress()
    try:   # with --candidate the trace gives the run (api.spec attributes it with spec_candidate)
        report = api.spec(model, TokenSource(tokens, tokens_file, prompt, prompt_file, tokenizer), note=warn,
                          candidate=candidate, engine=engine, draft=draft, script=script, depth=depth, steps=steps,
                          gate=gate, max_draft=max_draft, options=options, envelope=envelope_path,
                          progress=bar, trace_out=trace_out, pairing=pairing)
    except ParityError as e:
        raise Refused(str(e)) from None
    finally:
        bar.close()
    _show(report, as_json, markdown_path, html_path)
    raise SystemExit(1 if report.defects else 0)


def _show(report: object, as_json: bool, markdown_path: str | None, html_path: str | None) -> None:
    """--markdown FILE ('-': stdout), --html FILE, then the report as JSON or text on stdout (none when the
    Markdown went there)."""
    from parity.spec.printers import to_markdown, to_text

    if markdown_path:
        write_text(markdown_path, to_markdown(report))
    if html_path:
        from parity.spec.html import write_spec_html

        write_spec_html(html_path, report)
    if as_json:
        echo_json(report.to_dict())
    elif markdown_path != "-":
        click.echo(to_text(report))


def _candidate_only(ctx: click.Context) -> None:
    """With --candidate the trace gives the run: a run option given on the command line is refused by name."""
    from click.core import ParameterSource

    given = [p for p in ("script", "engine", "depth", "pairing", "steps", "tokens", "tokens_file", "prompt",
                         "prompt_file", "gate", "max_draft", "no_fp8_kv", "no_fp4_indexer", "device", "inject",
                         "trace_out")
             if ctx.get_parameter_source(p) not in (ParameterSource.DEFAULT, None)]
    if given:
        flag = next(p.opts[0] for p in ctx.command.params if p.name == given[0])
        raise Refused(f"--candidate reads the run from the trace: drop {flag} (only -m, "
                      "--draft, --envelope, --json, --markdown and --html go with it)")


COMMANDS = [spec]
