"""Whole-model prefill and decode time of one engine on one file, as its users run it: the full-depth bench's
`speed-*` steps (issue 27, point 5: torch beside llama.cpp, per token, same machine, same run).

    python -m parity.bench.engine_speed torch MODEL PROMPT_FILE --decode 4 --reps 2 --threads 2
    python -m parity.bench.engine_speed llama.cpp MODEL PROMPT_FILE --decode 4 --reps 2 --threads 2
    python -m parity.bench.engine_speed reference MODEL PROMPT_FILE --decode 4 --reps 1 --threads 2

torch and reference: loaded through `load_engine` (`threads=N`, the reference with its default cache budget) and
timed by the harness's own forward loop (`measure.time_prefill_decode`: no recording; each layer's time too), QAT
simulations off. llama.cpp: the library its users call (llama-cpp-python's `Llama`, the file
memory-mapped, `n_threads`), not the harness's llamacpp engine, which captures every layer's tensors; it computes
no QAT round trips either. Each prefills the prompt in one batch and then decodes one token per step (torch and
the reference their greedy tokens, llama.cpp the prompt's first tokens again: the cost of a step does not depend on
the token). Prints one JSON line, the `SpeedFound` record (medians over the repetitions).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from parity.bench.full_depth_report import SpeedFound
from parity.bench.measure import load_average

ENGINES = ("torch", "reference", "llama.cpp")


def harness_speed(name: str, model: str, prompt: list[int], decode: int, reps: int, threads: int) -> SpeedFound:
    """Engine `name`'s prefill of `prompt` and `decode` greedy steps through the harness's loop, `reps` times,
    medians (whole model and per layer)."""
    from parity.bench.measure import TimedEngine, time_prefill_decode
    from parity.contract.engine import RunOptions, load_engine

    t = time.perf_counter()
    engine = load_engine(name, model, RunOptions(fp8_kv=False, fp4_indexer=False, engine_args=(f"threads={threads}",)))
    load_s = time.perf_counter() - t
    run = time_prefill_decode(TimedEngine(engine), len(prompt), reps, decode, prompt=prompt)
    return SpeedFound(name, len(prompt), decode, reps, threads, load_s, run.prefill_s, run.decode_s,
                      run.prefill_cpu_s, run.decode_cpu_s, run.load, run.prefill_layer_s, run.decode_layer_s)


def llamacpp_speed(model: str, prompt: list[int], decode: int, reps: int, threads: int) -> SpeedFound:
    """llama.cpp's prefill of `prompt` in one batch and `decode` one-token steps, `reps` times, medians."""
    from llama_cpp import Llama

    t = time.perf_counter()
    llm = Llama(model_path=model, n_ctx=len(prompt) + decode + 8, n_batch=len(prompt), n_threads=threads,
                n_threads_batch=threads, verbose=False)
    load_s = time.perf_counter() - t
    times: dict[str, list[float]] = {"prefill": [], "decode": [], "prefill_cpu": [], "decode_cpu": [], "load": []}
    for _ in range(reps):
        llm.reset()
        times["load"].append(load_average())
        t, c = time.perf_counter(), time.process_time()
        llm.eval(prompt)
        times["prefill"].append(time.perf_counter() - t)
        times["prefill_cpu"].append(time.process_time() - c)
        for i in range(decode):
            t, c = time.perf_counter(), time.process_time()
            llm.eval([prompt[i % len(prompt)]])
            times["decode"].append(time.perf_counter() - t)
            times["decode_cpu"].append(time.process_time() - c)
    med = {k: float(statistics.median(v)) if v else None for k, v in times.items()}
    return SpeedFound("llama.cpp", len(prompt), decode, reps, threads, load_s, med["prefill"], med["decode"],
                      med["prefill_cpu"], med["decode_cpu"], med["load"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("engine", choices=ENGINES)
    ap.add_argument("model", type=Path)
    ap.add_argument("prompt_file", type=Path, help="comma-separated token ids")
    ap.add_argument("--decode", type=int, required=True, help="decode steps after the prefill")
    ap.add_argument("--reps", type=int, required=True, help="repetitions (medians are reported)")
    ap.add_argument("--threads", type=int, required=True, help="CPU threads of the engine")
    args = ap.parse_args(argv)
    prompt = [int(t) for t in args.prompt_file.read_text().split(",")]
    work = (str(args.model), prompt, args.decode, args.reps, args.threads)
    speed = llamacpp_speed(*work) if args.engine == "llama.cpp" else harness_speed(args.engine, *work)
    print(json.dumps(speed.to_dict()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
