"""How often `v4parity check` is right: false DEFECTs on correct runs, detection of injected faults.

Correct candidates: the torch engine with its QAT simulations on (default `RunOptions`) on the tiny F32 and tiny
real-mix models at several prompt lengths (traced without and with sub-op records, `trace --subops`: layer-level
and op-level verdicts), the clean QAT-off torch runs that serve as the faults' baselines, and
llama.cpp captures of the tiny F32 model quantized by llama.cpp's own quantizer. Faulty candidates: every torch
fault switch on several prompts of the tiny F32 and tiny real-mix models, QAT simulations on and off; a fault counts
as found when `check` says DEFECT and names that fault at the first layer whose recorded output differs bitwise from
the clean torch trace on the same tokens (the rule of tests/test_check.py). Every candidate is written to a file
and judged from the file, as a foreign engine's would be. `run_verdicts` returns the judged rows (`_judge`) and their
aggregates (`summarize`) as a `parity.bench.verdicts_report.VerdictsReport` (records all the way down);
`render_verdicts_markdown` prints it, `write_verdicts` writes `verdicts.json` and `verdicts.md`.
"""

from __future__ import annotations

import json
import math
import shutil
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from parity.bench.verdicts_report import (
    Brief,
    CorrectRow,
    CorrectSummary,
    FaultCount,
    FaultRow,
    FaultSummary,
    GroupStats,
    QatCount,
    TieBrief,
    TieRow,
    Times,
    TimeSummary,
    VerdictRow,
    VerdictsReport,
    VerdictSummary,
    read_row,
)
from parity.compare.verdict import Verdict
from parity.contract.progress import SILENT, Note, ProgressSink

if TYPE_CHECKING:
    from parity.contract.engine import RunOptions
    from parity.gguf.config import ModelConfig

ALPHA = 1e-3        # the significance level of check's round-off null (docs/check.md)
N_TWINS = 19        # round-off twins per run (docs/check.md)
MODELS = ("f32", "real-mix")
LLAMACPP_TYPES = ("F16", "BF16", "Q8_0", "MXFP4_MOE", "Q4_K_M", "Q2_K")


@dataclass(frozen=True)
class VerdictPlan:
    """What `run_verdicts` runs. torch_lengths: prompt length -> number of seeded prompts, per model of
    torch_models; subop_lengths: the same with sub-op records (op-level); llamacpp_types x llamacpp_seeds captures
    of `llamacpp_length` tokens; faults (None: every torch fault) x fault_prompts prompts of `fault_length` tokens,
    once per model of fault_models, per QAT setting of fault_qat and per value of fault_subops (with sub-op records
    or not); the tie-breaking fault `indexer-ties-highest` also where ties exist (`tie_motif`, `tie_prompts`: see
    TIE_FAULT). Every run adds `decode` greedy steps (the faulty runs are forced onto their clean run's tokens)."""

    torch_lengths: dict[int, int]
    subop_lengths: dict[int, int] = field(default_factory=dict)
    torch_models: tuple[str, ...] = MODELS
    llamacpp_types: tuple[str, ...] = LLAMACPP_TYPES
    llamacpp_seeds: int = 3
    llamacpp_length: int = 40
    faults: tuple[str, ...] | None = None
    fault_prompts: int = 5
    fault_length: int = 40
    fault_qat: tuple[bool, ...] = (True, False)
    fault_subops: tuple[bool, ...] = (False,)
    fault_models: tuple[str, ...] = ("f32",)
    tie_motif: bool = False      # indexer-ties-highest on the built-in motif prompt (tiny f32: one exact tie)
    tie_prompts: int = 0         # ... and on seeded prompts of the zero-indexer copy (every score ties at 0)
    decode: int = 8
    seed0: int = 1
    extra: dict[str, Any] = field(default_factory=dict)


PLANS = {
    # >= 50 correct runs: 2 x 16 torch, 2 x 10 of them again with sub-op records (the first seeds: same prompts),
    # 2 x 5 clean QAT-off baselines, 6 x 3 llama.cpp captures; 2 models x 11 faults x 5 prompts x 2 QAT settings
    "default": VerdictPlan(torch_lengths={40: 7, 150: 4, 300: 3, 600: 2},
                           subop_lengths={40: 3, 150: 3, 300: 2, 600: 2}, fault_models=MODELS, tie_motif=True,
                           tie_prompts=5),
    # the pipeline in a few minutes: numbers not meaningful
    "quick": VerdictPlan(torch_lengths={40: 1, 150: 1}, llamacpp_types=("Q8_0",), llamacpp_seeds=1,
                         faults=("no-decode-compression", "rope-split-halves"), fault_prompts=1, fault_qat=(True,)),
}


# The fault that only acts on exact indexer-score ties at the top-k cut (random prompts on random weights have none):
# it runs on the built-in motif prompt of tiny f32 (ReLU zeroes two rows' scores: one tie, which a TIE must call
# benign) and on the tiny f32 copy whose TIE_TENSOR is zero (every score ties at 0: many ties, all broken the
# fault's way, which check must call DEFECT, naming it). Expected: TIE with one changed pick, DEFECT with >= 2.
TIE_FAULT = "indexer-ties-highest"
TIE_TENSOR = "blk.2.indexer.proj.weight"
TIE_MODEL = "f32-zero-indexer"
MOTIF_SEED = 0      # a tie task with this seed runs the built-in motif prompt, not a seeded random one


def prompt(n: int, seed: int, vocab_size: int, bos: int) -> list[int]:
    """BOS followed by n - 1 seeded random ids in [2, vocab)."""
    rng = np.random.default_rng(seed)
    return [int(bos)] + [int(x) for x in rng.integers(2, vocab_size, n - 1)]


def verdict_models(cache_dir: Path, plan: VerdictPlan, log: Note) -> dict[str, Path]:
    """The tiny models the plan needs, written once into cache_dir: 'f32', 'real-mix' and one llama.cpp
    quantization of the F32 file per file type (keys 'lcp-<TYPE>')."""
    from parity import api
    from parity.gguf.synth import synthesize

    cache_dir.mkdir(parents=True, exist_ok=True)
    out = {}
    for quant in sorted({"f32", *plan.torch_models, *plan.fault_models}):
        path = cache_dir / f"tiny-{quant}.gguf"
        if not path.exists():
            synthesize(path, "tiny", quant, seed=0)
        out[quant] = path
    if plan.tie_prompts:
        out[TIE_MODEL] = zero_tensor_copy(out["f32"], cache_dir / f"tiny-{TIE_MODEL}.gguf", TIE_TENSOR)
    for ft in plan.llamacpp_types:
        path = cache_dir / f"tiny-lcp-{ft.lower()}.gguf"
        if not path.exists():
            log(f"quantizing {out['f32'].name} to {ft} with llama.cpp's quantizer ...")
            part = path.with_name(path.name + ".part")
            api.quantize_llamacpp(out["f32"], part, ft)
            part.replace(path)
        out[f"lcp-{ft}"] = path
    return out


def zero_tensor_copy(src: Path, dst: Path, name: str) -> Path:
    """A copy of a GGUF with one tensor's bytes zeroed (same shapes and types), written once."""
    from parity.gguf.container import GGUFFile, TensorData, write_gguf

    if not dst.exists():
        g = GGUFFile(src)
        part = dst.with_name(dst.name + ".part")
        write_gguf(part, g.kv, [TensorData(n, i.ne, i.ggml_type, bytes(i.nbytes) if n == name else bytes(g.data(n)))
                                for n, i in g.tensors.items()])
        part.replace(dst)
    return dst


def changed_picks(clean: Any, faulty: Any, layer: int) -> int:
    """Positions of `layer` whose recorded indexer selection differs between two traces of the same tokens."""
    a, b = (t.attn for t in (clean, faulty))
    rows = (a["layer"] == layer) & a["has_sel"]
    return int((np.sort(a["sel"][rows], axis=1) != np.sort(b["sel"][rows], axis=1)).any(axis=1).sum())


def first_acting_layer(clean: Any, faulty: Any) -> int | None:
    """First layer whose recorded output or visible compressed-row count differs bitwise between two traces of
    the same tokens; None when the fault does not act on this prompt."""
    from parity.contract.checkpoints import block

    for l in range(clean.n_layers):
        a, b = (t.attn["n_comp"][t.attn["layer"] == l] for t in (clean, faulty))
        if not (np.array_equal(clean.vectors[block(l)], faulty.vectors[block(l)]) and np.array_equal(a, b)):
            return l
    return None


def _row(report: Any, **what: Any) -> dict[str, Any]:
    """One result row: the run's description plus check's verdict, culprit, last named cause and cost."""
    from parity.check.check_report import headline

    culprit = report.culprit
    return {**what, "verdict": report.verdict, "headline": headline(report).splitlines()[0],
            "culprit_layer": culprit.layer if culprit else None, "culprit_subop": culprit.subop if culprit else None,
            "cause": report.causes[-1].name if report.causes else None,
            "causes": [f"{c.kind}:{c.name}@{c.layer}" for c in report.causes], "judged": report.judged,
            "seconds": float(report.seconds), "layer_runs": dict(report.layer_runs),
            "layer_runs_total": int(sum(report.layer_runs.values()))}


def _tasks(plan: VerdictPlan, faults: Sequence[str]) -> list[dict[str, Any]]:
    """Every run of the plan, in order (correct runs first), as descriptions."""
    tasks: list[dict[str, Any]] = []
    for model in plan.torch_models:
        for subops, lengths in ((False, plan.torch_lengths), (True, plan.subop_lengths)):
            tasks += [{"kind": "correct", "engine": "torch", "model": model, "qat": True, "fault": None,
                       "prompt": n, "seed": plan.seed0 + s, "subops": subops}
                      for n, seeds in sorted(lengths.items()) for s in range(seeds)]
    fault_seeds = [plan.seed0 + 1000 + i for i in range(plan.fault_prompts)]
    if False in plan.fault_qat and faults:   # the clean QAT-off baselines are correct runs too
        tasks += [{"kind": "correct", "engine": "torch", "model": model, "qat": False, "fault": None,
                   "prompt": plan.fault_length, "seed": s} for model in plan.fault_models for s in fault_seeds]
    for ft in plan.llamacpp_types:
        tasks += [{"kind": "correct", "engine": "llamacpp", "model": f"lcp-{ft}", "qat": False, "fault": None,
                   "prompt": plan.llamacpp_length, "seed": plan.seed0 + s} for s in range(plan.llamacpp_seeds)]
    for model in plan.fault_models:
        for qat in plan.fault_qat:
            for subops in plan.fault_subops:
                for fault in faults:
                    tasks += [{"kind": "fault", "engine": "torch", "model": model, "qat": qat, "fault": fault,
                               "prompt": plan.fault_length, "seed": s, "subops": subops} for s in fault_seeds]
    tie = {"kind": "tie", "engine": "torch", "qat": True, "fault": TIE_FAULT, "subops": False}
    if plan.tie_motif:
        from parity.bisect.search import BUILTIN_LEN

        tasks.append({**tie, "model": "f32", "prompt": BUILTIN_LEN, "seed": MOTIF_SEED})
    tasks += [{**tie, "model": TIE_MODEL, "prompt": plan.fault_length, "seed": s}
              for s in fault_seeds[: plan.tie_prompts]]
    return tasks


TASK_KEYS = ("kind", "engine", "model", "qat", "fault", "prompt", "seed", "subops")


def task_key(task: Mapping[str, Any] | VerdictRow) -> tuple:
    """What identifies a run of the plan (a task, or the row it gave): a row of an earlier result with the same key
    is the same run (a row without `subops` is one with subops False)."""
    if isinstance(task, Mapping):
        return tuple(bool(task.get(k)) if k == "subops" else task[k] for k in TASK_KEYS)
    return tuple(bool(getattr(task, k)) if k == "subops" else getattr(task, k) for k in TASK_KEYS)


def _judge(row: dict[str, Any]) -> VerdictRow:
    """The judged record of a row (the run, check's answer and, for a faulty or tie run, the first layer where its
    fault acts; for a tie run, the picks it changed there): a correct run is a false DEFECT when check says DEFECT;
    a faulty run is detected when DEFECT and found when, besides, the named cause is the fault at the expected
    layer."""
    if row["kind"] == "correct":
        marks: dict[str, Any] = {"false_defect": row["verdict"] == Verdict.DEFECT}
    elif row["kind"] == "tie":   # one changed pick: a TIE at that layer (NOISE); >= 2: DEFECT naming the fault
        expected = "TIE" if row["changed_picks"] == 1 else "DEFECT"
        marks = {"expected": expected, "found": bool(row["expected_layer"] is not None and (
            (row["verdict"] == Verdict.NOISE and f"benign:tie@{row['expected_layer']}" in row["causes"])
            if expected == "TIE" else
            (row["verdict"] == Verdict.DEFECT and row["cause"] == row["fault"]
             and row["culprit_layer"] == row["expected_layer"])))}
    else:
        detected = row["verdict"] == Verdict.DEFECT
        marks = {"detected": detected, "found": bool(detected and row["cause"] == row["fault"]
                                                     and row["culprit_layer"] == row["expected_layer"])}
    return read_row({**row, **marks})


def run_verdicts(models: dict[str, Path], plan: VerdictPlan, scratch: Path,
                 progress: ProgressSink = SILENT,
                 done: Sequence[VerdictRow] = (),
                 on_row: Callable[[VerdictRow], None] | None = None, *, plan_name: str) -> VerdictsReport:
    """Run the plan (named `plan_name` in the report: "quick", "default", ...): trace (or capture) each candidate
    into `scratch`, judge it with `parity.api.check` from the file, one progress line per run through
    `progress.note`. `done`: rows of an earlier result (its `rows`); a run of the plan with the same `task_key` as
    one of them is taken from there, not run again. `on_row(row)` is called after each new run (to keep partial
    results). Returns the report: plan, rows, summary (`summarize(rows)`), wall time."""
    from parity.contract.engine import engine_faults
    from parity.gguf.weights import Weights

    faults = plan.faults if plan.faults is not None else engine_faults("torch")
    tasks = _tasks(plan, faults)
    scratch.mkdir(parents=True, exist_ok=True)
    configs = {k: Weights(p).config for k, p in models.items()}
    clean: dict[tuple[str, bool, int], Any] = {}   # (model, qat, seed) -> clean torch trace, fault_length tokens
    earlier = {task_key(r): r for r in done}
    todo = sum(task_key(t) not in earlier for t in tasks)
    rows: list[VerdictRow] = []
    ran = 0
    t0 = time.perf_counter()
    for i, task in enumerate(tasks):
        if task_key(task) in earlier:
            rows.append(earlier[task_key(task)])
            continue
        ran += 1
        row = _run_task(i, task, models[task["model"]], configs[task["model"]], plan, scratch, clean)
        rows.append(row)
        if on_row is not None:
            on_row(row)
        eta = (time.perf_counter() - t0) / ran * (todo - ran)
        progress.note(f"[{ran}/{todo}] {_progress(task, row, plan)}; ETA {eta / 60:.1f} min")
    return VerdictsReport(ALPHA, N_TWINS, _plan_json(plan, faults), rows, summarize(rows), time.perf_counter() - t0,
                          plan_name)


def _run_task(i: int, task: dict[str, Any], model: Path, cfg: ModelConfig, plan: VerdictPlan, scratch: Path,
              clean: dict[tuple[str, bool, int], Any]) -> VerdictRow:
    """One run of the plan (the i-th task): its candidate written into a folder of `scratch`, judged by
    `parity.api.check` from the file; the judged row. cfg: the model's config; clean: the clean torch traces
    already loaded (filled here)."""
    from parity import api
    from parity.bisect.search import builtin_prompt
    from parity.contract.engine import RunOptions

    t = time.perf_counter()
    motif = task["kind"] == "tie" and task["seed"] == MOTIF_SEED
    tokens = (builtin_prompt(cfg.vocab_size, cfg.bos_token_id) if motif else
              prompt(task["prompt"], task["seed"], cfg.vocab_size, cfg.bos_token_id))
    opts = RunOptions() if task["qat"] else RunOptions(fp8_kv=False, fp4_indexer=False)
    keep = task["kind"] == "correct" and task["engine"] == "torch" and not task["qat"]
    # a trace and its vectors side file, in a folder of their own; a clean QAT-off run is kept as the baseline
    # of the faulty runs on the same prompt
    folder = scratch / (f"clean-{task['model']}-0-{task['seed']}" if keep else f"cand-{i}")
    folder.mkdir(exist_ok=True)
    path = folder / "trace.npz"
    expected, picks = None, 0
    if task["engine"] == "llamacpp":
        api.capture_llamacpp(model, tokens, path, decode=plan.decode)
    elif task["kind"] == "correct":
        api.save_trace(api.trace("torch", model, tokens, positions="all", full="all", decode=plan.decode,
                                 options=opts, subops=task.get("subops", False)), path)
    else:
        expected, picks = _faulty_run(task, model, tokens, opts, plan, scratch, clean, path)
    row = _row(api.check(path, model), **task, decode=plan.decode, wall_s=time.perf_counter() - t)
    if task["kind"] != "correct":
        row["expected_layer"] = expected
    if task["kind"] == "tie":
        row["changed_picks"] = picks
    if not keep:
        shutil.rmtree(folder)
    return _judge(row)


def _faulty_run(task: dict[str, Any], model: Path, tokens: Sequence[int], opts: RunOptions, plan: VerdictPlan,
                scratch: Path, clean: dict[tuple[str, bool, int], Any], path: Path) -> tuple[int | None, int]:
    """The faulty torch trace written to `path`, forced onto the tokens of its clean run (traced into `scratch` or
    taken from `clean` when already there); the first layer where the fault acts (None: inert) and the router
    picks it changed there."""
    from parity import api
    from parity.contract.engine import RunOptions

    key = (task["model"], task["qat"], task["seed"])
    if key not in clean:
        base = scratch / f"clean-{task['model']}-{int(task['qat'])}-{task['seed']}" / "trace.npz"
        if not base.exists():
            base.parent.mkdir(exist_ok=True)
            api.save_trace(api.trace("torch", model, tokens, positions="all", full="all",
                                     decode=plan.decode, options=opts), base)
        clean[key] = api.load_trace(base)
    ref = clean[key]
    forced = ref.header.tokens[len(tokens):]
    api.save_trace(api.trace("torch", model, tokens, positions="all", full="all", decode=plan.decode,
                             forced=forced, options=RunOptions(fp8_kv=task["qat"], fp4_indexer=task["qat"],
                                                               inject=(task["fault"],)),
                             subops=task.get("subops", False)), path)
    faulty = api.load_trace(path)
    expected = first_acting_layer(ref, faulty)
    return expected, (changed_picks(ref, faulty, expected) if expected is not None else 0)


def _progress(task: dict[str, Any], row: VerdictRow, plan: VerdictPlan) -> str:
    """The progress line of a judged run (without its counter and ETA)."""
    what = f"{_group(row)} T={task['prompt']}+{plan.decode}"
    if not isinstance(row, CorrectRow):
        what += f" fault {task['fault']} (expected layer {row.expected_layer})"
    if isinstance(row, TieRow):
        what += f", {row.changed_picks} pick(s) changed: expected {row.expected}"
    flag = ((" FALSE DEFECT" if row.false_defect else "") if isinstance(row, CorrectRow) else
            " (fault inert on this prompt: not counted)" if row.expected_layer is None else "" if row.found else
            " MISSED")
    return (f"{what} seed {task['seed']}: {row.headline[:120]} "
            f"({row.seconds:.1f} s check, {row.wall_s:.1f} s run){flag}")


def _plan_json(plan: VerdictPlan, faults: Sequence[str]) -> dict[str, Any]:
    """The plan as JSON values (without `extra`; prompt lengths as string keys, the faults that ran)."""
    plan_json = {k: v for k, v in asdict(plan).items() if k != "extra"}
    plan_json["torch_lengths"] = {str(k): v for k, v in plan.torch_lengths.items()}
    plan_json["faults"] = list(faults)
    return plan_json


def upper_bound(k: int, n: int, conf: float = 0.95) -> float:
    """One-sided Clopper-Pearson upper bound of a binomial rate with k successes in n trials."""
    if n == 0:
        return 1.0
    if k >= n:
        return 1.0

    def cdf(p: float) -> float:
        return sum(math.comb(n, i) * p ** i * (1 - p) ** (n - i) for i in range(k + 1))

    lo, hi = k / n, 1.0
    for _ in range(60):   # cdf decreases in p: the p where P(X <= k) = 1 - conf
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) > 1 - conf else (lo, mid)
    return hi


def _times(rows: Sequence[VerdictRow]) -> Times:
    """Time per check over `rows`."""
    secs = [r.seconds for r in rows]
    runs = [r.layer_runs_total for r in rows]
    return Times(n=len(rows), median_s=statistics.median(secs) if secs else None, max_s=max(secs, default=None),
                 median_layer_runs=statistics.median(runs) if runs else None)


def summarize(rows: Sequence[VerdictRow]) -> VerdictSummary:
    """Aggregates computed from the rows alone: false-DEFECT count / rate (with its 95 % upper bound), verdict
    counts, detection and naming rates (overall, per fault, per QAT setting), the runs that went wrong, and time
    per check (overall, per candidate group, and against the prompt length)."""
    correct = [r for r in rows if isinstance(r, CorrectRow)]
    faulty = [r for r in rows if isinstance(r, FaultRow)]
    acting = [r for r in faulty if r.expected_layer is not None]
    n_fd = sum(r.false_defect for r in correct)
    groups: dict[str, list[CorrectRow]] = {}
    for r in correct:
        groups.setdefault(_group(r), []).append(r)
    by_length: dict[str, dict[str, list[CorrectRow]]] = {}
    for r in correct:
        if r.engine == "torch" and r.qat:
            key = r.model + (" --subops (op-level)" if r.subops else "")
            by_length.setdefault(key, {}).setdefault(str(r.prompt), []).append(r)
    return VerdictSummary(
        correct=CorrectSummary(
            n=len(correct), verdicts=_count(correct), false_defects=n_fd,
            false_defect_rate=n_fd / len(correct) if correct else None,
            false_defect_rate_upper95=upper_bound(n_fd, len(correct)) if correct else None,
            groups={g: GroupStats(_count(rs), sum(r.false_defect for r in rs), _times(rs))
                    for g, rs in groups.items()}),
        faults=_fault_summary(faulty, acting),
        ties=[TieBrief(**_brief(r), changed_picks=r.changed_picks, expected=r.expected, found=r.found)
              for r in rows if isinstance(r, TieRow)],
        false_defects=[Brief(**_brief(r)) for r in correct if r.false_defect],
        misses=[Brief(**_brief(r)) for r in acting if not r.found],
        time=TimeSummary(all=_times(rows), correct=_times(correct), faults=_times(faulty),
                         by_length={m: {n: _times(rs) for n, rs in sorted(d.items(), key=lambda kv: int(kv[0]))}
                                    for m, d in by_length.items()}))


def _fault_summary(faulty: Sequence[FaultRow], acting: Sequence[FaultRow]) -> FaultSummary:
    """The faulty runs' counts and rates, overall (acting runs), per model and fault, per model and QAT setting."""
    per_fault: dict[str, dict[str, int]] = {}
    for r in faulty:
        f = per_fault.setdefault(f"{r.model} {r.fault}" + (" --subops" if r.subops else ""),
                                 {"n": 0, "acting": 0, "detected": 0, "found": 0})
        f["n"] += 1
        f["acting"] += r.expected_layer is not None
        f["detected"] += r.detected
        f["found"] += r.found and r.expected_layer is not None
    per_qat = {}
    for model, qat in sorted({(r.model, r.qat) for r in faulty}, key=lambda mq: (mq[0], not mq[1])):
        rs = [r for r in acting if r.qat == qat and r.model == model]
        per_qat[f"{model} QAT {'on' if qat else 'off'}"] = QatCount(
            n=len(rs), detected=sum(r.detected for r in rs), found=sum(r.found for r in rs))
    detected, found = sum(r.detected for r in acting), sum(r.found for r in acting)
    return FaultSummary(n=len(faulty), acting=len(acting), inert=len(faulty) - len(acting), detected=detected,
                        found=found, detection_rate=detected / len(acting) if acting else None,
                        found_rate=found / len(acting) if acting else None,
                        per_fault={k: FaultCount(**v) for k, v in per_fault.items()}, per_qat=per_qat)


def _brief(r: VerdictRow) -> dict[str, Any]:
    """A row's fields named in the summary (`Brief`; expected_layer None for a correct run)."""
    return {"engine": r.engine, "model": r.model, "qat": r.qat, "fault": r.fault, "prompt": r.prompt, "seed": r.seed,
            "expected_layer": getattr(r, "expected_layer", None), "verdict": r.verdict, "headline": r.headline}


def _group(r: VerdictRow) -> str:
    """A correct candidate's group: engine, model, QAT off, sub-op records."""
    return f"{r.engine} {r.model}{'' if r.qat else ' qat-off'}{' --subops' if r.subops else ''}"


def _count(rows: Sequence[VerdictRow]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in rows:
        out[r.verdict] = out.get(r.verdict, 0) + 1
    return out


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f} %"


def render_verdicts_markdown(result: VerdictsReport) -> str:
    """The tables of docs/check.md's benchmark section."""
    s = result.summary
    c, f, tm = s.correct, s.faults, s.time
    verdicts = lambda d: ", ".join(f"{k} {v}" for k, v in sorted(d.items()))  # noqa: E731
    lines = [f"`check` verdicts: α = {result.alpha:g}, {result.twins} round-off twins, "
             f"{c.n} correct and {f.n} faulty candidates, bench wall time {result.wall_s / 60:.1f} min.", "",
             "| measure | value |", "|---|---|",
             f"| correct runs | {c.n} ({verdicts(c.verdicts)}) |",
             f"| false DEFECT | {c.false_defects} / {c.n} = {_pct(c.false_defect_rate)} "
             f"(95 % upper bound {_pct(c.false_defect_rate_upper95)}) |",
             f"| faulty runs (fault acts on the prompt) | {f.n} ({f.acting}) |",
             f"| detected (DEFECT) | {f.detected} / {f.acting} = {_pct(f.detection_rate)} |",
             f"| found (DEFECT, that fault, right layer) | {f.found} / {f.acting} = {_pct(f.found_rate)} |",
             f"| time per check, median / max | {tm.all.median_s:.1f} s / {tm.all.max_s:.1f} s |", "",
             "| correct candidates | runs | verdicts | false DEFECT | median / max s | median layer-runs |",
             "|---|---|---|---|---|---|"]
    for g, d in c.groups.items():
        lines.append(f"| {g} | {d.times.n} | {verdicts(d.verdicts)} | {d.false_defects} | "
                     f"{d.times.median_s:.1f} / {d.times.max_s:.1f} | {d.times.median_layer_runs:g} |")
    lines += ["", "| model, fault | runs (acting) | detected | found | ", "|---|---|---|---|"]
    lines += [f"| {name} | {d.n} ({d.acting}) | {d.detected} | {d.found} |"
              + (" inert: no exact ties on these prompts (tie table below) |" if TIE_FAULT in name and not d.acting
                 else "") for name, d in f.per_fault.items()]
    if s.ties:
        lines += ["", f"`{TIE_FAULT}` where exact ties exist (expected: TIE with one changed pick, DEFECT naming "
                  "the fault with >= 2):", "",
                  "| model | prompt | layer | picks changed | expected | verdict | as expected |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {r.model} | {'motif' if r.seed == MOTIF_SEED else 'seed ' + str(r.seed)}, "
                  f"T={r.prompt} "
                  f"| {r.expected_layer} | {r.changed_picks} | {r.expected} | {r.verdict} | "
                  f"{'yes' if r.found else 'NO'} |" for r in s.ties]
    if f.per_qat:
        lines += ["", "Per model and QAT setting (acting runs): " + "; ".join(
            f"{k}: {d.found} / {d.n} found, {d.detected} DEFECT" for k, d in f.per_qat.items())]
    if tm.by_length:
        lines += ["", "Time per check against prompt length (torch, QAT on, + decode steps; median s / median "
                  "layer-runs):", "", "| model | " + " | ".join(f"T = {n}" for n in
                                                                 next(iter(tm.by_length.values()))) + " |",
                  "|---|" + "---|" * len(next(iter(tm.by_length.values())))]
        for m, d in tm.by_length.items():
            lines.append(f"| tiny {m} | " + " | ".join(f"{v.median_s:.1f} s / {v.median_layer_runs:g}"
                                                       for v in d.values()) + " |")
    for title, briefs in (("False DEFECTs", s.false_defects), ("Missed or misnamed faults", s.misses)):
        lines += ["", f"{title}: {len(briefs) or 'none'}"]
        for r in briefs:
            fault = f" fault {r.fault} (expected layer {r.expected_layer})" if r.fault else ""
            lines.append(f"* {r.engine} {r.model} qat={r.qat} T={r.prompt} seed {r.seed}{fault}: `{r.headline}`")
    return "\n".join(lines) + "\n"


def write_verdicts(result: VerdictsReport, out_dir: Path) -> tuple[Path, Path]:
    """verdicts.json (the report's document, strict JSON, atomic) and verdicts.md in out_dir."""
    from parity.contract.files import atomic_write_bytes, atomic_write_text

    out_dir.mkdir(parents=True, exist_ok=True)
    js = atomic_write_bytes(out_dir / "verdicts.json",
                            json.dumps(result.to_dict(), indent=2, allow_nan=False).encode("utf-8"))
    md = atomic_write_text(out_dir / "verdicts.md", render_verdicts_markdown(result))
    return js, md
