"""`v4parity bench` as one call: check the choices, run the performance tables and/or the verdict benchmark,
write OUT/bench.json, bench.md, verdicts.json, verdicts.md; the CLI only prints what `run_bench_command` returns
(frozen section reports, `parity.bench.perf_report` and `parity.bench.verdicts_report`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from parity.bench.perf_report import PerfReport
from parity.bench.verdicts_report import VerdictsReport
from parity.contract.errors import ParityError
from parity.contract.progress import SILENT, ProgressSink

ENGINES = ("reference", "torch")


@dataclass(frozen=True)
class BenchRun:
    """What one `bench` run measured and wrote: the performance `report` and its Markdown `table` (None with
    verdicts only), the verdict benchmark's report and Markdown (None without it), and the files written."""

    report: PerfReport | None
    table: str | None
    verdicts: VerdictsReport | None
    verdicts_markdown: str | None
    files: tuple[Path, ...]


def bench_device(device: str) -> str:
    """--device auto | cuda | cpu -> the device the torch engine and dequantizers run on (cuda refused without
    a CUDA device torch can see)."""
    if device == "cpu":
        return device
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if not torch.cuda.is_available():
        raise ParityError("--device cuda: torch sees no CUDA device on this machine (use --device cpu)")
    return device


def bench_choices(engines: str, peers: str, torch_threads: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """--engines and --peers (comma lists) -> (engines, peers), each name checked; --torch-threads >= 0."""
    from parity.contract.engine import available_engines

    chosen = tuple(e.strip() for e in engines.split(",") if e.strip())
    unknown = [e for e in chosen if e not in ENGINES]
    if unknown or not chosen:
        raise ParityError(f"--engines: unknown engine(s) {unknown or [engines]}; choose from {', '.join(ENGINES)}")
    if torch_threads < 0:
        raise ParityError(f"--torch-threads must be >= 0, got {torch_threads}")
    peer_names = tuple(p.strip() for p in peers.split(",") if p.strip())
    missing = [p for p in peer_names if p not in available_engines()]
    if missing:
        raise ParityError(f"--peers: engine(s) {missing} not registered; registered: {', '.join(available_engines())}")
    return chosen, peer_names


def run_bench_command(cache_dir: str | Path, out_dir: str | Path, *, device: str, quick: bool, engines: str,
                      peers: str, torch_threads: int, verdicts: bool, verdicts_only: bool,
                      progress: ProgressSink = SILENT, verdict_progress: ProgressSink = SILENT) -> BenchRun:
    """Everything `v4parity bench` does but print: the performance tables unless `verdicts_only` (stages through
    `progress`), the verdict benchmark when `verdicts` or `verdicts_only` (stages through `verdict_progress`; the
    command prints the two differently)."""
    from parity.bench.measure import render_markdown, run_bench
    from parity.contract.files import atomic_write_text

    chosen, peer_names = bench_choices(engines, peers, torch_threads)
    device = bench_device(device)
    out, cache = Path(out_dir), Path(cache_dir)
    out.mkdir(parents=True, exist_ok=True)
    report = table = None
    files: list[Path] = []
    if not verdicts_only:
        report = run_bench(cache, device, quick, chosen, torch_threads or None, progress, peers=peer_names)
        atomic_write_text(out / "bench.json", json.dumps(report.to_dict(), indent=2, allow_nan=False))
        table = render_markdown(report)
        atomic_write_text(out / "bench.md", table)
        files += [out / "bench.json", out / "bench.md"]
    verdict_report = markdown = None
    if verdicts or verdicts_only:
        verdict_report, markdown, written = _verdicts(cache, quick, out, verdict_progress)
        files += written
    return BenchRun(report, table, verdict_report, markdown, tuple(files))


def _verdicts(cache_dir: Path, quick: bool, out: Path,
              progress: ProgressSink) -> tuple[VerdictsReport, str, list[Path]]:
    """The verdict benchmark (parity.bench.verdicts): runs it, writes OUT/verdicts.json and verdicts.md; returns
    (its report, its Markdown tables, the two paths)."""
    import tempfile

    from parity.bench.verdicts import PLANS, render_verdicts_markdown, run_verdicts, verdict_models, write_verdicts

    plan = PLANS["quick" if quick else "default"]
    models = verdict_models(cache_dir / "verdicts", plan, progress.note)
    with tempfile.TemporaryDirectory(prefix="v4parity-verdicts-") as scratch:
        result = run_verdicts(models, plan, Path(scratch), progress, plan_name="quick" if quick else "default")
    js, md = write_verdicts(result, out)
    return result, render_verdicts_markdown(result), [Path(js), Path(md)]
