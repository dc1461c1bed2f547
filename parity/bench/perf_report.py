"""The typed result of `v4parity bench`'s performance section (OUT/bench.json): frozen records, one field per JSON
key in the order the file holds them, built where the numbers are measured (`parity.bench.measure`:
`time_prefill_decode` -> `TimedRun`, `time_tracing` -> `TracingTime`, `run_worker` -> `WorkerResult`, `_dequant_row`
-> `DequantRow`, `time_trace_diff` -> `TraceDiffTime`, `machine_info` -> `Machine`, `run_bench` -> `PerfReport`),
and printed from the records (`parity.bench.measure.render_markdown`, `summary_rows`, `thread_rows`, ...).

A worker process answers with its `WorkerResult`'s document on stdout; the orchestrator reads it back with
`from_dict` (which refuses a missing or unknown key, or a scalar of another type, by name). `to_dict()` writes
bench.json exactly as the dict-based bench did (tests/fixtures/bench/bench.json, written by that code).

Optional keys (absent from the document where None) are the ones the printers leave out of a table when missing:
the load averages and CPU times recorded beside a timing, the thread counts of a worker (documents of earlier bench
versions lack them; hand-made reports in the tests too), and the two-thread dequantizer throughputs (measured on the
CPU only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from parity.bench.reports import JsonRecord, each, values


@dataclass(frozen=True)
class Machine(JsonRecord):
    """What the numbers were measured on: CPU model, cores (None where the OS cannot tell), memory (GiB), versions,
    the 1/5/15-minute load averages at the start, the CUDA device's name (None without one)."""

    cpu: str
    cores: int | None
    memory_gb: float
    python: str
    numpy: str
    torch: str
    load_avg_start: list[float]
    cuda: str | None


@dataclass(frozen=True)
class ModelSize(JsonRecord):
    """A benchmark GGUF: its path and size in GiB."""

    path: str
    gib: float


@dataclass(frozen=True)
class DequantRow(JsonRecord):
    """One type's dequantizer throughput (M values/s) for gguf.quants and both engines on the same bytes, the
    engines' speed-ups over gguf.quants, bit-exactness against it and (CPU only) two dequantizers at once."""

    OPTIONAL: ClassVar[tuple[str, ...]] = ("reference_mvs_2t", "torch_mvs_2t")

    type: str
    values: int
    gguf_mvs: float
    reference_mvs: float
    torch_mvs: float
    reference_speedup: float
    torch_speedup: float
    reference_exact: bool
    torch_exact: bool
    reference_mvs_2t: float | None
    torch_mvs_2t: float | None


@dataclass(frozen=True)
class TraceDiffTime(JsonRecord):
    """`api.diff` of two real-size .npz traces: checkpoints x positions, seconds, the load and CPU seconds of a
    call, the first drifting checkpoint found, the two files' MiB."""

    OPTIONAL: ClassVar[tuple[str, ...]] = ("load", "cpu_s")

    checkpoints: int
    positions: int
    from_npz_s: float
    load: float | None
    cpu_s: float | None
    first_drift: str | None
    npz_mb: float


@dataclass(frozen=True)
class TimedRun(JsonRecord):
    """An n-token prefill and its decode steps (medians over `reps`): load average, CPU seconds, wall seconds total
    and per layer (decode: None / [] without decode steps)."""

    OPTIONAL: ClassVar[tuple[str, ...]] = ("load", "prefill_cpu_s", "decode_cpu_s")

    prompt: int
    reps: int
    decode_steps: int
    load: float | None
    prefill_cpu_s: float | None
    decode_cpu_s: float | None
    prefill_s: float
    prefill_all_s: list[float]
    prefill_layer_s: list[float]
    decode_s: float | None
    decode_layer_s: list[float]


@dataclass(frozen=True)
class TracingTime(JsonRecord):
    """The cost of recording a fingerprint trace of every position: forward and recorder seconds (medians), their
    ratio, the load average."""

    OPTIONAL: ClassVar[tuple[str, ...]] = ("load",)

    prompt: int
    reps: int
    forward_s: float
    record_s: float
    overhead: float
    load: float | None


@dataclass(frozen=True)
class WorkerResult(JsonRecord):
    """One engine's worker process (or its per-length workers merged): what it loaded, its timed runs and tracing
    cost, peak memory (GiB), cache statistics (None: no cache), thread counts, load averages."""

    OPTIONAL: ClassVar[tuple[str, ...]] = ("threads",)
    NESTED: ClassVar[dict[str, Any]] = {"runs": each(TimedRun.from_dict), "tracing": TracingTime.from_dict}

    engine: str
    engine_version: str
    device: str
    model: str
    n_layers: int
    ratios: list[int]
    load_s: float
    runs: list[TimedRun]
    tracing: TracingTime | None
    peak_rss_anon_gb: float
    peak_rss_gb: float
    model_file_gb: float
    cache: dict[str, Any] | None
    blas_threads: str | None
    usable_cpus: int
    threads: dict[str, int] | None
    load_start: float
    load_end: float


@dataclass(frozen=True)
class PerfReport(JsonRecord):
    """OUT/bench.json: the machine, the models, dequantizer throughput, trace-diff times, the engines' workers
    (`parity.bench.measure.run_bench`) and, with peers, the tiny-model engines."""

    OPTIONAL: ClassVar[tuple[str, ...]] = ("tiny_engines",)
    NESTED: ClassVar[dict[str, Any]] = {
        "machine": Machine.from_dict, "models": values(ModelSize.from_dict), "dequant": each(DequantRow.from_dict),
        "trace_diff": TraceDiffTime.from_dict, "engines": values(WorkerResult.from_dict),
        "tiny_engines": values(WorkerResult.from_dict)}

    bench_version: int
    quick: bool
    device: str
    torch_threads: int
    machine: Machine
    models: dict[str, ModelSize]
    dequant_load: float
    dequant: list[DequantRow]
    dequant_load_end: float
    trace_diff: TraceDiffTime
    engines: dict[str, WorkerResult]
    tiny_engines: dict[str, WorkerResult] | None
    wall_s: float
    load_end: float
