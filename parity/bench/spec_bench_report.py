"""The plan and the typed result of the fitted-drafter acceptance benchmark (`parity.bench.spec_acceptance`,
OUT/spec_acceptance.json): frozen records, one field per JSON key, built by the benchmark as it runs (`run_row`,
`aggregate`, `fit_drafters`, `run_spec_bench`), read from a stored document by `from_dict` (which refuses a missing
or unknown key or a scalar of another type by name), written by `to_dict` exactly as the dict-based benchmark wrote
them and printed from the records (`parity.bench.spec_acceptance.render_markdown`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from parity.bench.reports import JsonRecord, as_tuple, each, plain_record, values
from parity.spec.attribution import StateDivergence


@dataclass(frozen=True)
class SpecBenchPlan(JsonRecord):
    """What `run_spec_bench` runs. heads: mtpK (MTP chain depth K) and dspark (one block of B a round); sims:
    QAT settings (False: --no-fp8-kv --no-fp4-indexer, True: both simulations on); fit_steps: Adam steps per
    drafter kind; fit_prompts: how many of the benchmark prompts the drafters are fitted on (None: all);
    reuse_fits: reuse a drafter fitted earlier in the work directory on the same prompts, steps and seed."""

    NESTED: ClassVar[dict[str, Any]] = {"engines": as_tuple, "heads": as_tuple, "sims": as_tuple}

    prompts: int
    prompt_len: int
    steps: int
    engines: tuple[str, ...]
    heads: tuple[str, ...]
    sims: tuple[bool, ...]
    fit_steps: dict[str, int]
    seed: int = 0
    fit_prompts: int | None = None
    reuse_fits: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class FitSummary(JsonRecord):
    """One fitted drafter: its file, Adam steps, agreement per slot (fitted / held-out prompts, and a random
    drafter's), the anchors or rounds counted (training, held-out) and the seconds of each phase."""

    path: str
    steps: int
    agreement: dict[str, list[float]]
    counted: list[int]
    seconds: dict[str, float]


@dataclass(frozen=True)
class EnvelopeTime(JsonRecord):
    """The envelope of one (engine, QAT setting): its logits rel-L2 and the seconds to find or measure it."""

    logit_rel: float
    seconds: float


@dataclass(frozen=True)
class RunDivergence(JsonRecord):
    """A run's first divergence: its class (TIE / WRONG), step and whether speculation induced it."""

    KEYS: ClassVar[dict[str, str]] = {"cls": "class"}

    cls: str
    step: int
    spec_induced: bool | None


@dataclass(frozen=True)
class RunRow(JsonRecord):
    """One spec run of the grid, read off its `SpecReport`."""

    NESTED: ClassVar[dict[str, Any]] = {"divergence": RunDivergence.from_dict,
                                        "state_divergence": plain_record(StateDivergence)}

    engine: str
    head: str
    sims: bool
    prompt: int
    exact: bool
    divergence: RunDivergence | None
    state_checked: bool
    state_equal: bool
    state_divergence: StateDivergence | None
    labels: dict[str, int]
    committed: dict[str, int]
    per_slot: list[float | None]
    reference_per_slot: list[float | None]
    mean_accepted: float
    cost: dict[str, int]
    defects: list[str]
    seconds: float


@dataclass(frozen=True)
class Cell(JsonRecord):
    """One grid cell (engine, head, QAT setting) over its prompts: runs, exact runs, runs with equal states, runs
    exiting 0, label counts (non-zero), whether only correct labels occurred, committed verdicts, first
    divergences' classes, mean acceptance per slot (online, offline), drafts accepted per round, trunk rows, time."""

    sims: bool
    engine: str
    head: str
    runs: int
    exact: int
    state_equal: int
    exit_0: int
    labels: dict[str, int]
    only_correct_labels: bool
    committed: dict[str, int]
    divergences: dict[str, int]
    per_slot: list[float | None]
    reference_per_slot: list[float | None]
    mean_accepted: float
    rounds: int
    verify_rows: int
    replayed_rows: int
    seconds: float


@dataclass(frozen=True)
class SpecBenchResult(JsonRecord):
    """OUT/spec_acceptance.json: the plan, the prompts, the fitted drafters, the envelopes, the grid's cells and
    runs, the total seconds and the load average (1, 5, 15 min) at the start and the end."""

    NESTED: ClassVar[dict[str, Any]] = {"plan": SpecBenchPlan.from_dict, "fits": values(FitSummary.from_dict),
                                        "envelopes": values(EnvelopeTime.from_dict), "cells": each(Cell.from_dict),
                                        "runs": each(RunRow.from_dict)}

    plan: SpecBenchPlan
    prompts: list[list[int]]
    fits: dict[str, FitSummary]
    envelopes: dict[str, EnvelopeTime]
    cells: list[Cell]
    runs: list[RunRow]
    seconds: float
    load_avg_start: list[float]
    load_avg_end: list[float]
