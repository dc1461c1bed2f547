"""The typed results of `v4parity bench`, one frozen report per section: `PerfReport` (the performance tables,
OUT/bench.json) and `VerdictsReport` (check's false-DEFECT and detection rates, OUT/verdicts.json).

As `parity.validate.result.ValidateReport`: frozen at the top level, one field per JSON key (in the order the file
holds them), the nested values JSON-shaped as the measurements produce them. `to_dict()` is the JSON document
(`parity.compare.jsonvalues.json_safe`). Built from the measured document by `from_dict`, which refuses a missing
or unknown key by name; the Markdown printers (`parity.bench.measure.render_markdown`,
`parity.bench.verdicts.render_verdicts_markdown`) render that same document.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, ClassVar

from parity.compare.jsonvalues import json_safe
from parity.contract.errors import ParityError


class _Section:
    """A frozen section report read from and written as its JSON document."""

    OPTIONAL: ClassVar[tuple[str, ...]] = ()   # keys the document may lack (None here, left out of `to_dict`)

    @classmethod
    def json_keys(cls) -> tuple[str, ...]:
        """The document's keys, in file order."""
        return tuple(f.name for f in fields(cls))  # type: ignore[arg-type]

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> Any:
        """The report of a document: every key a field (ParityError naming unknown and missing keys)."""
        unknown = [k for k in doc if k not in cls.json_keys()]
        missing = [k for k in cls.json_keys() if k not in doc and k not in cls.OPTIONAL]
        if unknown or missing:
            raise ParityError(f"{cls.__name__}: unknown key(s) {unknown}, missing key(s) {missing}")
        return cls(**{k: doc.get(k) for k in cls.json_keys()})

    def _present(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.json_keys() if not (k in self.OPTIONAL and getattr(self, k) is None)}

    def to_dict(self) -> dict[str, Any]:
        """The JSON document (file order; absent optional keys left out; values spelled by `json_safe`)."""
        return json_safe(self._present())


@dataclass(frozen=True)
class PerfReport(_Section):
    """OUT/bench.json: the machine, the models, dequantizer throughput, trace-diff times, the engines' workers
    (`parity.bench.measure.run_bench`) and, with peers, the tiny-model engines."""

    OPTIONAL: ClassVar[tuple[str, ...]] = ("tiny_engines",)

    bench_version: int
    quick: bool
    device: str
    torch_threads: int
    machine: dict[str, Any]
    models: dict[str, dict[str, Any]]
    dequant_load: float
    dequant: list[dict[str, Any]]
    dequant_load_end: float
    trace_diff: dict[str, Any]
    engines: dict[str, Any]
    tiny_engines: dict[str, Any] | None
    wall_s: float
    load_end: float


@dataclass(frozen=True)
class VerdictsReport(_Section):
    """OUT/verdicts.json: `parity.bench.verdicts.run_verdicts`'s plan, rows and summary, and the plan's name."""

    alpha: float
    twins: int
    plan: dict[str, Any]
    rows: list[dict[str, Any]]
    summary: dict[str, Any]
    wall_s: float
    plan_name: str
