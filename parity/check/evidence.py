"""The evidence of one `check` cause as data (issue 26, point 1): the numbers, names and records a cause rests on,
one frozen record per kind of finding. The words are made only by the printer
`parity.check.check_report.cause_words`; no record here holds a sentence (a `Fit`'s ties and structural difference
are records of `parity.check.discrete`, worded by `parity.check.words.discrete_words`).

* `Reproduced`: a benign hypothesis (a reference variant, a stack of two, or the candidate's expert ids replayed)
  reproduces a departing layer: the exact path's fit and the hypothesis's;
* `Tie`: a discrete pick some round-off twin also makes (one of the fit's tie records);
* `Drift`: a free-running excess with every layer locally inside: amplified sub-envelope drift, and the QAT code
  flip it tips over (the sub-op result of `parity.check.subops.inherited_flips`) when one is isolated;
* `EmbeddingDiffers`: the candidate's embedding of the same tokens differs from the reference's lookup;
* `TieRule`: a known fault breaks every tie of a layer as the candidate does;
* `LayerDefect`: a departing layer no benign hypothesis explains, and what the defect library found;
* `DrafterDefect`: a draft checkpoint outside its round-off null, and what the drafter faults found.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from parity.check.discrete import DiscreteTie
    from parity.check.draft_check import DraftFaultMatch
    from parity.check.hypotheses import Fit
    from parity.check.null import NullTest
    from parity.check.subops import SubopResult


class Library(StrEnum):
    """What the defect library (or the drafter faults) found for a departure no benign hypothesis explains."""

    MATCHED = "matched"            # a known fault reproduces it within the round-off null
    PARTIAL = "partial"            # the closest known fault explains part of it (fewer cells outside, smaller residual)
    NO_MATCH = "no match"          # faults were run; none explains any of it
    NONE_OFFERED = "none offered"  # no engine offers fault switches (drafter faults)
    NONE_TRIED = "none tried"      # engines offer drafter faults, none of this draft head's kind


@dataclass(frozen=True)
class Reproduced:
    """A benign hypothesis reproduces a departing layer: `exact` is the exact reference path's fit of the layer on
    the candidate's inputs, `variant` the hypothesis's run's (judged by its own twins, or the exact run's for a
    replay). `stack`: the stacked variant this hypothesis was accepted in (None alone); `routing`: the hypothesis
    is the candidate's expert ids replayed."""

    exact: Fit
    variant: Fit
    stack: str | None = None
    routing: bool = False


@dataclass(frozen=True)
class Tie:
    """A discrete pick (expert set, indexer selection, an op's pick) that differs, which some round-off twin also
    makes: one entry of `Fit.ties` (its sub-op is `tie.subop`)."""

    tie: DiscreteTie


@dataclass(frozen=True)
class Drift:
    """A free-running excess with every layer inside the envelope on the candidate's own inputs. `excess`: the
    largest excess over the envelope, at `checkpoint`; `layer`: the first layer outside (None: only checkpoints
    outside every block); `local`: whether the candidate's carriers allowed a local look; `flip`: the sub-op result
    holding the isolated QAT code flip(s) the drift tips over at `layer` (None: none isolated, or no local look)."""

    excess: float
    checkpoint: str
    layer: int | None
    local: bool
    flip: SubopResult | None = None


@dataclass(frozen=True)
class EmbeddingDiffers:
    """The candidate's embedding of the same tokens differs from the reference's lookup (no round-off there)."""

    rel_l2: float     # the largest rel-L2 over the traced positions
    excess: float     # over the envelope
    position: int     # the first position outside


@dataclass(frozen=True)
class TieRule:
    """`fault` breaks all `ties` ties of a layer exactly as the candidate does (the exact rule and the round-off
    twins break them otherwise)."""

    fault: str
    ties: int


@dataclass(frozen=True)
class LayerDefect:
    """A departing layer no benign hypothesis explains: `exact` the exact path's fit on the candidate's inputs;
    `fault`, `fault_fit` the defect library's best mutation and its fit (None when no engine offers faults)."""

    exact: Fit
    library: Library
    fault: str | None = None
    fault_fit: Fit | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "library", Library(self.library))
        ran = self.library is not Library.NONE_OFFERED
        if self.library is Library.NONE_TRIED or ran != (self.fault is not None) or ran != (self.fault_fit is not None):
            raise ValueError(f"LayerDefect: library {self.library} with fault {self.fault!r}: a fault and its fit are "
                             "given exactly when faults were run (matched, partial, no match)")


@dataclass(frozen=True)
class DrafterDefect:
    """A draft checkpoint outside its round-off null: `test` and `rel_l2` the exact draft head's on the
    candidate's trunk carriers; `fault` the best drafter fault's match (None when none was run)."""

    test: NullTest
    rel_l2: float
    library: Library
    fault: DraftFaultMatch | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "library", Library(self.library))
        ran = self.library in (Library.MATCHED, Library.PARTIAL)
        if self.library is Library.NO_MATCH or ran != (self.fault is not None):
            raise ValueError(f"DrafterDefect: library {self.library} with fault {self.fault!r}: the best drafter "
                             "fault is given exactly when one was run (matched, partial)")


Evidence = Reproduced | Tie | Drift | EmbeddingDiffers | TieRule | LayerDefect | DrafterDefect
EVIDENCE = (Reproduced, Tie, Drift, EmbeddingDiffers, TieRule, LayerDefect, DrafterDefect)
