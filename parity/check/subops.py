"""Sub-op comparison inside one layer: `SubopResult`, the drill-down (`drill_down`: both engines and the round-off
twins on the same inputs, judged by `check`'s op-level test), the envelope comparison of two captured runs
(`compare_subops`, for references without twins and for `inherited_flips`) and the QAT code-flip records.

Shared by `check` (its free-running flip naming, its hypotheses) and `bisect` (its drill-down), so it lives in the
check package, below the bisection.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from parity.check.attribution import teacher_forced
from parity.check.envelope import ROW_CAPTURES, Envelope, aligned_weights
from parity.check.null import N_TWINS
from parity.check.subop_evidence import (
    Cascade,
    NearTies,
    OpDeparts,
    OpExcess,
    OpStructural,
    OpTie,
    Outside,
    RowCount,
    SetDiff,
    SubopEvidence,
    evidence_words,
)
from parity.compare.metrics import rel_l2, set_overlap
from parity.compare.verdict import QuantFlip, QuantFormat, SubopStatus
from parity.contract.checkpoints import SUBOPS, block, block_attn
from parity.contract.engine import Engine, LayerOutput, RoundoffTwins
from parity.contract.errors import ParityError
from parity.tracing.runner import ChunkResult

if TYPE_CHECKING:
    from parity.check.opforce import OpVerdict

@dataclass(frozen=True)
class SubopResult:
    """Local comparison of one sub-op inside the culprit layer (both engines on the reference's inputs)."""

    name: str
    status: SubopStatus    # ok | noise | defect
    err: float             # largest local error over the positions judged (rel-L2, or 1 - overlap for sets)
    floor: float           # envelope floor (0 for set comparisons)
    excess: float
    position: int | None   # first position outside the envelope
    evidence: tuple[SubopEvidence, ...] = ()   # what the status rests on, as records (`parity.check.subop_evidence`)

    def __post_init__(self) -> None:
        object.__setattr__(self, "status", SubopStatus(self.status))   # a mistyped status is an error naming it

    @property
    def flips(self) -> tuple[QuantFlip, ...]:
        """The isolated QAT code flips behind a 'noise' status, one per capture (the `QuantFlip`s of `evidence`)."""
        return tuple(e for e in self.evidence if isinstance(e, QuantFlip))

    def to_dict(self) -> dict[str, Any]:
        """The JSON record: the numbers, the evidence in words (`detail`, by `subop_words`) and the flips."""
        return {"name": self.name, "status": self.status, "err": self.err, "floor": self.floor, "excess": self.excess,
                "position": self.position, "detail": subop_words(self), "flips": [asdict(f) for f in self.flips]}


def subop_words(r: SubopResult) -> str:
    """The evidence of one sub-op result in words ('' for an 'ok' sub-op with nothing to say): what `bisect`'s
    summary and `check`'s causes print after the sub-op's name."""
    return "; ".join(evidence_words(e) for e in r.evidence)


# Captures that went through an FP8/FP4 round trip: mantissa bits of the format, for code-flip recognition.
QUANT_FORMAT = {"rope_kv": QuantFormat.FP8_E4M3, "comp_rows": QuantFormat.FP8_E4M3, "index_rows": QuantFormat.FP4_E2M1}
QUANT_MBITS = {name: f.mbits for name, f in QUANT_FORMAT.items()}   # 3, 3, 1
# An isolated code flip touches at most this fraction of a row's elements (at least one element).
FLIP_FRACTION = 1 / 32



def _cat(outs: Sequence[LayerOutput], name: str, engine: str, layer: int) -> np.ndarray:
    for o in outs:
        if name not in o.captures:
            raise ParityError(f"{engine} engine did not fill capture {name!r} at layer {layer}; "
                              "the drill-down needs every capture of parity.contract.checkpoints.SUBOPS")
    return np.concatenate([o.captures[name] for o in outs])


def is_code_flip(ref_row: np.ndarray, got_row: np.ndarray, noise_rel: float, mbits: int) -> bool:
    """True when the rows differ only by isolated one-code steps of a float format with `mbits` mantissa
    bits: at most max(1, FLIP_FRACTION * n) elements off by more than noise_rel * rms(ref_row), each by at
    most two quanta 2^(floor(log2 max(|a|,|b|)) - mbits) (power-of-two block scales; two quanta cover
    sub-normal codes)."""
    a, b = np.asarray(ref_row, np.float64).ravel(), np.asarray(got_row, np.float64).ravel()
    d = np.abs(a - b)
    off = d > noise_rel * np.sqrt(np.mean(a * a))
    if not off.any() or off.sum() > max(1, FLIP_FRACTION * a.size):
        return False
    m = np.maximum(np.abs(a), np.abs(b))[off]
    quantum = np.exp2(np.floor(np.log2(m)) - mbits)
    return bool((d[off] <= 2 * quantum).all())


class _Judge:
    """Compares captures position by position, remembering where a legitimate flip started a cascade."""

    def __init__(self, layer: int, env: Envelope, positions: np.ndarray, ratio: int) -> None:
        self.layer, self.env, self.positions, self.ratio = layer, env, positions, ratio
        self.taint: int | None = None   # first position touched by a legitimate flip

    def excused(self, pos: int) -> bool:
        return self.taint is not None and pos >= self.taint

    def flip(self, pos: int) -> None:
        self.taint = pos if self.taint is None else min(self.taint, pos)

    def floats(self, name: str, a: np.ndarray, b: np.ndarray, pos: np.ndarray) -> SubopResult:
        floor = self.env.subop_floor(self.layer, name)
        tol = self.env.limit(floor)
        err = rel_l2(a, b) if len(a) else np.zeros(0)
        bad = [i for i in np.flatnonzero(err > tol) if not self.excused(int(pos[i]))]
        flips = [i for i in bad if name in QUANT_MBITS and is_code_flip(a[i], b[i], tol, QUANT_MBITS[name])]
        real = [i for i in bad if i not in flips]
        for i in flips:
            self.flip(int(pos[i]))
        worst = float(err.max()) if len(err) else 0.0
        if real:
            i = real[0]
            bad_row = b[i].ravel()
            value = None if np.isfinite(err[i]) else float(bad_row[~np.isfinite(bad_row)][0])
            return SubopResult(name, SubopStatus.DEFECT, float(err[i]), floor, float(self.env.excess(err[i], floor)),
                               int(pos[i]), (Outside(name, float(err[i]), int(pos[i]), value),))
        status = SubopStatus.NOISE if (flips or (err > tol).any()) else SubopStatus.OK
        evidence: tuple[SubopEvidence, ...] = (
            (QuantFlip(name, QUANT_FORMAT[name], len(flips), self.taint),) if flips and self.taint is not None
            else (Cascade(self.taint),) if status is SubopStatus.NOISE else ())   # flips set the taint
        return SubopResult(name, status, worst, floor, float(self.env.excess(worst, floor)), None, evidence)

    def rows(self, name: str, ref_outs: Sequence[LayerOutput], cand_outs: Sequence[LayerOutput]) -> SubopResult:
        """Emitted rows: a row missing or extra at some chunk is a defect at the position that emits it."""
        for o_r, o_c in zip(ref_outs, cand_outs, strict=True):
            nr, nc = len(o_r.captures[name]), len(o_c.captures[name])
            if nr != nc:
                j = min(nr, nc)
                pos = (j + 1) * self.ratio - 1 if self.ratio else int(self.positions[0])
                return SubopResult(name, SubopStatus.DEFECT, 1.0, 0.0, np.inf, pos, (RowCount(name, nc, nr, pos),))
        a, b = ref_outs[-1].captures[name], cand_outs[-1].captures[name]
        row_pos = (np.arange(len(a)) + 1) * max(self.ratio, 1) - 1
        return self.floats(name, a, b, row_pos)

    def sets(self, name: str, a: np.ndarray, b: np.ndarray, pos: np.ndarray,
             margin: np.ndarray | None) -> SubopResult:
        """Per-position set overlap of selected ids (-1 = padding); routing flips judged by the router margin."""
        tol = self.env.margin_tol(self.layer)
        miss = 1 - set_overlap(a, b)
        worst = float(miss.max(initial=0.0))
        for i in np.flatnonzero(miss > 0):
            p = int(pos[i])
            if self.excused(p):
                continue
            if margin is not None and np.isfinite(margin[i]) and margin[i] <= tol:
                self.flip(p)
                continue
            ra, rb = (tuple(sorted(set(x[i][x[i] >= 0].tolist()))) for x in (a, b))
            m = None if margin is None else float(margin[i])
            return SubopResult(name, SubopStatus.DEFECT, float(miss[i]), 0.0, np.inf, p,
                               (SetDiff(name, p, ra, rb, m, None if m is None else tol),))
        status = SubopStatus.NOISE if worst > 0 else SubopStatus.OK
        return SubopResult(name, status, worst, 0.0, 0.0, None, (NearTies(tol, self.taint),) if worst else ())


def _worst(results: list[SubopResult], name: str) -> SubopResult:
    """Combine the captures of one sub-op: the first defect, else the worst status."""
    for r in results:
        if r.status is SubopStatus.DEFECT:
            return replace(r, name=name)
    best = max(results, key=lambda r: (r.status is SubopStatus.NOISE, r.excess))
    return SubopResult(name, best.status, best.err, best.floor, best.excess, best.position,
                       tuple(e for r in results for e in r.evidence))


def drill_down(ref_engine: Engine, cand: Engine, ref: Sequence[ChunkResult], layer: int,
               env: Envelope) -> list[SubopResult]:
    """Every sub-op of `layer`, in SUBOPS order, both engines fed the reference's inputs, judged by the round-off
    null (N_TWINS twins of the reference on the same inputs: 2 + N_TWINS layer-runs); by the envelope's floors
    only when the reference has no twins."""
    r_outs = teacher_forced(ref_engine, ref, [layer], capture=True)[layer]
    c_outs = teacher_forced(cand, ref, [layer], capture=True)[layer]
    for name in (n for _sub, caps in SUBOPS for n in caps):   # every capture filled, on both sides
        _cat(r_outs, name, ref_engine.name, layer)
        _cat(c_outs, name, cand.name, layer)
    if not isinstance(ref_engine, RoundoffTwins):
        return compare_subops(r_outs, c_outs, ref, layer, cand.config.ratio(layer), env,
                              (ref_engine.name, cand.name))
    from parity.check.opforce import judge_ops  # opforce -> hypotheses -> this module

    twins = [teacher_forced(ref_engine.roundoff_twin(s), ref, [layer], capture=True)[layer]
             for s in range(1, N_TWINS + 1)]
    return null_drill_down(judge_ops(r_outs, twins, as_dumps(ref, c_outs, layer), layer, cand.config.ratio(layer)))


def as_dumps(chunks: Sequence[ChunkResult], outs: Sequence[LayerOutput], layer: int) -> list[ChunkResult]:
    """One engine's captured run of `layer` (one LayerOutput per chunk) as the per-chunk dumps `judge_ops` reads:
    that layer's carriers, diagnostics and sub-op captures (the other layers' slots are empty)."""
    pad = [None] * layer
    return [ChunkResult(c.start_pos, c.tokens, {block_attn(layer): o.attn_carrier, block(layer): o.carrier},
                        c.logits, [*pad, o.diag], [*([{}] * layer), o.captures])  # type: ignore[list-item]
            for c, o in zip(chunks, outs, strict=True)]


def null_drill_down(v: OpVerdict) -> list[SubopResult]:
    """`judge_ops`'s verdict of one layer as SubopResults in SUBOPS order. Both engines ran the whole layer on the
    same inputs, so an op inherits the departures of the ops before it: the culprit ('defect') is the first op, in
    execution order, that departs by the null (its test significant, or the structural difference), else, when
    only the pooled cells depart, judge_ops' culprit. An op with TIEs or with cells outside every twin short of
    significance is 'noise'; else 'ok'. floor: the largest twin at the op's worst cell; excess: that cell's
    distance over it."""
    struct_op = v.fit.subop if v.fit.structural is not None else None
    departs = [sub for sub, _ in SUBOPS if sub == struct_op or (sub in v.ops and v.ops[sub].significant)]
    culprit = departs[0] if departs else None if v.fit.explains else v.fit.subop
    out = []
    for sub, _caps in SUBOPS:
        t = v.ops.get(sub)
        ties = [d for d in v.fit.ties if d.subop == sub]
        worst = t.worst if t is not None else None
        err = t.err if t is not None else 0.0
        floor, excess = (worst.twin_max, worst.ratio) if worst is not None else (0.0, 0.0)
        if sub == culprit:
            own = t is not None and t.significant and sub != struct_op
            finding = (OpStructural(sub, v.fit.structural) if sub == struct_op and v.fit.structural is not None
                       else OpDeparts(sub, t if own and t is not None else v.fit.test))
            pos = t.first.position if own and t is not None and t.first is not None else v.fit.position
            out.append(SubopResult(sub, SubopStatus.DEFECT, err, floor, excess, pos, (finding,)))
        elif ties or (t is not None and t.exceed):
            excess_cells = (OpExcess(t),) if t is not None and t.exceed else ()
            out.append(SubopResult(sub, SubopStatus.NOISE, err, floor, excess, None,
                                   (*(OpTie(d) for d in ties), *excess_cells)))
        else:
            out.append(SubopResult(sub, SubopStatus.OK, err, floor, excess, None))
    return out


def compare_subops(r_outs: Sequence[LayerOutput], c_outs: Sequence[LayerOutput], chunks: Sequence[ChunkResult],
                   layer: int, ratio: int, env: Envelope, names: tuple[str, str]) -> list[SubopResult]:
    """Judge every sub-op capture of two runs of `layer` over the chunk schedule `chunks` (one LayerOutput per
    chunk on each side, captured), in SUBOPS order; `names` are the two sides' names for error messages."""
    pos = np.concatenate([c.start_pos + np.arange(len(c.tokens)) for c in chunks])
    judge = _Judge(layer, env, pos, ratio)
    margin = np.concatenate([o.diag.router_margin for o in r_outs])
    results = []
    for sub, caps in SUBOPS:
        parts = []
        for name in caps:
            if name in ROW_CAPTURES:
                _cat(r_outs, name, names[0], layer)
                _cat(c_outs, name, names[1], layer)
                parts.append(judge.rows(name, r_outs, c_outs))
                continue
            a, b = _cat(r_outs, name, names[0], layer), _cat(c_outs, name, names[1], layer)
            if name == "index_sel":
                parts.append(judge.sets(name, a, b, pos, None))
            elif name == "expert_ids":
                parts.append(judge.sets(name, a, b, pos, margin))
            elif name == "expert_weights":
                wa, wb, same = aligned_weights(_cat(r_outs, "expert_ids", names[0], layer), a,
                                               _cat(c_outs, "expert_ids", names[1], layer), b)
                parts.append(judge.floats(name, wa[same], wb[same], pos[same]))
            else:
                parts.append(judge.floats(name, a, b, pos))
        results.append(_worst(parts, sub))
    return results


def inherited_flips(ref_engine: Engine, ref: Sequence[ChunkResult], inputs: Sequence[ChunkResult], layer: int,
                    env: Envelope) -> list[SubopResult]:
    """The reference's `layer` run on its own inputs and on another run's inputs (`inputs`: chunks whose carrier
    entering `layer` is taken), both captured and judged sub-op by sub-op. When the other run's input drift is
    inside the envelope, an excess at this layer is either a legitimate QAT code flip the drift tipped over
    (named in the sub-op's detail) or a defect-like amplification (status 'defect'). 2 layer-runs."""
    own = teacher_forced(ref_engine, ref, [layer], capture=True)[layer]
    other = teacher_forced(ref_engine, inputs, [layer], capture=True)[layer]
    return compare_subops(own, other, ref, layer, ref_engine.config.ratio(layer), env,
                          (ref_engine.name, f"{ref_engine.name} on the other run's inputs"))
