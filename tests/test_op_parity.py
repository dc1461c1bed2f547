"""Op-level parity: each `reference_cpu` op against its `gpu_engine` twin, from one declarative table.

`TWINS` holds one row per op pair. A row names the reference op, the torch op, a seeded input builder and a
tolerance, and gives the measured reason for that tolerance. A single generic checker (`test_twin_matches`)
runs every row. For each of the `SEEDS` seeds it builds the inputs with NumPy as float32 (ints as int64). It
calls the reference op on those arrays and the torch op on the same values as float32 CPU tensors, then compares
every output. Integer and boolean outputs (indices, selections, draft tokens, ring positions) must be equal.
Floating outputs are scored by the worst row's relative L2 (`parity.compare.metrics.rel_l2`, rows along the
first axis), which must be <= the row's tolerance; a tolerance of 0 means bit-identical. Where the two engines
give one op different contracts, the table row adapts them with a lambda; the list of differences is below.

Every tolerance is about 4x the worst rel-L2 measured over the seeds at the shapes in the table, and the reason
string gives that number. `FAULTS` are the engine's fault ops (`gpu_engine.faults`) put in place of the correct
torch op. `test_fault_is_caught` asserts that each one misses its twin's tolerance on every seed, which shows
the checker can fail.

Contract differences (same-named ops whose contracts still differ; issue 26 point 4)
------------------------------------------------------------------------------------
- rms_norm: reference has `rms_norm(x, w, eps)` and `rms_norm_unweighted(x, eps)`; torch has one
  `rms_norm(x, weight | None, eps)`.
- rope_frequencies: reference takes a `RopeSpec` and returns float32 [r/2]; torch takes the seven scalars and
  returns float64 that holds the float32 values.
- apply_rope / rope_angles: reference takes a `RopeTable` (spec, freqs, angle mode, including ggml's
  'recurrence' angles); torch takes the `freqs` tensor and has no recurrence mode.
- swiglu_clamped: `reference_cpu.moe` vs `gpu_engine.ops`.
- fp8: the reference builds `fp8_sim_nope` on `fp8_e4m3_roundtrip` (any width) and has `e4m3_codes` /
  `e2m1_codes`; torch has only `fp8_sim_nope` and no code functions.
- q8_0_roundtrip: `reference_cpu.numerics` vs `gpu_engine.ops`; torch clamps q to +-127, the reference does not
  (no effect: |x|·127/amax <= 127).
- hadamard: reference `hadamard(x)` applies it and `hadamard_matrix(n)` is float64; torch has only
  `hadamard_matrix(n, dtype, device)`, and the engine applies `x @ H` in a lambda (`engine.py`, `index_round`).
- hc_mixes: reference `fn` is a `Weight` (an array, or a `Matrix` whose input rounding sees the normalised
  carrier); torch `fn` is a plain tensor.
- hc_head: `scale` is a float in the reference and a tensor [1] in torch (`scale[0]`).
- sink_attention: the reference takes one query's heads (q [nh, hd]), that query's own keys and an explicit
  scale; torch takes a batch of queries q [n, nh, d], a bool mask [n, nk] and a `budget`, and fixes the scale
  at 1/sqrt(d).
- attend: reference `(q, pos[], raw, raw_start, window, comp, ratio, sel, sink, scale, workers)` applies the
  visibility rule itself (`key_set`); torch `(q, start_pos, raw, raw0, window, comp, n_vis, sel, sinks,
  attention, budget)` takes the visible counts already computed (`n_visible`, which has no reference twin).
- compressor_update: reference `(state, kv, score) -> (rows, first_row_index)`, where the state carries the
  ratio, the overlap flag and the previous-block buffers, and blocks are pooled by `hca_pool` / `csa_pool`;
  torch `(cache, kv, score, start_pos, m, j, slots_of, pool) -> rows`, gathering slots with `hca_slots` /
  `csa_slots`. The states are named `CompressorState` (pend_* / prev_*) vs `CompressorCache` (start, kv, score).
  The row post-processing is an op in the reference (`main_row_post`, `index_row_post`); torch does it inline
  (`model.compressed_keys`, `indexer_selection`).
- indexer_scores: the reference scores one query (q [nh, dI], w [nh]) -> [N]; torch scores a batch
  [n, nh, dI] -> [n, R].
- select_rows: the reference `(q, w, rows, pos, ratio, topk, workers, tie_seed)` scores the rows and applies the
  visibility rule; torch `select_rows(scores, n_vis, top_k)` takes both, and `select_chunked(q, w, rows, n_vis,
  top_k, select, budget)` does the scoring. Torch has no `tie_seed`.
- routing weights: torch takes the scores through a separate op slot, `weight_scores(scores, keys)`
  (`unbiased_scores`); the reference passes the scores directly.
- routed_experts: the reference `expert(e)` returns the weights (w_gate, w_up, w_down) and takes `limit` and
  `workers`; torch `expert(e, x_e, w_e)` returns y and takes a `run` map.
- Ring: frozen in the reference, mutable in torch; `Ring.empty(window, width, dtype)` vs
  `(window, width, device, dtype)`.
- DSpark keys: reference `ring_visible(ring, p, window) -> bool [W]` and `dspark_attend(q, block_k, ring, p,
  window, sink, scale)`; torch `dspark_mask(ring_pos, p, window, block) -> bool [B, W + B]`, which feeds
  `sink_attention`.
- mtp_input / dspark_main / confidence / markov_chain: the reference multiplies through `linear(x, W)` (row
  blocks, `Weight`); torch uses `x @ W.T`.
- Weights: torch ops take weight handles (`gpu_engine.linear.Matrix`, built over a tensor by `dense_matrix`) where
  the reference takes a `Weight`; torch's grouped_output and routed experts have no `workers` (a handle carries
  how its CPU matvecs run, `moe` a `run` map).
- route / moe: the reference has no op of that name outside `reference_cpu.model` (which looks weights up in its
  store); its rows compare torch `model.route` (tensors in: gate, bias or tid2eid, the replayed ids) with the
  reference's router_scores + select_topk / hash_select + routing_weights, and torch `model.moe` with
  routed_experts + expert_ffn. Torch's expert handles are [E, out, in] (`expert_of(W, e)` per expert).
- indexer_queries: torch takes the RoPE op and the index rounding (`Ops` slots: faults replace them) where the
  reference takes a `RopeTable` and an `fp4` flag.
- No pair in the table: main_kv and dspark_stage take `(w, cfg, ops, plan, ...)`, composing the ops above with
  a layer's weights read by `gpu_engine.layer_weights` (as `block_forward` does).
- Not twins but copies: `check_tap_carriers` and `check_taps` are the same NumPy functions in `reference_cpu.draft`
  and `gpu_engine.draft`.

`python tests/test_op_parity.py` prints each row's measured worst rel-L2 next to its recorded `measured`, so the
values can be refreshed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

from gpu_engine import attention as tatt
from gpu_engine import compressor as tcomp
from gpu_engine import draft as tdraft
from gpu_engine import hc as thc
from gpu_engine import indexer as tidx
from gpu_engine import model as tmodel
from gpu_engine import moe as tmoe
from gpu_engine import ops as tops
from gpu_engine.linear import dense_matrix
from parity.compare.metrics import rel_l2
from reference_cpu import attention as ratt
from reference_cpu import compressor as rcomp
from reference_cpu import draft as rdraft
from reference_cpu import hc as rhc
from reference_cpu import indexer as ridx
from reference_cpu import moe as rmoe
from reference_cpu import norms as rnorms
from reference_cpu import numerics as rnum
from reference_cpu import quant_sim as rq
from reference_cpu import rope as rrope
from reference_cpu.state import CompressorState
from reference_cpu.threads import Workers

SEEDS = range(5)
F32 = np.float32
CPU = torch.device("cpu")
BIG = 1 << 20                      # torch's score budget: no chunking at these shapes
ONE = Workers(1)
EPS = 1e-6
Inputs = dict[str, Any]


TOL_FACTOR = 4      # tolerance = TOL_FACTOR x the worst rel-L2 measured over SEEDS (0 measured: bit-identical)


@dataclass(frozen=True)
class Twin:
    """One op pair: build(rng) -> inputs; ref(**numpy inputs) and torch(**tensor inputs) -> an array/tensor or a
    tuple of them; measured: the worst row rel-L2 of the floating outputs over SEEDS (float32, CPU), why: where
    that difference comes from."""

    name: str
    build: Callable[[np.random.Generator], Inputs]
    ref: Callable[..., Any]
    torch: Callable[..., Any]
    measured: float
    why: str

    @property
    def tol(self) -> float:
        return TOL_FACTOR * self.measured

    @property
    def reason(self) -> str:
        if self.measured == 0:
            return f"measured 0 over {len(SEEDS)} seeds: bit-identical; {self.why}"
        return f"measured {self.measured:.3g} over {len(SEEDS)} seeds; {self.why}"


# -- input builders ------------------------------------------------------------------------------------------------

def _n(rng: np.random.Generator, *shape: int, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(F32)


def _row_scaled(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    """Rows whose magnitudes span 2^-20..2^12 (block scales of every size, tiny values), one block of zeros."""
    x = _n(rng, n, k) * np.exp2(rng.uniform(-20, 12, (n, 1))).astype(F32)
    x[0, :32] = 0
    return x


def _ints(rng: np.random.Generator, lo: int, hi: int, *shape: int) -> np.ndarray:
    return rng.integers(lo, hi, shape).astype(np.int64)


# -- fixed op parameters -------------------------------------------------------------------------------------------

PLAIN = rrope.RopeSpec(16, 10000.0, False)
YARN = rrope.RopeSpec(16, 160000.0, True, 16.0, 65536, 32.0, 1.0)
H, D, HD, NH = 4, 32, 32, 4          # HC streams, model width, head width, heads
WINDOW, RATIO = 4, 4


def _t_freqs(s: rrope.RopeSpec) -> torch.Tensor:
    return tops.rope_frequencies(s.rope_dim, s.base, s.yarn, s.factor, s.original_seq_len, s.beta_fast,
                                 s.beta_slow).to(torch.float32)


def _r_table(s: rrope.RopeSpec) -> rrope.RopeTable:
    return rrope.RopeTable.build(s, np.dtype(F32), "exact")


def _rope_in(rng: np.random.Generator) -> Inputs:
    return {"x": _n(rng, 6, 3, 24), "pos": _ints(rng, 0, 70000, 6)}


def _hc_in(rng: np.random.Generator) -> Inputs:
    M = (2 + H) * H
    return {"X": _n(rng, 5, H, D), "fn": _n(rng, M, H * D, scale=0.1), "scale": _n(rng, 3) + 1,
            "base": _n(rng, M, scale=0.5)}


def _hc_post_in(rng: np.random.Generator) -> Inputs:
    comb = rhc.sinkhorn(_n(rng, 5, H, H, scale=2.0), 20, EPS).astype(F32)
    return {"y": _n(rng, 5, D), "X": _n(rng, 5, H, D), "post": 2 * rng.random((5, H)).astype(F32), "comb": comb}


def _q_in(rng: np.random.Generator) -> Inputs:
    return {"x": _n(rng, 6, D), "wq_a": _n(rng, 24, D, scale=0.3), "q_norm": _n(rng, 24),
            "wq_b": _n(rng, NH * HD, 24, scale=0.3)}


def _attend_in(rng: np.random.Generator, csa: bool) -> Inputs:
    """5 queries at positions 8..12, raw rows of positions 5..12, the 3 compressed rows they can see."""
    pos = np.arange(8, 13)
    inputs = {"q": _n(rng, 5, NH, HD), "raw": _n(rng, 8, HD), "comp": _n(rng, 3, HD), "sink": _n(rng, NH) + 1,
              "pos": pos}
    if csa:   # up to 2 of each query's visible rows, ascending, -1 padded
        sel = np.full((5, 2), -1, np.int64)
        for i, t in enumerate(pos):
            vis = (t + 1) // RATIO
            chosen = np.sort(rng.choice(vis, min(2, vis), replace=False))
            sel[i, : len(chosen)] = chosen
        inputs["sel"] = sel
    return inputs


def _r_attend(q, raw, comp, sink, pos, sel=None):
    return ratt.attend(q, pos, raw, 5, WINDOW, comp, RATIO, sel, sink, 1 / math.sqrt(HD), ONE)


def _t_attend(n_visible: Callable = tatt.n_visible) -> Callable[..., torch.Tensor]:
    def run(q, raw, comp, sink, pos, sel=None):
        n_vis = torch.clamp(n_visible(pos, RATIO), max=comp.shape[0])
        return tatt.attend(q, 8, raw, 5, WINDOW, comp, n_vis, sel, sink, tatt.sink_attention, BIG)
    return run


# ratio, call sizes; a 1-token call completes a block (CSA: position 3, HCA: position 15)
CHUNKS = {"csa": (4, (3, 1, 4, 1, 5)), "hca": (8, (13, 1, 1, 1, 8, 16))}


def _comp_in(rng: np.random.Generator, kind: str) -> Inputs:
    m, sizes = CHUNKS[kind]
    width = (2 if m == 4 else 1) * 16
    return {"kv": _n(rng, sum(sizes), width), "score": _n(rng, sum(sizes), width, scale=2.0)}


def _r_compress(kind: str) -> Callable[..., np.ndarray]:
    m, sizes = CHUNKS[kind]

    def run(kv, score):
        state, at = CompressorState.empty(m, 16, np.dtype(F32)), 0
        for n in sizes:
            rows, _first = rcomp.compressor_update(state, kv[at : at + n], score[at : at + n])
            state.rows, at = np.concatenate([state.rows, rows]), at + n
        return state.rows
    return run


def _t_compress(kind: str, slots: tcomp.SlotsOp | None = None,
                blocks: Callable = tcomp.completed_blocks) -> Callable[..., torch.Tensor]:
    m, sizes = CHUNKS[kind]
    slots_of = slots or (tcomp.csa_slots if m == 4 else tcomp.hca_slots)

    def run(kv, score):
        cache, at = tcomp.new_compressor_cache(kv.shape[1], 16, CPU, torch.float32), 0
        for n in sizes:
            rows = tcomp.compressor_update(cache, kv[at : at + n], score[at : at + n], at, m,
                                           blocks(at, n, m, CPU), slots_of)
            cache.rows, at = torch.cat([cache.rows, rows]), at + n
        return cache.rows
    return run


def _select_in(rng: np.random.Generator, integer: bool) -> Inputs:
    """8 queries at positions 16..23 over 6 indexer rows, top-3. Integer values make exact score ties common."""
    if integer:
        q, w, rows = (_ints(rng, -2, 3, 8, 2, 8), _ints(rng, -1, 3, 8, 2), _ints(rng, -2, 3, 6, 8))
        q, w, rows = q.astype(F32), w.astype(F32), rows.astype(F32)
    else:
        q, w, rows = _n(rng, 8, 2, 8), _n(rng, 8, 2), _n(rng, 6, 8)
    return {"q": q, "w": w, "rows": rows, "pos": np.arange(16, 24)}


def _r_select(q, w, rows, pos):
    return ridx.select_rows(q, w, rows, pos, RATIO, 3, ONE)


def _t_select(select: tidx.SelectOp = tidx.select_rows) -> Callable[..., torch.Tensor]:
    def run(q, w, rows, pos):
        n_vis = torch.clamp(torch.div(pos + 1, RATIO, rounding_mode="floor"), max=rows.shape[0])
        return tidx.select_chunked(q, w, rows, n_vis, 3, select, 2 * 6)   # budget: 1 query per chunk
    return run


def _experts_in(rng: np.random.Generator) -> Inputs:
    E, F = 4, 24
    ids = np.stack([rng.choice(E, 2, replace=False) for _ in range(6)]).astype(np.int64)
    return {"x": _n(rng, 6, 16), "ids": ids, "weights": rng.random((6, 2)).astype(F32),
            "wg": _n(rng, E, F, 16, scale=0.5), "wu": _n(rng, E, F, 16, scale=0.5), "wd": _n(rng, E, 16, F, scale=0.3)}


def _t_experts(x, ids, weights, wg, wu, wd):
    def expert(e: int, xe: torch.Tensor, we: torch.Tensor) -> torch.Tensor:
        return (we[:, None] * tops.swiglu_clamped(xe @ wg[e].T, xe @ wu[e].T, 1.5)) @ wd[e].T
    return tmoe.routed_experts(x, ids, weights, expert)


def _route_in(rng: np.random.Generator) -> Inputs:
    return {"x": _n(rng, 6, D), "gate": _n(rng, 16, D, scale=2.0), "bias": _n(rng, 16, scale=0.3),
            "tid2eid": _ints(rng, 0, 16, 50, 4), "tokens": _ints(rng, 0, 50, 6)}


def _r_route(x, gate, bias, tid2eid, tokens):
    s = rmoe.router_scores(x, gate)
    ids, margin = rmoe.select_topk(s + bias, 4)
    return ids, rmoe.routing_weights(s, ids, 1.5), margin


def _t_route(weight_scores: Callable = tmoe.unbiased_scores) -> Callable[..., Any]:
    def run(x, gate, bias, tid2eid, tokens):
        r = tmodel.route(x, dense_matrix(gate), bias, None, tokens, 4, 1.5, weight_scores, None)
        return r.ids, r.weights, r.margin
    return run


def _r_route_hash(x, gate, bias, tid2eid, tokens):   # the margin (nan on hash layers) is checked in the test below
    ids = rmoe.hash_select(tid2eid, tokens)
    return ids, rmoe.routing_weights(rmoe.router_scores(x, gate), ids, 1.5)


def _t_route_hash(x, gate, bias, tid2eid, tokens):
    r = tmodel.route(x, dense_matrix(gate), None, tid2eid, tokens, 4, 1.5, tmoe.unbiased_scores, None)
    assert bool(torch.isnan(r.margin).all())
    return r.ids, r.weights


def _t_expert_ffn(swiglu: Callable = tops.swiglu_clamped) -> Callable[..., Any]:
    def run(x, ids, weights, wg, wu, wd):
        w0, w1 = (tuple(dense_matrix(t[e]) for t in (wg, wu, wd)) for e in (0, 1))
        return tmoe.expert_ffn(x, *w0, 1.5, None, swiglu), tmoe.expert_ffn(x, *w1, 1.5, weights[:, 0], swiglu)
    return run


def _r_moe(x, ids, weights, wg, wu, wd):   # expert 0's weights also serve as the shared expert (limit 2.0)
    return (rmoe.routed_experts(x, ids, weights, lambda e: (wg[e], wu[e], wd[e]), 1.5, ONE),
            rmoe.expert_ffn(x, wg[0], wu[0], wd[0], 2.0))


def _t_moe(swiglu: Callable = tops.swiglu_clamped) -> Callable[..., Any]:
    def run(x, ids, weights, wg, wu, wd):
        r = tmodel.Routing(ids, weights, torch.zeros(len(ids)))
        shared = tuple(dense_matrix(t[0]) for t in (wg, wu, wd))
        return tmodel.moe(x, r, tuple(dense_matrix(t) for t in (wg, wu, wd)), shared, 1.5, 2.0, swiglu)
    return run


def _routing_in(rng: np.random.Generator) -> Inputs:
    scores = rng.random((6, 16)).astype(F32) + 0.1
    return {"scores": scores, "bias": _n(rng, 16), "ids": np.argsort(-scores, axis=1)[:, :4].astype(np.int64)}


def _t_routing(weight_scores: Callable = tmoe.unbiased_scores) -> Callable[..., torch.Tensor]:
    return lambda scores, bias, ids: tmoe.routing_weights(weight_scores(scores, scores + bias), ids, 1.5)


def _mtp_in(rng: np.random.Generator) -> Inputs:
    return {"e_row": _n(rng, 5, D), "carrier": _n(rng, 5, H, D) * np.arange(1, H + 1, dtype=F32)[:, None],
            "enorm_w": _n(rng, D), "hnorm_w": _n(rng, D), "e_proj": _n(rng, D, D, scale=0.2),
            "h_proj": _n(rng, D, D, scale=0.2)}


def _markov_in(rng: np.random.Generator) -> Inputs:
    return {"logits": _n(rng, 5, 40), "w1": _n(rng, 40, 6), "w2": _n(rng, 40, 6)}


RING_W, BLOCK, P = 6, 3, 13


def _ring_in(rng: np.random.Generator) -> Inputs:
    """A prompt of 9 rows (positions 0..8), then a round writing positions 9..14 (14 > p stays invisible)."""
    return {"prompt": _n(rng, 9, HD), "round_rows": _n(rng, 6, HD), "q": _n(rng, BLOCK, NH, HD),
            "block_k": _n(rng, BLOCK, HD), "sink": _n(rng, NH) + 1}


def _r_ring(prompt, round_rows, **_: Any) -> rdraft.Ring:
    ring = rdraft.ring_write(rdraft.Ring.empty(RING_W, HD, np.dtype(F32)), prompt, np.arange(9))
    return rdraft.ring_write(ring, round_rows, np.arange(9, 15))


def _t_ring(prompt, round_rows, write: Callable = tdraft.ring_write, **_: Any) -> tdraft.Ring:
    ring = write(tdraft.Ring.empty(RING_W, HD, CPU, torch.float32), prompt, torch.arange(9))
    return write(ring, round_rows, torch.arange(9, 15))


def _rows_pos(ring: rdraft.Ring | tdraft.Ring) -> tuple[Any, Any]:
    return ring.rows, ring.pos


def _r_dspark_attend(prompt, round_rows, q, block_k, sink):
    return rdraft.dspark_attend(q, block_k, _r_ring(prompt, round_rows), P, RING_W, sink, 1 / math.sqrt(HD))


def _t_dspark_attend(mask_op: Callable = tdraft.dspark_mask) -> Callable[..., torch.Tensor]:
    def run(prompt, round_rows, q, block_k, sink):
        ring = _t_ring(prompt, round_rows)
        mask = mask_op(ring.pos, P, RING_W, BLOCK)
        return tatt.sink_attention(q, torch.cat([ring.rows, block_k]), mask, sink, BIG)
    return run


# -- the table -----------------------------------------------------------------------------------------------------

# why the two engines differ (the `why` of the rows below)
MM = "float32 matmul: BLAS vs torch summation order"
MM_BLOCKS = MM + " (the reference's 8-row blocks)"
SINK = "float32 q·k, softmax with sink: max-shifted exp vs torch.softmax over [z, sink]"
SLOTS = "softmax over the slots: max-shifted exp vs torch.softmax"
MEAN_SQ = "float32 mean(x^2): NumPy pairwise vs torch summation order"
COS_SIN = "cos/sin of float32 angles up to 7e4 rad: NumPy vs torch libm, an ulp apart"

TWINS: list[Twin] = [
    Twin("rms_norm", lambda r: {"x": _n(r, 6, 3, 32, scale=4.0), "w": _n(r, 32)},
         lambda x, w: rnorms.rms_norm(x, w, EPS), lambda x, w: tops.rms_norm(x, w, EPS),
         1.21e-07, MEAN_SQ),
    Twin("rms_norm_unweighted", lambda r: {"x": _n(r, 6, 3, 32, scale=4.0)},
         lambda x: rnorms.rms_norm_unweighted(x, EPS), lambda x: tops.rms_norm(x, None, EPS),
         1.02e-07, MEAN_SQ),
    Twin("rope_frequencies", lambda r: {},
         lambda: (rrope.rope_frequencies(PLAIN), rrope.rope_frequencies(YARN)),
         lambda: (_t_freqs(PLAIN), _t_freqs(YARN)),
         0, "the same float32 steps (pow rounded once, reciprocal, YaRN ramp)"),
    Twin("apply_rope", _rope_in,
         lambda x, pos: (rrope.apply_rope(x, pos, _r_table(PLAIN)), rrope.apply_rope(x, pos, _r_table(YARN))),
         lambda x, pos: (tops.apply_rope(x, pos, _t_freqs(PLAIN)), tops.apply_rope(x, pos, _t_freqs(YARN))),
         7.11e-08, COS_SIN),
    Twin("rope_angles", lambda r: {"pos": _ints(r, 0, 70000, 6)},
         lambda pos: rrope.rope_angles(pos, _r_table(YARN)), lambda pos: tops.rope_angles(pos, _t_freqs(YARN)),
         0, "one float32 product p·f per angle"),
    Twin("apply_rope_inverse", _rope_in,
         lambda x, pos: rrope.apply_rope(x, pos, _r_table(YARN), inverse=True),
         lambda x, pos: tops.apply_rope(x, pos, _t_freqs(YARN), inverse=True),
         5.07e-08, COS_SIN),
    Twin("swiglu_clamped", lambda r: {"g": _n(r, 6, 64, scale=4.0), "u": _n(r, 6, 64, scale=4.0)},
         lambda g, u: rmoe.swiglu_clamped(g, u, 2.0), lambda g, u: tops.swiglu_clamped(g, u, 2.0),
         3.08e-08, "silu: reference g·sigmoid(g) vs torch's silu kernel"),
    Twin("e4m3_round", lambda r: {"v": np.clip(_n(r, 4, 64) * np.exp2(r.uniform(-12, 9, (4, 64))), -448, 448)
                                  .astype(F32)},
         rq.e4m3_round, tops.e4m3_round, 0, "the same float32 steps (frexp, step, round half to even)"),
    Twin("e2m1_round", lambda r: {"v": np.concatenate([r.uniform(-6, 6, (3, 32)).astype(F32),
                                                       np.array([[0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25,
                                                                  -2.5, -5.0, 0, 6, -6, 0.5, 3, 4] * 2], F32)])},
         rq.e2m1_round, tops.e2m1_round,
         0, "the same float32 steps (step by range, round half to even), exact ties included"),
    Twin("fp8_sim_nope", lambda r: {"kv": _row_scaled(r, 6, 96)},
         lambda kv: rq.fp8_sim_nope(kv, 64), lambda kv: tops.fp8_sim_nope(kv, 64),
         0, "the same float32 steps (amax·fl(1/448), ceil log2, e4m3 rounding)"),
    Twin("fp4_e2m1_roundtrip", lambda r: {"x": _row_scaled(r, 6, 64)},
         rq.fp4_e2m1_roundtrip, tops.fp4_e2m1_roundtrip,
         0, "the same float32 steps (amax/6, ceil log2, e2m1 rounding)"),
    Twin("q8_0_roundtrip", lambda r: {"x": _row_scaled(r, 6, 64)},
         rnum.q8_0_roundtrip, tops.q8_0_roundtrip, 0, "the same float32 steps (amax/127 to f16, rint)"),
    Twin("hadamard", lambda r: {"x": _n(r, 6, 64)},
         rq.hadamard, lambda x: x @ tops.hadamard_matrix(64, torch.float32, CPU), 2.13e-07, MM),
    Twin("hadamard_fp4 (indexer round)", lambda r: {"x": _n(r, 6, 64)},
         lambda x: rq.fp4_e2m1_roundtrip(rq.hadamard(x)),
         lambda x: tops.fp4_e2m1_roundtrip(x @ tops.hadamard_matrix(64, torch.float32, CPU)),
         0, "the Hadamard's ~2e-7 matmul differences flip no FP4 code at these inputs"),
    Twin("hc_mixes", _hc_in,
         lambda X, fn, scale, base: rhc.hc_mixes(X, fn, EPS), lambda X, fn, scale, base: thc.hc_mixes(X, fn, EPS),
         3.77e-07, MM_BLOCKS),
    Twin("sinkhorn", lambda r: {"Z": _n(r, 6, H, H, scale=2.0)},
         lambda Z: rhc.sinkhorn(Z, 20, EPS), lambda Z: thc.sinkhorn(Z, 20, EPS),
         1.39e-07, "softmax (exp(Z - max)/Σ vs torch.softmax), then 39 float32 normalisations"),
    Twin("hc_pre", _hc_in,
         lambda X, fn, scale, base: rhc.hc_pre(X, fn, scale, base, EPS, EPS, 20),
         lambda X, fn, scale, base: thc.hc_pre(X, fn, scale, base, EPS, EPS, 20),
         4.37e-07, MM + ", softmax inside Sinkhorn"),
    Twin("hc_post", _hc_post_in, rhc.hc_post, lambda y, X, post, comb: thc.hc_post(y, X, post, comb),
         0, "[4, 4] x [4, 32] products: np.matmul and torch.bmm sum alike"),
    Twin("hc_head", lambda r: {"X": _n(r, 5, H, D), "fn": _n(r, H, H * D, scale=0.1), "scale": _n(r, 1) + 1,
                               "base": _n(r, H)},
         lambda X, fn, scale, base: rhc.hc_head(X, fn, float(scale[0]), base, EPS, EPS),
         lambda X, fn, scale, base: thc.hc_head(X, fn, scale, base, EPS, EPS), 2.96e-07, MM),
    Twin("q_path", _q_in,
         lambda x, wq_a, q_norm, wq_b: ratt.q_path(x, wq_a, q_norm, wq_b, NH, EPS),
         lambda x, wq_a, q_norm, wq_b: tmodel.q_path(x, dense_matrix(wq_a), q_norm, dense_matrix(wq_b), NH, EPS),
         2.66e-07, MM_BLOCKS + ", then two RMS norms"),
    Twin("kv_latent", lambda r: {"x": _n(r, 6, D), "wkv": _n(r, HD, D, scale=0.3), "kv_norm": _n(r, HD)},
         lambda x, wkv, kv_norm: ratt.kv_latent(x, wkv, kv_norm, EPS),
         lambda x, wkv, kv_norm: tmodel.kv_latent(x, dense_matrix(wkv), kv_norm, EPS),
         2.48e-07, MM_BLOCKS + ", then an RMS norm"),
    Twin("grouped_output", lambda r: {"o": _n(r, 6, NH, HD), "wo_a": _n(r, 2 * 16, NH * HD // 2, scale=0.2),
                                      "wo_b": _n(r, D, 2 * 16, scale=0.3)},
         lambda o, wo_a, wo_b: ratt.grouped_output(o, wo_a, wo_b, 2, ONE),
         lambda o, wo_a, wo_b: tmodel.grouped_output(o, dense_matrix(wo_a), dense_matrix(wo_b), 2),
         3.97e-07, MM_BLOCKS + " (per group, then W_ob)"),
    Twin("sink_attention", lambda r: {"q": _n(r, 3, NH, HD), "keys": _n(r, 10, HD), "sink": _n(r, NH) + 1},
         lambda q, keys, sink: np.stack([ratt.sink_attention(qi, keys, sink, 1 / math.sqrt(HD)) for qi in q]),
         lambda q, keys, sink: tatt.sink_attention(q, keys, torch.ones(3, 10, dtype=torch.bool), sink, BIG),
         2.31e-07, SINK),
    Twin("attend (HCA visibility)", lambda r: _attend_in(r, False), _r_attend, _t_attend(), 2.48e-07, SINK),
    Twin("attend (CSA selection)", lambda r: _attend_in(r, True), _r_attend, _t_attend(), 2.48e-07, SINK),
    Twin("softmax_pool", lambda r: {"kv": _n(r, 3, 8, 16), "score": _n(r, 3, 8, 16, scale=3.0)},
         rcomp.softmax_pool, tcomp.softmax_pool, 1.22e-07, SLOTS),
    Twin("compressor_update (HCA m=8, chunked)", lambda r: _comp_in(r, "hca"), _r_compress("hca"),
         _t_compress("hca"), 1.1e-07, SLOTS),
    Twin("compressor_update (CSA m=4, chunked)", lambda r: _comp_in(r, "csa"), _r_compress("csa"),
         _t_compress("csa"), 1.01e-07, SLOTS),
    Twin("indexer_weights", lambda r: {"x": _n(r, 6, D), "w_proj": _n(r, NH, D)},
         lambda x, w_proj: ridx.indexer_weights(x, w_proj, 16),
         lambda x, w_proj: tidx.indexer_weights(x, dense_matrix(w_proj), 16), 3.58e-07, MM),
    Twin("indexer_queries (FP4 off)", lambda r: {"qr": _n(r, 6, 24), "wq_b": _n(r, NH * 16, 24, scale=0.3),
                                                 "pos": _ints(r, 0, 70000, 6)},
         lambda qr, wq_b, pos: ridx.indexer_queries(qr, wq_b, pos, _r_table(YARN), NH, False),
         lambda qr, wq_b, pos: tidx.indexer_queries(qr, dense_matrix(wq_b), pos, _t_freqs(YARN), NH, tops.apply_rope,
                                                    tops.identity), 1.52e-07, MM_BLOCKS + "; " + COS_SIN),
    Twin("compressor_project", lambda r: {"x": _n(r, 6, D), "w_kv": _n(r, 32, D, scale=0.3),
                                          "w_gate": _n(r, 32, D, scale=0.3), "ape": _n(r, 4, 32),
                                          "pos": _ints(r, 0, 100, 6)},
         rcomp.compressor_project,
         lambda x, w_kv, w_gate, ape, pos: tcomp.compressor_project(x, dense_matrix(w_kv), dense_matrix(w_gate), ape,
                                                                    pos), 1.66e-07, MM_BLOCKS),
    Twin("indexer_scores", lambda r: {"q": _n(r, 5, NH, 16), "w": _n(r, 5, NH), "rows": _n(r, 7, 16)},
         lambda q, w, rows: np.stack([ridx.indexer_scores(qi, wi, rows) for qi, wi in zip(q, w, strict=True)]),
         tidx.indexer_scores, 2.4e-07, "float32 q·k: BLAS vs torch.einsum summation order"),
    Twin("select_rows (integer scores, ties)", lambda r: _select_in(r, True),
         _r_select, _t_select(), 0.0, "discrete outputs"),
    Twin("select_rows (float scores)", lambda r: _select_in(r, False),
         _r_select, _t_select(), 0.0, "discrete outputs"),
    Twin("router_scores", lambda r: {"x": _n(r, 6, D), "gate": _n(r, 16, D, scale=2.0)},
         rmoe.router_scores, lambda x, gate: tmoe.router_scores(x, dense_matrix(gate)), 1.31e-07, MM),
    Twin("route (biased top-k)", _route_in, _r_route, _t_route(), 7.02e-07,
         MM + ", sqrt(softplus); the margin (a difference of two keys) has the largest relative error"),
    Twin("route (hash layer)", _route_in, _r_route_hash, _t_route_hash, 1.9e-07, MM + ", sqrt(softplus)"),
    Twin("expert_ffn (shared, weighted)", _experts_in,
         lambda x, ids, weights, wg, wu, wd: (rmoe.expert_ffn(x, wg[0], wu[0], wd[0], 1.5),
                                              rmoe.expert_ffn(x, wg[1], wu[1], wd[1], 1.5, weights[:, 0])),
         _t_expert_ffn(), 2.82e-07, MM_BLOCKS + ", silu"),
    Twin("moe (routed + shared)", _experts_in, _r_moe, _t_moe(), 3.05e-07, MM_BLOCKS + ", silu"),
    Twin("select_topk", lambda r: {"keys": np.concatenate([_n(r, 4, 16), _ints(r, 0, 4, 4, 16).astype(F32)])},
         lambda keys: rmoe.select_topk(keys, 4), lambda keys: tmoe.select_topk(keys, 4),
         0, "a stable sort of the same keys; the margin is one float32 subtraction"),
    Twin("routing_weights", _routing_in, lambda scores, bias, ids: rmoe.routing_weights(scores, ids, 1.5),
         _t_routing(), 0, "the same gather, sum of 4 and division"),
    Twin("hash_select", lambda r: {"tid2eid": _ints(r, 0, 16, 50, 4), "tokens": _ints(r, 0, 50, 9)},
         rmoe.hash_select, tmoe.hash_select, 0.0, "discrete outputs"),
    Twin("routed_experts", _experts_in,
         lambda x, ids, weights, wg, wu, wd: rmoe.routed_experts(x, ids, weights, lambda e: (wg[e], wu[e], wd[e]),
                                                                 1.5, ONE),
         _t_experts, 3.05e-07, MM + ", silu"),
    Twin("mtp_pairs (prev, same)", lambda r: {"c": _n(r, 5, H, D), "tok": _ints(r, 0, 99, 5)},
         lambda c, tok: (*rdraft.mtp_pairs(c, tok, "prev"), *rdraft.mtp_pairs(c, tok, "same")),
         lambda c, tok: (*tdraft.mtp_pairs(c, tok, "prev"), *tdraft.mtp_pairs(c, tok, "same")), 0.0,
         "slices of the same arrays"),
    Twin("mtp_input", _mtp_in, lambda **a: rdraft.mtp_input(**a, eps=EPS), lambda **a: tdraft.mtp_input(**a, eps=EPS),
         1.9e-07, MM_BLOCKS),
    Twin("dspark_taps", lambda r: {"c0": _n(r, 5, H, D), "c1": _n(r, 5, H, D), "c2": _n(r, 5, H, D)},
         lambda c0, c1, c2: rdraft.dspark_taps([c0, c1, c2]), lambda c0, c1, c2: tdraft.dspark_taps([c0, c1, c2]),
         0, "a mean over 4 streams: NumPy and torch sum alike"),
    Twin("dspark_main", lambda r: {"taps": _n(r, 5, 3 * D), "proj": _n(r, D, 3 * D, scale=0.2), "norm": _n(r, D)},
         lambda taps, proj, norm: rdraft.dspark_main(taps, proj, norm, EPS),
         lambda taps, proj, norm: tdraft.dspark_main(taps, proj, norm, EPS), 3.13e-07, MM_BLOCKS),
    Twin("markov_chain", _markov_in, lambda logits, w1, w2: rdraft.markov_chain(logits, 7, w1, w2),
         lambda logits, w1, w2: tdraft.markov_chain(logits, 7, w1, w2),
         8.56e-08, "biased logits: the reference's blocked matmul vs torch's matrix-vector product"),
    Twin("confidence", lambda r: {"z": _n(r, 5, D), "u": _n(r, 5, 6), "w_c": _n(r, 1, D + 6)},
         rdraft.confidence, tdraft.confidence, 2.95e-07, MM),
    Twin("ring_write (prompt, then a round)", _ring_in,
         lambda **a: _rows_pos(_r_ring(**a)), lambda **a: _rows_pos(_t_ring(**a)),
         0.0, "copies of the same rows"),
    Twin("ring_visible / dspark_mask", _ring_in,
         lambda **a: np.tile(np.concatenate([rdraft.ring_visible(_r_ring(**a), P, RING_W), np.ones(BLOCK, bool)]),
                             (BLOCK, 1)),
         lambda **a: tdraft.dspark_mask(_t_ring(**a).pos, P, RING_W, BLOCK), 0.0, "discrete outputs"),
    Twin("dspark_attend", _ring_in, _r_dspark_attend, _t_dspark_attend(), 1.61e-07, SINK),
]
BY_NAME = {t.name: t for t in TWINS}

# (twin, name of the fault, the torch op with the fault in place of the correct one)
FAULTS: list[tuple[str, str, Callable[..., Any]]] = [
    ("apply_rope", "rope-split-halves",
     lambda x, pos: (tops.apply_rope_split_halves(x, pos, _t_freqs(PLAIN)),
                     tops.apply_rope_split_halves(x, pos, _t_freqs(YARN)))),
    ("swiglu_clamped", "swiglu-symmetric-clamp", lambda g, u: tops.swiglu_symmetric_clamp(g, u, 2.0)),
    ("hc_post", "comb-not-transposed", lambda y, X, post, comb: thc.hc_post_not_transposed(y, X, post, comb)),
    ("sink_attention", "sink-dropped",
     lambda q, keys, sink: tatt.sink_attention_no_sink(q, keys, torch.ones(3, 10, dtype=torch.bool), sink, BIG)),
    ("attend (HCA visibility)", "compressed-row-visible-late", _t_attend(tatt.n_visible_late)),
    ("compressor_update (CSA m=4, chunked)", "csa-halves-swapped",
     _t_compress("csa", slots=tcomp.csa_slots_halves_swapped)),
    ("compressor_update (HCA m=8, chunked)", "no-decode-compression",
     _t_compress("hca", blocks=tcomp.completed_blocks_multi_token)),
    ("select_rows (integer scores, ties)", "indexer-ties-highest", _t_select(tidx.select_rows_ties_highest)),
    ("routing_weights", "router-bias-in-weights", _t_routing(tmoe.biased_keys)),
    ("route (biased top-k)", "router-bias-in-weights", _t_route(tmoe.biased_keys)),
    ("expert_ffn (shared, weighted)", "swiglu-symmetric-clamp", _t_expert_ffn(tops.swiglu_symmetric_clamp)),
    ("moe (routed + shared)", "swiglu-symmetric-clamp", _t_moe(tops.swiglu_symmetric_clamp)),
    ("mtp_pairs (prev, same)", "mtp-pairing-same",
     lambda c, tok: (*tdraft.mtp_pairs_same(c, tok, "prev"), *tdraft.mtp_pairs(c, tok, "same"))),
    ("mtp_input", "mtp-hnorm-flat", lambda **a: tdraft.mtp_input_hnorm_flat(**a, eps=EPS)),
    ("markov_chain", "dspark-markov-unconditioned",
     lambda logits, w1, w2: tdraft.markov_chain_unconditioned(logits, 7, w1, w2)),
    ("ring_write (prompt, then a round)", "dspark-stale-ring",
     lambda **a: _rows_pos(_t_ring(**a, write=tdraft.ring_write_newest_row))),
    ("dspark_attend", "dspark-causal-block", _t_dspark_attend(tdraft.dspark_mask_causal)),
]


# -- the checker ---------------------------------------------------------------------------------------------------

def _to_torch(v: Any) -> Any:
    if isinstance(v, np.ndarray):
        return torch.from_numpy(v.copy())
    return v


def _outputs(out: Any) -> list[np.ndarray]:
    items = out if isinstance(out, tuple | list) else (out,)
    return [o.detach().numpy() if isinstance(o, torch.Tensor) else np.asarray(o) for o in items]


def _error(a: np.ndarray, b: np.ndarray) -> float:
    """0 when equal; for discrete outputs inf otherwise; for floating ones the worst row's rel-L2 (a: reference)."""
    if a.shape != b.shape:
        return math.inf
    if a.dtype.kind in "iub" or b.dtype.kind in "iub":
        return 0.0 if np.array_equal(a, b) else math.inf
    rows = a.reshape(len(a), -1) if a.ndim > 1 else a.reshape(1, -1)
    return float(rel_l2(rows, b.reshape(rows.shape)).max()) if a.size else 0.0


def errors(twin: Twin, torch_op: Callable[..., Any] | None = None) -> list[float]:
    """The worst output error of `twin` (or of `torch_op` in place of its torch op) for every seed."""
    out = []
    for seed in SEEDS:
        inputs = twin.build(np.random.default_rng(seed))
        ref = _outputs(twin.ref(**inputs))
        tor = _outputs((torch_op or twin.torch)(**{k: _to_torch(v) for k, v in inputs.items()}))
        assert len(ref) == len(tor), f"{twin.name}: {len(ref)} reference outputs, {len(tor)} torch outputs"
        out.append(max(_error(a, b) for a, b in zip(ref, tor, strict=True)))
    return out


@pytest.mark.parametrize("twin", TWINS, ids=lambda t: t.name)
def test_twin_matches(twin: Twin):
    errs = errors(twin)
    assert max(errs) <= twin.tol, f"{twin.name}: worst rel-L2 per seed {errs} > tolerance {twin.tol} ({twin.reason})"


@pytest.mark.parametrize("fault", FAULTS, ids=lambda f: f[1])
def test_fault_is_caught(fault: tuple[str, str, Callable[..., Any]]):
    twin_name, name, op = fault
    twin = BY_NAME[twin_name]
    errs = errors(twin, op)
    assert min(errs) > twin.tol, f"fault {name} passes as {twin_name} on some seed: errors {errs} <= {twin.tol}"


def test_table_covers_at_least_15_pairs():
    assert len({t.name for t in TWINS}) == len(TWINS) >= 15
    assert {f[0] for f in FAULTS} <= set(BY_NAME), "a fault names a twin not in the table"


if __name__ == "__main__":   # re-measure: the worst rel-L2 over SEEDS of every row, and of every fault
    for row in TWINS:
        print(f"{row.name:42s} measured now {max(errors(row)):.3g}   recorded {row.measured:.3g}")
    for twin_name, name, op in FAULTS:
        print(f"fault {name:36s} least error {min(errors(BY_NAME[twin_name], op)):.3g}")
