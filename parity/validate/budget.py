"""Budget files: one bound per line, `metric <= value` or `metric >= value`; `#` starts a comment.

A `<=` bound passes when the metric's upper 95 % CI bound is at most the value, a `>=` bound when its lower
CI bound is at least the value (so a pass is a claim the sample supports, not a point estimate that happens
to fall inside). Metric names are the keys of the report's `aggregates`, e.g. `divergence_rate <= 0.05`,
`kl_mean <= 1e-3`, `top1_agreement >= 0.99`, `rel_l2.blk.5.p99 <= 0.01`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from parity.contract.errors import ParityError


class BudgetError(ParityError):
    """A budget file line that does not parse or names an unknown metric."""


@dataclass(frozen=True)
class Bound:
    metric: str
    op: str          # "<=" | ">="
    value: float
    line: int


_LINE = re.compile(r"^\s*([A-Za-z0-9_.\-]+)\s*(<=|>=)\s*(\S+)\s*$")


def parse_budget(text: str, source: str = "budget") -> list[Bound]:
    bounds = []
    for no, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0]
        if not line.strip():
            continue
        m = _LINE.match(line)
        if not m:
            raise BudgetError(f"{source}:{no}: expected 'metric <= value' or 'metric >= value', got {raw.strip()!r}")
        try:
            value = float(m.group(3))
        except ValueError:
            raise BudgetError(f"{source}:{no}: {m.group(3)!r} is not a number") from None
        if not math.isfinite(value):
            raise BudgetError(f"{source}:{no}: bound {m.group(3)!r} is not finite")
        bounds.append(Bound(m.group(1), m.group(2), value, no))
    if not bounds:
        raise BudgetError(f"{source}: no bounds")
    return bounds


def check_names(bounds: list[Bound], metrics: set[str], source: str = "budget") -> None:
    unknown = [b for b in bounds if b.metric not in metrics]
    if unknown:
        raise BudgetError(f"{source}:{unknown[0].line}: unknown metric {unknown[0].metric!r}; known: "
                          f"{', '.join(sorted(m for m in metrics if not m.startswith('rel_l2.')))}, rel_l2.blk.N.STAT")


def judge(bounds: list[Bound], aggregates: dict[str, dict]) -> list[dict]:
    """One row per bound: the CI bound used, and whether it passed."""
    rows = []
    for b in bounds:
        lo, hi = aggregates[b.metric]["ci"]
        used = hi if b.op == "<=" else lo
        ok = used <= b.value if b.op == "<=" else used >= b.value
        rows.append({"metric": b.metric, "op": b.op, "value": b.value, "ci_bound": used, "passed": bool(ok)})
    return rows
