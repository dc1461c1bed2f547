"""The envelope's runs in lockstep (layer after layer over every run) equal the same runs one after another.

`run_lockstep` runs several token-forced runs layer-major so engines sharing one weight cache dequantize a layer
once; `measure_envelope` takes its floors per layer from it. The independent spelling here is the plain loop:
`run_sequence` per run (chunk after chunk through every layer) and `pair_floors` on whole-model results."""

from __future__ import annotations

import numpy as np
import pytest

from parity.check.attribution import teacher_forced
from parity.check.envelope import measure_envelope, pair_floors
from parity.contract.checkpoints import EMBED, FINAL_NORM, block, block_attn
from parity.contract.engine import RunOptions, load_engine
from parity.contract.errors import TraceError
from parity.tracing.runner import run_lockstep, run_sequence

PROMPT = [1, 17, 99, 4, 250, 33, 61, 8, 140, 77, 5, 19]
DECODE = 3


class ChunkOrdered:
    """The reference without `LayerwiseState`: its state refuses any order but chunk after chunk (every layer of
    a chunk before the next chunk), as an engine whose caches are per sequence (llama.cpp's) would."""

    def __init__(self, inner):
        self.inner, self.name, self.config, self.options = inner, inner.name, inner.config, inner.options

    def new_state(self):
        return {"inner": self.inner.new_state(), "last": (-1, self.config.n_layers - 1)}

    def embed(self, tokens):
        return self.inner.embed(tokens)

    def forward_layer(self, state, layer, carrier, tokens, start_pos, capture=False):
        start, last = state["last"]
        ok = (layer == 0 and last == self.config.n_layers - 1 and start_pos > start) or \
             (layer == last + 1 and start_pos == start)
        assert ok, f"layer {layer} at {start_pos} after layer {last} at {start}"
        state["last"] = (start_pos, layer)
        return self.inner.forward_layer(state["inner"], layer, carrier, tokens, start_pos, capture)

    def head(self, carrier):
        return self.inner.head(carrier)


@pytest.fixture(scope="module")
def engines(tiny_realmix):
    ref = load_engine("reference", str(tiny_realmix), RunOptions(fp8_kv=True, fp4_indexer=True))
    return ref, load_engine("reference", str(tiny_realmix), RunOptions(dtype="float64", fp8_kv=True,
                                                                           fp4_indexer=True))


def test_lockstep_equals_runs_one_after_another(engines, tiny_realmix):
    ref, _ = engines
    torch = load_engine("torch", str(tiny_realmix), ref.options)
    base = run_sequence(ref, PROMPT, DECODE)
    forced = [int(t) for t in np.concatenate([r.tokens for r in base])[len(PROMPT):]]
    tokens = [*PROMPT, *forced]
    plans = [(ref.roundoff_twin(3), [len(PROMPT), 1, 1, 1]), (ref, [5, 5, 2, 1, 1, 1]),
             (ChunkOrdered(ref), [4, 4, 4, 1, 1, 1]), (torch, [6, 6, 1, 1, 1])]
    seen: dict[int, list] = {}
    ends = run_lockstep(plans, tokens, True, lambda l, outs: seen.setdefault(l, outs))
    assert sorted(seen) == list(range(ref.config.n_layers))
    for r, (engine, sizes) in enumerate(plans):
        chunk = None if sizes[0] == len(PROMPT) else sizes[0]
        want = run_sequence(engine, PROMPT, DECODE, chunk=chunk, forced=forced, capture=True)
        assert [c.start_pos for c in want] == [c.start_pos for c in ends[r]]
        for i, c in enumerate(want):
            for name in (EMBED, FINAL_NORM):
                np.testing.assert_array_equal(ends[r][i].checkpoints[name], c.checkpoints[name])
            np.testing.assert_array_equal(ends[r][i].logits, c.logits)
            for l in seen:
                got = seen[l][r][i]
                np.testing.assert_array_equal(got.attn_carrier, c.checkpoints[block_attn(l)])
                np.testing.assert_array_equal(got.carrier, c.checkpoints[block(l)])
                assert sorted(got.captures) == sorted(c.captures[l])
                for k, v in got.captures.items():
                    np.testing.assert_array_equal(v, c.captures[l][k])


def test_lockstep_refuses_chunks_that_do_not_cover_the_tokens(engines):
    ref, _ = engines
    with pytest.raises(TraceError, match=r"chunk sizes \[4, 4\] do not cover the 12 tokens"):
        run_lockstep([(ref, [4, 4])], PROMPT, False, lambda l, outs: None)


def test_envelope_floors_equal_pair_floors_of_separate_runs(engines):
    ref, ref64 = engines
    env = measure_envelope(ref, ref64, ref, PROMPT, DECODE, chunk=5, n_twins=2)
    base = run_sequence(ref, PROMPT, DECODE, capture=True)
    forced = [int(t) for t in np.concatenate([r.tokens for r in base])[len(PROMPT):]]

    def run(engine, chunk=None):
        return run_sequence(engine, PROMPT, DECODE, chunk=chunk, forced=forced, capture=True)

    twins = [pair_floors(base, run(ref.roundoff_twin(s))) for s in (1, 2)]
    assert env.null == {k: sorted(t[k] for t in twins) for k in twins[0]}
    assert list(env.null) == list(twins[0])
    assert env.components["oracle"] == pair_floors(base, run(ref64))
    assert env.components["rechunk"] == pair_floors(run(ref), run(ref, 5))
    assert list(env.components) == ["oracle", "rechunk"]
    assert env.calibration["pairs"] == ["oracle", "rechunk"]
    # real-mix with QAT: the twins differ from the exact run somewhere, so the floors are not all zero
    assert max(env.checkpoints.values()) > 0


def test_teacher_forcing_runs_a_chunk_ordered_engine_chunk_after_chunk(engines):
    ref, _ = engines
    chunks = run_sequence(ref, PROMPT, DECODE, chunk=5)
    layers = list(range(ref.config.n_layers))
    want = teacher_forced(ref, chunks, layers, capture=True)    # layer after layer (LayerwiseState)
    got = teacher_forced(ChunkOrdered(ref), chunks, layers, capture=True)   # refuses any other order
    for l in layers:
        for a, b in zip(want[l], got[l], strict=True):
            np.testing.assert_array_equal(a.carrier, b.carrier)
            np.testing.assert_array_equal(a.attn_carrier, b.attn_carrier)
