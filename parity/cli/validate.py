"""`v4parity validate`: an approximate path against the exact path over many prompts, with CIs and pins."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import click

from parity.cli.common import html_option, json_errors, json_option, model_option, pool_args
from parity.cli.progress import Progress
from parity.logprobs.compare import DRIFT_TOL, TIE_MARGIN

RESUMABLE = ("resume", "workers", "ray", "as_json", "html_path")


class TaskProgress:
    """validate's printer of the progress protocol: the shared bar (with ETA) on a terminal; off a terminal a line
    with the ETA every 5 %. The first count (the driver's, before this session's first task) starts the clock; the
    ETA is at this session's rate."""

    def __init__(self, bar: Progress | None = None, clock: Callable[[], float] = time.perf_counter) -> None:
        self.bar, self.clock = bar or Progress(), clock
        self.start: tuple[float, int] | None = None   # (clock, tasks done) when this session's first task started

    def note(self, message: str) -> None:
        """A stage in words, as the bar prints it."""
        self.bar.note(message)

    def count(self, stage: str, done: int, total: int | None) -> None:
        """`done` of `total` tasks finished."""
        now = self.clock()
        if self.start is None:
            self.start = (now, done)
            return
        if self.bar.terminal or total is None:
            self.bar.count(stage, done, total)
        elif done % max(1, total // 20) == 0 or done == total:
            elapsed = now - self.start[0]
            eta = elapsed / (done - self.start[1]) * (total - done)
            self.bar.note(f"{stage}: {done}/{total} tasks ({100 * done / total:.0f}%), {elapsed:.0f} s, "
                          f"ETA {eta:.0f} s")


@click.command()
@model_option(required=False, help="deepseek4 GGUF (with --ray: readable at this path on every node).")
@click.option("--exact", default="torch", show_default=True, metavar="ENGINE[:OPTS]",
              help="The exact path, e.g. torch or reference. OPTS: key=value,... over the run options "
                   "(dtype, act_quant, kv_cache, rope_angles, fp8_kv, fp4_indexer, device, cache_gb).")
@click.option("--approx", metavar="ENGINE[:OPTS]", help="The approximate path, e.g. torch:act_quant=q8_0.")
@click.option("--prompts", "prompt_file", type=click.Path(exists=True, dir_okay=False),
              help="Prompts, one per line: text, or .jsonl objects with 'text' or 'tokens'.")
@click.option("--corpus", is_flag=True, help="The text corpus shipped with v4parity as --prompts.")
@click.option("--boundary", is_flag=True,
              help="Prompts from the model's constants (window, compress ratios, indexer top-k, prefill chunks, "
                   "decode past the window), seeded. With --prompts/--corpus: half text, half boundary.")
@click.option("--n", default=200, show_default=True, type=click.IntRange(1), help="Number of prompts.")
@click.option("--decode", default=64, show_default=True, type=click.IntRange(0), help="Greedy decode steps.")
@click.option("--seed", default=0, show_default=True, type=int, help="Seeds the boundary prompts and the bootstrap.")
@click.option("--workers", default=1, show_default=True, type=click.IntRange(1),
              help="Worker processes (engines loaded once per worker); with --ray and no address: the local "
                   "instance's CPUs (2 if not given).")
@click.option("--ray", "ray", is_flag=False, flag_value="local", default=None, metavar="[ADDRESS]",
              help="Run each prompt as a Ray task on the cluster at ADDRESS; --ray alone starts a local instance.")
@click.option("--budget", type=click.Path(exists=True, dir_okay=False),
              help="Budget file: lines 'metric <= value' / 'metric >= value', judged on the CI bound.")
@click.option("--top-k", default=20, show_default=True, type=click.IntRange(1), help="Entries for the KL bound.")
@click.option("--tie-margin", default=TIE_MARGIN, show_default=True, type=float,
              help="Exact-path logprob gap (nats) under which a different top-1 is a TIE-FLIP.")
@click.option("--drift-tol", default=DRIFT_TOL, show_default=True, type=float,
              help="Top-1 logprob change (nats) above which a same-token step is DRIFT.")
@click.option("--pins", default=4, show_default=True, type=click.IntRange(0),
              help="Prompts on which the exactness pin reruns the exact path (twice: again, and explicit-exact).")
@click.option("-o", "--output", type=click.Path(file_okay=False), help="Output directory.")
@click.option("--resume", type=click.Path(exists=True, file_okay=False),
              help="Continue the run in this directory (its settings; only --workers/--ray may change).")
@json_option(help="Print report.json instead of the Markdown summary (errors as JSON too).")
@html_option()
@click.pass_context
@json_errors
def validate(ctx, model, exact, approx, prompt_file, corpus, boundary, n, decode, seed, workers, ray, budget, top_k,
             tie_margin, drift_tol, pins, output, resume, as_json, html_path) -> None:
    """Validate an approximate path against the exact path over n prompts: token divergence (TIE-FLIP / DRIFT /
    WRONG), top-k KL, top-1 agreement, per-layer carrier rel-L2, each with a bootstrap 95% CI and the minimum
    detectable effect; an exactness pin, an announce pin and an optional budget. Results are written to
    DIR/results.jsonl as they arrive (Ctrl-C loses nothing; --resume DIR continues), then report.json,
    report.md and validate.png. Exit 0: pass, 1: a pin or a budget bound failed, 2: usage or preflight error.

    \b
    Example:
      v4parity validate --model tiny.gguf --exact torch --approx torch:act_quant=q8_0 \\
          --boundary --corpus --n 200 --decode 16 --workers 2 --budget budget.txt -o out/q8
      v4parity validate --resume out/q8 --ray
    """
    from parity import api
    from parity.validate.prompts import CORPUS
    from parity.validate.report import FIGURE, MARKDOWN, REPORT, render_json, render_markdown, to_html

    out = Path(_out_dir(ctx, model, approx, output, resume, corpus, prompt_file))
    workers, ray = pool_args(workers, ray)
    report = api.validate(out, model=model, exact=exact, approx=approx, n=n, decode=decode, seed=seed,
                          prompts=str(CORPUS) if corpus else prompt_file, boundary=boundary, top_k=top_k,
                          tie_margin=tie_margin, drift_tol=drift_tol, pins=pins, budget=budget, workers=workers,
                          ray=ray, resume=bool(resume), progress=TaskProgress())
    if html_path:
        to_html(html_path, report)
    if as_json:
        click.echo(render_json(report), nl=False)
    else:
        click.echo(render_markdown(report), nl=False)
        click.echo(f"wrote {out / REPORT}, {out / MARKDOWN}, {out / FIGURE}; {report.timing.wall_s_this_session:.1f} s "
                   f"(timing.json)")
    if not report.passed:
        raise SystemExit(1)


def _out_dir(ctx: click.Context, model: str | None, approx: str | None, output: str | None, resume: str | None,
             corpus: bool, prompt_file: str | None) -> str:
    """The run directory: --resume DIR (then only the RESUMABLE options may be given) or -o with --model and
    --approx (and not both --prompts and --corpus)."""
    if resume:
        extra = [p for p in ctx.params if p not in RESUMABLE
                 and ctx.get_parameter_source(p) is not click.core.ParameterSource.DEFAULT]
        if extra:
            raise click.UsageError(f"--resume takes its settings from the directory; drop {', '.join(extra)}")
        return resume
    missing = [o for o, v in (("--model", model), ("--approx", approx), ("-o", output)) if v is None]
    if missing:
        raise click.UsageError(f"missing {', '.join(missing)} (or --resume DIR)")
    if corpus and prompt_file:
        raise click.UsageError("give --prompts or --corpus, not both")
    return output


COMMANDS = [validate]
