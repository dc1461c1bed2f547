"""The evidence of one sub-op result (`parity.check.subops.SubopResult.evidence`) as data: one frozen record per
kind of finding, with the numbers, names and positions it rests on. Words are made only by `evidence_words` (and
`parity.check.subops.subop_words`, which joins a result's evidence); no decision reads them.

Judged by the envelope's floors (`compare_subops`):
* `Outside`: a float capture outside the envelope at a position (its rel-L2, or the candidate's non-finite value);
* `RowCount`: an emitted-row capture with another row count than the reference's;
* `SetDiff`: a selected set (indexer rows, expert ids) that differs, with the router margin where one was judged;
* `QuantFlip` (`parity.compare.verdict`): isolated QAT code flips of one capture;
* `Cascade`: an excess only at positions after a flip's first position;
* `NearTies`: sets that differ only at near-tie router margins or in a flip's cascade.
Judged by the round-off null (`null_drill_down`, `check`'s op-level test, `parity.check.opforce.judge_ops`):
* `OpDeparts`: the op's test (or the layer's pooled test) is significant;
* `OpStructural`, `OpTie`: a discrete difference no twin makes / some twin makes too (`judge_ops`' records of
  `parity.check.discrete`, worded by `parity.check.words.discrete_words`);
* `OpExcess`: cells outside every twin, short of significance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from parity.check.discrete import DiscreteTie, Structural
from parity.check.null import NullTest
from parity.check.words import discrete_words, null_words
from parity.compare.verdict import QuantFlip, flip_words


@dataclass(frozen=True)
class Outside:
    """A float capture outside the envelope at `position`: rel-L2 `err`, or (`nonfinite`) the first non-finite
    value of the candidate's row there."""

    capture: str
    err: float
    position: int
    nonfinite: float | None = None


@dataclass(frozen=True)
class RowCount:
    """An emitted-row capture where the candidate has `candidate` rows and the reference `reference`: row
    min(candidate, reference) is missing or extra, emitted at `position`."""

    capture: str
    candidate: int
    reference: int
    position: int


@dataclass(frozen=True)
class SetDiff:
    """A selected set that differs at `position` (ids, padding dropped). `margin`: the reference's router margin
    there (None: not a routing decision; inf: hash routing), judged against the router-margin noise `noise`."""

    capture: str
    position: int
    reference: tuple[int, ...]
    candidate: tuple[int, ...]
    margin: float | None = None
    noise: float | None = None


@dataclass(frozen=True)
class Cascade:
    """An excess only at positions from `position` on, where a legitimate flip started a cascade (None: none)."""

    position: int | None


@dataclass(frozen=True)
class NearTies:
    """Sets that differ only at router margins <= `noise`, or in the cascade of a flip from `cascade` on."""

    noise: float
    cascade: int | None


@dataclass(frozen=True)
class OpDeparts:
    """The op `subop` departs by the round-off null: `test` (its own, or the layer's pooled test)."""

    subop: str
    test: NullTest


@dataclass(frozen=True)
class OpStructural:
    """A discrete difference of `subop` no round-off twin makes (`judge_ops`' record of it)."""

    subop: str
    difference: Structural


@dataclass(frozen=True)
class OpTie:
    """A discrete difference some round-off twin makes too (`judge_ops`' record of it)."""

    tie: DiscreteTie


@dataclass(frozen=True)
class OpExcess:
    """Cells outside every round-off twin, short of significance."""

    test: NullTest


SubopEvidence = (Outside | RowCount | SetDiff | QuantFlip | Cascade | NearTies | OpDeparts | OpStructural | OpTie
                 | OpExcess)


def evidence_words(e: SubopEvidence) -> str:
    """One finding in words (the sentences `bisect`'s summary and `check`'s causes print)."""
    if isinstance(e, Outside):
        what = f"rel-L2 {e.err:.3g}" if e.nonfinite is None else f"non-finite candidate value {e.nonfinite}"
        return f"{e.capture}: {what} at position {e.position}"
    if isinstance(e, RowCount):
        return (f"{e.capture}: candidate has {e.candidate} rows, reference {e.reference} (row "
                f"{min(e.candidate, e.reference)} missing or extra, emitted at position {e.position})")
    if isinstance(e, SetDiff):
        return f"{e.capture} at position {e.position}: reference {list(e.reference)}, candidate {list(e.candidate)}" \
            + _margin_words(e)
    if isinstance(e, QuantFlip):
        return flip_words(e)
    if isinstance(e, Cascade):
        return f"excess only in the cascade of a flip at position {e.position}"
    if isinstance(e, NearTies):
        return f"near-tie flips (margin <= {e.noise:.3g}) or cascade from position {e.cascade}"
    if isinstance(e, OpDeparts):
        return f"{e.subop}: {null_words(e.test)}"
    if isinstance(e, OpStructural):
        return f"{e.subop}: {discrete_words(e.difference)}"
    if isinstance(e, OpTie):
        return discrete_words(e.tie)
    if isinstance(e, OpExcess):
        return null_words(e.test)
    raise TypeError(f"not a sub-op evidence record: {type(e).__name__}")


def _margin_words(e: SetDiff) -> str:
    if e.margin is None:
        return ""
    if not math.isfinite(e.margin):
        return " (hash routing is a table lookup)"
    return f" at router margin {e.margin:.3g} > noise {e.noise:.3g}"
