"""`check`'s causes hold data and only the printers make words (issue 26, point 1).

* no report class in parity/check stores a str field named headline / summary / evidence / detail (an AST scan,
  shown to fail on planted classes);
* a cause's evidence is a record of `parity.check.evidence` (a sentence is refused), and a record whose library
  outcome contradicts its fault is refused;
* `cause_words` renders every record kind as the sentences the code wrote before the records (the f-strings of
  parity/check/check.py at commit 1bf8311, filled in by hand with the numbers below); the two kinds real runs
  reach on the tiny model (a flip's drift, a matched fault) are compared byte for byte with the fixture in
  tests/test_verdict_types.py.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from parity.check.check import Cause
from parity.check.check_report import cause_words
from parity.check.draft_check import DraftFaultMatch
from parity.check.evidence import (
    DrafterDefect,
    Drift,
    EmbeddingDiffers,
    LayerDefect,
    Library,
    Reproduced,
    Tie,
    TieRule,
)
from parity.check.hypotheses import Fit
from parity.check.null import Cell, NullTest

ROOT = Path(__file__).resolve().parent.parent
PROSE_FIELDS = {"headline", "summary", "evidence", "detail"}


def _fields(source: str) -> list[tuple[str, str, ast.expr]]:
    """(class, field, annotation) of every annotated class-body field in `source`."""
    return [(node.name, stmt.target.id, stmt.annotation) for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.ClassDef) for stmt in node.body
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)]


def _mentions_str(annotation: ast.expr) -> bool:
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):   # a quoted annotation
        annotation = ast.parse(annotation.value, mode="eval").body
    return any(isinstance(n, ast.Name) and n.id == "str" for n in ast.walk(annotation))


def stored_prose(source: str, path: str = "<string>") -> list[str]:
    """Class fields named headline / summary / evidence / detail whose type involves str (stored words)."""
    return [f"{path}: {cls}.{name}: {ast.unparse(ann)}" for cls, name, ann in _fields(source)
            if name in PROSE_FIELDS and _mentions_str(ann)]


def test_no_report_class_in_check_stores_words():
    assert stored_prose("class R:\n    headline: str\n")                     # the scan can fail
    assert stored_prose("class R:\n    detail: str | None = None\n")
    assert stored_prose("class R:\n    evidence: tuple[str, ...] = ()\n")
    assert stored_prose("class R:\n    summary: 'str'\n")
    assert not stored_prose("class R:\n    evidence: Evidence\n    name: str\n")
    files = sorted((ROOT / "parity" / "check").glob("*.py"))
    seen = {(cls, name) for p in files for cls, name, _ in _fields(p.read_text())}
    assert ("Cause", "evidence") in seen and ("CheckReport", "verdict") in seen   # the scan reads the classes
    found = [hit for p in files for hit in stored_prose(p.read_text(), str(p.relative_to(ROOT)))]
    assert not found, found


# ---------------------------------------------------------------- records and their words

WORST = Cell("blk.2", 7, 0.02, 0.004)
EXACT_TEST = NullTest(64, 3, 19, 0.0123, Cell("blk.2", 5, 0.01, 0.005), WORST, 0.02)
EXACT_WORDS = ("3 of 64 cells outside all 19 round-off twins (p = 0.012); worst blk.2 at position 7: 0.02 vs "
               "twins' 0.004")
EXACT = Fit(0.01, 0.02, EXACT_TEST, None, (), 5)
STRUCT = Fit(0.01, 0.02, EXACT_TEST, "visible compressed rows 3 vs reference 4", (), 5)
VARIANT = Fit(None, 0.001, NullTest(64, 0, 19, 1.0, None, None, 0.001), None, (), None)
PART = Fit(None, 0.01, NullTest(64, 1, 19, 0.5, None, None, 0.01), None, (), None)
DRIFT = ("free-running excess 4 at embed with every layer inside the envelope on the candidate's own inputs: "
         "amplified sub-envelope drift")

CASES = [
    (Reproduced(EXACT, VARIANT, "act-bf16 + kv-f16"),
     "exact path: 3 of 64 cells outside all 19 round-off twins (p = 0.012, rel-L2 0.02) -> with the variant: 0 "
     "(p = 1, rel-L2 0.001) (together with act-bf16 + kv-f16)"),
    (Reproduced(STRUCT, VARIANT),
     "exact path: 3 of 64 cells outside all 19 round-off twins (p = 0.012, rel-L2 0.02) -> with the variant: 0 "
     "(p = 1, rel-L2 0.001); visible compressed rows 3 vs reference 4"),
    (Reproduced(EXACT, VARIANT, routing=True),
     "exact path: 3 of 64 cells outside all 19 round-off twins (p = 0.012, rel-L2 0.02) -> with the variant: 0 "
     "(p = 1, rel-L2 0.001); the candidate's expert picks differ only at router margins within noise"),
    (Tie("router", "TIE: expert set at position 3, router margin 1e-07 (0.84 ulps of 1)"),
     "TIE: expert set at position 3, router margin 1e-07 (0.84 ulps of 1)"),
    (Drift(4.0, "embed", None, False), DRIFT + " (no local error available)"),
    (Drift(4.0, "embed", 2, True), DRIFT + "; no isolated QAT code flip at layer 2 (near-ties or amplification)"),
    (EmbeddingDiffers(0.5, 2000.0, 3),
     "the candidate's embedding of the same tokens differs from the reference's lookup (rel-L2 0.5, excess 2e+03 "
     "over the envelope, first at position 3); every later difference may be inherited from it"),
    (TieRule("indexer-ties-highest", 3),
     "matches indexer-ties-highest: it breaks all 3 ties as the candidate does (the exact rule and the round-off "
     "twins break them otherwise)"),
    (LayerDefect(STRUCT, Library.MATCHED, "sink-dropped", VARIANT),
     "matches sink-dropped: residual 0.001 vs unexplained 0.02, 0 vs 3 of 64 cells outside the round-off twins; "
     "visible compressed rows 3 vs reference 4"),
    (LayerDefect(STRUCT, Library.PARTIAL, "sink-dropped", PART),
     EXACT_WORDS + " (rel-L2 0.02); visible compressed rows 3 vs reference 4; the closest known fault, "
     "sink-dropped, explains part of it (1 cells outside, residual 0.01)"),
    (LayerDefect(EXACT, Library.NO_MATCH, "sink-dropped", PART),
     EXACT_WORDS + " (rel-L2 0.02); no known fault explains any of it"),
    (LayerDefect(EXACT, Library.NONE_OFFERED), EXACT_WORDS + " (rel-L2 0.02); no engine offers fault switches"),
    (DrafterDefect(EXACT_TEST, 0.3, Library.MATCHED, DraftFaultMatch("mtp-no-norm", 0, 40, 0.002)),
     "matches mtp-no-norm: 0 of 40 draft cells outside the round-off twins around its run (residual 0.002); exact "
     "path: " + EXACT_WORDS + " (rel-L2 0.3; teacher-forced on the candidate's trunk carriers)"),
    (DrafterDefect(EXACT_TEST, 0.3, Library.PARTIAL, DraftFaultMatch("mtp-no-norm", 30, 40, 0.2)),
     EXACT_WORDS + " (rel-L2 0.3; teacher-forced on the candidate's trunk carriers); the closest drafter fault, "
     "mtp-no-norm, leaves 30 of 40 cells outside"),
    (DrafterDefect(EXACT_TEST, 0.3, Library.NONE_OFFERED),
     EXACT_WORDS + " (rel-L2 0.3; teacher-forced on the candidate's trunk carriers); no engine offers drafter faults"),
    (DrafterDefect(EXACT_TEST, 0.3, Library.NONE_TRIED),
     EXACT_WORDS + " (rel-L2 0.3; teacher-forced on the candidate's trunk carriers); no drafter fault of this head "
     "was tried"),
]


@pytest.mark.parametrize(("evidence", "words"), CASES, ids=lambda x: type(x).__name__ if not isinstance(x, str) else "")
def test_cause_words_are_the_old_sentences(evidence, words):
    assert cause_words(Cause("defect", "x", 1, None, evidence)) == words


def test_a_cause_takes_a_record_never_a_sentence():
    with pytest.raises(TypeError, match="evidence must be a record of parity.check.evidence, not str"):
        Cause("benign", "amplified-drift", None, None, "free-running excess 4 at embed: amplified drift")
    with pytest.raises(ValueError, match="a fault and its fit are given exactly when faults were run"):
        LayerDefect(EXACT, Library.MATCHED)
    with pytest.raises(ValueError, match="a fault and its fit are given exactly when faults were run"):
        LayerDefect(EXACT, Library.NONE_OFFERED, "sink-dropped", PART)
    with pytest.raises(ValueError, match="the best drafter fault is given exactly when one was run"):
        DrafterDefect(EXACT_TEST, 0.3, Library.NONE_TRIED, DraftFaultMatch("mtp-no-norm", 0, 40, 0.002))
    with pytest.raises(ValueError, match="'matched!' is not a valid Library"):
        LayerDefect(EXACT, "matched!")
    assert Cause("benign", "x", 1, None, Drift(4.0, "embed", 2, True)).flips == ()   # no flip record: no flips
