"""Arbitration: several engines on the same tokens; per checkpoint, which engines agree with which.

Without `check` reports (rule "tolerance"): two engines agree at a checkpoint when the largest per-position rel-L2
between their vectors is within the checkpoint's tolerance; the clusters are the connected groups of agreeing engines
(largest first, ties by the order the engines were given). The odd ones out are the engines outside the largest
cluster at the first checkpoint (in depth order) where the engines split.

With each engine's `check` report (`arbitrate --check`, rule "check": `judged_by_checks`) the clusters are `check`'s
judgement, so the two never disagree about a run: an engine departs at a checkpoint when `check` calls its run
DEFECT and the checkpoint is at or after its culprit (the first checkpoint of the culprit layer that `check`'s table
does not mark `ok`; the embedding for a culprit outside every block); engines that do not depart there agree (each
is within the reference's round-off null, or explained as benign); departing engines agree when `check` names the
same known fault at the same layer (an "unexplained" one stands alone). The pairwise rel-L2 stays as evidence.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from parity.compare.jsonvalues import json_safe
from parity.compare.metrics import rel_l2
from parity.compare.verdict import CauseKind, RowStatus, Verdict
from parity.contract.checkpoints import EMBED, LOGITS, block, block_attn, checkpoint_layer, trace_checkpoints
from parity.tracing.runner import ChunkResult, all_tokens, stack


@dataclass(frozen=True)
class CheckpointClusters:
    name: str
    tolerance: float
    clusters: tuple[tuple[str, ...], ...]     # largest first
    pairs: dict[str, float]                   # "a~b" -> max over positions of rel-L2


@dataclass(frozen=True)
class Arbitration:
    engines: tuple[str, ...]
    tokens: tuple[int, ...]                   # every engine ran these (decode tokens: the first engine's greedy ones)
    n_prompt: int
    checkpoints: tuple[CheckpointClusters, ...]
    first_split: str | None                   # first checkpoint where the engines do not all agree
    odd_ones_out: tuple[str, ...]             # outside the largest cluster at first_split
    greedy_disagreements: dict[str, int]      # decode steps whose argmax differs from the first engine's token
    # `arbitrate --check`: engine -> its `check` report (parity.check.check.CheckReport); empty without it
    checks: dict[str, Any] = field(default_factory=dict)
    rule: str = "tolerance"                   # how engines agree: "tolerance" (rel-L2 <= tol) | "check" (verdicts)

    @property
    def unanimous(self) -> bool:
        return self.first_split is None

    def to_dict(self) -> dict:
        """The JSON document of `arbitrate --json` (pairs spelled by `json_safe`)."""
        return {"engines": list(self.engines), "tokens": list(self.tokens), "n_prompt": self.n_prompt,
                "rule": self.rule, "first_split": self.first_split, "odd_ones_out": list(self.odd_ones_out),
                "greedy_disagreements": self.greedy_disagreements,
                "checkpoints": [{"name": c.name, "tolerance": c.tolerance, "clusters": [list(g) for g in c.clusters],
                                 "pairs": {k: json_safe(v) for k, v in c.pairs.items()}} for c in self.checkpoints]}


def clusters(engines: Sequence[str], agree: Callable[[str, str], bool]) -> tuple[tuple[str, ...], ...]:
    """Connected components of the agreement graph, largest first (ties: order of `engines`)."""
    parent = {e: e for e in engines}

    def root(e: str) -> str:
        while parent[e] != e:
            e = parent[e]
        return e

    for i, a in enumerate(engines):
        for b in engines[i + 1:]:
            if agree(a, b):
                parent[root(b)] = root(a)
    groups: dict[str, list[str]] = {}
    for e in engines:
        groups.setdefault(root(e), []).append(e)
    return tuple(sorted((tuple(g) for g in groups.values()), key=lambda g: (-len(g), engines.index(g[0]))))


def arbitrate_runs(runs: Mapping[str, Sequence[ChunkResult]], n_prompt: int,
                   tolerance: Callable[[str], float]) -> Arbitration:
    """Cluster the engines' runs (same tokens, same chunk schedule) at every checkpoint and the logits."""
    engines = tuple(runs)
    first = runs[engines[0]]
    n_layers = len(first[0].diags)
    out = []
    for name in [*trace_checkpoints(n_layers), LOGITS]:
        vec = {e: stack(runs[e], name) for e in engines}
        pairs = {f"{a}~{b}": float(rel_l2(vec[a], vec[b]).max())
                 for i, a in enumerate(engines) for b in engines[i + 1:]}
        tol = tolerance(name)
        out.append(CheckpointClusters(name, tol, clusters(engines, lambda a, b, p=pairs, t=tol: p[f"{a}~{b}"] <= t),
                                      pairs))
    split = next((c for c in out if len(c.clusters) > 1), None)
    tokens = all_tokens(first)
    greedy = {}
    for e in engines[1:]:
        own = [int(np.argmax(c.logits[-1])) for c in runs[e]][:-1]
        ref = [int(t) for t in tokens[n_prompt:]]
        steps = own[len(own) - len(ref):] if ref else []
        greedy[e] = sum(a != b for a, b in zip(steps, ref, strict=True))
    return Arbitration(engines, tuple(int(t) for t in tokens), n_prompt, tuple(out),
                       split.name if split else None,
                       tuple(e for g in split.clusters[1:] for e in g) if split else (), greedy)


def departs_from(report: Any, names: Sequence[str]) -> int | None:
    """Index in `names` (the arbitration's checkpoints, depth order) from which `check`'s report calls the run
    departed: None unless DEFECT; a culprit outside every block (layer None) from the embedding; a trunk layer L from
    the first checkpoint of L (or later) that the report's table does not mark `ok`, else from blk.L; a culprit after
    the trunk (the drafter) never."""
    if report.verdict != Verdict.DEFECT:
        return None
    c = report.culprit
    layer = c.layer if c is not None else None
    if isinstance(layer, str):         # "drafter <checkpoint>": after every trunk checkpoint
        return None
    if layer is None:
        return names.index(EMBED) if EMBED in names else 0
    status = {r.checkpoint: r.status for r in report.table}
    later = [i for i, n in enumerate(names) if n == LOGITS or (checkpoint_layer(n) is not None
                                                             and checkpoint_layer(n) >= layer)]
    unjudged = [names[i] for i in later if names[i] not in status]
    if unjudged:   # the arbitration's checkpoints are the judged trace's: a gap is a mismatch, never "ok"
        raise ValueError(f"check's table has no row for checkpoint(s) {', '.join(unjudged[:3])} of the arbitration")
    bad = [i for i in later if status[names[i]] != RowStatus.OK]
    return bad[0] if bad else next(i for i, n in enumerate(names) if n in (block_attn(layer), block(layer)))


def _defect_key(engine: str, report: Any) -> str:
    """What two departing engines share when `check` names the same known fault at the same layer."""
    name = next((c.name for c in report.causes if c.kind == CauseKind.DEFECT), "unexplained")
    layer = report.culprit.layer if report.culprit is not None else None
    return f"unexplained:{engine}" if name == "unexplained" else f"{name}@{layer}"


def judged_by_checks(a: Arbitration, checks: Mapping[str, Any]) -> Arbitration:
    """The arbitration re-clustered by each engine's `check` report (see the module doc): clusters, first split and
    odd ones out follow the verdicts; pairs (rel-L2) and greedy disagreements are kept. Every engine needs a report."""
    missing = [e for e in a.engines if e not in checks]
    if missing:
        raise ValueError(f"judged_by_checks: no check report for engine(s) {', '.join(missing)}")
    names = [c.name for c in a.checkpoints]
    start = {e: departs_from(checks[e], names) for e in a.engines}
    out = []
    for i, c in enumerate(a.checkpoints):
        key = {e: ("ok" if start[e] is None or i < start[e] else _defect_key(e, checks[e])) for e in a.engines}
        out.append(replace(c, clusters=clusters(a.engines, lambda x, y, k=key: k[x] == k[y])))
    split = next((c for c in out if len(c.clusters) > 1), None)
    return replace(a, checkpoints=tuple(out), first_split=split.name if split else None,
                   odd_ones_out=tuple(e for g in split.clusters[1:] for e in g) if split else (),
                   checks=dict(checks), rule="check")


def summary_lines(a: Arbitration) -> list[str]:
    """The report a person reads: the verdict line, then one line per checkpoint with its clusters."""
    by = " by each engine's `check` verdict" if a.rule == "check" else ""
    if a.unanimous:
        head = f"all {len(a.engines)} engines agree{by} at every checkpoint ({', '.join(a.engines)})"
    else:
        head = (f"engines split{by} first at {a.first_split}: odd one(s) out {', '.join(a.odd_ones_out)} "
                f"(the others agree with each other)")
    lines = [head]
    if a.greedy_disagreements:
        lines.append("greedy decode vs " + a.engines[0] + ": " + ", ".join(
            f"{e} {n} step(s) differ" for e, n in a.greedy_disagreements.items()))
    width = max(len(c.name) for c in a.checkpoints)
    for c in a.checkpoints:
        groups = " | ".join("{" + ", ".join(g) + "}" for g in c.clusters)
        worst = max(c.pairs.values()) if c.pairs else 0.0
        rule = "check" if a.rule == "check" else f"tol {c.tolerance:.2g}"
        lines.append(f"{c.name:<{width}}  {groups}  ({rule}, worst pair {worst:.3g})")
    return lines
