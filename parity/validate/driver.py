"""One validation run end to end: preflight, prompts, tasks through an executor into results.jsonl, then the
report (report.json, report.md, validate.png) and the timing (timing.json, the only file that depends on the
machine and the executor)."""

from __future__ import annotations

import os
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from parity.contract.engine import engine_class
from parity.contract.errors import ParityError
from parity.contract.progress import SILENT, ProgressSink
from parity.gguf.weights import Weights
from parity.validate import executors, stats
from parity.validate.budget import check_names, parse_budget
from parity.validate.prompts import Prompt, build_prompts
from parity.validate.report import REPORT as REPORT  # re-exported: the file name callers read the report from
from parity.validate.report import write_files
from parity.validate.result import Timing, ValidateReport
from parity.validate.spec import approx_keys, explicit_exact, parse_spec
from parity.validate.store import ResultWriter, StoreError, read_config, read_results, start
from parity.validate.summary import metric_names, summarize
from parity.validate.worker import MAIN, PIN, Job, Task

FORMAT, VERSION = "v4parity-validate", 1
TIMES = ("seconds", "cpu_seconds")  # per-record timings: timing.json only, never report.json
STAGE = "validate"   # the progress stage: tasks (main and pin) done of all the run's tasks


@dataclass(frozen=True)
class Executor:
    workers: int = 1
    ray: str | None = None        # None: no Ray; "local": start a local instance; else a cluster address

    def describe(self) -> str:
        if self.ray is None:
            return "in-process" if self.workers == 1 else f"{self.workers} worker processes"
        return f"Ray ({'local, ' + str(self.workers) + ' CPUs' if self.ray == 'local' else self.ray})"


def new_config(model: str, exact: str, approx: str, n: int, decode: int, seed: int, prompt_file: str | None,
               boundary: bool, top_k: int, tie_margin: float, drift_tol: float, pins: int,
               budget_file: str | None) -> dict:
    """The stored configuration of a run (what --resume reads back)."""
    return {"model": str(Path(model).resolve()), "exact": parse_spec(exact).text(), "approx": parse_spec(approx).text(),
            "n": n, "decode": decode, "seed": seed,
            "prompt_file": None if prompt_file is None else str(Path(prompt_file).resolve()), "boundary": boundary,
            "top_k": top_k, "tie_margin": tie_margin, "drift_tol": drift_tol, "pins": pins,
            "budget": None if budget_file is None else Path(budget_file).read_text(),
            "budget_source": None if budget_file is None else str(budget_file)}


def _preflight(cfg: dict) -> tuple[Job, list[Prompt], dict]:
    """Everything checked before a task runs: specs, engines registered, ranges, the model, budget names, prompts."""
    exact, approx = parse_spec(cfg["exact"]), parse_spec(cfg["approx"])
    for spec in (exact, approx):
        engine_class(spec.engine)
    if cfg["decode"] < 0 or cfg["top_k"] < 1 or cfg["pins"] < 0 or cfg["tie_margin"] < 0 or cfg["drift_tol"] < 0:
        raise ParityError("--decode and --pins must be >= 0, --top-k >= 1, --tie-margin and --drift-tol >= 0")
    weights = Weights(cfg["model"])
    identity, mcfg = weights.identity(), weights.config
    if cfg["budget"] is not None:
        check_names(parse_budget(cfg["budget"], cfg["budget_source"]), metric_names(mcfg.n_layers),
                    cfg["budget_source"])
    prompts = build_prompts(mcfg, cfg["model"], cfg["n"], cfg["decode"], cfg["seed"], cfg["prompt_file"],
                            cfg["boundary"])
    explicit = explicit_exact(exact, approx) if approx_keys(exact, approx) and approx.engine == exact.engine else None
    job = Job(cfg["model"], exact, approx, explicit, cfg["decode"], cfg["top_k"], cfg["tie_margin"],
              cfg["drift_tol"])
    return job, prompts, identity


def _sources(prompts: list[Prompt]) -> str:
    kinds = Counter(p.source.split(":")[0] for p in prompts)
    return ", ".join(f"{k} {v}" for k, v in kinds.items())


def run_validation(out: str | os.PathLike, config: dict | None, executor: Executor,
                   progress: ProgressSink = SILENT) -> ValidateReport:
    """Run (config given) or resume (config None: read from `out`) a validation; writes report.json, report.md,
    validate.png and timing.json into `out` (`parity.validate.report.write_files`) and returns the report.
    `progress.count(STAGE, done, total)` counts the tasks: once before the first task of this session (the tasks a
    resumed run already has), then after each."""
    out = Path(out)
    cfg = read_config(out) if config is None else config
    job, prompts, identity = _preflight(cfg)
    if config is None:
        done = read_results(out)
    else:
        start(out, cfg)
        done = []
    by_index = {p.index: p for p in prompts}
    have = set()
    for r in done:
        p = by_index.get(r["index"])
        if p is None or r["prompt_sha"] != p.sha:
            raise StoreError(f"{out}: stored record for prompt {r['index']} does not match the prompts of this "
                             "configuration")
        have.add((r["kind"], r["index"]))
    tasks = [Task(MAIN, p) for p in prompts] + [Task(PIN, p) for p in prompts[: cfg["pins"]]]
    todo = [t for t in tasks if (t.kind, t.prompt.index) not in have]
    records = list(done)
    progress.count(STAGE, len(tasks) - len(todo), len(tasks))
    t0 = time.perf_counter()
    if not todo:
        stream = iter(())
    elif executor.ray is not None:
        stream = executors.ray_tasks(job, todo, None if executor.ray == "local" else executor.ray, executor.workers)
    elif executor.workers > 1:
        stream = executors.processes(job, todo, executor.workers)
    else:
        stream = executors.serial(job, todo)
    writer = ResultWriter(out)
    try:
        for i, rec in enumerate(stream, 1):
            writer.add(rec)
            records.append(rec)
            progress.count(STAGE, len(tasks) - len(todo) + i, len(tasks))
    finally:
        writer.close()
    wall = time.perf_counter() - t0
    timing = _timing(executor, wall, records, len(todo), len(tasks))
    report = build_report(cfg, job, prompts, identity, records, timing)
    write_files(report, out)
    return report


def _timing(executor: Executor, wall: float, records: list[dict], todo: int, tasks: int) -> Timing:
    """This session's wall time and task count, and the engine seconds of every stored record."""
    main = [r for r in records if r["kind"] == MAIN]
    return Timing(executor.describe(), wall, todo, tasks, sum(r["seconds"] for r in records),
                  sum(r["cpu_seconds"] for r in records), sum(r["seconds"] for r in main) / len(main),
                  sum(r["cpu_seconds"] for r in main) / len(main))


def build_report(cfg: dict, job: Job, prompts: list[Prompt], identity: dict, records: list[dict],
                 timing: Timing) -> ValidateReport:
    """The report of a run from its configuration and every stored record (main and pin tasks)."""
    main = [r for r in records if r["kind"] == MAIN]
    pins = [r for r in records if r["kind"] == PIN]
    bounds = parse_budget(cfg["budget"], cfg["budget_source"]) if cfg["budget"] is not None else None
    summary = summarize(main, pins, cfg["seed"], job.explicit.text() if job.explicit else None, bounds)
    return ValidateReport(
        format=FORMAT, version=VERSION, model=identity, exact=job.exact.text(), approx=job.approx.text(),
        n=len(prompts), prompt_sources=_sources(prompts), decode=cfg["decode"], steps=cfg["decode"] + 1,
        seed=cfg["seed"], top_k=cfg["top_k"], tie_margin=cfg["tie_margin"], drift_tol=cfg["drift_tol"],
        bootstrap=stats.BOOTSTRAP, alpha=stats.ALPHA, beta=stats.BETA, aggregates=summary["aggregates"],
        divergence=summary["divergence"], pins=summary["pins"], budget=summary["budget"], passed=summary["passed"],
        findings=summary["findings"],
        records=[{k: v for k, v in r.items() if k not in TIMES} for r in sorted(main, key=lambda r: r["index"])],
        timing=timing)
