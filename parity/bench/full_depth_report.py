"""The typed result of the full-depth bench (`parity.bench.full_depth`, OUT/full_depth.json): frozen records, one
field per JSON key, built by the bench as each step is measured (`parity.bench.full_depth.run`, `verdict`, `drift`),
read back from an earlier OUT/full_depth.json by `from_dict` (which refuses a missing or unknown key, a scalar of
another type or a mistyped verdict by name), written by `to_dict` exactly as the dict-based bench wrote them and
printed from the records (`parity.bench.full_depth.render_markdown`).

A step's row holds the measurement of its child process (the fields of `Measured`, the frozen record
`parity.bench.full_depth.run_measured` returns) and, spliced into the same JSON object, what the child printed: a
check step's verdict (`CheckFound`) or error, a diff step's drift (`DiffFound`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from parity.bench.reports import JsonRecord, one_of, values
from parity.compare.verdict import Judged, Verdict


@dataclass(frozen=True)
class CheckFound(JsonRecord):
    """`check --json`'s verdict, level, culprit, causes and own seconds (the culprit and causes as check's JSON
    document holds them), and where its envelope came from."""

    OPTIONAL: ClassVar[tuple[str, ...]] = ("envelope_source",)
    NESTED: ClassVar[dict[str, Any]] = {"verdict": one_of(Verdict), "judged": one_of(Judged)}

    verdict: Verdict
    judged: Judged
    culprit: dict[str, Any] | None
    causes: list[dict[str, Any]]
    seconds: float
    envelope_source: str | None = None


@dataclass(frozen=True)
class DiffFound(JsonRecord):
    """`diff --json`'s agreement, first drifting checkpoint (diff's record of it: checkpoint, layer, positions,
    rel-L2, reason, ...), each checkpoint's worst rel-L2 over positions and the logits' largest rel-L2 (None /
    empty when the diff printed none: an error)."""

    agree: bool | None
    first_drift: dict[str, Any] | None
    rel_l2: dict[str, Any]
    logits_rel_l2_max: float | None


@dataclass(frozen=True)
class SpeedFound(JsonRecord):
    """Whole-model speed of one engine as its users run it (`parity.bench.engine_speed`): engine, prompt tokens,
    decode steps, repetitions, CPU threads, model load seconds, then medians over the repetitions: prefill seconds,
    seconds per decode step, their CPU seconds, the 1-minute load average, and (engines run layer by layer
    through the harness) each layer's prefill and decode-step seconds."""

    OPTIONAL: ClassVar[tuple[str, ...]] = ("prefill_layer_s", "decode_layer_s")

    engine: str
    prompt: int
    decode_steps: int
    reps: int
    threads: int
    load_s: float
    prefill_s: float
    decode_s: float | None
    prefill_cpu_s: float | None
    decode_cpu_s: float | None
    load: float | None
    prefill_layer_s: list[float] | None = None
    decode_layer_s: list[float] | None = None


@dataclass(frozen=True)
class Measured:
    """One child process as `parity.bench.full_depth.run_measured` measured it: argv, exit status, why it was killed
    (or None), wall / CPU / user / system seconds, peak RSS total and anonymous (bytes), 1-minute load before and
    after, its stderr log (the first fields of its `StepRow`)."""

    argv: list[str]
    exit: int
    killed: str | None
    wall_s: float
    cpu_s: float
    user_s: float
    sys_s: float
    peak_rss: int
    peak_anon: int
    load_before: float
    load_after: float
    log: str


@dataclass(frozen=True)
class StepRow(JsonRecord, Measured):
    """One measured step: what `Measured` holds (argv, exit status, why it was killed, times, peak RSS, load, its
    stderr log), then what it is, the sizes of the files it wrote; then what its output said (check / diff /
    an engine's speed), or check's error; for a parallel check, the serial step it repeats and whether the two
    JSON reports are the same apart from their wall-clock seconds."""

    OPTIONAL: ClassVar[tuple[str, ...]] = ("error", "speed", "same_report_as", "same_report")
    SPLICED: ClassVar[dict[str, type[JsonRecord]]] = {"check": CheckFound, "diff": DiffFound}
    NESTED: ClassVar[dict[str, Any]] = {"speed": SpeedFound.from_dict}

    what: str
    sizes: dict[str, int]
    check: CheckFound | None = None
    error: str | None = None
    diff: DiffFound | None = None
    speed: SpeedFound | None = None
    same_report_as: str | None = None
    same_report: bool | None = None


@dataclass(frozen=True)
class ModelFile(JsonRecord):
    """The model the steps ran on: its path and size in bytes (None when it does not exist)."""

    path: str
    bytes: int | None


@dataclass(frozen=True)
class FullDepthResult(JsonRecord):
    """OUT/full_depth.json: the measured steps by name (in the order they were first run) and the model file."""

    OPTIONAL: ClassVar[tuple[str, ...]] = ("model",)
    NESTED: ClassVar[dict[str, Any]] = {"steps": values(StepRow.from_dict), "model": ModelFile.from_dict}

    steps: dict[str, StepRow]
    model: ModelFile | None = None
