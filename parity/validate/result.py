"""The typed result of a validation: `ValidateReport` (what report.json holds) and `Timing` (timing.json, the only
part that depends on the machine and the executor). Both frozen, built once by the driver; printers in
`parity.validate.report`."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from parity.compare.jsonvalues import json_safe


@dataclass(frozen=True)
class Timing:
    """Wall and CPU seconds of one session (this call) and of every task stored in the run directory."""

    executor: str                    # `Executor.describe()`: in-process / N worker processes / Ray (...)
    wall_s_this_session: float
    tasks_this_session: int
    tasks: int
    engine_wall_s_all_tasks: float
    engine_cpu_s_all_tasks: float
    engine_wall_s_per_prompt: float
    engine_cpu_s_per_prompt: float

    def to_dict(self) -> dict[str, Any]:
        """The timing.json document (fields in this order)."""
        return json_safe(asdict(self))


@dataclass(frozen=True)
class ValidateReport:
    """A validation's verdict and evidence: the run settings, the summary (`parity.validate.summary.summarize`:
    aggregates, divergence profile, pins, budget rows, passed, findings) and the per-prompt records (timings
    removed, sorted by prompt index). Equal whichever executor produced it: `timing` is not compared.

    Frozen at the top level; the nested values are the summary's own dicts and lists (JSON-shaped, as report.json
    holds them). Read it by attribute (`report.passed`); it is not a mapping (`to_dict()` is the document)."""

    format: str
    version: int
    model: dict[str, Any]            # `Weights.identity()`: file, size, header_sha256, data_sha256
    exact: str
    approx: str
    n: int
    prompt_sources: str
    decode: int
    steps: int
    seed: int
    top_k: int
    tie_margin: float
    drift_tol: float
    bootstrap: int
    alpha: float
    beta: float
    aggregates: dict[str, dict[str, Any]]
    divergence: dict[str, Any]
    pins: dict[str, dict[str, Any]]
    budget: list[dict[str, Any]] | None
    passed: bool
    findings: list[str]
    records: list[dict[str, Any]]
    timing: Timing = field(compare=False)

    def to_dict(self) -> dict[str, Any]:
        """The report.json document: every field but `timing`, non-finite values spelled by `json_safe`."""
        return json_safe({k: getattr(self, k) for k in _KEYS})


_KEYS = tuple(f.name for f in fields(ValidateReport) if f.name != "timing")   # the report.json keys
