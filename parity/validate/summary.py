"""From the per-prompt records to the report: aggregates with CIs and MDEs, the two pins, the budget verdict.

Everything here is a pure function of the records sorted by prompt index and the seed, so the report is the
same byte for byte whichever executor produced the records and in whatever order they arrived.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np

from parity.compare.verdict import StepVerdict
from parity.validate import stats
from parity.validate.budget import Bound, judge
from parity.validate.spec import NUMERICS

DIVERGENT = (StepVerdict.TIE_FLIP.value, StepVerdict.WRONG.value)
MEAN_METRICS = ("divergence_rate", "wrong_rate", "step_divergence_rate", "step_wrong_rate", "step_drift_rate",
                "top1_agreement", "kl_mean")
POOLED = {"kl_p50": lambda x: np.percentile(x, 50, axis=1), "kl_p99": lambda x: np.percentile(x, 99, axis=1),
          "kl_max": lambda x: x.max(axis=1)}
LAYER_STATS = ("mean", "p50", "p99", "max")
PROPORTIONS = ("divergence_rate", "wrong_rate")


def metric_names(n_layers: int) -> set[str]:
    return {*MEAN_METRICS, *POOLED, *(f"rel_l2.blk.{l}.{s}" for l in range(n_layers) for s in LAYER_STATS)}


def per_prompt(records: Sequence[dict]) -> dict[str, np.ndarray]:
    """Per-prompt values of the mean metrics, [n] each (every prompt has the same number of steps, so a mean
    over prompts equals the pooled mean over steps)."""
    v = [np.array(r["verdict"]) for r in records]
    return {
        "divergence_rate": np.array([np.isin(x, DIVERGENT).any() for x in v], np.float64),
        "wrong_rate": np.array([(x == StepVerdict.WRONG.value).any() for x in v], np.float64),
        "step_divergence_rate": np.array([np.isin(x, DIVERGENT).mean() for x in v]),
        "step_wrong_rate": np.array([(x == StepVerdict.WRONG.value).mean() for x in v]),
        "step_drift_rate": np.array([(x == StepVerdict.DRIFT.value).mean() for x in v]),
        "top1_agreement": np.array([np.isin(x, (StepVerdict.MATCH.value, StepVerdict.DRIFT.value)).mean() for x in v]),
        "kl_mean": np.array([np.asarray(r["kl"], np.float64).mean() for r in records]),
    }


def _stat(values: np.ndarray, name: str) -> np.ndarray:
    if name == "mean":
        return values.mean(axis=-1)
    if name == "max":
        return values.max(axis=-1)
    return np.percentile(values, float(name[1:]), axis=-1)


def aggregates(records: Sequence[dict], seed: int) -> dict[str, dict]:
    """metric -> {value, ci: [lo, hi], mde (None where not defined), n}."""
    n = len(records)
    idx = stats.resamples(n, seed)
    out: dict[str, dict] = {}
    for name, vals in per_prompt(records).items():
        mde = stats.mde_proportion(round(vals.sum()), n) if name in PROPORTIONS else stats.mde_mean(vals)
        out[name] = {"value": float(vals.mean()), "ci": list(stats.mean_ci(vals, idx)), "mde": mde, "n": n}
    kl = np.array([r["kl"] for r in records], np.float64)
    for name, fn in POOLED.items():
        out[name] = {"value": float(fn(kl.reshape(1, -1))[0]), "ci": list(stats.pooled_ci(kl, idx, fn)), "mde": None,
                     "n": n}
    layers = np.array([r["layer_rel_l2"] for r in records], np.float64)  # [n, L]
    for l in range(layers.shape[1]):
        col = layers[:, l]
        for s in LAYER_STATS:
            reps = _stat(col[idx], s)
            out[f"rel_l2.blk.{l}.{s}"] = {"value": float(_stat(col, s)), "ci": list(stats.percentile_ci(reps)),
                                         "mde": stats.mde_mean(col) if s == "mean" else None, "n": n}
    return out


def divergence_profile(records: Sequence[dict]) -> dict:
    """First divergent steps: class counts, a histogram by step, and the per-step divergence rate."""
    first = [r["first_divergent_step"] for r in records]
    steps = len(records[0]["verdict"])
    per_step = np.array([np.isin(np.array(r["verdict"]), DIVERGENT) for r in records]).mean(axis=0)
    diverged = [f for f in first if f is not None]
    return {"classes": dict(sorted(Counter(r["first_divergent_class"] for r in records if r["first_divergent_class"])
                                   .items())),
            "first_step_median": float(np.median(diverged)) if diverged else None,
            "first_step_histogram": [sum(f == s for f in first) for s in range(steps)],
            "per_step_divergence_rate": [float(x) for x in per_step],
            "per_step_kl_mean": [float(x) for x in np.array([r["kl"] for r in records], np.float64).mean(axis=0)]}


def exactness_pin(main: dict[int, dict], pins: Sequence[dict], explicit: str | None) -> dict:
    """The exact path run again and the explicit-exact spec must equal the first exact run in every bit."""
    failures = []
    for p in pins:
        ref = main[p["index"]]["digest_exact"]
        if p["digest_exact_again"] != ref:
            failures.append(f"prompt {p['index']}: a second run of the exact path differs in bits from the first")
        if p["digest_explicit"] is not None and p["digest_explicit"] != ref:
            failures.append(f"prompt {p['index']}: {explicit} (approximate option at its exact value) differs in "
                            "bits from the exact path")
    return {"prompts": [p["index"] for p in pins], "explicit_spec": explicit, "passed": not failures,
            "failures": failures}


def announce_pin(records: Sequence[dict]) -> dict:
    """The approximate run's header flags must declare its modes, the engine must name them on stderr, and a
    run whose numerics differ from the exact path while declaring nothing is a silent approximation."""
    declared = {k: records[0]["flags_approx"][k] for k in NUMERICS
                if records[0]["flags_approx"][k] != records[0]["flags_exact"][k]}
    differ = [r["index"] for r in records if r["digest_approx"] != r["digest_exact"]]
    unannounced = sorted({k for r in records for k, ok in r["announced"].items() if not ok})
    failures = []
    if differ and not declared:
        failures.append(f"silent approximation: the approximate path's numerics differ from the exact path on "
                        f"{len(differ)}/{len(records)} prompts while its trace header flags declare no approximate "
                        "mode")
    for k in unannounced:
        failures.append(f"announce pin: the engine did not name {k}={declared.get(k)} on stderr "
                        f"(declared in the header flags)")
    notes = []
    if declared and not differ:
        notes.append("the declared approximate mode changed no bit on any prompt")
    return {"declared": declared, "numerics_differ_on": len(differ), "stderr_announced": not unannounced,
            "passed": not failures, "failures": failures, "notes": notes}


def summarize(records: Sequence[dict], pins: Sequence[dict], seed: int, explicit: str | None,
              bounds: Sequence[Bound] | None) -> dict:
    """Aggregates, divergence profile, pins, budget and the overall verdict (records: main records)."""
    records = sorted(records, key=lambda r: r["index"])
    pins = sorted(pins, key=lambda r: r["index"])
    with np.errstate(invalid="ignore", over="ignore"):  # a non-finite value makes its statistic inf / nan, as it must
        agg = aggregates(records, seed)
    exact = exactness_pin({r["index"]: r for r in records}, pins, explicit)
    announce = announce_pin(records)
    budget = judge(list(bounds), agg) if bounds else None
    findings = [*exact["failures"], *announce["failures"],
                *(f"budget: {b['metric']} {b['op']} {b['value']:g} failed (CI bound {b['ci_bound']:.4g})"
                  for b in budget or [] if not b["passed"])]
    return {"aggregates": agg, "divergence": divergence_profile(records),
            "pins": {"exactness": exact, "announce": announce}, "budget": budget,
            "passed": not findings, "findings": findings}
