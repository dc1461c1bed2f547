"""Both engines at full depth on the V4-Flash-shaped file (issue 27, points 2 and 5): `make bench-full`.

    python -m parity.bench.full_depth --model /tmp/flash/flash.gguf --out out/bench-full [--steps inspect,...]

Not part of `make test` (tens of minutes to hours on a 2-core machine). Each step is one `v4parity` command run as
a child process, exactly as a user types it, under OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1; for each the script
records wall time, CPU time (user + system, from wait4), peak total RSS (wait4's ru_maxrss: includes the pages of
the memory-mapped model file), peak anonymous RSS (sampled from /proc/PID/status every 0.2 s: the memory beyond the
mapped file), the 1-minute load average before and after, the exit status, and the size of the files it wrote.
A child whose anonymous RSS passes --anon-limit-gb is killed and recorded as such. Steps (`STEPS`, run in order,
any subset with --steps; results merge into OUT/full_depth.json by step name, the table OUT/full_depth.md is
rewritten from all of them):

  synth           v4parity synth --preset flash --experts N (only when --model does not exist yet)
  inspect         v4parity inspect MODEL
  trace-ref-24    reference: 24 prompt tokens + 4 decode steps, --positions all --full all
  trace-torch-24  torch: the same
  trace-torch-2000  torch: a 2 000-token prompt, every position, fingerprints only (no full vectors)
  diff-clean      v4parity diff of the reference and the clean torch trace (no verdict: drift per checkpoint)
  check-clean     v4parity check of the torch trace of trace-torch-24
  trace-torch-24-fault  torch with --inject comb-not-transposed@30, 24 + 4 forced onto the clean run's tokens
  diff-fault      v4parity diff of the reference and the faulty torch trace
  check-fault     v4parity check of that trace
  capture-llamacpp-24  v4parity capture llamacpp: llama.cpp's tensors of the same 24 + 4 tokens
  check-llamacpp  v4parity check of that capture (QAT simulations off, so an envelope of its own is measured once)
  check-fault-workers2  the same check with --workers 2 (its JSON compared with check-fault's)
  check-fault-ray       the same check with --ray --workers 2 (a local Ray instance of 2 CPUs; compared the same)

and, placed after trace-torch-24, the engines' speed as users run them (`parity.bench.engine_speed`):

  speed-torch-24     the torch engine: 24-token prefill + 4 decode steps, whole model, QAT simulations off
  speed-llamacpp-24  llama.cpp on the same file, the same prompt and steps, as its users run it (`PlainDecode`)
  speed-reference-24 the reference, the same (one repetition: minutes); torch's and its times per layer too

The prompts are `measure.prompt_tokens` (seeded ids in [2, vocab)). Memory is the whole process tree's: a check's
worker processes and a local Ray instance (raylet, workers) are the step's descendants, and their anonymous RSS is
summed into the step's (the peak total RSS is wait4's: the largest single process).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from parity.bench.full_depth_report import (
    CheckFound,
    DiffFound,
    FullDepthResult,
    Measured,
    ModelFile,
    SpeedFound,
    StepRow,
)
from parity.bench.measure import load_average, prompt_tokens, seconds_cell
from parity.check.check_report import timeless
from parity.compare.verdict import Judged, Verdict
from parity.contract.errors import ParityError

FAULT = "comb-not-transposed@30"
SPEED_RUNS = (("torch", "threads", 2), ("llamacpp", "lcp_threads", 2), ("reference", "threads", 1))
# the speed steps: engine, its thread-count argument, repetitions
CHUNK_2000 = 128   # prefill chunk of the 2000-token trace: 88 checkpoints x 128 rows x 4 x 4096 float32 = 0.7 GiB
SAMPLE_S = 0.2


@dataclass(frozen=True)
class Step:
    """One measured command: argv after `v4parity`, the files it writes (sizes recorded)."""

    name: str
    what: str
    argv: list[str]
    outputs: list[Path]


def descendants(pid: int) -> list[int]:
    """`pid` and every process below it (parent links of /proc/*/stat; one that exits meanwhile is skipped)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo += children.get(tree[-1], [])
    return tree


def read_status(pid: int) -> dict[str, int]:
    """RssAnon and VmRSS (bytes) of process `pid` from /proc/PID/status; {} once it has exited."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    return {k: int(fields[k].split()[0]) * 1024 for k in ("RssAnon", "VmRSS") if k in fields}


def run_measured(argv: list[str], log: Path, anon_limit: int, timeout_s: float | None) -> Measured:
    """Run argv (stdout to `log`.out, stderr to `log`); wall, CPU, peak RSS (total; anonymous, summed over the
    process and its descendants), load, exit. Killed (and recorded so) when that anonymous RSS passes `anon_limit`
    bytes or its wall time `timeout_s`."""
    env = os.environ | {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    load0, t0 = load_average(), time.perf_counter()
    peak_anon, killed = 0, None
    with log.with_suffix(".out").open("w") as out, log.open("w") as err:
        proc = subprocess.Popen(argv, stdout=out, stderr=err, env=env, start_new_session=True)
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            peak_anon = max(peak_anon, sum(read_status(p).get("RssAnon", 0) for p in descendants(proc.pid)))
            if killed is None and peak_anon > anon_limit:
                killed = f"killed: anonymous RSS {peak_anon / 2**30:.2f} GiB over the limit {anon_limit / 2**30:.2f}"
            elif killed is None and timeout_s is not None and time.perf_counter() - t0 > timeout_s:
                killed = f"killed: still running after the step time limit {timeout_s:.0f} s"
            if killed is not None:
                os.killpg(proc.pid, signal.SIGKILL)   # its workers too (its own session)
            time.sleep(SAMPLE_S)
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped by wait4: keep Popen from waiting again
    return Measured(argv=argv, exit=proc.returncode, killed=killed, wall_s=time.perf_counter() - t0,
                    cpu_s=usage.ru_utime + usage.ru_stime, user_s=usage.ru_utime, sys_s=usage.ru_stime,
                    peak_rss=usage.ru_maxrss * 1024, peak_anon=peak_anon, load_before=load0,
                    load_after=load_average(), log=str(log))


def prompt_arg(n: int) -> str:
    """The argv placeholder of the n-token prompt file (written when its step runs: it needs the vocabulary)."""
    return f"@prompt:{n}"


def steps(model: Path, out: Path, experts: int) -> list[Step]:
    """Every step in order."""
    from parity.contract.cpus import usable_cpus

    exe, threads = str(Path(sys.executable).with_name("v4parity")), usable_cpus()
    trace = [exe, "trace", "-m", str(model), "--positions", "all"]

    def npz(name: str) -> list[Path]:
        return [out / f"{name}.npz", out / f"{name}.vectors.npz"]

    return [
        Step("synth", f"synth --preset flash --experts {experts}",
             [exe, "synth", "--preset", "flash", "--experts", str(experts), "-o", str(model)], [model]),
        Step("inspect", "inspect", [exe, "inspect", "-m", str(model)], []),
        Step("trace-ref-24", "reference trace, 24 + 4 decode, --positions all --full all",
             [*trace, "--engine", "reference", "--tokens-file", prompt_arg(24), "--decode", "4", "--full", "all",
              "-o", str(out / "ref24.npz")], npz("ref24")),
        Step("trace-torch-24", "torch trace, 24 + 4 decode, --positions all --full all",
             [*trace, "--engine", "torch", "--tokens-file", prompt_arg(24), "--decode", "4", "--full", "all",
              "-o", str(out / "torch24.npz")], npz("torch24")),
        *(Step(f"speed-{engine}-24", f"{engine}: 24-token prefill + 4 decode steps, whole model, {threads} threads, "
               f"QAT simulations off (x {reps}, medians)",
               [sys.executable, "-m", "parity.bench.engine_speed", engine, str(model), prompt_arg(24), "--decode", "4",
                "--reps", str(reps), "--threads", str(threads), "--thread-arg", thread_arg], [])
          for engine, thread_arg, reps in SPEED_RUNS),
        Step("trace-torch-2000", f"torch trace, 2000-token prompt in chunks of {CHUNK_2000}, --positions all, "
             "fingerprints only",
             [*trace, "--engine", "torch", "--tokens-file", prompt_arg(2000), "--chunk", str(CHUNK_2000),
              "-o", str(out / "torch2000.npz")], [out / "torch2000.npz"]),
        Step("diff-clean", "diff reference vs clean torch (24 + 4)",
             [exe, "diff", str(out / "ref24.npz"), str(out / "torch24.npz"), "--json", "--no-fail"], []),
        Step("check-clean", "check of the clean torch trace",
             [exe, "check", "-m", str(model), "-c", str(out / "torch24.npz"), "--json"], []),
        Step("trace-torch-24-fault", f"torch trace with --inject {FAULT}, following the clean torch trace",
             [exe, "trace", "-m", str(model), "--engine", "torch", "--follow", str(out / "torch24.npz"),
              "--full", "all", "--inject", FAULT, "-o", str(out / "torch24-fault.npz")], npz("torch24-fault")),
        Step("diff-fault", f"diff reference vs torch with {FAULT}",
             [exe, "diff", str(out / "ref24.npz"), str(out / "torch24-fault.npz"), "--json", "--no-fail"], []),
        Step("check-fault", f"check of the torch trace with {FAULT}",
             [exe, "check", "-m", str(model), "-c", str(out / "torch24-fault.npz"), "--json"], []),
        Step("capture-llamacpp-24", "llama.cpp capture (every mapped tensor), 24 + 4 decode, 2 threads",
             [exe, "capture", "llamacpp", "-m", str(model), "--tokens-file", prompt_arg(24), "--decode", "4",
              "--engine-arg", f"lcp_threads={threads}", "-o", str(out / "lcp24.npz")], [out / "lcp24.npz"]),
        Step("check-llamacpp", "check of the llama.cpp capture (QAT simulations off: their own envelope)",
             [exe, "check", "-m", str(model), "-c", str(out / "lcp24.npz"), "--json"], []),
        Step("check-fault-workers2", f"check of the torch trace with {FAULT}, --workers 2",
             [exe, "check", "-m", str(model), "-c", str(out / "torch24-fault.npz"), "--json", "--workers", "2"], []),
        Step("check-fault-ray", f"check of the torch trace with {FAULT}, --ray (local, 2 CPUs)",
             [exe, "check", "-m", str(model), "-c", str(out / "torch24-fault.npz"), "--json", "--ray",
              "--workers", "2"], []),
    ]


STEPS = ("synth", "inspect", "trace-ref-24", "trace-torch-24", "speed-torch-24", "speed-llamacpp-24",
         "speed-reference-24", "trace-torch-2000", "diff-clean", "check-clean", "trace-torch-24-fault", "diff-fault",
         "check-fault", "capture-llamacpp-24", "check-llamacpp", "check-fault-workers2", "check-fault-ray")
SERIAL_OF = {"check-fault-workers2": "check-fault", "check-fault-ray": "check-fault"}   # parallel -> serial step


def _stdout_json(stdout: Path) -> dict[str, Any] | None:
    """The JSON document a step printed on stdout; None when there is none (no file, or not JSON: the step failed)."""
    try:
        doc = json.loads(stdout.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return doc if isinstance(doc, dict) else None


def verdict(stdout: Path) -> tuple[CheckFound | None, str | None]:
    """check --json's verdict, level, culprit, causes, own seconds and envelope source (None when it printed no
    verdict), and its error (None when it printed none), from the step's stdout."""
    doc = _stdout_json(stdout) or {}
    found = None
    if "verdict" in doc:
        missing = [k for k in ("judged", "culprit", "causes", "seconds") if k not in doc]
        if missing:
            raise ParityError(f"{stdout}: check --json printed a verdict without {', '.join(missing)}")
        envelope = doc.get("envelope")
        found = CheckFound(Verdict(doc["verdict"]), Judged(doc["judged"]), doc["culprit"], doc["causes"],
                           doc["seconds"], envelope.get("source") if isinstance(envelope, dict) else None)
    return found, doc.get("error")


def drift(stdout: Path) -> DiffFound | None:
    """diff --json's agreement, first drifting checkpoint, and each checkpoint's worst rel-L2 over positions (None
    when the step printed no JSON)."""
    doc = _stdout_json(stdout)
    if doc is None:
        return None
    worst = {row["checkpoint"]: row["rel_l2"] for row in doc.get("worst", [])}
    logits = [row["rel_l2"] for row in doc.get("logits", [])]
    return DiffFound(doc.get("agree"), doc.get("first_drift"), worst, max(logits) if logits else None)


def speed(stdout: Path) -> SpeedFound | None:
    """engine_speed's record (its one JSON line); None when the step printed none (it failed)."""
    doc = _stdout_json(stdout)
    return None if doc is None else SpeedFound.from_dict(doc)


def same_report(stdout: Path, serial: Path) -> bool | None:
    """Whether two check runs printed the same JSON report apart from their wall-clock seconds; None when either
    printed no JSON document."""
    a, b = _stdout_json(stdout), _stdout_json(serial)
    return None if a is None or b is None else timeless(a) == timeless(b)


def run(model: Path, out: Path, only: list[str], experts: int, anon_limit_gb: float,
        timeout_s: float | None = None) -> FullDepthResult:
    """Run the chosen steps, merge their rows into OUT/full_depth.json (re-read and checked before each write: two
    runs with different steps may share OUT), rewrite OUT/full_depth.md."""
    unknown = [s for s in only if s not in STEPS]
    if unknown:
        raise ParityError(f"unknown step(s) {', '.join(unknown)}; expected some of {', '.join(STEPS)}")
    out.mkdir(parents=True, exist_ok=True)
    model.parent.mkdir(parents=True, exist_ok=True)
    result_path = out / "full_depth.json"
    result = FullDepthResult(steps={})

    def vocab() -> int:
        from parity.gguf.weights import Weights
        return Weights(str(model)).config.vocab_size

    for step in steps(model, out, experts):
        if step.name not in only:
            continue
        if step.name == "synth" and model.exists():
            print(f"[full-depth] synth: {model} exists, reused (not measured)", file=sys.stderr)
            continue
        argv = [_prompt_file(out, int(a.split(":")[1]), vocab) if a.startswith("@prompt:") else a
                for a in step.argv]
        print(f"[full-depth] {step.name}: {' '.join(argv)} (load {load_average():.1f})", file=sys.stderr, flush=True)
        measured = run_measured(argv, out / f"{step.name}.log", int(anon_limit_gb * 2**30), timeout_s)
        stdout = Path(measured.log).with_suffix(".out")
        check, error = verdict(stdout) if step.name.startswith("check") else (None, None)
        serial = SERIAL_OF.get(step.name)
        row = StepRow(**vars(measured), what=step.what,
                      sizes={p.name: p.stat().st_size for p in step.outputs if p.exists()}, check=check, error=error,
                      diff=drift(stdout) if step.name.startswith("diff") else None,
                      speed=speed(stdout) if step.name.startswith("speed") else None, same_report_as=serial,
                      same_report=same_report(stdout, out / f"{serial}.out") if serial else None)
        print(f"[full-depth] {step.name}: exit {row.exit}, {row.wall_s:.1f} s wall, {row.cpu_s:.1f} s CPU, "
              f"peak RSS {row.peak_rss / 2**30:.2f} GiB (anon {row.peak_anon / 2**30:.2f}), load "
              f"{row.load_before:.1f} -> {row.load_after:.1f}", file=sys.stderr, flush=True)
        earlier = FullDepthResult.from_dict(json.loads(result_path.read_text())) if result_path.exists() else result
        result = FullDepthResult({**earlier.steps, step.name: row},
                                 ModelFile(str(model), model.stat().st_size if model.exists() else None))
        write_result(out, result)
    return result


def write_result(out: Path, result: FullDepthResult) -> None:
    """OUT/full_depth.json (the result's document, indent 1) and its table OUT/full_depth.md."""
    (out / "full_depth.json").write_text(json.dumps(result.to_dict(), indent=1))
    (out / "full_depth.md").write_text(render_markdown(result))


def _prompt_file(out: Path, n: int, vocab: Callable[[], int]) -> str:
    path = out / f"prompt{n}.txt"
    if not path.exists():
        path.write_text(",".join(map(str, prompt_tokens(n, vocab()))))
    return str(path)


def render_markdown(result: FullDepthResult) -> str:
    """The table of a full-depth result, one row per measured step (in `STEPS` order): wall, CPU, peak RSS total /
    anonymous, load before -> after, files, outcome (killed, check's verdict, the diff's drift, the error, or the
    exit status)."""
    gib = 2**30
    lines = ["| step | wall | CPU (user + sys) | peak RSS total / anon | load before -> after | files | outcome |",
             "|---|---|---|---|---|---|---|"]
    for name in STEPS:
        row = result.steps.get(name)
        if row is None:
            continue
        files = ", ".join(f"{k} {v / 2**20:,.1f} MiB" for k, v in row.sizes.items()) or "-"
        outcome = row.killed or _judged(row.check) or _drifted(row.diff) or row.error or f"exit {row.exit}"
        lines.append(f"| {name}: {row.what} | {row.wall_s:.1f} s | {row.cpu_s:.1f} s | "
                     f"{row.peak_rss / gib:.2f} / {row.peak_anon / gib:.2f} GiB | "
                     f"{row.load_before:.1f} -> {row.load_after:.1f} | {files} | {outcome} |")
    return "\n".join(lines + speed_lines(result) + parallel_lines(result)) + "\n"


def speed_lines(result: FullDepthResult) -> list[str]:
    """The speed steps' table, the torch / llama.cpp and reference / torch ratios per token, and the per-layer
    times of the engines run layer by layer (nothing when no speed step ran)."""
    found = [row.speed for name in ("speed-torch-24", "speed-llamacpp-24", "speed-reference-24")
             if (row := result.steps.get(name)) is not None and row.speed is not None]
    if not found:
        return []
    lines = ["", "| engine (threads) | model load | prefill (per token) | decode step | CPU prefill / decode step "
             "| load avg |", "|---|---|---|---|---|---|"]
    for s in found:
        lines.append(f"| {s.engine} ({s.threads}) | {s.load_s:.1f} s | {s.prefill_s:.2f} s "
                     f"({s.prefill_s / s.prompt:.3f} s) | {seconds_cell(s.decode_s)} | "
                     f"{seconds_cell(s.prefill_cpu_s)} / {seconds_cell(s.decode_cpu_s)} | "
                     f"{'-' if s.load is None else f'{s.load:.1f}'} |")
    by = {s.engine: s for s in found}
    for slow, fast in (("torch", "llamacpp"), ("reference", "torch")):
        a, b = by.get(slow), by.get(fast)
        if a and b and a.decode_s and b.decode_s:
            per_token = a.prefill_s / a.prompt / (b.prefill_s / b.prompt)
            lines += ["", f"{slow} / {fast} per token: prefill {per_token:.2f}x, decode {a.decode_s / b.decode_s:.2f}x "
                          f"(above 1: {slow} slower)"]
    layered = [s for s in found if s.prefill_layer_s and s.decode_layer_s]
    if layered:
        lines += ["", "| engine | per layer: prefill median (min-max) | decode step median (min-max) |",
                  "|---|---|---|"]
        lines += [f"| {s.engine} | {_spread(s.prefill_layer_s)} | {_spread(s.decode_layer_s)} |" for s in layered]
    return lines


def _spread(seconds: list[float]) -> str:
    return f"{float(np.median(seconds)):.3f} s ({min(seconds):.3f}-{max(seconds):.3f} s)"


def amdahl(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Amdahl's law T(N) = a + b / N fitted to (workers, wall seconds) by least squares: (a, b), the serial and the
    parallelisable seconds (exact through two points)."""
    x = np.array([1 / n for n, _ in points])
    y = np.array([t for _, t in points])
    b, a = np.polyfit(x, y, 1)
    return float(a), float(b)


def parallel_lines(result: FullDepthResult) -> list[str]:
    """The parallel checks against the serial one (speed-up, same report) and Amdahl's law fitted to the process
    points (serial, --workers 2) for 16 and 64 workers (nothing when no parallel check ran)."""
    steps = result.steps
    rows = [(name, steps[name]) for name in SERIAL_OF if name in steps]
    if not rows:
        return []
    lines = [""]
    for name, row in rows:
        serial = steps.get(SERIAL_OF[name])
        gain = f", speed-up {serial.wall_s / row.wall_s:.2f}x over {serial.wall_s:.1f} s serial" if serial else ""
        same = {True: "the same as", False: "NOT the same as", None: "not comparable with"}[row.same_report]
        cpu = "; its CPU column counts the driver only (Ray's workers are not its children)" if "ray" in name else ""
        lines.append(f"* {name}: {row.wall_s:.1f} s{gain} (load {row.load_before:.1f} -> {row.load_after:.1f}); "
                     f"its report is {same} {row.same_report_as}'s (wall-clock seconds aside){cpu}")
    serial, two = steps.get("check-fault"), steps.get("check-fault-workers2")
    if serial and two:
        a, b = amdahl([(1, serial.wall_s), (2, two.wall_s)])
        lines.append(f"* Amdahl's law through serial and --workers 2: T(N) = {a:.0f} s + {b:.0f} s / N (parallel "
                     f"share {b / (a + b):.2f}): 16 workers {a + b / 16:.0f} s, 64 workers {a + b / 64:.0f} s")
    return lines


def _judged(check: CheckFound | None) -> str | None:
    """A check step's outcome: verdict (level), culprit, causes; None without a verdict."""
    if check is None:
        return None
    return f"{check.verdict} ({check.judged}), culprit {check.culprit}, causes {check.causes}"


def _drifted(diff: DiffFound | None) -> str | None:
    """A diff step's outcome: agreement, first drift, final_norm's and the logits' worst rel-L2; None when the diff
    printed no logits."""
    if diff is None or diff.logits_rel_l2_max is None:
        return None
    return (f"agree {diff.agree}, first drift {diff.first_drift}, worst rel-L2 final_norm "
            f"{diff.rel_l2.get('final_norm', float('nan')):.2e}, logits {diff.logits_rel_l2_max:.2e}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True, help="the flash-shaped GGUF (synthesized if missing)")
    ap.add_argument("--out", type=Path, required=True, help="directory for traces, logs and full_depth.json/.md")
    ap.add_argument("--steps", default=",".join(STEPS), help=f"comma list, in order, of: {', '.join(STEPS)}")
    ap.add_argument("--experts", type=int, default=16, help="routed experts of a synthesized file (default 16)")
    ap.add_argument("--anon-limit-gb", type=float, default=14.0,
                    help="kill a step whose anonymous RSS passes this (GiB; default 14)")
    ap.add_argument("--step-timeout-s", type=float, default=None, help="kill a step running longer (default: none)")
    args = ap.parse_args(argv)
    result = run(args.model, args.out, [s for s in args.steps.split(",") if s], args.experts, args.anon_limit_gb,
                 args.step_timeout_s)
    failed = [n for n, r in result.steps.items() if r.killed or (r.exit != 0 and not n.startswith("check"))]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
