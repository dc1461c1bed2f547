"""Whole-model prefill and decode time of one engine on one file: the full-depth bench's `speed-*` steps (issue
27, point 5: torch beside llama.cpp and the reference, per token, same machine, same run).

    python -m parity.bench.engine_speed torch MODEL PROMPT_FILE --decode 4 --reps 2 --threads 2 --thread-arg threads
    python -m parity.bench.engine_speed llamacpp MODEL PROMPT_FILE --decode 4 --reps 2 --threads 2 \
        --thread-arg lcp_threads

Every engine is loaded through `load_engine` with the engine argument `--thread-arg`=N (each engine names its own
thread count: `threads`, llama.cpp's `lcp_threads`) and QAT simulations off, as llama.cpp has none. An engine
with the capability `PlainDecode` (llama.cpp) is timed as its users run it: its whole graph with nothing copied out
and the last row's logits only, decode steps fed the prompt's first tokens again (a step's cost does not depend on
its token). The others (torch, the reference) are timed by the harness's own forward loop
(`measure.time_prefill_decode`: no recording; each layer's time too; greedy decode tokens). Each prefills the
prompt in one batch. Prints one JSON line, the `SpeedFound` record (medians over the repetitions).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from parity.bench.full_depth_report import SpeedFound
from parity.bench.measure import load_average


def engine_speed(name: str, model: str, prompt: list[int], decode: int, reps: int, threads: int,
                 thread_arg: str) -> SpeedFound:
    """Engine `name`'s prefill of `prompt` and `decode` one-token steps, `reps` times, medians, with its engine
    argument `thread_arg` set to `threads`."""
    from parity.contract.engine import PlainDecode, RunOptions, load_engine

    t = time.perf_counter()
    args = (f"{thread_arg}={threads}",)
    engine = load_engine(name, model, RunOptions(fp8_kv=False, fp4_indexer=False, engine_args=args))
    load_s = time.perf_counter() - t
    if isinstance(engine, PlainDecode):
        return _plain(engine, name, prompt, decode, reps, threads, load_s)
    from parity.bench.measure import TimedEngine, time_prefill_decode

    run = time_prefill_decode(TimedEngine(engine), len(prompt), reps, decode, prompt=prompt)
    return SpeedFound(name, len(prompt), decode, reps, threads, load_s, run.prefill_s, run.decode_s,
                      run.prefill_cpu_s, run.decode_cpu_s, run.load, run.prefill_layer_s, run.decode_layer_s)


def _plain(engine: Any, name: str, prompt: list[int], decode: int, reps: int, threads: int,
           load_s: float) -> SpeedFound:
    """`PlainDecode`'s prefill and decode steps, `reps` times, medians (no per-layer times: one graph)."""
    times: dict[str, list[float]] = {"prefill": [], "decode": [], "prefill_cpu": [], "decode_cpu": [], "load": []}
    ids = np.asarray(prompt, np.int64)
    feeds = [("prefill", 0, ids), *(("decode", len(ids) + k, ids[k % len(ids)][None]) for k in range(decode))]
    for _ in range(reps):
        plain = engine.new_plain()
        times["load"].append(load_average())
        for kind, start, tokens in feeds:
            t, c = time.perf_counter(), time.process_time()
            engine.plain_decode(plain, tokens, start)
            times[kind].append(time.perf_counter() - t)
            times[f"{kind}_cpu"].append(time.process_time() - c)
    med = {k: float(statistics.median(v)) if v else None for k, v in times.items()}
    return SpeedFound(name, len(prompt), decode, reps, threads, load_s, med["prefill"], med["decode"],
                      med["prefill_cpu"], med["decode_cpu"], med["load"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("engine", help="a registered engine: torch, reference, llamacpp, ...")
    ap.add_argument("model", type=Path)
    ap.add_argument("prompt_file", type=Path, help="comma-separated token ids")
    ap.add_argument("--decode", type=int, required=True, help="decode steps after the prefill")
    ap.add_argument("--reps", type=int, required=True, help="repetitions (medians are reported)")
    ap.add_argument("--threads", type=int, required=True, help="CPU threads of the engine")
    ap.add_argument("--thread-arg", required=True, help="the engine argument that sets its thread count "
                    "(torch, reference: threads; llamacpp: lcp_threads)")
    args = ap.parse_args(argv)
    prompt = [int(t) for t in args.prompt_file.read_text().split(",")]
    speed = engine_speed(args.engine, str(args.model), prompt, args.decode, args.reps, args.threads,
                         args.thread_arg)
    print(json.dumps(speed.to_dict()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
