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

The prompts are `measure.prompt_tokens` (seeded ids in [2, vocab)).
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

from parity.bench.full_depth_report import CheckFound, DiffFound, FullDepthResult, Measured, ModelFile, StepRow
from parity.bench.measure import load_average, prompt_tokens
from parity.compare.verdict import Judged, Verdict
from parity.contract.errors import ParityError

FAULT = "comb-not-transposed@30"
SAMPLE_S = 0.2


@dataclass(frozen=True)
class Step:
    """One measured command: argv after `v4parity`, the files it writes (sizes recorded)."""

    name: str
    what: str
    argv: list[str]
    outputs: list[Path]


def read_status(pid: int) -> dict[str, int]:
    """RssAnon and VmRSS (bytes) of process `pid` from /proc/PID/status; {} once it has exited."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    return {k: int(fields[k].split()[0]) * 1024 for k in ("RssAnon", "VmRSS") if k in fields}


def run_measured(argv: list[str], log: Path, anon_limit: int, timeout_s: float | None) -> Measured:
    """Run argv (stdout to `log`.out, stderr to `log`); wall, CPU, peak RSS (total, anonymous), load, exit. Killed
    (and recorded so) when its anonymous RSS passes `anon_limit` bytes or its wall time `timeout_s`."""
    env = os.environ | {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    load0, t0 = load_average(), time.perf_counter()
    peak_anon, killed = 0, None
    with log.with_suffix(".out").open("w") as out, log.open("w") as err:
        proc = subprocess.Popen(argv, stdout=out, stderr=err, env=env)
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            peak_anon = max(peak_anon, read_status(proc.pid).get("RssAnon", 0))
            if killed is None and peak_anon > anon_limit:
                killed = f"killed: anonymous RSS {peak_anon / 2**30:.2f} GiB over the limit {anon_limit / 2**30:.2f}"
            elif killed is None and timeout_s is not None and time.perf_counter() - t0 > timeout_s:
                killed = f"killed: still running after the step time limit {timeout_s:.0f} s"
            if killed is not None:
                os.kill(proc.pid, signal.SIGKILL)
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
    exe = str(Path(sys.executable).with_name("v4parity"))
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
        Step("trace-torch-2000", "torch trace, 2000-token prompt, --positions all, fingerprints only",
             [*trace, "--engine", "torch", "--tokens-file", prompt_arg(2000), "-o", str(out / "torch2000.npz")],
             [out / "torch2000.npz"]),
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
    ]


STEPS = ("synth", "inspect", "trace-ref-24", "trace-torch-24", "trace-torch-2000", "diff-clean", "check-clean",
         "trace-torch-24-fault", "diff-fault", "check-fault")


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
        row = StepRow(**vars(measured), what=step.what,
                      sizes={p.name: p.stat().st_size for p in step.outputs if p.exists()}, check=check, error=error,
                      diff=drift(stdout) if step.name.startswith("diff") else None)
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
    return "\n".join(lines) + "\n"


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
