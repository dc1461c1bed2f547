"""`run_sequence(keep=False)`, as `trace` runs it: every chunk reaches `on_chunk` whole, the chunks returned keep only
their start, tokens and a copy of their last logits row (no view into the chunk's arrays), and the run, greedy
decode tokens included, is the one that keeps everything. (At 2000 positions of V4-Flash the kept checkpoints were
11.5 GiB: docs/bench.md "Full depth".)"""

from __future__ import annotations

import numpy as np

from parity.contract.engine import RunOptions, load_engine
from parity.tracing.runner import run_sequence

PROMPT = [1, 17, 99, 4, 250, 33, 61, 8, 140, 77, 5, 19]


def test_a_streamed_run_equals_the_kept_one_and_holds_no_chunk(tiny_f32):
    engine = load_engine("reference", str(tiny_f32), RunOptions())
    whole, streamed = [], []
    kept = run_sequence(engine, PROMPT, 3, chunk=5, on_chunk=whole.append)
    slim = run_sequence(engine, PROMPT, 3, chunk=5, on_chunk=streamed.append, keep=False)
    assert [len(r.tokens) for r in kept] == [5, 5, 2, 1, 1, 1]
    assert [r.tokens.tolist() for r in slim] == [r.tokens.tolist() for r in kept]
    for a, b in zip(streamed, whole, strict=True):
        assert a.checkpoints.keys() == b.checkpoints.keys()
        assert all(np.array_equal(a.checkpoints[k], b.checkpoints[k]) for k in a.checkpoints)
        assert np.array_equal(a.logits, b.logits)
    for s, k in zip(slim, kept, strict=True):
        assert s.start_pos == k.start_pos and s.checkpoints == {} and s.diags == [] and s.captures == []
        assert np.array_equal(s.logits, k.logits[-1:]) and s.logits.base is None
