"""Real-dimension performance of both engines, measured side by side (`v4parity bench`).

Every engine measurement runs in its own worker process (`python -m parity.bench.measure worker SPEC_JSON`):
peak memory is then per engine, BLAS threading is fixed before NumPy loads, and one engine's caches
never warm the other's. Inside a worker each number is the median of several runs. The orchestrator
(`run_bench`) writes/caches the real-dimension GGUFs, measures the dequantizers in-process, starts the
workers, and returns the frozen `parity.bench.perf_report.PerfReport` (each record built where its numbers are
measured; a worker answers with its `WorkerResult`'s document); `render_markdown` turns it into the table for the
docs.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from parity.bench import perf_report as perf
from parity.bench.perf_report import PerfReport, TimedRun, TracingTime, WorkerResult
from parity.contract.errors import ParityError
from parity.contract.progress import SILENT, Note, ProgressSink

BENCH_VERSION = 1            # part of the cached file names: bump when synth_real's output changes
DEQUANT_VALUES = 1 << 23     # 8 M values per type = one 2048 x 4096 routed expert
# prompt length -> runs per engine (the median of the runs is reported); the scaling lengths run once.
PLANS = {
    "reference": {"lengths": {24: 3, 128: 2, 512: 1}, "decode_steps": 2, "trace_reps": 2},
    "torch-cpu": {"lengths": {24: 3, 128: 2, 512: 1}, "decode_steps": 2, "trace_reps": 0},
    "torch-cuda": {"lengths": {24: 3, 128: 3, 256: 1, 512: 1, 1024: 1}, "decode_steps": 3, "trace_reps": 3},
    "quick": {"lengths": {8: 2, 16: 2}, "decode_steps": 2, "trace_reps": 2},
}
DEQUANT_REPS = 3
REAL_LAYERS = 43             # V4-Flash: the model decode estimate is this many times a layer's decode step


# ------------------------------------------------------------------------------------------------
# Worker side: one engine, one model, timed through the harness's own forward loop


class TimedEngine:
    """An Engine proxy recording the wall time of every forward_layer call (in call order)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.layer_s: list[float] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def forward_layer(self, *args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        out = self.engine.forward_layer(*args, **kwargs)
        self.layer_s.append(time.perf_counter() - t)
        return out


class MemoryWatch:
    """Peak anonymous RSS (memory beyond the mapped model file) and peak total RSS of this process, sampled."""

    def __init__(self, every_s: float = 0.01) -> None:
        self.every_s, self.peak_anon, self.peak_total = every_s, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def sample() -> tuple[int, int]:
        """(RssAnon, VmRSS) in bytes from /proc/self/status (Linux); a ParityError where either is unavailable."""
        status = Path("/proc/self/status")
        try:
            fields = dict(line.split(":", 1) for line in status.read_text().splitlines())
        except OSError as exc:
            raise ParityError(f"bench measures memory from {status}, which cannot be read here: {exc}") from exc
        missing = [key for key in ("RssAnon", "VmRSS") if key not in fields]
        if missing:
            raise ParityError(f"{status} has no {', '.join(missing)} field: peak memory cannot be measured")
        return int(fields["RssAnon"].split()[0]) * 1024, int(fields["VmRSS"].split()[0]) * 1024

    def _run(self) -> None:
        while not self._stop.is_set():
            anon, total = self.sample()
            self.peak_anon, self.peak_total = max(self.peak_anon, anon), max(self.peak_total, total)
            self._stop.wait(self.every_s)

    def __enter__(self) -> MemoryWatch:
        self.sample()  # an unreadable /proc fails here, not silently inside the sampling thread
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        anon, total = self.sample()
        self.peak_anon, self.peak_total = max(self.peak_anon, anon), max(self.peak_total, total)


def prompt_tokens(n: int, vocab_size: int, seed: int = 0) -> np.ndarray:
    """A fixed pseudo-random prompt of n ids in [2, vocab) (0 and 1 are BOS/EOS in synthetic vocabularies)."""
    return np.random.default_rng(seed).integers(2, vocab_size, size=n).astype(np.int64)


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def load_average() -> float:
    """The 1-minute load average (runnable + waiting tasks), recorded beside every timing: on a shared machine a
    wall time means nothing without it."""
    return os.getloadavg()[0]


def time_prefill_decode(timed: TimedEngine, n_prompt: int, reps: int, decode_steps: int,
                        prompt: Sequence[int] | None = None) -> TimedRun:
    """Median wall time of an n-token prefill (of `prompt`, else `prompt_tokens`) and of each following greedy
    decode step, total and per layer.

    The decode step at context c (= n_prompt + i) sees the window and every compressed row up to c.
    """
    from parity.tracing.runner import forward_chunk

    n_layers = timed.config.n_layers
    prompt = (prompt_tokens(n_prompt, timed.config.vocab_size) if prompt is None else
              np.asarray(prompt, dtype=np.int64))
    prefill, prefill_layers, decode, decode_layers, loads, cpu = [], [], [], [], [], {"prefill": [], "decode": []}
    for _ in range(reps):
        state = timed.new_state()
        timed.layer_s = []
        loads.append(load_average())
        t, c = time.perf_counter(), time.process_time()
        res = forward_chunk(timed, state, prompt, 0)
        prefill.append(time.perf_counter() - t)
        cpu["prefill"].append(time.process_time() - c)
        prefill_layers.append(timed.layer_s[-n_layers:])
        for i in range(decode_steps):
            tok = np.array([int(np.argmax(res.logits[-1]))])
            timed.layer_s = []
            t, c = time.perf_counter(), time.process_time()
            res = forward_chunk(timed, state, tok, n_prompt + i)
            decode.append(time.perf_counter() - t)
            cpu["decode"].append(time.process_time() - c)
            decode_layers.append(timed.layer_s[-n_layers:])
    return TimedRun(
        prompt=n_prompt, reps=reps, decode_steps=decode_steps, load=_median(loads),
        prefill_cpu_s=_median(cpu["prefill"]), decode_cpu_s=_median(cpu["decode"]) if decode else None,
        prefill_s=_median(prefill), prefill_all_s=prefill,
        prefill_layer_s=[_median([r[l] for r in prefill_layers]) for l in range(n_layers)],
        decode_s=_median(decode) if decode else None,
        decode_layer_s=[_median([r[l] for r in decode_layers]) for l in range(n_layers)] if decode else [],
    )


def time_tracing(timed: TimedEngine, n_prompt: int, reps: int, top_k: int = 20) -> TracingTime:
    """Cost of recording a fingerprint trace of every position (what `v4parity trace --positions all` adds).

    The recorder's own time (per-chunk `Recorder.add` plus building the tables) is measured inside the same
    run as the forward pass, so the ratio does not depend on how busy a shared machine is.
    """
    from parity.contract.checkpoints import trace_checkpoints
    from parity.tracing.recorder import Recorder
    from parity.tracing.runner import run_sequence

    cfg = timed.config
    prompt = prompt_tokens(n_prompt, cfg.vocab_size).tolist()
    forward, record = [], []
    for _ in range(reps):
        rec = Recorder(trace_checkpoints(cfg.n_layers), list(range(n_prompt)), [], top_k, cfg.hc_mult)
        spent = [0.0]

        def add(r: Any, rec: Recorder = rec, spent: list[float] = spent) -> None:
            t = time.perf_counter()
            rec.add(r)
            spent[0] += time.perf_counter() - t

        t = time.perf_counter()
        run_sequence(timed, prompt, on_chunk=add, keep=False)   # as `trace` runs it
        total = time.perf_counter() - t
        t = time.perf_counter()
        rec.tables()
        record.append(spent[0] + time.perf_counter() - t)
        forward.append(total - spent[0])
    return TracingTime(prompt=n_prompt, reps=reps, forward_s=_median(forward), record_s=_median(record),
                       overhead=_median(record) / _median(forward), load=load_average())


def run_worker(spec: dict[str, Any]) -> WorkerResult:
    """Load one engine through `load_engine` and run the measurements the spec asks for."""
    from parity.contract.cpus import usable_cpus
    from parity.contract.engine import RunOptions, load_engine

    options = RunOptions(device=spec["device"], cache_gb=spec["cache_gb"], fp8_kv=spec["qat_sims"],
                         fp4_indexer=spec["qat_sims"], engine_args=tuple(spec.get("engine_args", ())))
    load_start = load_average()
    with MemoryWatch() as mem:
        t = time.perf_counter()
        engine = load_engine(spec["engine"], spec["model"], options)
        load_s = time.perf_counter() - t
        timed = TimedEngine(engine)
        runs = [time_prefill_decode(timed, int(n), int(reps), spec["decode_steps"])
                for n, reps in spec["lengths"].items()]
        tracing = time_tracing(timed, spec["trace_prompt"], spec["trace_reps"]) if spec["trace_reps"] else None
    from parity.contract.engine import CacheStats

    return WorkerResult(
        engine=spec["engine"], engine_version=engine.version, device=spec["device"],
        model=spec["model"], n_layers=engine.config.n_layers, ratios=list(engine.config.compress_ratios),
        load_s=load_s, runs=runs, tracing=tracing,
        peak_rss_anon_gb=mem.peak_anon / 2**30, peak_rss_gb=mem.peak_total / 2**30,
        model_file_gb=Path(spec["model"]).stat().st_size / 2**30,
        cache=engine.cache_stats() if isinstance(engine, CacheStats) else None,
        blas_threads=os.environ.get("OPENBLAS_NUM_THREADS"), usable_cpus=usable_cpus(),
        threads=engine_threads(engine), load_start=load_start, load_end=load_average(),
    )


def engine_threads(engine: Any) -> dict[str, int]:
    """The thread counts the engine runs with (what its defaults chose, or its engine arguments): the reference's
    worker threads; the torch engine's intra-op and expert threads; the CPUs torch itself would use meanwhile."""
    import torch

    out = {"torch_intra_op": torch.get_num_threads()}
    for key, attr in (("engine", "threads"), ("expert", "expert_threads")):
        if isinstance(getattr(engine, attr, None), int):
            out[key] = getattr(engine, attr)
    workers = getattr(engine, "workers", None)
    if workers is not None and isinstance(getattr(workers, "n", None), int):
        out["engine"] = workers.n
    return out


def torch_args(engine: str, threads: int | None) -> list[str]:
    """The torch engine's intra-op thread count as its engine argument threads=N (the engine's own default, one per
    usable CPU, where None); nothing for the other engines."""
    return [f"threads={threads}"] if engine == "torch" and threads else []


def spawn_worker(spec: dict[str, Any], blas_threads: int | None, timeout_s: float) -> WorkerResult:
    """Run `run_worker(spec)` in a fresh Python process and return its answer (the record read from its JSON)."""
    env = dict(os.environ)
    if blas_threads is not None:
        env["OPENBLAS_NUM_THREADS"] = env["OMP_NUM_THREADS"] = str(blas_threads)
    cmd = [sys.executable, "-m", "parity.bench.measure", "worker", json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as exc:
        raise ParityError(f"bench worker for {spec['engine']} ran past {timeout_s:.0f} s") from exc
    if proc.returncode != 0:
        raise ParityError(f"bench worker for {spec['engine']} failed (exit {proc.returncode}):\n"
                          f"{proc.stderr.strip()[-3000:]}")
    return WorkerResult.from_dict(json.loads(proc.stdout.strip().splitlines()[-1]))


# ------------------------------------------------------------------------------------------------
# Dequantizer throughput: reference (NumPy) vs torch engine vs gguf.quants, same bytes


# the types added after the release's mix (Q8_K is left out: gguf.quants cannot dequantize it, so it has no baseline)
NEW_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q3_K", "Q5_K", "Q6_K", "IQ1_S", "IQ1_M", "IQ2_XS", "IQ2_S", "IQ3_XXS",
             "IQ3_S", "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0")
# byte offsets of each new type's f16 scales inside a block (IQ1_M: its f16 is the top nibbles of 4 words at 48)
_F16_SCALES = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q3_K": (108,), "Q5_K": (0, 2),
               "Q6_K": (208,), "IQ1_S": (0,), "IQ1_M": (), "IQ2_XS": (0,), "IQ2_S": (0,), "IQ3_XXS": (0,),
               "IQ3_S": (0,), "IQ4_NL": (0,), "IQ4_XS": (0,), "TQ1_0": (52,), "TQ2_0": (64,)}
_SCALE_BITS = 0x1400  # f16 0.0010: finite, realistic block scales


def _random_scaled_blocks(qtype: Any, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Random code bytes (every pattern is a valid block of these types) with the f16 scales set to 0.001.
    -> [n_blocks, block bytes] uint8"""
    from gguf.constants import GGML_QUANT_SIZES

    blocks = rng.integers(0, 256, size=(n_blocks, GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8)
    for at in _F16_SCALES[qtype.name]:
        blocks[:, at : at + 2] = np.array([_SCALE_BITS], "<u2").view(np.uint8)
    if qtype.name == "IQ1_M":
        words = blocks[:, 48:56].copy().view("<u2")
        for k in range(4):
            words[:, k] = (words[:, k] & 0x0FFF) | (((_SCALE_BITS >> (4 * k)) & 0xF) << 12)
        blocks[:, 48:56] = words.view(np.uint8)
    return blocks


def dequant_sources(model: Path | None, n_values: int, rng: np.random.Generator) -> dict[str, tuple[int, np.ndarray]]:
    """type name -> (ggml type, raw bytes [rows, row_bytes]) of n_values values; real tensors where the
    model file has that type (expert 0 of gate/down, attention q_b rows), random valid blocks otherwise."""
    from gguf import quants
    from gguf.constants import GGML_QUANT_SIZES
    from gguf.constants import GGMLQuantizationType as Q

    from parity.gguf.quant_blocks import random_blocks

    width = 4096
    rows = n_values // width
    normal = rng.standard_normal((rows, width)).astype(np.float32) * 0.02
    mx = rng.integers(0, 256, size=(rows * width // 32, 17), dtype=np.uint8)
    mx[:, 0] = rng.integers(118, 128, size=len(mx))  # scales 2^-10 .. 2^-1: finite, realistic
    out = {
        "F32": (Q.F32, normal.view(np.uint8)),
        "F16": (Q.F16, normal.astype(np.float16).view(np.uint8)),
        "BF16": (Q.BF16, quants.quantize(normal, Q.BF16).view(np.uint8)),
        "Q8_0": (Q.Q8_0, quants.quantize(normal, Q.Q8_0)),
        "Q4_K": (Q.Q4_K, random_blocks(Q.Q4_K, (rows, width), 0.02, rng)),
        "Q2_K": (Q.Q2_K, random_blocks(Q.Q2_K, (rows, width), 0.02, rng)),
        "IQ2_XXS": (Q.IQ2_XXS, random_blocks(Q.IQ2_XXS, (rows, width), 0.02, rng)),
        "MXFP4": (Q.MXFP4, mx.reshape(rows, -1)),
    }
    for name in NEW_TYPES:
        qtype = Q[name]
        block, _ = GGML_QUANT_SIZES[qtype]
        out[name] = (qtype, _random_scaled_blocks(qtype, rows * width // block, rng).reshape(rows, -1))
    if model is not None:
        from parity.gguf.weights import Weights

        w = Weights(model)
        for name, tensor in (("IQ2_XXS", "blk.0.ffn_gate_exps.weight"), ("Q2_K", "blk.0.ffn_down_exps.weight"),
                             ("Q8_0", "blk.0.attn_q_b.weight")):
            info = w.info(tensor)
            row_bytes = info.nbytes // int(np.prod(info.shape[:-1]))
            n_rows = n_values // info.shape[-1]
            out[name] = (info.ggml_type, np.array(w.raw(tensor)[: n_rows * row_bytes]).reshape(n_rows, row_bytes))
    return out


def _median_of(fn: Callable[[], Any], reps: int) -> tuple[float, Any]:
    """Median seconds of `reps` calls after one warm-up call; returns (seconds, last result)."""
    result = fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t)
    return _median(times), result


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal float32 bit patterns (any NaN equals any NaN)."""
    a, b = np.asarray(a, np.float32).ravel(), np.asarray(b, np.float32).ravel()
    nan = np.isnan(a)
    return a.shape == b.shape and bool(np.array_equal(nan, np.isnan(b))
                                       and np.array_equal(a.view(np.uint32)[~nan], b.view(np.uint32)[~nan]))


def _concurrent_mvs(make: Callable[[], Callable[[], Any]], n_values: int, threads: int, reps: int) -> float:
    """M values/s of `threads` dequantizers running at once (each its own callable and output), median of reps."""
    from concurrent.futures import ThreadPoolExecutor

    runs = [make() for _ in range(threads)]
    with ThreadPoolExecutor(threads) as pool:
        seconds, _ = _median_of(lambda: list(pool.map(lambda f: f(), runs)), reps)
    return threads * n_values / seconds / 1e6


def _dequant_row(name: str, qtype: int, raw: np.ndarray, reps: int, device: str) -> perf.DequantRow:
    """One type: median seconds of gguf.quants and of each engine's dequantizer capability on the same bytes, and
    the combined throughput of two of each engine's dequantizers running at once on two threads."""
    from gguf import quants

    from parity.contract.engine import engine_class

    n_values = raw.shape[0] * int(quants.quant_shape_from_byte_shape(raw.shape, qtype)[-1])
    shape = (raw.shape[0], n_values // raw.shape[0])
    t_gguf, want = _median_of(lambda: quants.dequantize(raw, qtype).astype(np.float32, copy=False), reps)
    ref_run = engine_class("reference").dequantizer(raw, qtype, shape, "cpu")
    torch_run = engine_class("torch").dequantizer(raw, qtype, shape, device)
    t_ref, got = _median_of(ref_run, reps)
    t_torch, got_t = _median_of(torch_run, reps)
    make = {engine: (lambda engine=engine, dev=dev: engine_class(engine).dequantizer(raw, qtype, shape, dev))
            for engine, dev in (("reference", "cpu"), ("torch", device))}
    two = {engine: _concurrent_mvs(m, n_values, 2, reps) if device == "cpu" else None for engine, m in make.items()}
    return perf.DequantRow(
        type=name, values=n_values, gguf_mvs=n_values / t_gguf / 1e6, reference_mvs=n_values / t_ref / 1e6,
        torch_mvs=n_values / t_torch / 1e6, reference_speedup=t_gguf / t_ref, torch_speedup=t_gguf / t_torch,
        reference_exact=_same_bits(got, want), torch_exact=_same_bits(got_t, want),
        reference_mvs_2t=two["reference"], torch_mvs_2t=two["torch"],
    )


def measure_dequant(model: Path | None, device: str, n_values: int, reps: int) -> list[perf.DequantRow]:
    """Throughput (M values/s) of every type for the three dequantizers, and bit-exactness against gguf. On the CPU
    torch runs single-threaded meanwhile, so that the types the torch engine decodes with torch ops (not its C
    decoders) are measured on one thread too, as gguf.quants, the reference and the C decoders are."""
    import torch

    sources = dequant_sources(model, n_values, np.random.default_rng(0))
    threads = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(1)
    try:
        return [_dequant_row(name, qtype, raw, reps, device) for name, (qtype, raw) in sources.items()]
    finally:
        torch.set_num_threads(threads)


# ------------------------------------------------------------------------------------------------
# Trace diff at real-model size: 88 carrier checkpoints (embed, blk.l.attn and blk.l for 43 layers, final_norm)
# x 4096 positions


def synthetic_trace(n_layers: int, n_pos: int, rng: np.random.Generator, base: Any = None,
                    drift_from: int | None = None) -> Any:
    """A fingerprint-only trace of real-model size (tables only, no vectors). With `base`, a copy whose
    fingerprints carry a relative perturbation of 1e-2 from checkpoint index `drift_from` on."""
    from parity.contract.checkpoints import trace_checkpoints
    from parity.tracing.records import Trace, TraceHeader, make_table
    from parity.tracing.stats import FP_DIM

    names = trace_checkpoints(n_layers)
    H, K, E, S = 4, 20, 6, 512
    if base is not None:
        fp = base.ckpt["fp"].copy()
        drifting = base.ckpt["ck"] >= drift_from
        fp[drifting] *= 1 + 1e-2 * rng.standard_normal((int(drifting.sum()), FP_DIM)).astype(np.float32)
        return Trace(base.header, make_table("ckpt", {**base.ckpt.cols, "fp": fp}, {"H": H, "F": FP_DIM, "K": K}),
                     base.hc, base.moe, base.attn)
    n_ck = len(names)
    ck, pos = np.repeat(np.arange(n_ck), n_pos), np.tile(np.arange(n_pos), n_ck)
    rows = len(ck)
    f32 = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    ckpt = {"ck": ck, "pos": pos, "tok": pos % 290, "min": -np.abs(f32(rows)), "max": np.abs(f32(rows)),
            "rms": 1 + np.abs(f32(rows)), "l2s": 1 + np.abs(f32(rows, H)), "sum_l2": 1 + np.abs(f32(rows)),
            "fp": f32(rows, FP_DIM), "argmax": np.where(ck == n_ck - 1, pos % 290, -1),
            "top_ids": np.full((rows, K), -1), "top_logits": np.full((rows, K), np.nan)}
    lp = np.repeat(np.arange(n_layers), n_pos), np.tile(np.arange(n_pos), n_layers)
    n_lp = len(lp[0])
    hc = {"layer": np.repeat(lp[0], 2), "sub": np.tile([0, 1], n_lp), "pos": np.repeat(lp[1], 2),
          "pre": f32(2 * n_lp, H), "post": f32(2 * n_lp, H), "comb": f32(2 * n_lp, H * H)}
    moe = {"layer": lp[0], "pos": lp[1], "ids": rng.integers(0, 256, (n_lp, E)), "w": f32(n_lp, E),
           "margin": f32(n_lp)}
    has_sel = lp[0] % 2 == 0
    sel = np.where(has_sel[:, None], rng.integers(-1, 1024, (n_lp, S)), -1)
    attn = {"layer": lp[0], "pos": lp[1], "n_comp": lp[1] // 4, "has_sel": has_sel, "sel": sel}
    final = ck == n_ck - 1  # final_norm: one [D] vector (one l2 number) with argmax and top-k logits
    ckpt["l2s"][final, 1:] = np.nan
    ckpt["top_ids"][final] = np.arange(K)
    ckpt["top_logits"][final] = -np.arange(K, dtype=np.float32)
    widths = {"H": H, "F": FP_DIM, "K": K, "E": E, "S": S}
    header = TraceHeader(engine="synthetic", engine_version="0", model={"file": "x.gguf", "size": 0,
                         "header_sha256": "0" * 64}, dtype="float32", n_hc=H, dim=4096, top_k=K,
                         tokens=(np.arange(n_pos) % 290).tolist(), n_prompt=n_pos, chunks=[n_pos], decode=0,
                         positions=list(range(n_pos)), checkpoints=names, full=[], flags={})
    return Trace(header, make_table("ckpt", ckpt, widths), make_table("hc", hc, widths),
                 make_table("moe", moe, widths), make_table("attn", attn, widths))


def _timed_median(fn: Callable[[], Any], reps: int, slow_s: float = 5.0) -> tuple[float, Any]:
    """Seconds of fn(): one call, and the median of `reps` more when that call took under `slow_s`."""
    t = time.perf_counter()
    result = fn()
    first = time.perf_counter() - t
    return (first, result) if first >= slow_s else _median_of(fn, reps)


def time_trace_diff(n_layers: int, n_pos: int, reps: int, tmp: Path) -> perf.TraceDiffTime:
    """Seconds of `api.diff` on two traces written as .npz files (what `v4parity diff A.npz B.npz` does)."""
    from parity.api import diff
    from parity.contract.checkpoints import block_attn, trace_checkpoints
    from parity.tracing.io import write_trace

    rng = np.random.default_rng(0)
    a = synthetic_trace(n_layers, n_pos, rng)
    b = synthetic_trace(n_layers, n_pos, rng, base=a,
                        drift_from=trace_checkpoints(n_layers).index(block_attn(n_layers // 2)))
    tmp.mkdir(parents=True, exist_ok=True)
    pa, pb = write_trace(a, tmp / "a.npz"), write_trace(b, tmp / "b.npz")
    del a, b
    load, c = load_average(), time.process_time()
    from_files, report = _timed_median(lambda: diff(pa, pb), reps)
    cpu = (time.process_time() - c) / (1 if from_files >= 5.0 else reps + 1)
    first = report.first_drift or {}
    return perf.TraceDiffTime(checkpoints=len(trace_checkpoints(n_layers)), positions=n_pos, from_npz_s=from_files,
                         load=load, cpu_s=cpu, first_drift=first.get("checkpoint"),
                         npz_mb=(pa.stat().st_size + pb.stat().st_size) / 2**20)


# ------------------------------------------------------------------------------------------------
# Orchestration


def bench_models(cache_dir: Path, quick: bool, log: Note) -> dict[str, Path]:
    """The benchmark GGUFs, written once and cached: real-dimension 1- and 2-layer files (quick: tiny synth)."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    if quick:
        from parity.gguf.synth import synthesize

        path = cache_dir / f"tiny-real-mix-v{BENCH_VERSION}.gguf"
        if not path.exists():
            synthesize(path, "tiny", "real-mix", seed=0)
        return {"1layer": path, "2layer": path}
    from parity.gguf.synth_real import LAYOUTS, write_real

    out = {}
    for name, ratios in LAYOUTS.items():
        path = cache_dir / f"v4flash-{name}-v{BENCH_VERSION}.gguf"
        if not path.exists():
            log(f"writing {path} (real V4-Flash layer dimensions, ratios {ratios}) ...")
            t = time.perf_counter()
            write_real(path, ratios)
            log(f"  {path.stat().st_size / 2**30:.2f} GiB in {time.perf_counter() - t:.0f} s")
        out[name] = path
    return out


def machine_info() -> perf.Machine:
    """What the numbers were measured on (CPU model, cores, memory, load at start)."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30  # Linux, as MemoryWatch
    import torch

    return perf.Machine(cpu=cpu, cores=os.cpu_count(), memory_gb=mem_gb, python=platform.python_version(),
                   numpy=np.__version__, torch=torch.__version__, load_avg_start=list(os.getloadavg()),
                   cuda=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)


TINY_PLAN = {"lengths": {24: 3}, "decode_steps": 3}  # peers: the tiny model, every engine the same work


def bench_tiny(cache_dir: Path, engines: tuple[str, ...], torch_threads: int | None,
               log: Note) -> dict[str, WorkerResult]:
    """Every engine (ours and the peers llama.cpp / transformers) on the tiny F32 model with the QAT simulations
    off (the peers omit them), one worker process each: prefill 24 tokens and decode steps."""
    from parity.contract.engine import RunOptions
    from parity.gguf.synth import synthesize

    path = cache_dir / f"tiny-f32-v{BENCH_VERSION}.gguf"
    if not path.exists():
        synthesize(path, "tiny", "f32", seed=0)
    out = {}
    for engine in engines:
        log(f"{engine} engine on the tiny F32 model (QAT simulations off): prefill 24 tokens, decode steps ...")
        spec = {"engine": engine, "model": str(path), "device": "cpu", **TINY_PLAN, "trace_prompt": 24,
                "trace_reps": 0, "cache_gb": RunOptions.cache_gb, "qat_sims": False,
                "engine_args": torch_args(engine, torch_threads)}
        out[engine] = spawn_worker(spec, 1 if engine == "reference" else torch_threads, 600)
    return out


def tiny_rows(report: PerfReport) -> list[tuple[str, str, str, str]]:
    """(engine, prefill per layer, decode per layer, vs reference) on the tiny model; per layer = whole forward
    / L (whole-graph engines such as llama.cpp run every layer in one call)."""
    rows, ref = [], None
    for name, w in (report.tiny_engines or {}).items():
        run = w.runs[0]
        pre, dec = run.prefill_s / w.n_layers, run.decode_s / w.n_layers
        ref = ref or (pre, dec)
        rows.append((name, f"{1e3 * pre:.2f} ms", f"{1e3 * dec:.2f} ms",
                     f"{ref[0] / pre:.2f}x / {ref[1] / dec:.2f}x{_load_note(run)}"))
    return rows


def merge_workers(parts: list[WorkerResult]) -> WorkerResult:
    """One engine's answer from its per-length workers: the first worker's record with the runs in order, the tracing
    run, the largest peak memory and load time."""
    return replace(parts[0], runs=[r for w in parts for r in w.runs],
                   tracing=next((w.tracing for w in parts if w.tracing), None),
                   **{k: max(getattr(w, k) for w in parts) for k in ("peak_rss_anon_gb", "peak_rss_gb", "load_s")})


def run_bench(cache_dir: Path, device: str, quick: bool, engines: tuple[str, ...], torch_threads: int | None = None,
              progress: ProgressSink = SILENT, peers: tuple[str, ...] = ()) -> PerfReport:
    """All measurements of `v4parity bench` (each stage announced through `progress.note`), as the frozen report
    (its `to_dict()` is the JSON the command writes)."""
    from parity.contract.cpus import usable_cpus

    t0, log = time.perf_counter(), progress.note
    # torch's intra-op threads, always set for the worker (an inherited OMP_NUM_THREADS=1 would otherwise decide)
    torch_threads = torch_threads or usable_cpus()
    machine = machine_info()
    models = bench_models(cache_dir, quick, log)
    log("dequantizer throughput (reference NumPy / torch / gguf.quants) ...")
    n_values = (1 << 18) if quick else DEQUANT_VALUES
    dequant_load = load_average()
    dequant = measure_dequant(None if quick else models["2layer"], device, n_values, DEQUANT_REPS)
    dequant_load_end = load_average()
    log("trace diff at real-model size (88 checkpoints x 4096 positions) ...")
    trace_diff = time_trace_diff(43, 256 if quick else 4096, DEQUANT_REPS, cache_dir / "traces")
    workers = engine_workers(models, device, quick, engines, torch_threads, log)
    tiny = bench_tiny(cache_dir, ("reference", "torch", *peers), torch_threads, log) if peers else None
    return PerfReport(
        bench_version=BENCH_VERSION, quick=quick, device=device, torch_threads=torch_threads, machine=machine,
        models={k: perf.ModelSize(str(v), v.stat().st_size / 2**30) for k, v in models.items()},
        dequant_load=dequant_load, dequant=dequant, dequant_load_end=dequant_load_end, trace_diff=trace_diff,
        engines=workers, tiny_engines=tiny, wall_s=time.perf_counter() - t0, load_end=load_average())


def engine_workers(models: dict[str, Path], device: str, quick: bool, engines: tuple[str, ...], torch_threads: int,
                   log: Note) -> dict[str, WorkerResult]:
    """The engines on the 2-layer file, one worker per (prompt length, engine), merged per engine; with the
    reference, its memory on the 1-layer file with the default cache budget (evicted by layer, so what one layer
    of a full-depth run holds) and (not quick) its 1-thread point."""
    from parity.contract.engine import RunOptions

    timeout = 600 if quick else 1800
    plans = {e: PLANS["quick" if quick else e if e == "reference" else f"torch-{device}"] for e in engines}
    parts: dict[str, list[WorkerResult]] = {e: [] for e in engines}
    # one worker per (prompt length, engine), the engines alternating at each length: the two sides of a ratio are
    # measured seconds apart, not minutes (on a shared machine the load changes within minutes)
    for n in sorted(set().union(*(p["lengths"] for p in plans.values()))):
        for engine in (e for e in engines if n in plans[e]["lengths"]):
            dev, plan = device if engine == "torch" else "cpu", plans[engine]
            log(f"{engine} engine ({dev}) on the 2-layer file: prefill {n} tokens, decode steps ...")
            first = n == min(plan["lengths"])
            spec = {"engine": engine, "model": str(models["2layer"]), "device": dev,
                    "lengths": {n: plan["lengths"][n]}, "decode_steps": plan["decode_steps"], "trace_prompt": n,
                    "trace_reps": plan["trace_reps"] if first else 0, "cache_gb": RunOptions.cache_gb,
                    "qat_sims": True, "engine_args": torch_args(engine, torch_threads)}
            # the reference parallelises over experts itself; a second BLAS thread pool would only contend
            parts[engine].append(spawn_worker(spec, 1 if engine == "reference" else torch_threads, timeout))
    workers = {e: merge_workers(ws) for e, ws in parts.items()}
    if "reference" in engines:
        # the budget is evicted by layer (reference_cpu.weights_cache.LayerCache): one real layer's dense weights
        # alone need more than a 1/43 share of it, and a full-depth run holds one layer at a time
        log(f"reference on the 1-layer file with the default cache budget ({RunOptions.cache_gb:.0f} GiB, evicted "
            "by layer): memory ...")
        n = min(PLANS["quick" if quick else "reference"]["lengths"])
        spec = {"engine": "reference", "model": str(models["1layer"]), "device": "cpu", "lengths": {n: 1},
                "decode_steps": 2, "trace_prompt": n, "trace_reps": 0, "cache_gb": RunOptions.cache_gb,
                "qat_sims": True}
        workers["reference_1layer_memory"] = spawn_worker(spec, 1, timeout)
        if not quick:
            log("reference on the 2-layer file with 1 worker thread (the thread-scaling point) ...")
            spec = {"engine": "reference", "model": str(models["2layer"]), "device": "cpu", "lengths": {n: 3},
                    "decode_steps": 2, "trace_prompt": n, "trace_reps": 0, "cache_gb": RunOptions.cache_gb,
                    "qat_sims": True, "engine_args": ["threads=1"]}
            workers["reference_1thread"] = spawn_worker(spec, 1, timeout)
    return workers


# ------------------------------------------------------------------------------------------------
# Presentation


def _run(worker: WorkerResult | None, n: int) -> TimedRun | None:
    """The worker's run at prompt length n; None where that engine was not run or not at that length."""
    return next((r for r in worker.runs if r.prompt == n), None) if worker else None


def _per_layer(worker: WorkerResult | None, n: int, key: str) -> list[float] | None:
    """Per-layer seconds `key` (prefill_layer_s / decode_layer_s) of the worker's run at length n; None where absent
    (e.g. no decode steps)."""
    run = _run(worker, n)
    return getattr(run, key) if run and getattr(run, key) else None


def seconds_cell(seconds: float | None) -> str:
    """A table cell of seconds ('-' where not measured)."""
    return "-" if seconds is None else f"{seconds:.3f} s"


def _cpu_s(run: TimedRun | None, what: str) -> float | None:
    """The run's CPU seconds of `what` (prefill / decode); None where not run or not recorded."""
    return getattr(run, f"{what}_cpu_s") if run else None


def summary_rows(report: PerfReport) -> list[tuple[str, str, str, str]]:
    """(measure, reference, torch, torch speed-up) rows of the main table, per real layer."""
    eng = report.engines
    ref, tor = eng.get("reference"), eng.get("torch")
    rows = []
    lengths = sorted({r.prompt for w in (ref, tor) if w for r in w.runs})[:2]  # the rest: scaling table
    ratios = (ref or tor).ratios
    for n in lengths:
        at = _loads(ref, tor, n)
        for l, ratio in enumerate(ratios):
            kind = {4: "CSA", 128: "HCA"}.get(ratio, f"ratio {ratio}")
            for what, key in ((f"prefill {n} tok", "prefill_layer_s"), (f"decode @ctx {n}", "decode_layer_s")):
                r, t = (times[l] if times else None for times in (_per_layer(ref, n, key), _per_layer(tor, n, key)))
                rows.append((f"{what}, layer {l} ({kind})", seconds_cell(r), seconds_cell(t),
                             f"{r / t:.1f}x{at}" if r and t else "-"))
        for what in ("prefill", "decode"):
            r, t = (_cpu_s(_run(w, n), what) for w in (ref, tor))
            if r and t:
                rows.append((f"CPU time, {what} {n} tok (all layers, all threads)", seconds_cell(r), seconds_cell(t),
                             f"{r / t:.1f}x{at}"))
    est = []
    for w in (ref, tor):
        decode = _per_layer(w, lengths[0], "decode_layer_s")
        per_layer = float(np.mean(decode)) if decode else None
        est.append(f"{REAL_LAYERS * per_layer:.1f} s/tok = {1 / (REAL_LAYERS * per_layer):.3f} tok/s"
                   if per_layer else "-")
    rows.append((f"model decode estimate: {REAL_LAYERS} x mean layer decode @ctx {lengths[0]}", *est,
                 _loads(ref, tor, lengths[0]).strip()))
    for name, w in (("reference", ref), ("torch", tor)):
        if w and w.tracing:
            tr = w.tracing
            rows.append((f"{name}: trace recording / forward ({tr.prompt} tok, every position)",
                         f"{tr.record_s:.4f} / {tr.forward_s:.3f} s", "",
                         f"{100 * tr.overhead:+.2f} %{_load_note(tr)}"))
    td = report.trace_diff
    at = f" (CPU {td.cpu_s:.2f} s, load {td.load:.1f})" if td.load is not None and td.cpu_s is not None else ""
    rows.append((f"diff of two .npz traces, {td.checkpoints} checkpoints x {td.positions} positions",
                 f"{td.from_npz_s:.2f} s{at}", "", ""))
    return rows + _memory_rows(eng.get("reference_1layer_memory"), tor)


def _memory_rows(mem: WorkerResult | None, tor: WorkerResult | None) -> list[tuple[str, str, str, str]]:
    """The main table's last rows: the reference's times and peak memory on the 1-layer file with the default
    cache budget, the torch engine's peak memory (each where it was run)."""
    rows = []
    if mem:
        run = mem.runs[0]
        share = f"1 layer, {mem.cache['budget'] / 2**30:.2f} GiB cache"  # type: ignore[index]
        rows.append((f"reference {share}: prefill {run.prompt} / decode", seconds_cell(run.prefill_s),
                     seconds_cell(run.decode_s), _load_note(run).strip()))
        rows.append((f"reference peak RSS, {share} (anon / total)",
                     f"{mem.peak_rss_anon_gb:.2f} / {mem.peak_rss_gb:.2f} GiB", "", ""))
    if tor:
        rows.append(("torch peak RSS, 2 layers (anon / total)",
                     "", f"{tor.peak_rss_anon_gb:.2f} / {tor.peak_rss_gb:.2f} GiB", ""))
    return rows


def _load_note(run: TimedRun | TracingTime | None) -> str:
    """' (load X)': the 1-minute load average recorded with a run ('' where the run predates the record)."""
    return f" (load {run.load:.1f})" if run and run.load is not None else ""


def _loads(ref: WorkerResult | None, tor: WorkerResult | None, n: int) -> str:
    """' (load R / T)': the 1-minute load average during the reference's and the torch engine's runs at length n
    ('' where a run predates the load record)."""
    r, t = (_run(w, n) for w in (ref, tor))
    return f" (load {r.load:.1f} / {t.load:.1f})" if r and t and r.load is not None and t.load is not None else ""


def thread_rows(report: PerfReport) -> list[tuple[str, str, str, str]]:
    """(measure, 1 thread, N threads, speed-up) of the reference, per layer (layer 0 CSA / layer 1 HCA)."""
    eng = report.engines
    one, many = eng.get("reference_1thread"), eng.get("reference")
    if not one or not many:
        return []
    n = one.runs[0].prompt
    rows = []
    at = _loads(one, many, n)
    for what, key in ((f"prefill {n} tok", "prefill_layer_s"), (f"decode @ctx {n}", "decode_layer_s")):
        a, b = _per_layer(one, n, key), _per_layer(many, n, key)
        rows.append((what, " / ".join(f"{x:.3f} s" for x in a), " / ".join(f"{x:.3f} s" for x in b),
                     " / ".join(f"{x / y:.2f}x" for x, y in zip(a, b, strict=True)) + at))
    return rows


def scaling_rows(report: PerfReport) -> list[tuple[int, list[str]]]:
    """Per prompt length: per-layer prefill and decode seconds of each engine ('a / b' over the layers), and the
    load averages of the two runs."""
    eng = report.engines
    lengths = sorted({r.prompt for w in (eng.get("reference"), eng.get("torch")) if w for r in w.runs})
    out = []
    for n in lengths:
        cells = []
        for w in (eng.get("reference"), eng.get("torch")):
            for key in ("prefill_layer_s", "decode_layer_s"):
                times = _per_layer(w, n, key)
                cells.append(" / ".join(f"{x:.3f}" for x in times) if times else "-")
        cells.append(_loads(eng.get("reference"), eng.get("torch"), n).strip(" ()") or "-")
        out.append((n, cells))
    return out


def _thread_note(report: PerfReport) -> str:
    """' Threads: ...': what each engine's worker ran with (recorded by `engine_threads`; '' for older reports)."""
    parts = [f"{name} {', '.join(f'{k} {v}' for k, v in w.threads.items())}"
             for name, w in report.engines.items() if name in ("reference", "torch") and w.threads is not None]
    return f" Threads: {'; '.join(parts)}." if parts else ""


def render_markdown(report: PerfReport) -> str:
    """The tables of docs/bench.md: machine, per-layer times, dequantizer throughput."""
    m = report.machine
    lines = [f"Machine: {m.cpu}, {m.cores} cores, {m.memory_gb:.0f} GiB; numpy {m.numpy}, "
             f"torch {m.torch}; load average at start {m.load_avg_start[0]:.1f}, at end {report.load_end:.1f}"
             f"; device {report.device}; total bench wall time {report.wall_s:.0f} s."
             + _thread_note(report), "",
             "| measure (per real layer) | reference | torch | torch speed-up |", "|---|---|---|---|"]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in summary_rows(report)]
    lines += ["", "Scaling (seconds per layer, layer 0 CSA / layer 1 HCA; decode = one step at that context):", "",
              "| prompt = context | reference prefill | reference decode | torch prefill | torch decode "
              "| load (ref / torch) |",
              "|---|---|---|---|---|---|"]
    for n, cells in scaling_rows(report):
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    threads = thread_rows(report)
    if threads:
        n = report.engines["reference"].usable_cpus  # the reference's default thread count
        lines += ["", f"Reference thread scaling, 1 -> {n} worker threads (the default: one per usable CPU; per "
                  "layer, layer 0 CSA / layer 1 HCA; bit-identical results):", "",
                  f"| measure | 1 thread | {n} threads | speed-up |",
                  "|---|---|---|---|"]
        lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in threads]
    at = f"; load {report.dequant_load:.1f} at the start, {report.dequant_load_end:.1f} at the end"
    lines += ["", f"Dequantizers, {report.dequant[0].values / 1e6:.1f} M values per type "
              f"(M values/s, median; speed-up vs gguf.quants; bit-exact vs gguf.quants{at}):", "",
              "| type | gguf.quants | reference | ref speed-up | ref exact | torch | torch speed-up | torch exact "
              "| torch / reference |", "|---|---|---|---|---|---|---|---|---|"]
    for r in report.dequant:
        yes = lambda ok: "yes" if ok else "NO"  # noqa: E731
        lines.append(f"| {r.type} | {r.gguf_mvs:.0f} | {r.reference_mvs:.0f} | {r.reference_speedup:.1f}x"
                     f" | {yes(r.reference_exact)} | {r.torch_mvs:.0f} | {r.torch_speedup:.1f}x"
                     f" | {yes(r.torch_exact)} | {r.torch_mvs / r.reference_mvs:.1f}x |")
    if all(r.reference_mvs_2t is not None and r.torch_mvs_2t is not None for r in report.dequant):
        lines += ["", "The same dequantizers, two at once on two threads (each its own matrix and output; M values/s "
                  "of both together; torch / reference at 2 threads):", "",
                  "| type | reference 1 -> 2 threads | torch 1 -> 2 threads | torch / reference |", "|---|---|---|---|"]
        lines += [f"| {r.type} | {r.reference_mvs:.0f} -> {r.reference_mvs_2t:.0f} | {r.torch_mvs:.0f} -> "
                  f"{r.torch_mvs_2t:.0f} | {r.torch_mvs_2t / r.reference_mvs_2t:.1f}x |"  # type: ignore[operator]
                  for r in report.dequant]
    if report.tiny_engines:
        lines += ["", "Every engine on the tiny F32 model (6 layers, dim 256, QAT simulations off), seconds per layer "
                  "= whole forward / L, prefill of 24 tokens and one decode step (median); speed vs the reference:",
                  "", "| engine | prefill 24 tok / layer | decode step / layer | vs reference (prefill / decode) |",
                  "|---|---|---|---|"]
        lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in tiny_rows(report)]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> None:
    """`python -m parity.bench.measure worker SPEC_JSON`: one measurement process; prints its JSON on the last line."""
    if len(argv) != 2 or argv[0] != "worker":
        raise SystemExit("usage: python -m parity.bench.measure worker SPEC_JSON")
    spec = json.loads(argv[1])
    spec["lengths"] = {int(k): int(v) for k, v in spec["lengths"].items()}
    print(json.dumps(run_worker(spec).to_dict()))


if __name__ == "__main__":
    main(sys.argv[1:])
