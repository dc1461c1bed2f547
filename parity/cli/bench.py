"""`v4parity bench`: both engines at real DeepSeek-V4-Flash layer dimensions, measured side by side."""

from __future__ import annotations

import click

from parity.bench.run import ENGINES
from parity.cli.common import device_option, echo_json, json_errors, json_option


@click.command()
@device_option(help="Device of the torch engine and the torch dequantizers (auto: CUDA when present; the "
                    "reference always runs on CPU).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="out/bench", show_default=True,
              help="Directory for bench.json and bench.md (the tables).")
@click.option("--cache-dir", type=click.Path(file_okay=False), default=".bench", show_default=True,
              help="Where the generated benchmark GGUFs are cached (about 6 GiB for the real-dimension files).")
@click.option("--engines", default=",".join(ENGINES), show_default=True,
              help="Comma-separated engines to run, e.g. 'torch' on a GPU machine.")
@click.option("--peers", default="llamacpp,hf", show_default=True,
              help="Peer engines timed beside ours on the tiny F32 model (comma list of registered engines; '' for "
                   "none).")
@click.option("--torch-threads", type=int, default=0, show_default=True,
              help="Torch CPU (intra-op) threads of the torch worker (0: one per usable CPU, set explicitly whatever "
                   "OMP_NUM_THREADS says). On a busy 2-core box 1 thread lost half the torch engine's CPU share "
                   "(docs/bench.md); the reference always runs one BLAS thread and parallelises over experts.")
@click.option("--quick", is_flag=True,
              help="Tiny synthetic model and short prompts: checks the whole pipeline in seconds (numbers are "
                   "not meaningful).")
@click.option("--verdicts/--no-verdicts", default=True, show_default=True,
              help="Also measure `check`'s verdicts on the tiny models (false DEFECTs on correct runs, detection of "
                   "the torch faults; OUT/verdicts.json and verdicts.md; about 80 min on 2 cores, --quick: minutes).")
@click.option("--verdicts-only", is_flag=True, help="Only the verdict benchmark (skip the performance tables).")
@json_option(help="Print the report as JSON on stdout instead of the tables (errors too).")
@json_errors
def bench(device: str, out_dir: str, cache_dir: str, engines: str, peers: str, torch_threads: int, quick: bool,
          verdicts: bool, verdicts_only: bool, as_json: bool) -> None:
    """Measure both engines on real-dimension synthetic layers: prefill of 24/128 tokens, decode steps,
    scaling to 512 tokens, tracing overhead, peak memory, and the dequantizers of every ggml type against
    gguf.quants. Prints the tables and writes OUT/bench.json and OUT/bench.md.

    The first run writes the 1-layer (CSA) and 2-layer (CSA + HCA) GGUFs into --cache-dir (a few minutes);
    later runs reuse them. Every engine number is a median of several runs in one worker process.

    \b
    Example: v4parity bench --quick            (the pipeline in seconds)
             v4parity bench --device cuda --engines torch
    """
    from rich.console import Console
    from rich.markdown import Markdown

    from parity.bench.run import run_bench_command
    from parity.contract.progress import Notes

    console = Console(stderr=True)
    run = run_bench_command(cache_dir, out_dir, device=device, quick=quick, engines=engines, peers=peers,
                            torch_threads=torch_threads, verdicts=verdicts, verdicts_only=verdicts_only,
                            progress=Notes(lambda m: console.print(f"[dim]{m}[/dim]")),
                            verdict_progress=Notes(lambda m: console.print(m, markup=False, highlight=False)))
    if as_json:
        verdicts = None if run.verdicts is None else run.verdicts.to_dict()
        echo_json(verdicts if run.report is None else
                  {**run.report.to_dict(), "verdicts": verdicts} if verdicts else run.report.to_dict())
        return
    if run.verdicts_markdown is not None:
        Console().print(Markdown(run.verdicts_markdown))
        click.echo(f"wrote {run.files[-2]} and {run.files[-1]}")
    if run.table is not None:
        Console().print(Markdown(run.table))
        click.echo(f"wrote {run.files[0]} and {run.files[1]}")


COMMANDS = [bench]
