"""`v4parity bench`: both engines at real DeepSeek-V4-Flash layer dimensions, measured side by side."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from parity.cli.common import device_option, echo_json, json_errors, json_option
from parity.compare.jsonvalues import json_safe
from parity.contract.files import atomic_write_text

ENGINES = ("reference", "torch")


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

    from parity.bench.measure import render_markdown, run_bench
    from parity.contract.errors import ParityError

    chosen = tuple(e.strip() for e in engines.split(",") if e.strip())
    unknown = [e for e in chosen if e not in ENGINES]
    if unknown or not chosen:
        raise ParityError(f"--engines: unknown engine(s) {unknown or [engines]}; choose from {', '.join(ENGINES)}")
    console = Console(stderr=True)
    if device != "cpu":
        import torch

        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        elif not torch.cuda.is_available():
            raise ParityError("--device cuda: torch sees no CUDA device on this machine (use --device cpu)")
    if torch_threads < 0:
        raise ParityError(f"--torch-threads must be >= 0, got {torch_threads}")
    from parity.contract.engine import available_engines

    peer_names = tuple(p.strip() for p in peers.split(",") if p.strip())
    missing = [p for p in peer_names if p not in available_engines()]
    if missing:
        raise ParityError(f"--peers: engine(s) {missing} not registered; registered: {', '.join(available_engines())}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if verdicts_only:
        verdict_report = _verdicts(Path(cache_dir), quick, out, console, not as_json)
        if as_json:
            echo_json(verdict_report)
        return
    report = run_bench(Path(cache_dir), device, quick, chosen, torch_threads or None,
                       log=lambda m: console.print(f"[dim]{m}[/dim]"), peers=peer_names)
    atomic_write_text(out / "bench.json", json.dumps(json_safe(report), indent=2, allow_nan=False))
    table = render_markdown(report)
    atomic_write_text(out / "bench.md", table)
    verdict_report = _verdicts(Path(cache_dir), quick, out, console, not as_json) if verdicts else None
    if as_json:
        echo_json({**report, "verdicts": verdict_report} if verdict_report else report)
        return
    Console().print(Markdown(table))
    click.echo(f"wrote {out / 'bench.json'} and {out / 'bench.md'}")


def _verdicts(cache_dir: Path, quick: bool, out: Path, console: Any, show: bool) -> dict[str, Any]:
    """The verdict benchmark (parity.bench.verdicts): runs it (progress on `console`, stderr), writes
    OUT/verdicts.json and verdicts.md, prints the tables on stdout when `show`; returns its report."""
    import tempfile

    from rich.markdown import Markdown

    from parity.bench.verdicts import PLANS, render_verdicts_markdown, run_verdicts, verdict_models, write_verdicts

    plan = PLANS["quick" if quick else "default"]
    log = lambda m: console.print(m, markup=False, highlight=False)  # noqa: E731
    models = verdict_models(cache_dir / "verdicts", plan, log)
    with tempfile.TemporaryDirectory(prefix="v4parity-verdicts-") as scratch:
        result = run_verdicts(models, plan, Path(scratch), log)
    result["plan_name"] = "quick" if quick else "default"
    js, md = write_verdicts(result, out)
    if show:
        from rich.console import Console

        Console().print(Markdown(render_verdicts_markdown(result)))
        click.echo(f"wrote {js} and {md}")
    return result


COMMANDS = [bench]
