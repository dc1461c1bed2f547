"""Teacher-forced (local) attribution: each candidate layer run on the reference's input carrier.

For layer l and every chunk of the reference run, the candidate's `forward_layer(l)` gets the reference's
carrier entering layer l (and so builds its layer-l cache from the reference's inputs). Its output minus the
reference's output is the *local* error of layer l; the free-running error (candidate fed by its own
previous layers) is the local error plus amplified upstream drift. Both are reported per layer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from parity.check import parallel
from parity.compare.metrics import rel_l2, set_overlap
from parity.compare.verdict import LayerKind
from parity.contract.checkpoints import EMBED, block, block_attn
from parity.contract.engine import Engine, LayerOutput
from parity.tracing.runner import ChunkResult

if TYPE_CHECKING:   # the envelope measures its floors with the null, which runs layers with `teacher_forced`
    from parity.check.envelope import Envelope


def layer_input(chunk: ChunkResult, layer: int) -> np.ndarray:
    """The reference carrier entering `layer` in one chunk: embed for layer 0, else blk.{layer-1}. [n, H, D], always
    C-contiguous: an engine's arithmetic may depend on the memory layout of its input (the reference's matmuls
    give other roundings on the broadcast view its embed returns), and a worker process receives a contiguous
    copy, so every teacher-forced run gets one."""
    return np.ascontiguousarray(chunk.checkpoints[EMBED if layer == 0 else block(layer - 1)])


def teacher_forced(engine: Engine, ref: Sequence[ChunkResult], layers: Sequence[int], capture: bool = False,
                   on_chunk: Callable[[int], None] | None = None) -> dict[int, list[LayerOutput]]:
    """Run `engine`'s layers on the reference's inputs over the reference's chunk schedule.
    Returns layer -> one LayerOutput per chunk. One state; an engine with `LayerwiseState` (caches per layer, so a
    layer alone gives the same outputs) runs layer after layer, each over every chunk (its weights dequantized
    once however many chunks), any other chunk after chunk (`parallel.over_chunks`); with a work pool active
    (`parallel`) one unit per layer. `on_chunk(i)` reports progress in chunks:
    after the k-th of K layers, i = k * len(ref) // K - 1 (at least 0)."""
    pooled = parallel.for_engine(engine)
    if pooled is not None:
        d, eref = pooled
        runs = (outs for outs, _ in d.layers([(eref, None, l) for l in layers], ref, capture))
    else:
        runs = iter(parallel.over_chunks(engine, layers, [parallel.layer_inputs(ref, l) for l in layers], capture))
    outs_of = {}
    for k, (l, outs) in enumerate(zip(layers, runs, strict=True)):
        outs_of[l] = outs
        if on_chunk:
            on_chunk(max(0, (k + 1) * len(ref) // len(layers) - 1))
    return outs_of


@dataclass(frozen=True)
class LayerAttribution:
    """Local (teacher-forced) vs free-running error of one layer's output carrier (max over positions)."""

    layer: int
    local: float           # max_t rel-L2 of blk.l, candidate layer on the reference's input
    local_attn: float      # same for the half-layer carrier blk.l.attn
    free: float            # max_t rel-L2 of blk.l, candidate on its own inputs
    floor: float           # envelope floor of blk.l
    local_excess: float    # local / (k*floor + eps)
    free_excess: float
    worst_position: int    # argmax_t of the local error
    row_mismatch: int | None = None  # first position whose visible compressed-row count differs (structural)
    null_departs: bool | None = None  # the round-off null's test (parity.check.null), when measured: it decides

    @property
    def kind(self) -> LayerKind:
        """'local' defect, 'propagated' upstream drift, or 'clean'. Local by the round-off null when it was
        measured (the same judgement as `check`), else by the envelope."""
        local = self.null_departs if self.null_departs is not None else self.local_excess > 1
        if local or self.row_mismatch is not None:
            return LayerKind.LOCAL
        return LayerKind.PROPAGATED if self.free_excess > 1 else LayerKind.CLEAN


def attribute(ref: Sequence[ChunkResult], tf: dict[int, list[LayerOutput]], free_errors: dict[str, np.ndarray],
              env: Envelope, departs: dict[int, bool] | None = None) -> list[LayerAttribution]:
    """One row per teacher-forced layer, from the TF outputs and the free-running per-position errors;
    `departs`: per layer, the round-off null's verdict on the local error (None: judged by the envelope)."""
    rows = []
    for l, outs in sorted(tf.items()):
        ref_out = np.concatenate([c.checkpoints[block(l)] for c in ref])
        ref_attn = np.concatenate([c.checkpoints[block_attn(l)] for c in ref])
        loc = rel_l2(ref_out, np.concatenate([o.carrier for o in outs]))
        loc_attn = rel_l2(ref_attn, np.concatenate([o.attn_carrier for o in outs]))
        floor = env.floor(block(l))
        free = float(free_errors[block(l)].max())
        vis_ref = np.concatenate([c.diags[l].n_comp_visible for c in ref])
        vis = np.concatenate([o.diag.n_comp_visible for o in outs])
        mism = np.flatnonzero(vis != vis_ref)
        rows.append(LayerAttribution(
            layer=l, local=float(loc.max()), local_attn=float(loc_attn.max()), free=free, floor=floor,
            local_excess=float(env.excess(loc.max(), floor)),
            free_excess=float(env.excess(free, floor)), worst_position=int(loc.argmax()),
            row_mismatch=int(mism[0]) if len(mism) else None,
            null_departs=None if departs is None else departs[l]))
    return rows


@dataclass(frozen=True)
class LayerRouting:
    """MoE and indexer agreement of one layer over all positions (candidate free-running on the same tokens)."""

    layer: int
    expert_overlap_min: float      # min over positions of |ids_ref ∩ ids_cand| / K
    flips: int                     # positions whose expert set differs
    noise_flips: int               # ... of which at a reference router margin within the measured noise
    largest_flip_margin: float     # largest reference margin among the flips (0 when none; inf on hash layers)
    index_overlap_min: float       # min over positions of indexer-selection overlap (1 off CSA layers)
    index_diffs: int               # positions whose indexer selection differs
    flip_positions: tuple[tuple[int, float, float], ...] = ()  # (position, expert overlap, reference margin)
    index_diff_positions: tuple[tuple[int, float], ...] = ()    # (position, selection overlap)


def _selection(rs: Sequence[ChunkResult], l: int) -> np.ndarray:
    """Indexer selections of layer l over all positions, int [T, k]; a layer without indexer selects nothing."""
    return np.concatenate([c.diags[l].index_sel if c.diags[l].index_sel is not None
                           else -np.ones((len(c.tokens), 1), dtype=np.int64) for c in rs])


def routing(ref: Sequence[ChunkResult], got: Sequence[ChunkResult], env: Envelope) -> list[LayerRouting]:
    """Expert-set overlap, routing flips judged by the reference's router margin, indexer-selection overlap."""
    rows = []
    for l in range(len(ref[0].diags)):
        def cat(rs: Sequence[ChunkResult], what: str, l: int = l) -> np.ndarray:
            return np.concatenate([getattr(c.diags[l], what) for c in rs])

        ov = set_overlap(cat(ref, "expert_ids"), cat(got, "expert_ids"))
        margin = cat(ref, "router_margin")[ov < 1]
        hash_layer = margin.size > 0 and not np.isfinite(margin).all()
        noise = int((np.isfinite(margin) & (margin <= env.margin_tol(l))).sum())
        iov = set_overlap(_selection(ref, l), _selection(got, l))
        flips = np.flatnonzero(ov < 1)
        diffs = np.flatnonzero(iov < 1)
        rows.append(LayerRouting(l, float(ov.min()), len(flips), noise,
                                 np.inf if hash_layer else float(margin.max(initial=0.0)),
                                 float(iov.min()), len(diffs),
                                 tuple((int(p), float(ov[p]), float(m)) for p, m in zip(flips, margin, strict=True)),
                                 tuple((int(p), float(iov[p])) for p in diffs)))
    return rows
