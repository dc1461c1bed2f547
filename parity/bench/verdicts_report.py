"""The typed result of the verdict benchmark (`parity.bench.verdicts`, OUT/verdicts.json): frozen records, one field
per JSON key in the order the file holds them, built by the benchmark as each run is judged (`verdicts._judge` ->
`CorrectRow` / `FaultRow` / `TieRow`) and aggregated (`verdicts.summarize` -> `VerdictSummary`), printed from the
records (`verdicts.render_verdicts_markdown`) and written by `to_dict` exactly as the dict-based benchmark wrote them
(tests/fixtures/bench/verdicts.json / .md, written by that code).

A row's keys depend on its kind (`ROW_KINDS`): every row has the run's description, `check`'s verdict and cost;
a faulty run adds the first layer where its fault acts (None: inert) and whether it was detected and found, a
tie-breaking run the router picks the fault changed there and what was expected. `subops` is absent from the runs
traced without that choice (the QAT-off baselines, llama.cpp captures).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from parity.bench.reports import JsonRecord, each, one_of, values
from parity.compare.verdict import Judged, Verdict
from parity.contract.errors import ParityError


@dataclass(frozen=True)
class RowBase(JsonRecord):
    """What every row holds: the run (kind, engine, model, QAT setting, fault, prompt length, seed, sub-op records,
    decode steps, wall seconds) and `check`'s verdict, headline, culprit, causes, what it judged on, own seconds and
    layer-runs."""

    OPTIONAL: ClassVar[tuple[str, ...]] = ("subops",)
    NESTED: ClassVar[dict[str, Any]] = {"verdict": one_of(Verdict), "judged": one_of(Judged)}

    kind: str
    engine: str
    model: str
    qat: bool
    fault: str | None
    prompt: int
    seed: int
    subops: bool | None
    decode: int
    wall_s: float
    verdict: Verdict
    headline: str
    culprit_layer: int | None
    culprit_subop: str | None
    cause: str | None
    causes: list[str]
    judged: Judged
    seconds: float
    layer_runs: dict[str, int]
    layer_runs_total: int


@dataclass(frozen=True)
class CorrectRow(RowBase):
    """A correct candidate: a false DEFECT when check says DEFECT."""

    false_defect: bool


@dataclass(frozen=True)
class FaultRow(RowBase):
    """A faulty candidate: the first layer where the fault acts (None: inert on this prompt), detected (DEFECT) and
    found (DEFECT naming that fault at that layer)."""

    expected_layer: int | None
    detected: bool
    found: bool


@dataclass(frozen=True)
class TieRow(JsonRecord):
    """The tie-breaking fault where exact ties exist: the fields of `RowBase` (its run described in the order of
    the tie task, `verdicts._tasks`: kind, engine, qat, fault, subops, model, prompt, seed), its first acting layer,
    the picks it changed there, the expected verdict (TIE with one changed pick, DEFECT with more) and whether check
    gave it."""

    NESTED: ClassVar[dict[str, Any]] = RowBase.NESTED

    kind: str
    engine: str
    qat: bool
    fault: str | None
    subops: bool
    model: str
    prompt: int
    seed: int
    decode: int
    wall_s: float
    verdict: Verdict
    headline: str
    culprit_layer: int | None
    culprit_subop: str | None
    cause: str | None
    causes: list[str]
    judged: Judged
    seconds: float
    layer_runs: dict[str, int]
    layer_runs_total: int
    expected_layer: int | None
    changed_picks: int
    expected: str
    found: bool


VerdictRow = CorrectRow | FaultRow | TieRow
ROW_KINDS: dict[str, type[JsonRecord]] = {"correct": CorrectRow, "fault": FaultRow, "tie": TieRow}


def read_row(doc: Mapping[str, Any]) -> VerdictRow:
    """The record of one row document, by its kind (ParityError naming an unknown kind)."""
    kind = doc.get("kind") if isinstance(doc, Mapping) else None
    if kind not in ROW_KINDS:
        raise ParityError(f"verdict row: kind {kind!r} is not one of {list(ROW_KINDS)}")
    return ROW_KINDS[kind].from_dict(doc)  # type: ignore[no-any-return]


@dataclass(frozen=True)
class Times(JsonRecord):
    """Time per check over some rows: how many, median and max seconds, median layer-runs (None: no rows)."""

    n: int
    median_s: float | None
    max_s: float | None
    median_layer_runs: float | None


@dataclass(frozen=True)
class GroupStats(JsonRecord):
    """One group of correct candidates: verdict counts, false DEFECTs, then its `Times`."""

    SPLICED: ClassVar[dict[str, type[JsonRecord]]] = {"times": Times}

    verdicts: dict[str, int]
    false_defects: int
    times: Times


@dataclass(frozen=True)
class CorrectSummary(JsonRecord):
    """The correct candidates: count, verdict counts, false DEFECTs, their rate and its 95 % upper bound (None: no
    runs), per group."""

    NESTED: ClassVar[dict[str, Any]] = {"groups": values(GroupStats.from_dict)}

    n: int
    verdicts: dict[str, int]
    false_defects: int
    false_defect_rate: float | None
    false_defect_rate_upper95: float | None
    groups: dict[str, GroupStats]


@dataclass(frozen=True)
class FaultCount(JsonRecord):
    """One model and fault: runs, acting runs, detected, found."""

    n: int
    acting: int
    detected: int
    found: int


@dataclass(frozen=True)
class QatCount(JsonRecord):
    """One model and QAT setting (acting runs): runs, detected, found."""

    n: int
    detected: int
    found: int


@dataclass(frozen=True)
class FaultSummary(JsonRecord):
    """The faulty candidates: runs, acting, inert, detected, found, the two rates (None: none acting), per fault
    and per QAT setting."""

    NESTED: ClassVar[dict[str, Any]] = {"per_fault": values(FaultCount.from_dict),
                                        "per_qat": values(QatCount.from_dict)}

    n: int
    acting: int
    inert: int
    detected: int
    found: int
    detection_rate: float | None
    found_rate: float | None
    per_fault: dict[str, FaultCount]
    per_qat: dict[str, QatCount]


@dataclass(frozen=True)
class Brief(JsonRecord):
    """A run named in the summary: engine, model, QAT, fault, prompt, seed, expected layer, verdict, headline."""

    NESTED: ClassVar[dict[str, Any]] = {"verdict": one_of(Verdict)}

    engine: str
    model: str
    qat: bool
    fault: str | None
    prompt: int
    seed: int
    expected_layer: int | None
    verdict: Verdict
    headline: str


@dataclass(frozen=True)
class TieBrief(Brief):
    """A tie-breaking run: its `Brief`, the picks changed, the expected verdict, whether check gave it."""

    changed_picks: int
    expected: str
    found: bool


@dataclass(frozen=True)
class TimeSummary(JsonRecord):
    """Time per check: all rows, correct, faulty, and per model against the prompt length (correct torch runs,
    QAT on)."""

    NESTED: ClassVar[dict[str, Any]] = {"all": Times.from_dict, "correct": Times.from_dict, "faults": Times.from_dict,
                                        "by_length": values(values(Times.from_dict))}

    all: Times
    correct: Times
    faults: Times
    by_length: dict[str, dict[str, Times]]


@dataclass(frozen=True)
class VerdictSummary(JsonRecord):
    """The aggregates of the rows (`parity.bench.verdicts.summarize`)."""

    NESTED: ClassVar[dict[str, Any]] = {
        "correct": CorrectSummary.from_dict, "faults": FaultSummary.from_dict, "ties": each(TieBrief.from_dict),
        "false_defects": each(Brief.from_dict), "misses": each(Brief.from_dict), "time": TimeSummary.from_dict}

    correct: CorrectSummary
    faults: FaultSummary
    ties: list[TieBrief]
    false_defects: list[Brief]
    misses: list[Brief]
    time: TimeSummary


@dataclass(frozen=True)
class VerdictsReport(JsonRecord):
    """OUT/verdicts.json: `parity.bench.verdicts.run_verdicts`'s plan, rows and summary, and the plan's name."""

    NESTED: ClassVar[dict[str, Any]] = {"rows": each(read_row), "summary": VerdictSummary.from_dict}

    alpha: float
    twins: int
    plan: dict[str, Any]
    rows: list[VerdictRow]
    summary: VerdictSummary
    wall_s: float
    plan_name: str
