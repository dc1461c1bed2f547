"""`v4parity demo`: the whole workflow on the built-in tiny model, including a caught porting bug."""

from __future__ import annotations

import time
from pathlib import Path

import click

DEMO_FAULT = "compress-ratios-u32"  # the paper's root cause 1: the ratio array read with the wrong width
DEMO_EXPECTED_LAYER = 2             # the first compressed layer of the tiny schedule (0, 0, 4, 128, 4, 128)


def run_demo(out: Path, echo=click.echo) -> bool:
    """Synthesize, trace reference and torch, diff (agree), trace torch with the fault, diff (drift at blk.2), plot.

    Returns True when both verdicts are the expected ones.
    """
    from parity import api
    from parity.compare.printers import print_report
    from parity.contract.engine import RunOptions
    from parity.gguf.synth import synthesize

    t0 = time.perf_counter()
    model = synthesize(out / "tiny-f32.gguf", "tiny", "f32", 0)
    echo(f"[1/5] synthesized {model} (tiny preset: 6 layers, compress ratios 0,0,4,128,4,128)")
    ref = api.trace("reference", model, api.GOLDEN_PROMPT, positions="all", decode=api.GOLDEN_DECODE)
    api.save_trace(ref, out / "reference.trace")
    echo(f"[2/5] traced the NumPy reference: {len(ref.header.tokens)} tokens -> {out / 'reference.trace'}")
    run = api.follow(ref)
    torch_ok = api.trace("torch", model, **run)
    api.save_trace(torch_ok, out / "torch.trace")
    echo(f"[3/5] traced the torch engine on the same tokens -> {out / 'torch.trace'}\n")
    clean = api.diff(ref, torch_ok)
    print_report(clean, echo=echo)
    faulty = api.trace("torch", model, options=RunOptions(inject=(DEMO_FAULT,)), **run)
    api.save_trace(faulty, out / "torch-fault.trace")
    echo(f"\n[4/5] traced the torch engine with --inject {DEMO_FAULT} -> {out / 'torch-fault.trace'}\n")
    bad = api.diff(ref, faulty)
    print_report(bad, echo=echo)
    plot = api.plot(bad, out / "drift.png")
    echo(f"\n[5/5] drift profile written to {plot}  ({time.perf_counter() - t0:.1f} s total)")
    ok = bool(clean) and bad.first_drift is not None and bad.first_drift["layer"] == DEMO_EXPECTED_LAYER
    echo("demo verdict: " + ("OK: the clean engines agree and the fault is located at its first compressed layer "
                             f"(blk.{DEMO_EXPECTED_LAYER})" if ok else "UNEXPECTED: see the reports above"))
    return ok


@click.command()
@click.option("--out", default="out/demo", show_default=True, type=click.Path(file_okay=False),
              help="Directory for the model, traces and plot.")
def demo(out) -> None:
    """End-to-end demo on the tiny synthetic model: reference vs torch (agree), then torch with the
    compress-ratios-u32 porting bug (first drift at the first compressed layer), plus the drift plot.

    Exits 0 when both verdicts are the expected ones, 1 otherwise.
    Example: v4parity demo --out out/demo    (what `make demo` runs)
    """
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    raise SystemExit(0 if run_demo(out_dir) else 1)


COMMANDS = [demo]
