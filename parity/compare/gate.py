"""CI gate: a candidate trace against a golden one, with per-checkpoint tolerances.

Tolerance file (JSON, or TOML with a .toml extension):
    {"default": {"rel_tol": 1e-3, "norm_tol": 1e-3},
     "checkpoints": {"final_norm": {"rel_tol": 2e-3}, "blk.*.attn": {"rel_tol": 1e-3}},
     "require_top1": true}
Checkpoint keys are shell patterns (fnmatch); the first matching key in file order wins. Unknown
keys, and a pattern that matches no compared checkpoint (a typo would silently leave the default), are
an error. The result reports, per failing checkpoint, the smallest tolerance that would have passed, and
renders as JUnit XML and a Markdown summary. The side files' full logits, when both traces carry them, are one
more case (`logits`, rel-L2 only), as `diff` judges them.
"""

from __future__ import annotations

import fnmatch
import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape, quoteattr

import numpy as np

from parity.compare.differ import DiffReport, Thresholds, diff_traces
from parity.compare.jsonvalues import json_safe
from parity.compare.rows import CheckpointRow
from parity.compare.verdict import Verdict
from parity.contract.checkpoints import LOGITS
from parity.contract.errors import ParityError
from parity.tracing.records import Trace

TOP_KEYS = {"default", "checkpoints", "require_top1"}
TOL_KEYS = {"rel_tol", "norm_tol"}


@dataclass(frozen=True)
class Tolerances:
    default: Thresholds = field(default_factory=Thresholds)
    checkpoints: tuple[tuple[str, Thresholds], ...] = ()
    require_top1: bool = True

    def for_checkpoint(self, name: str) -> Thresholds:
        return next((th for pat, th in self.checkpoints if fnmatch.fnmatchcase(name, pat)), self.default)


def _thresholds(d: Any, base: Thresholds, where: str) -> Thresholds:
    if not isinstance(d, dict):
        raise ParityError(f"tolerances: {where} must be an object with rel_tol / norm_tol")
    unknown = set(d) - TOL_KEYS
    if unknown:
        raise ParityError(f"tolerances: {where}: unknown key(s) {sorted(unknown)} (allowed: {sorted(TOL_KEYS)})")
    for k, v in d.items():
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
            raise ParityError(f"tolerances: {where}.{k} must be a positive number, got {v!r}")
    return base.with_overrides(**{k: float(v) for k, v in d.items()})


def load_tolerances(src: str | os.PathLike | dict | None) -> Tolerances:
    """Parse a tolerance file (or dict); None gives the defaults."""
    if src is None:
        return Tolerances()
    if isinstance(src, dict):
        d = src
    else:
        path = Path(src)
        if not path.is_file():
            raise ParityError(f"tolerances: no such file {path}")
        try:
            if path.suffix == ".toml":
                import tomllib

                d = tomllib.loads(path.read_text())
            else:
                d = json.loads(path.read_text())
        except (ValueError, UnicodeDecodeError) as e:
            raise ParityError(f"tolerances: {path} is not valid {path.suffix.lstrip('.') or 'JSON'}: {e}") from None
    unknown = set(d) - TOP_KEYS
    if unknown:
        raise ParityError(f"tolerances: unknown top-level key(s) {sorted(unknown)} (allowed: {sorted(TOP_KEYS)})")
    default = _thresholds(d.get("default", {}), Thresholds(), "default")
    per = tuple((pat, _thresholds(v, default, f"checkpoints.{pat}")) for pat, v in d.get("checkpoints", {}).items())
    top1 = d.get("require_top1", True)
    if not isinstance(top1, bool):
        raise ParityError(f"tolerances: require_top1 must be true or false, got {top1!r}")
    return Tolerances(default, per, top1)


@dataclass(frozen=True)
class GateResult:
    """passed + one entry per checkpoint (name, status, worst metrics, tolerance, minimal passing tolerance)."""

    passed: bool
    cases: tuple[dict[str, Any], ...]
    report: DiffReport
    golden: str
    candidate: str

    def __bool__(self) -> bool:
        return self.passed

    def to_dict(self) -> dict[str, Any]:
        """The JSON document of `gate --json`: passed, the two traces' names, the cases, the diff's first drift and
        warnings (a non-finite number spelled by `json_safe`, not the non-JSON NaN / Infinity)."""
        return json_safe({"passed": self.passed, "golden": self.golden, "candidate": self.candidate,
                          "cases": list(self.cases), "first_drift": self.report.first_drift,
                          "warnings": self.report.warnings})


def run_gate(golden: Trace, candidate: Trace, tolerances: str | os.PathLike | dict | None = None,
             force: bool = False, names: tuple[str, str] = ("golden", "candidate")) -> GateResult:
    """Diff candidate against golden and judge every checkpoint row (`DiffReport.rows`) by its own tolerance."""
    tol = load_tolerances(tolerances)
    report = diff_traces(golden, candidate, Thresholds(), force=force)
    compared = [r.checkpoint for r in report.rows] + ([LOGITS] if len(report.logits) else [])
    unmatched = [pat for pat, _ in tol.checkpoints if not any(fnmatch.fnmatchcase(c, pat) for c in compared)]
    if unmatched:
        raise ParityError(f"tolerances: checkpoint pattern(s) {unmatched} match no compared checkpoint "
                          f"(compared: {', '.join(compared)})")
    cases = [_case(row, tol.for_checkpoint(row.checkpoint), tol.require_top1) for row in report.rows]
    if len(report.logits):  # the side files' full logits, judged by rel-L2 as `diff` judges them
        th, rel = tol.for_checkpoint(LOGITS), report.logits["rel_l2"].to_numpy(dtype=np.float64)
        problems = [] if report.logits["finite"].all() else ["non-finite values"]
        if not np.all(rel <= th.rel_tol):
            problems.append(f"rel-L2 {np.nanmax(rel):.3e} > {th.rel_tol:g} (would pass at rel_tol >= "
                            f"{np.nanmax(rel):.3e})")
        cases.append({"checkpoint": LOGITS, "passed": not problems, "problems": problems, "method": "full",
                      "max_rel_l2": float(np.nanmax(rel)), "max_norm_dev": None, "rel_tol": th.rel_tol,
                      "norm_tol": th.norm_tol})
    return GateResult(all(c["passed"] for c in cases), tuple(cases), report, *names)


def _case(row: CheckpointRow, th: Thresholds, require_top1: bool) -> dict[str, Any]:
    """The gate's case of one checkpoint row: its failing metrics at the checkpoint's own tolerance `th` (worded,
    with the smallest tolerance that would pass) and, at final_norm with `require_top1`, every top-1 flip."""
    words = {"non-finite": "non-finite statistics",
             "rel-L2": f"rel-L2 {row.rel_l2_nanmax:.3e} > {th.rel_tol:g} (would pass at rel_tol >= "
                       f"{row.rel_l2_nanmax:.3e})",
             "norm ratio": f"|RMS ratio - 1| {row.norm_dev_nanmax:.3e} > {th.norm_tol:g} (would pass at norm_tol >= "
                           f"{row.norm_dev_nanmax:.3e})"}
    problems = [words[m] for m in row.failing_at(th.rel_tol, th.norm_tol)]
    if require_top1 and row.checkpoint == "final_norm":
        problems += [f"top-1 token differs at position {p}: golden {a}, candidate {b}" for p, a, b in row.top1_flips]
    return {"checkpoint": row.checkpoint, "passed": not problems, "problems": problems, "method": row.method,
            "max_rel_l2": row.rel_l2_nanmax, "max_norm_dev": row.norm_dev_nanmax, "rel_tol": th.rel_tol,
            "norm_tol": th.norm_tol}


def with_verdict(r: GateResult, verdict: Verdict, headline: str) -> GateResult:
    """The gate judged by `check`'s verdict (the round-off null on the candidate's own prompt): one more case,
    `check`, and `passed` follows it (MATCH / NOISE pass, DEFECT fails); the tolerance cases stay as evidence."""
    ok = Verdict(verdict) is not Verdict.DEFECT
    case = {"checkpoint": "check", "passed": ok, "problems": [] if ok else [headline], "method": "round-off null",
            "verdict": verdict, "headline": headline}
    return replace(r, passed=ok, cases=(*r.cases, case))


def junit_xml(r: GateResult) -> str:
    """JUnit XML: one testsuite, one testcase per checkpoint (failures carry the problems)."""
    fails = sum(not c["passed"] for c in r.cases)
    lines = ['<?xml version="1.0" encoding="UTF-8"?>',
             f'<testsuite name="v4parity-gate" tests="{len(r.cases)}" failures="{fails}" errors="0">']
    for c in r.cases:
        attrs = f'classname={quoteattr("v4parity." + Path(r.golden).name)} name={quoteattr(c["checkpoint"])}'
        if c["passed"]:
            lines.append(f"  <testcase {attrs}/>")
        else:
            msg = "; ".join(c["problems"])
            lines += [f"  <testcase {attrs}>", f"    <failure message={quoteattr(msg)}>{escape(msg)}</failure>",
                      "  </testcase>"]
    return "\n".join([*lines, "</testsuite>"]) + "\n"


def markdown(r: GateResult) -> str:
    """Markdown summary for CI annotations: verdict, failing checkpoints, then the full table."""
    head = "PASSED" if r.passed else "FAILED"
    lines = [f"### v4parity gate: {head}", "", f"golden `{r.golden}` vs candidate `{r.candidate}`", ""]
    lines += [f"> warning (forced): {w}" for w in r.report.warnings]
    if r.report.first_drift:
        f = r.report.first_drift
        lines += [f"First drifting checkpoint: **{f['checkpoint']}** from position {f['first_pos']} ({f['reason']})",
                  ""]
    lines += ["| checkpoint | status | method | max rel-L2 | rel_tol | max abs(RMS ratio - 1) | norm_tol |",
              "|---|---|---|---|---|---|---|"]
    verdicts = [c for c in r.cases if "verdict" in c]
    lines = [*lines, *(f"`check` (decides the gate): {c['headline']}" for c in verdicts), *([""] if verdicts else [])]
    lines += [f"| {c['checkpoint']} | {'pass' if c['passed'] else '**FAIL**'} | {c['method']} | {c['max_rel_l2']:.3e} "
              f"| {c['rel_tol']:g} | {'-' if c['max_norm_dev'] is None else format(c['max_norm_dev'], '.3e')} "
              f"| {c['norm_tol']:g} |" for c in r.cases if "verdict" not in c]
    for c in r.cases:
        lines += [f"- `{c['checkpoint']}`: {p}" for p in c["problems"] if "verdict" not in c]
    return "\n".join(lines) + "\n"
