"""Each injected fault, compared per layer with the NumPy reference (parity.tracing.runner + numpy), drifts first
at the checkpoint where the bug lives, and only from the position where it first acts.

Prompt of 40 tokens (one prefill chunk) then 6 decode steps (positions 40..45; the CSA block ending at
t = 43 completes during decode). A checkpoint drifts when some position's relative L2 error > 1e-4; the
fault-free torch engine stays far below that with sims off (control). With sims on, legitimate FP8/FP4 code
flips make the fault-free engine drift too, later than the faults tested with sims on (checked).
"""

from __future__ import annotations

import numpy as np
import pytest

from gpu_engine.faults import FAULTS
from parity.compare import metrics
from parity.contract.engine import RunOptions
from parity.tracing.runner import run_sequence, stack

N_PROMPT, DECODE, DRIFT = 40, 6, 1e-4
DEPTH = ("embed", *(n for l in range(6) for n in (f"blk.{l}.attn", f"blk.{l}")), "final_norm")
SIMS_ON = {"fp8-kv-off", "indexer-ties-highest"}  # faults in a QAT simulation need it enabled

# fault -> (first drifting checkpoint, first drifting position at that checkpoint)
EXPECTED = {
    "compress-ratios-u32": ("blk.2.attn", 1),      # first compressed layer; position 0 has a zero RoPE angle
    "no-decode-compression": ("blk.2.attn", 43),   # first decode step that completes a CSA block
    # layer 0 streams are equal copies, so C X vs Cᵀ X differ only by Sinkhorn row-sum deviations (small until
    # a position whose comb is far from doubly stochastic): the checkpoint is fixed, the position is not
    "comb-not-transposed": ("blk.0.attn", None),
    "rope-split-halves": ("blk.0.attn", 1),        # position 0 is not rotated in any layout
    "sink-dropped": ("blk.0.attn", 0),
    "router-bias-in-weights": ("blk.3", None),     # first non-hash layer's FFN
    "swiglu-symmetric-clamp": ("blk.0", None),     # layer 0 FFN; positions where a gate value is < -clamp
    "fp8-kv-off": ("blk.0.attn", 0),
    "csa-halves-swapped": ("blk.2.attn", 3),       # first CSA row (t = 3)
    "compressed-row-visible-late": ("blk.2.attn", 3),
}


def _prompt() -> np.ndarray:
    return np.random.default_rng(11).integers(2, 290, N_PROMPT)


def _opts(sims: bool, inject: tuple[str, ...] = ()) -> RunOptions:
    return RunOptions(fp8_kv=sims, fp4_indexer=sims, inject=inject)


def _rel(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per-position ||a - b|| / ||b|| (b the reference), parity.compare.metrics.  [T, ...] x2 -> [T]"""
    return metrics.rel_l2(b, a)


def _forced_run(engine, forced: np.ndarray):
    return run_sequence(engine, _prompt(), decode_steps=DECODE, forced=forced)


@pytest.fixture(scope="module")
def reference_runs(tiny_f32):
    """Reference traces with sims off and on (decode tokens forced to the reference's own greedy choice, so the
    faulty engine sees the same inputs and only its math differs)."""
    from reference_cpu.engine import ReferenceEngine

    out = {}
    for sims in (False, True):
        greedy = run_sequence(ReferenceEngine(str(tiny_f32), _opts(sims)), _prompt(), decode_steps=DECODE)
        forced = np.array([int(r.tokens[0]) for r in greedy[1:]])
        out[sims] = (greedy, forced)
    return out


def _drift(tiny_f32, reference_runs, inject: tuple[str, ...], sims: bool) -> dict[str, np.ndarray]:
    from gpu_engine.engine import TorchEngine

    ref, forced = reference_runs[sims]
    tor = _forced_run(TorchEngine(str(tiny_f32), _opts(sims, inject)), forced)
    return {name: _rel(stack(tor, name), stack(ref, name)) for name in DEPTH}


def _first(drift: dict[str, np.ndarray]) -> tuple[str, int] | None:
    for name in DEPTH:
        bad = np.flatnonzero(drift[name] > DRIFT)
        if bad.size:
            return name, int(bad[0])
    return None


def test_control_without_faults_does_not_drift(tiny_f32, reference_runs):
    drift = _drift(tiny_f32, reference_runs, (), False)
    worst = max(d.max() for d in drift.values())
    assert worst < DRIFT / 10, f"fault-free torch engine drifts {worst:.3g} (sims off)"


def _order(first: tuple[str, int]) -> tuple[int, int]:
    return DEPTH.index(first[0]), first[1]


@pytest.mark.parametrize("fault", sorted(EXPECTED))
def test_fault_drifts_first_where_it_acts(tiny_f32, reference_runs, fault):
    drift = _drift(tiny_f32, reference_runs, (fault,), fault in SIMS_ON)
    first = _first(drift)
    assert first is not None, f"{fault}: no measurable drift"
    name, pos = EXPECTED[fault]
    assert first[0] == name, f"{fault}: first drift at {first}, expected {name}"
    if pos is not None:
        assert first[1] == pos, f"{fault}: first drifting position {first[1]}, expected {pos}"
    print(f"\n{fault}: first drift {first}, final_norm max rel {drift['final_norm'].max():.3g}")
    if fault in SIMS_ON:  # the fault-free engine's first (code-flip) drift comes strictly later
        control = _first(_drift(tiny_f32, reference_runs, (), True))
        assert control is None or _order(control) > _order(first), f"control drifts first at {control}"
    if fault == "no-decode-compression":
        # nothing drifts anywhere in the prefill chunk or before the first decode emission
        assert max(d[:43].max() for d in drift.values()) < DRIFT


def test_indexer_ties_fault_acts_only_on_ties(tiny_f32, reference_runs):
    """Ties at the top-k cut are measure-zero with continuous scores, so this compares the faulty engine with the
    fault-free torch engine (same sims, same rounding): either no tie occurs (identical traces) or the first drift
    is in a CSA layer at a position with more than top_k visible rows (t >= 19). The switch itself is checked on an
    explicit tie in test_torch_engine.test_select_rows_ties_and_fault."""
    from gpu_engine.engine import TorchEngine

    _, forced = reference_runs[True]
    ok = _forced_run(TorchEngine(str(tiny_f32), _opts(True)), forced)
    bad = _forced_run(TorchEngine(str(tiny_f32), _opts(True, ("indexer-ties-highest",))), forced)
    drift = {name: _rel(stack(bad, name), stack(ok, name)) for name in DEPTH}
    first = _first(drift)
    print(f"\nindexer-ties-highest: first drift {first}")
    if first is not None:
        assert first[0] in ("blk.2.attn", "blk.4.attn") and first[1] >= 19


def test_every_fault_is_covered():
    assert set(EXPECTED) | {"indexer-ties-highest"} == set(FAULTS)
