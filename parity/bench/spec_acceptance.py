"""The fitted-drafter acceptance benchmark of `v4parity spec` (issue 25's acceptance run; `make bench-spec`).

On the tiny F32 trunk (`synthesize(..., "tiny", "f32", seed)`): `prompts` seeded prompts of `prompt_len` tokens
(parity.spec.fit.seeded_prompts, stream PROMPT_STREAM); one MTP drafter (fitted with the chained drafts to depth
max(MTP depths)) and one DSpark drafter (B = 5), both fitted by `parity.spec.fit.fit_drafter` on THOSE prompts'
greedy continuations of `steps` tokens (QAT sims off): the tiny random trunk's greedy map is near-chaotic, a drafter
fitted on other prompts reaches only 3-9 % on these (docs/drafters.md), so the benchmark measures a drafter trained
against the deployed target on the trajectories it decodes. Then every (QAT setting, engine, head, prompt) is one
`spec_report` of `steps` steps, the envelope measured once per (engine, QAT setting) as `spec` does when none is
stored. Per cell of the grid the table aggregates: exact runs (spec == plain == reference), runs with every state
equal, label counts, the committed tokens' MATCH / TIE / WRONG on their own prefix, the first divergences' classes,
the per-slot acceptance (candidate online / reference drafter offline: the mean over prompts of each run's share),
drafts accepted per round, and the time. `run_spec_bench` returns the typed result (`SpecBenchResult` of
`parity.bench.spec_bench_report`), `write_spec_bench` writes spec_acceptance.json and spec_acceptance.md.

    python -m parity.bench.spec_acceptance --out out/bench     (the full grid; measured 22 + 21 min for sims off + on
                                                                at load average 14-28 on 2 cores, docs/spec.md)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from parity.bench.spec_bench_report import (
    Cell,
    EnvelopeTime,
    FitSummary,
    RunDivergence,
    RunRow,
    SpecBenchPlan,
    SpecBenchResult,
)
from parity.contract.errors import ParityError
from parity.contract.files import atomic_write_text
from parity.contract.progress import SILENT, Note, Notes, ProgressSink

PROMPT_STREAM = 3                         # seeded_prompts stream of the benchmark prompts (the fit uses 1 and 2)
CORRECT = ("ACCEPT-OK", "DRAFTER-MISS", "NOT-VERIFIED")   # the only labels a correct engine may get (sims off)
HEADS = ("mtp1", "mtp2", "mtp3", "dspark")


def parse_head(head: str) -> tuple[str, int]:
    """'mtp2' -> ("mtp", 2), 'dspark' -> ("dspark", 1) (a DSpark round drafts its block of B)."""
    if head == "dspark":
        return "dspark", 1
    if head.startswith("mtp") and head[3:].isdigit() and int(head[3:]) >= 1:
        return "mtp", int(head[3:])
    raise ParityError(f"head {head!r}: expected mtpK (K >= 1) or dspark")


def fit_drafters(trunk: Path, out_dir: Path, plan: SpecBenchPlan, prompts: Sequence[Sequence[int]],
                 say: Note) -> dict[str, FitSummary]:
    """One fitted drafter per kind the heads need (MTP to the largest depth), on `prompts`' greedy continuations
    of `plan.steps` tokens; kind -> its `FitSummary` (kept beside the file as fitted-KIND.json; `plan.reuse_fits`:
    a kept fit of the same prompts, steps and seed is reused)."""
    from parity.spec.fit import fit_drafter

    kinds = sorted({parse_head(h)[0] for h in plan.heads})
    fits: dict[str, FitSummary] = {}
    for kind in kinds:
        saved = out_dir / f"fitted-{kind}.json"
        key = {"steps": plan.fit_steps[kind], "seed": plan.seed, "decode": plan.steps,
               "prompts": [list(map(int, p)) for p in prompts], "heads": sorted(plan.heads)}
        if plan.reuse_fits and saved.exists() and json.loads(saved.read_text())["key"] == key:
            fits[kind] = FitSummary.from_dict(json.loads(saved.read_text())["fit"])
            say(f"reusing the fitted {kind} drafter {fits[kind].path}")
            continue
        depth = max(parse_head(h)[1] for h in plan.heads if h.startswith(kind)) if kind == "mtp" else 1
        say(f"fitting the {kind} drafter (depth {depth}, {plan.fit_steps[kind]} steps, {len(prompts)} prompts x "
            f"{plan.steps} tokens)")
        f = fit_drafter(trunk, out_dir / f"fitted-{kind}.gguf", kind, seed=plan.seed, steps=plan.fit_steps[kind],
                        decode=plan.steps, depth=depth, train_prompts=[list(p) for p in prompts])
        fits[kind] = FitSummary(str(f.path), f.steps, {k: list(v) for k, v in f.agreement.items()}, list(f.counted),
                                dict(f.seconds))
        atomic_write_text(saved, json.dumps({"key": key, "fit": fits[kind].to_dict()}))
    return fits


def run_row(report: Any, engine: str, head: str, sims: bool, prompt_index: int, seconds: float) -> RunRow:
    """One spec run as a flat record (everything read off the SpecReport)."""
    d = report.divergence
    return RunRow(engine, head, sims, prompt_index, report.exact,
                  None if d is None else RunDivergence(d.cls, d.step, d.spec_induced), report.state_checked,
                  report.state_divergence is None, report.state_divergence, report.labels, report.committed_counts,
                  list(report.per_slot), list(report.reference_per_slot), report.mean_accepted, report.cost,
                  report.defects, seconds)


def _mean_slots(slots: Sequence[Sequence[float | None]]) -> list[float | None]:
    """Per slot, the mean over the runs that have a value there (None where none has)."""
    n = max((len(s) for s in slots), default=0)
    out = []
    for i in range(n):
        vals = [s[i] for s in slots if i < len(s) and s[i] is not None]
        out.append(statistics.fmean(vals) if vals else None)
    return out


def aggregate(sims: bool, engine: str, head: str, rows: Sequence[RunRow]) -> Cell:
    """One grid cell (same engine, head, QAT setting) over its prompts."""
    labels: Counter[str] = Counter()
    committed: Counter[str] = Counter()
    for r in rows:
        labels.update(r.labels)
        committed.update(r.committed)
    divergences = Counter(r.divergence.cls for r in rows if r.divergence is not None)
    return Cell(sims, engine, head, runs=len(rows), exact=sum(r.exact for r in rows),
                state_equal=sum(r.state_equal and r.state_checked for r in rows),
                exit_0=sum(not r.defects for r in rows), labels={k: v for k, v in labels.items() if v},
                only_correct_labels=all(k in CORRECT for k, v in labels.items() if v),
                committed=dict(committed), divergences=dict(divergences),
                per_slot=_mean_slots([r.per_slot for r in rows]),
                reference_per_slot=_mean_slots([r.reference_per_slot for r in rows]),
                mean_accepted=statistics.fmean(r.mean_accepted for r in rows) if rows else 0.0,
                rounds=sum(r.cost["rounds"] for r in rows), verify_rows=sum(r.cost["verify_rows"] for r in rows),
                replayed_rows=sum(r.cost["replayed_rows"] for r in rows), seconds=sum(r.seconds for r in rows))


def run_spec_bench(trunk: Path, work: Path, plan: SpecBenchPlan, progress: ProgressSink = SILENT,
                   on_row: Callable[[list[RunRow]], None] | None = None,
                   envelope: Callable[[str, Any], Any] | None = None) -> SpecBenchResult:
    """Fit the drafters, run the grid, aggregate. `trunk`: the tiny F32 GGUF; `work`: where the fitted drafters go;
    `progress.note` announces the fits and every run; `on_row(rows)` after every run (e.g. to keep partial results);
    `envelope(engine, options)` gives the tie threshold's envelope (None: measured now,
    `parity.api.measure_envelope`, as `spec` does when none is stored)."""
    from parity.api import measure_envelope
    from parity.contract.engine import RunOptions, engine_class
    from parity.gguf.weights import Weights
    from parity.spec.fit import seeded_prompts
    from parity.spec.report import spec_report

    for h in plan.heads:
        parse_head(h)
    load_start, t_start = list(os.getloadavg()), time.perf_counter()
    prompts = [[int(t) for t in p] for p in seeded_prompts(plan.seed, plan.prompts, plan.prompt_len,
                                                               Weights(trunk).config.vocab_size, PROMPT_STREAM)]
    fit_on = prompts[: plan.fit_prompts] if plan.fit_prompts is not None else prompts
    say = progress.note
    fits = fit_drafters(trunk, work, plan, fit_on, say)
    rows: list[RunRow] = []
    envelopes: dict[str, EnvelopeTime] = {}
    for sims in plan.sims:
        opts = RunOptions(fp8_kv=sims, fp4_indexer=sims)
        for engine in plan.engines:
            t0 = time.perf_counter()
            env = envelope(engine, opts) if envelope else measure_envelope(trunk, engine, opts)
            envelopes[f"{engine}, sims {'on' if sims else 'off'}"] = EnvelopeTime(env.logit_rel,
                                                                                 time.perf_counter() - t0)
            for kind, fit in fits.items():
                ref = engine_class("reference")(str(trunk), opts, draft=fit.path)
                cand = ref if engine == "reference" else engine_class(engine)(str(trunk), opts, draft=fit.path)
                for head in (h for h in plan.heads if parse_head(h)[0] == kind):
                    depth = parse_head(head)[1]
                    for i, prompt in enumerate(prompts):
                        t0 = time.perf_counter()
                        report = spec_report(cand, ref, kind, prompt, plan.steps, env, depth=depth,
                                             drafter=ref.drafter.config)
                        rows.append(run_row(report, engine, head, sims, i, time.perf_counter() - t0))
                        if on_row:
                            on_row(rows)
                        say(f"sims {'on' if sims else 'off'} {engine} {head} prompt {i}: "
                            f"{'exact' if report.exact else report.divergence.cls}, "
                            f"{rows[-1].seconds:.1f} s")
    cells = [aggregate(sims, engine, head, [r for r in rows if (r.sims, r.engine, r.head) == (sims, engine, head)])
             for sims in plan.sims for engine in plan.engines for head in plan.heads]
    return SpecBenchResult(plan, prompts, fits, envelopes, cells, rows, time.perf_counter() - t_start, load_start,
                           list(os.getloadavg()))


def _pcts(xs: Sequence[float | None]) -> str:
    return ", ".join("-" if x is None else f"{100 * x:.0f}" for x in xs) + " %"


def render_markdown(result: SpecBenchResult) -> str:
    """The grid as one Markdown table plus the fits and the conditions (load average, time)."""
    p = result.plan
    out = [f"Tiny F32 trunk (seed {p.seed}), {p.prompts} seeded prompts x {p.prompt_len} tokens, "
           f"{p.steps} steps each; drafters fitted on "
           f"{p.fit_prompts if p.fit_prompts is not None else p.prompts} of these prompts' greedy "
           f"continuations (sims off). Total {result.seconds / 60:.1f} min, load average "
           f"{result.load_avg_start[0]:.1f} at the start, {result.load_avg_end[0]:.1f} at the end.", "",
           "| sims | engine | head | exact | states equal | exit 0 | labels | committed MATCH / TIE / WRONG "
           "| first divergences | per slot, candidate (online) | per slot, reference drafter (offline) "
           "| drafts accepted / round | time |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in result.cells:
        com = c.committed
        out.append(f"| {'on' if c.sims else 'off'} | {c.engine} | {c.head} | {c.exact} / {c.runs} "
                   f"| {c.state_equal} / {c.runs} | {c.exit_0} / {c.runs} | "
                   + ", ".join(f"{k} {v}" for k, v in c.labels.items())
                   + f" | {com.get('MATCH', 0)} / {com.get('TIE', 0)} / {com.get('WRONG', 0)} | "
                   + (", ".join(f"{k} {v}" for k, v in c.divergences.items()) or "none")
                   + f" | {_pcts(c.per_slot)} | {_pcts(c.reference_per_slot)} | {c.mean_accepted:.2f} "
                   f"| {c.seconds:.0f} s |")
    out += ["", "| drafter | Adam steps | agreement per slot, fitted prompts | held-out prompts | fit time |",
            "|---|---|---|---|---|"]
    for k, f in result.fits.items():
        out.append(f"| {k} | {f.steps} | {_pcts(f.agreement['fitted'])} | {_pcts(f.agreement['heldout'])} "
                   f"| {sum(f.seconds.values()):.0f} s |")
    out += ["", "Envelopes (measured per engine and QAT setting): "
            + "; ".join(f"{k}: logit_rel {v.logit_rel:.2g} ({v.seconds:.0f} s)" for k, v in result.envelopes.items())]
    return "\n".join(out) + "\n"


def write_spec_bench(out_dir: Path, result: SpecBenchResult) -> tuple[Path, Path]:
    """OUT/spec_acceptance.json (the result's document, indent 1) and OUT/spec_acceptance.md."""
    out_dir.mkdir(parents=True, exist_ok=True)
    js = atomic_write_text(out_dir / "spec_acceptance.json", json.dumps(result.to_dict(), indent=1) + "\n")
    md = atomic_write_text(out_dir / "spec_acceptance.md", render_markdown(result))
    return js, md


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m parity.bench.spec_acceptance`: the benchmark; exit 0 when every sims-off cell is exact with
    equal states and only ACCEPT-OK / DRAFTER-MISS / NOT-VERIFIED labels and every sims-on run exits 0, else 1."""
    from parity.gguf.synth import synthesize

    ap = argparse.ArgumentParser(prog="python -m parity.bench.spec_acceptance", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="directory for spec_acceptance.json / .md")
    ap.add_argument("--work", default=".bench/spec", help="trunk and fitted drafters (default .bench/spec)")
    ap.add_argument("--prompts", type=int, default=10, help="seeded prompts (default 10)")
    ap.add_argument("--prompt-len", type=int, default=8, help="tokens per prompt (default 8)")
    ap.add_argument("--steps", type=int, default=64, help="generated tokens per run (default 64)")
    ap.add_argument("--engines", default="torch,reference", help="comma list (default torch,reference)")
    ap.add_argument("--heads", default=",".join(HEADS), help=f"comma list of mtpK / dspark (default {','.join(HEADS)})")
    ap.add_argument("--sims", default="off,on", help="QAT settings, comma list of off / on (default off,on)")
    ap.add_argument("--fit-steps-mtp", type=int, default=80, help="Adam steps of the MTP fit (default 80)")
    ap.add_argument("--fit-steps-dspark", type=int, default=200, help="Adam steps of the DSpark fit (default 200)")
    ap.add_argument("--reuse-fits", action="store_true", help="reuse drafters fitted earlier in --work with the "
                    "same prompts, steps and seed")
    a = ap.parse_args(argv)
    sims_map = {"off": False, "on": True}
    bad = [s for s in a.sims.split(",") if s not in sims_map]
    if bad:
        ap.error(f"--sims: {bad} not off / on")
    plan = SpecBenchPlan(a.prompts, a.prompt_len, a.steps, tuple(a.engines.split(",")), tuple(a.heads.split(",")),
                         tuple(sims_map[s] for s in a.sims.split(",")),
                         {"mtp": a.fit_steps_mtp, "dspark": a.fit_steps_dspark}, reuse_fits=a.reuse_fits)
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    trunk = synthesize(work / "tiny-f32.gguf", "tiny", "f32", seed=plan.seed)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    partial = out / "spec_acceptance.partial.json"
    result = run_spec_bench(trunk, work, plan, progress=Notes(lambda m: print(m, file=sys.stderr, flush=True)),
                            on_row=lambda rows: atomic_write_text(partial, json.dumps([r.to_dict() for r in rows])))
    _, md = write_spec_bench(out, result)
    print(md.read_text())
    ok = all((c.exact == c.state_equal == c.runs and c.only_correct_labels) if not c.sims else c.exit_0 == c.runs
             for c in result.cells)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
