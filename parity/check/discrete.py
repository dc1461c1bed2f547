"""Discrete differences between the candidate's picks and a run of the same layer on its inputs, as data (issue 26,
point 1): what differs, where, and the numbers it rests on. A `Fit` (`parity.check.hypotheses`) holds them; the
words are made only by `parity.check.words.discrete_words`.

Structural (no round-off twin makes it: the layer is not explained):
* `VisibleRows`: the candidate's visible compressed-row count at a position differs from the reference's;
* `ExpertSetDiffers`: an expert set differs at a router margin no twin crosses;
* `SelectionDiffers`: an indexer selection differs and no twin makes it;
* `RowsEmitted` (op level, `opforce.judge_ops`): an emitted-row capture with another row count on the same inputs;
* `PickDiffers` (op level): an op's pick differs and no twin makes it.
Ties (some round-off twin makes the candidate's pick too), each naming its sub-op (`subop`):
* `RouterTie`: an expert set, with the router margin (absolute and in float32 ulps of 1);
* `SelectionTie`: an indexer selection, the rows added and dropped;
* `PickTie` (op level): an op's pick, the ids added and dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class VisibleRows:
    """At `position` the candidate sees `candidate` compressed rows, the reference `reference`."""

    position: int
    candidate: int
    reference: int


@dataclass(frozen=True)
class ExpertSetDiffers:
    """The expert set differs at `position`, at the reference's router margin `margin`, which no twin crosses."""

    position: int
    margin: float


@dataclass(frozen=True)
class SelectionDiffers:
    """The indexer selection differs at `position` and no round-off twin makes the candidate's."""

    position: int


@dataclass(frozen=True)
class RowsEmitted:
    """Op `subop`'s emitted-row capture `capture`: the candidate emitted `candidate` rows, the reference `reference`
    on the same inputs; the first missing or extra row is emitted at `position`."""

    subop: str
    capture: str
    candidate: int
    reference: int
    position: int


@dataclass(frozen=True)
class PickDiffers:
    """Op `subop`'s pick (capture `capture`) differs at `position` and no round-off twin makes the candidate's."""

    subop: str
    capture: str
    position: int


@dataclass(frozen=True)
class RouterTie:
    """The expert set differs at `position`, and some twin picks the candidate's set too: the reference's router
    margin there, absolute and in float32 ulps of 1."""

    position: int
    margin: float
    ulps: float

    @property
    def subop(self) -> str:
        return "router"


@dataclass(frozen=True)
class SelectionTie:
    """The indexer selection differs at `position`: rows `added` (the candidate's only) and `dropped` (the
    reference's only), each picked or dropped by some round-off twin too."""

    position: int
    added: tuple[int, ...]
    dropped: tuple[int, ...]

    @property
    def subop(self) -> str:
        return "indexer_selection"


@dataclass(frozen=True)
class PickTie:
    """Op `subop`'s pick (capture `capture`) differs at `position`: ids `added` and `dropped`, each picked or dropped
    by some round-off twin too."""

    subop: str
    capture: str
    position: int
    added: tuple[int, ...]
    dropped: tuple[int, ...]


Structural = VisibleRows | ExpertSetDiffers | SelectionDiffers | RowsEmitted | PickDiffers
DiscreteTie = RouterTie | SelectionTie | PickTie


def pick_change(theirs: np.ndarray, mine: np.ndarray) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(added, dropped), each sorted: what the candidate picked beyond the reference and what it left out (-1
    padding ignored)."""
    a, b = set(theirs.tolist()) - {-1}, set(mine.tolist()) - {-1}
    return tuple(int(x) for x in sorted(a - b)), tuple(int(x) for x in sorted(b - a))
