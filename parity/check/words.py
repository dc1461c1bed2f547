"""Printers of the round-off null's test and of discrete differences (issue 26, point 1): the one place their
sentences are made, for `check`'s causes (`check_report`), the sub-op evidence (`subop_evidence.evidence_words`),
`bisect`'s summary and `check`'s progress lines. The records hold numbers only (`parity.check.null.NullTest`,
`parity.check.discrete`)."""

from __future__ import annotations

from parity.check.discrete import (
    DiscreteTie,
    ExpertSetDiffers,
    PickDiffers,
    PickTie,
    RouterTie,
    RowsEmitted,
    SelectionDiffers,
    SelectionTie,
    Structural,
    VisibleRows,
)
from parity.check.null import NullTest


def null_words(t: NullTest) -> str:
    """'X of C cells outside all N round-off twins (p = ...)', the non-finite cells, and the worst cell."""
    s = f"{t.exceed} of {t.cells} cells outside all {t.twins} round-off twins (p = {t.p_value:.2g})"
    if t.nonfinite:
        s += f", {t.nonfinite} of them non-finite"
    if t.worst is not None:
        w = t.worst
        s += f"; worst {w.quantity} at position {w.position}: {w.err:.3g} vs twins' {w.twin_max:.3g}"
    return s


def _picks(added: tuple[int, ...], dropped: tuple[int, ...]) -> str:
    """'+a +b -c -d': what the candidate picked beyond the reference and what it left out."""
    return " ".join([*(f"+{x}" for x in added), *(f"-{x}" for x in dropped)])


def discrete_words(d: Structural | DiscreteTie) -> str:
    """One discrete difference (structural, or a TIE) in words."""
    if isinstance(d, VisibleRows):
        return f"visible compressed rows {d.candidate} vs reference {d.reference}"
    if isinstance(d, ExpertSetDiffers):
        return (f"expert set differs at position {d.position} at router margin {d.margin:.3g}, which no round-off "
                "twin crosses")
    if isinstance(d, SelectionDiffers):
        return f"indexer selection differs at position {d.position}, which no round-off twin makes"
    if isinstance(d, RowsEmitted):
        return (f"{d.subop}: the candidate emitted {d.candidate} {d.capture}, the reference {d.reference} on the same "
                "inputs")
    if isinstance(d, PickDiffers):
        return f"{d.subop}: the candidate's pick at position {d.position} differs and no round-off twin makes it"
    if isinstance(d, RouterTie):
        return f"TIE: expert set at position {d.position}, router margin {d.margin:.3g} ({d.ulps:.3g} ulps of 1)"
    if isinstance(d, SelectionTie):
        return (f"TIE: indexer selection at position {d.position}: rows {_picks(d.added, d.dropped)}, each picked "
                "or dropped by some round-off twin too")
    if isinstance(d, PickTie):
        return (f"TIE: {d.subop} pick at position {d.position}: {_picks(d.added, d.dropped)}, each picked or "
                "dropped by some round-off twin too")
    raise TypeError(f"not a discrete difference record: {type(d).__name__}")
