"""`v4parity arbitrate`: several engines on the same tokens; per checkpoint, which agree with which."""

from __future__ import annotations

import click

from parity.cli.common import echo_json, json_errors, json_option, model_option, usage_errors, warn
from parity.compare.verdict import Verdict


@click.command()
@model_option()
@click.option("--engines", required=True,
              help="Comma list of registered engines, e.g. reference,torch,llamacpp,hf; NAME+FAULT[+FAULT] runs NAME "
                   "with those faults injected (e.g. torch+sink-dropped).")
@click.option("--tokens", help="Prompt token ids, e.g. 0,17,42.")
@click.option("--tokens-file", type=click.Path(exists=True, dir_okay=False), help="File of token ids.")
@click.option("--decode", default=0, show_default=True, type=click.IntRange(0),
              help="Decode steps: the first engine's greedy tokens, fed to every engine.")
@click.option("--chunk", default=None, type=click.IntRange(1), help="Prefill chunk size (default: one chunk).")
@click.option("--qat-sims", is_flag=True,
              help="Run the FP8 KV / FP4 indexer QAT round trips (off by default: llama.cpp and transformers omit "
                   "them; only engines that implement them can then take part).")
@click.option("--rel-tol", default=1e-4, show_default=True, type=click.FloatRange(0, min_open=True),
              help="Two engines agree at a checkpoint when their largest per-position rel-L2 is <= this.")
@click.option("--envelope", "envelope_path", type=click.Path(exists=True, dir_okay=False), default=None,
              help="The noise envelope each --check uses (default: the stored one, else measured). Needs --check: "
                   "engines are never judged by K x the envelope's floor.")
@click.option("--check", "check_each", is_flag=True,
              help="Also judge each engine's run with `check` against the model (the round-off null on this prompt); "
                   "the exit status then follows the verdicts: 1 if any engine is DEFECT.")
@json_option()
@json_errors
def arbitrate(model, engines, tokens, tokens_file, decode, chunk, qat_sims, rel_tol, envelope_path, check_each,
              as_json) -> None:
    """Run each engine on the same tokens and print, per checkpoint, the clusters of engines that agree, so
    "reference and llama.cpp agree, the port under test is the odd one out" is one command.

    \b
    Exit codes: 0 all engines agree everywhere, 1 they split somewhere, 2 usage error or an engine refused;
    with --check: 0 no engine is DEFECT, 1 one is (the clusters are then evidence only).
    Example: v4parity arbitrate -m tiny-f32.gguf --tokens 0,5,7,9 --decode 4 --engines reference,torch,llamacpp,hf
    """
    from parity import api
    from parity.cli.progress import Lines
    from parity.compare.arbitration import summary_lines
    from parity.tracing.plan import TokenSource

    if envelope_path is not None and not check_each:
        raise click.UsageError("--envelope needs --check: each engine's run is then judged by `check` (the round-off "
                               "null on this prompt), never by K x the envelope's floor")
    names = list(dict.fromkeys(e.strip() for e in engines.split(",") if e.strip()))
    if len(names) < 2:
        raise click.UsageError(f"--engines: arbitration needs at least two distinct engines, got {names}")
    with usage_errors():   # the run plan's errors (token sources, token range) are usage errors
        report = api.arbitrate(model, TokenSource(tokens, tokens_file), names, decode=decode, chunk=chunk, note=warn,
                               qat_sims=qat_sims, rel_tol=rel_tol, envelope=envelope_path,
                               progress=Lines(), check_each=check_each)
    if as_json:
        echo_json(report.to_dict() | ({"check": _check_docs(report.checks)} if check_each else {}))
    else:
        click.echo("\n".join(_check_lines(report.checks) + summary_lines(report)))
    if check_each:
        raise SystemExit(1 if any(c.verdict == Verdict.DEFECT for c in report.checks.values()) else 0)
    raise SystemExit(0 if report.unanimous else 1)


def _check_docs(checks: dict) -> dict:
    """engine -> `check`'s JSON document (`CheckReport.to_dict`) plus its headline."""
    from parity.check.check_report import headline

    return {e: {"headline": headline(c), **c.to_dict()} for e, c in checks.items()}


def _check_lines(checks: dict) -> list[str]:
    """One line per engine: its `check` verdict line (these decide the exit status)."""
    from parity.check.check_report import headline

    return [f"check {e} (decides the exit status): {headline(c)}" for e, c in checks.items()]


COMMANDS = [arbitrate]
