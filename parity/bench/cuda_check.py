"""One-shot GPU parity check: torch engine on CUDA vs the NumPy reference, float32 and bfloat16.

    python -m parity.bench.cuda_check                 # CUDA, prompt 200 + 64 decode steps, the three tiny models
    python -m parity.bench.cuda_check --device cpu    # same check on the CPU (what the test suite asserts)

Synthesizes the tiny f32 / real-mix / mxfp4 models into a temporary directory, runs the reference once per
model (float32, QAT sims off, greedy) and the torch engine in float32 and bfloat16 teacher-forced on the
reference's tokens, and prints per run: max relative L2 error and min cosine over every checkpoint and position,
argmax agreement at every position, expert-id and indexer-row agreement, and wall time. Exit status 1 when
the float32 run misses the acceptance bounds (rel L2 <= 1e-5, cosine >= 0.99999, identical argmax / experts /
indexer rows); bfloat16 is approximate (routing flips cascade on the tiny model) and only reported.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from parity.compare import metrics
from parity.contract.checkpoints import trace_checkpoints
from parity.contract.engine import RunOptions, load_engine
from parity.gguf.synth import synthesize
from parity.tracing.runner import all_tokens, run_sequence, stack

REL_TOL, COS_MIN = 1e-5, 0.99999


def _compare(ref, cand, n_layers: int) -> dict:
    """Worst rel L2 / cosine (parity.compare.metrics; a zero row gives nan, which fails) over every checkpoint
    and position,
    and agreement counts."""
    names = (*trace_checkpoints(n_layers), "logits")
    rel = np.concatenate([metrics.rel_l2(stack(ref, name), stack(cand, name)) for name in names])
    cos = np.concatenate([metrics.cosine(stack(ref, name), stack(cand, name)) for name in names])
    worst_rel, worst_cos = float(rel.max()), float(cos.min())
    ta, tb = stack(cand, "logits").argmax(-1), stack(ref, "logits").argmax(-1)
    ids = sel = True
    for l in range(n_layers):
        ids &= bool(np.array_equal(np.concatenate([r.diags[l].expert_ids for r in cand]),
                                   np.concatenate([r.diags[l].expert_ids for r in ref])))
        if ref[0].diags[l].index_sel is not None:
            sel &= bool(np.array_equal(np.concatenate([r.diags[l].index_sel for r in cand]),
                                       np.concatenate([r.diags[l].index_sel for r in ref])))
    return {"rel": worst_rel, "cos": worst_cos, "tokens_equal": int((ta == tb).sum()), "tokens": len(ta),
            "experts_equal": ids, "index_rows_equal": sel}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu", "auto"])
    ap.add_argument("--prompt", type=int, default=200, help="prompt length (default 200)")
    ap.add_argument("--decode", type=int, default=64, help="greedy decode steps (default 64)")
    args = ap.parse_args(argv)

    import torch

    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)
    print(f"device: {device}" + (f" ({torch.cuda.get_device_name()})" if device.type == "cuda" else ""))
    prompt = np.random.default_rng(7).integers(2, 290, args.prompt)
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        for quant in ("f32", "real-mix", "mxfp4"):
            path = Path(tmp) / f"tiny-{quant}.gguf"
            synthesize(path, "tiny", quant, seed=0)
            off = RunOptions(fp8_kv=False, fp4_indexer=False)
            t0 = time.time()
            ref = run_sequence(load_engine("reference", str(path), off), prompt, decode_steps=args.decode)
            t_ref = time.time() - t0
            for dtype in ("float32", "bfloat16"):
                eng = load_engine("torch", str(path), RunOptions(fp8_kv=False, fp4_indexer=False, dtype=dtype,
                                                        device=str(device)))
                t0 = time.time()
                # teacher-forced on the reference's greedy tokens: every position sees the same inputs
                cand = run_sequence(eng, prompt, decode_steps=args.decode, forced=all_tokens(ref)[args.prompt :])
                t = time.time() - t0
                r = _compare(ref, cand, eng.config.n_layers)
                ok = (r["rel"] <= REL_TOL and r["cos"] >= COS_MIN and r["tokens_equal"] == r["tokens"]
                      and r["experts_equal"] and r["index_rows_equal"])
                if dtype == "float32" and not ok:
                    failed = True
                verdict = ("PASS" if ok else "FAIL") if dtype == "float32" else "approximate"
                print(f"{quant:8s} {dtype:8s} max rel L2 {r['rel']:.3g}  min cos {r['cos']:.9f}  argmax "
                      f"{r['tokens_equal']}/{r['tokens']}  experts {'=' if r['experts_equal'] else '!='}  "
                      f"indexer {'=' if r['index_rows_equal'] else '!='}  torch {t:.2f}s  ref {t_ref:.2f}s  "
                      f"{verdict}")
    sys.stdout.flush()
    print("float32 parity: " + ("FAIL" if failed else "PASS"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
