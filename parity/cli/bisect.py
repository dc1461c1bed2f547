"""`v4parity bisect` and `v4parity envelope`: localise a candidate engine's first departure from the reference."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from parity.cli.common import (
    check_draft_options,
    device_option,
    draft_options,
    dtype_option,
    echo_json,
    html_option,
    inject_option,
    json_errors,
    json_option,
    model_option,
    pool_args,
    pool_options,
    tokenizer_option,
    usage_errors,
    warn,
)
from parity.compare.verdict import Verdict


def _stderr(msg: str) -> None:
    click.echo(msg, err=True)


def _progress() -> object:
    """Stage lines on stderr with the elapsed time since the command started (`stage ... [m:ss]`); called with
    (stage, done, total), a bar with ETA on a terminal and periodic `stage done/total elapsed` lines otherwise."""
    from parity.cli.progress import Progress

    return Progress()


def _options(dtype: str, device: str, no_fp8_kv: bool, no_fp4_indexer: bool, inject=()):
    from parity.contract.engine import RunOptions

    return RunOptions(fp8_kv=not no_fp8_kv, fp4_indexer=not no_fp4_indexer, dtype=dtype, device=device,
                      inject=tuple(inject))


model_opt = model_option()
engine_opt = click.option("--engine", default="torch", show_default=True, help="Candidate engine (registered name).")
dtype_opt = dtype_option(help="Candidate precision (the reference always runs float32); each dtype is judged by "
                              "its own envelope section.")
device_opt = device_option(help="Candidate device (torch engine; auto = CUDA when present).")
fp8_opt = click.option("--no-fp8-kv", is_flag=True, help="Both engines: skip the FP8 KV simulation.")
fp4_opt = click.option("--no-fp4-indexer", is_flag=True, help="Both engines: skip the FP4 indexer simulation.")


def numerics_opts(fn):
    """--dtype, --device, --no-fp8-kv, --no-fp4-indexer: how the candidate (and, for the QAT flags, both) run."""
    return dtype_opt(device_opt(fp8_opt(fp4_opt(fn))))


@click.command()
@model_opt
@engine_opt
@numerics_opts
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=None,
              help="Envelope file (default: this model's entry in the user cache, ~/.cache/v4parity/envelopes "
                   "or $XDG_CACHE_HOME/v4parity/envelopes, where check / bisect / spec find it); a section per "
                   "dtype is added.")
@json_option()
@json_errors
def envelope(model, engine, dtype, device, no_fp8_kv, no_fp4_indexer, output, as_json):
    """Measure the noise envelope of ENGINE on MODEL: reference f32 vs f64, the engine with two prefill
    chunkings (and, for bf16, bf16 vs its own f32) on a seeded calibration prompt, each checked against 19
    round-off twins of the reference (a float32 pair beyond 10x the quietest twin is left out of the floor).

    Example: v4parity envelope -m tiny-f32.gguf --engine torch --dtype bfloat16
    """
    from parity import api

    env, path = api.envelope(model, engine=engine, options=_options(dtype, device, no_fp8_kv, no_fp4_indexer),
                             output=output, progress=_progress())
    worst = max(env.checkpoints, key=env.checkpoints.get)
    if as_json:
        echo_json({"wrote": str(path), "dtype": dtype, "k": env.k, "eps": env.eps, "largest_floor":
                   {"checkpoint": worst, "floor": env.checkpoints[worst]}, "logit_rel": env.logit_rel})
        return
    click.echo(f"wrote {dtype} envelope to {path} (k={env.k:g}, eps={env.eps:g}; largest floor "
               f"{env.checkpoints[worst]:.3g} at {worst}; logit_rel {env.logit_rel:.3g})")


@click.command()
@model_opt
@engine_opt
@click.option("--tokens", default=None, help="Prompt token ids, e.g. 0,17,42 (default: a built-in prompt).")
@click.option("--tokens-file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="File with whitespace/comma separated prompt token ids.")
@click.option("--prompt", default=None, help="User text as one chat turn (as `trace --prompt`).")
@click.option("--prompt-file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="File of user text (read raw).")
@tokenizer_option()
@click.option("--follow", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Bisect on another trace's run: its prompt, decode length and prefill chunking (not with the "
                   "token, prompt, --decode or --chunk options).")
@click.option("--decode", type=click.IntRange(0), default=None,
              help="Greedy decode steps after the prompt (decode-only defects show up here).  [default: 4]")
@click.option("--chunk", type=click.IntRange(1), default=None, help="Prefill chunk size (default: one chunk).")
@inject_option()
@numerics_opts
@click.option("--envelope", "envelope_path", type=click.Path(dir_okay=False), default=None,
              help="Envelope file (default: the stored one measured on this model with this engine and QAT flags, "
                   "in the user cache, the model's directory or the repository's traces/; else measured now and "
                   "cached).")
@click.option("--routing-replay", is_flag=True,
              help="Force the candidate to use the reference's expert choices (separates routing flips from "
                   "arithmetic error).")
@draft_options("both engines open it; when the trunk has no defect, their draft heads on the reference's trunk "
               "carriers are compared as one more layer")
@json_option(help="Print the full report as JSON (errors too).")
@click.option("--plot", type=click.Path(dir_okay=False), default=None, help="Write a step x layer / layer PNG.")
@html_option()
@click.option("--wide", is_flag=True, help="Print the summary's lines unwrapped (default: within 100 columns).")
@pool_options("the teacher-forced pass and its round-off twins")
@json_errors
def bisect(model, engine, tokens, tokens_file, prompt, prompt_file, tokenizer, follow, decode, chunk, inject, dtype,
           device, no_fp8_kv, no_fp4_indexer, envelope_path, routing_replay, draft, mtp_depth, mtp_pairing, as_json,
           plot, html_path, wide, workers, ray):
    """Find where ENGINE departs from the reference: layer, sub-op, step, local or propagated, defect or noise.

    Exit status: 0 no defect (or noise only), 1 defect.

    \b
    Example: v4parity bisect -m tiny-f32.gguf --engine torch --inject no-decode-compression
             v4parity bisect -m tiny-f32.gguf --engine torch --follow ref.trace
    """
    from parity import api
    from parity.tracing.plan import TokenSource

    if envelope_path is not None and not Path(envelope_path).exists():
        raise click.BadParameter(f"{envelope_path} does not exist", param_hint="--envelope")
    check_draft_options(draft)
    workers, ray = pool_args(workers, ray)
    source = TokenSource(tokens, tokens_file, prompt, prompt_file, tokenizer)
    with usage_errors():   # the run plan's errors (token sources, --follow) are usage errors
        report = api.bisect(model, engine=engine, tokens=source, follow=follow, decode=decode, chunk=chunk, note=warn,
                            options=_options(dtype, device, no_fp8_kv, no_fp4_indexer, inject),
                            envelope=envelope_path, routing_replay=routing_replay, progress=_progress(),
                            draft=draft, mtp_depth=mtp_depth, mtp_pairing=mtp_pairing, workers=workers,
                            ray=ray)
    _figures(report, plot, html_path)
    if as_json:
        echo_json(report.to_dict())
    else:
        from parity.bisect.bisect_report import summary
        from parity.compare.textcells import fit_line

        text = summary(report)
        click.echo(text if wide else "\n".join(fit_line(line) for line in text.splitlines()))
    sys.exit(1 if report.verdict is Verdict.DEFECT else 0)


def _figures(report: object, plot: str | None, html_path: str | None) -> None:
    """--plot (step x layer / layer PNG) and --html, each announced on stderr."""
    from parity.bisect.bisect_report import plot as plot_report
    from parity.bisect.bisect_report import to_html

    if plot:
        plot_report(report, plot)
        _stderr(f"plot: {plot}")
    if html_path:
        to_html(html_path, report)
        _stderr(f"html: {html_path}")


COMMANDS = [bisect, envelope]
