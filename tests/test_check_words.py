"""`check`'s causes hold data and only the printers make words (issue 26, point 1).

* no class in parity/check or parity/bisect stores words: a field whose type holds str (other than as a dict key)
  is refused unless its name is one of NAME_FIELDS (identifiers: a checkpoint's, sub-op's, fault's name ...) or
  FREE_TEXT (notes and captured engine output, free text by design), so `words`, `structural`, `ties` of str or a
  sentence under any new name fail; and no data class there has a method that writes words (`summary`, `words`,
  ...; `NullTest.summary` was one). An AST scan, shown to fail on planted classes, among them the fields and
  method of commit f35a2b4 it was written against (`Fit.structural`, `Fit.ties`, `Tie.words`, `NullTest.summary`;
  run on that commit's files it also names `OpStructural.words` and `OpTie.words`);
* a cause's evidence is a record of `parity.check.evidence` (a sentence is refused), and a record whose library
  outcome contradicts its fault is refused;
* `cause_words` renders every record kind as the sentences the code wrote before the records (the f-strings of
  parity/check/check.py at commit 1bf8311, filled in by hand with the numbers below); the two kinds real runs
  reach on the tiny model (a flip's drift, a matched fault) are compared byte for byte with the fixture in
  tests/test_verdict_types.py;
* `discrete_words` and `null_words` (parity/check/words.py) render a fit's ties and structural differences
  (records of parity/check/discrete.py) and the null's test as the f-strings of commit f35a2b4 did.
"""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

from parity.check.check import Cause
from parity.check.check_report import cause_words
from parity.check.discrete import (
    ExpertSetDiffers,
    PickDiffers,
    PickTie,
    RouterTie,
    RowsEmitted,
    SelectionDiffers,
    SelectionTie,
    VisibleRows,
    pick_change,
)
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
from parity.check.subop_evidence import OpDeparts, OpExcess, OpStructural, OpTie, evidence_words
from parity.check.words import discrete_words, null_words

ROOT = Path(__file__).resolve().parent.parent
PROSE_FIELDS = {"headline", "summary", "evidence", "detail"}
# Fields whose str values name something (a checkpoint, layer label, sub-op, capture, quantity, fault, variant,
# engine, model file, dtype, envelope file): identifiers, never sentences.
NAME_FIELDS = {"name", "layer", "subop", "checkpoint", "quantity", "capture", "fault", "stack", "parts", "engine",
               "model", "draft", "dtype", "envelope_source", "excluded"}
# Free text by design, printed as it is: a run's notes, and the lines an engine printed (captured, `check._Quiet`).
FREE_TEXT = {"notes", "announced"}
# Methods that write words: a data class has none (its printer lives in a printers' module).
WORDS_METHODS = {"summary", "words", "headline", "detail", "describe", "text", "sentence"}
SCANNED = ("check", "bisect")


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


def _holds_str(annotation: ast.expr) -> bool:
    """Whether a value of this type can hold a str other than as a dict key (`dict[str, float]` cannot)."""
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):   # a quoted annotation
        annotation = ast.parse(annotation.value, mode="eval").body
    if isinstance(annotation, ast.Name):
        return annotation.id == "str"
    if isinstance(annotation, ast.Subscript):
        args = annotation.slice.elts if isinstance(annotation.slice, ast.Tuple) else [annotation.slice]
        if isinstance(annotation.value, ast.Name) and annotation.value.id in ("dict", "Mapping") and len(args) == 2:
            args = args[1:]
        return any(_holds_str(a) for a in args)
    if isinstance(annotation, ast.BinOp):   # X | Y
        return _holds_str(annotation.left) or _holds_str(annotation.right)
    return False


def stored_words(source: str, path: str = "<string>") -> list[str]:
    """Class fields that can hold a str under a name that is not an identifier's (NAME_FIELDS) or free text's
    (FREE_TEXT): words stored where the data is made."""
    return [f"{path}: {cls}.{name}: {ast.unparse(ann)}" for cls, name, ann in _fields(source)
            if name not in NAME_FIELDS | FREE_TEXT and _holds_str(ann)]


def words_methods(source: str, path: str = "<string>") -> list[str]:
    """Methods (and properties) named like a printer (WORDS_METHODS) on a data class."""
    return [f"{path}: {node.name}.{stmt.name}" for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.ClassDef) and any("dataclass" in ast.unparse(d) for d in node.decorator_list)
            for stmt in node.body if isinstance(stmt, ast.FunctionDef) and stmt.name in WORDS_METHODS]


def _scanned() -> list[Path]:
    return sorted(p for d in SCANNED for p in (ROOT / "parity" / d).glob("*.py"))


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


def test_no_record_in_check_or_bisect_holds_a_sentence_under_any_name():
    old = ("class Fit:\n    structural: str | None\n    ties: tuple[tuple[str, str], ...]\n"
           "class Tie:\n    subop: str\n    words: str\n")   # the fields of commit f35a2b4
    assert stored_words(old) == ["<string>: Fit.structural: str | None",
                                 "<string>: Fit.ties: tuple[tuple[str, str], ...]", "<string>: Tie.words: str"]
    assert stored_words("class R:\n    message: 'list[str] | None'\n")
    assert stored_words("class R:\n    why: dict[str, str]\n")   # str values, not only keys
    assert not stored_words("class R:\n    runs: dict[str, int]\n    name: str\n    notes: tuple[str, ...]\n")
    files = _scanned()
    assert {p.parent.name for p in files} == set(SCANNED)
    found = [hit for p in files for hit in stored_words(p.read_text(), str(p.relative_to(ROOT)))]
    assert not found, found


def test_no_data_class_in_check_or_bisect_writes_words():
    old = ("@dataclass(frozen=True)\nclass NullTest:\n    cells: int\n\n    def summary(self) -> str:\n"
           "        return f'{self.cells} cells'\n")   # NullTest of commit f35a2b4
    assert words_methods(old) == ["<string>: NullTest.summary"]
    assert words_methods("@dataclasses.dataclass\nclass R:\n    @property\n    def words(self) -> str: ...\n")
    assert not words_methods("class Printer:\n    def summary(self) -> str: ...\n")   # not a data class
    assert not words_methods("@dataclass\nclass R:\n    def options(self) -> int: ...\n")
    found = [hit for p in _scanned() for hit in words_methods(p.read_text(), str(p.relative_to(ROOT)))]
    assert not found, found


# ---------------------------------------------------------------- records and their words

WORST = Cell("blk.2", 7, 0.02, 0.004)
EXACT_TEST = NullTest(64, 3, 19, 0.0123, Cell("blk.2", 5, 0.01, 0.005), WORST, 0.02)
EXACT_WORDS = ("3 of 64 cells outside all 19 round-off twins (p = 0.012); worst blk.2 at position 7: 0.02 vs "
               "twins' 0.004")
EXACT = Fit(0.01, 0.02, EXACT_TEST, None, (), 5)
STRUCT = Fit(0.01, 0.02, EXACT_TEST, VisibleRows(5, 3, 4), (), 5)
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
    (Tie(RouterTie(3, 1e-07, 0.84)),
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


# ---------------------------------------------------------------- discrete differences and the null's test in words
# Expected: the f-strings of hypotheses.discrete_differences, opforce.judge_ops and NullTest.summary at commit
# f35a2b4, filled in by hand (op-level structural words keep the sub-op prefix that OpStructural's words repeat, as
# tests/fixtures/bisect_words/router.txt shows).

PICK = PickDiffers("router", "expert_ids", 0)
PICK_TIE = PickTie("indexer_selection", "index_sel", 4, (12,), (7, 8))
DISCRETE_CASES = [
    (VisibleRows(5, 3, 4), "visible compressed rows 3 vs reference 4"),
    (ExpertSetDiffers(7, 0.0123456),
     "expert set differs at position 7 at router margin 0.0123, which no round-off twin crosses"),
    (SelectionDiffers(9), "indexer selection differs at position 9, which no round-off twin makes"),
    (RowsEmitted("compressor_rows", "comp_rows", 2, 3, 11),
     "compressor_rows: the candidate emitted 2 comp_rows, the reference 3 on the same inputs"),
    (PICK, "router: the candidate's pick at position 0 differs and no round-off twin makes it"),
    (RouterTie(3, 1e-07, 0.84), "TIE: expert set at position 3, router margin 1e-07 (0.84 ulps of 1)"),
    (SelectionTie(4, (12, 30), (7,)),
     "TIE: indexer selection at position 4: rows +12 +30 -7, each picked or dropped by some round-off twin too"),
    (PICK_TIE,
     "TIE: indexer_selection pick at position 4: +12 -7 -8, each picked or dropped by some round-off twin too"),
]


@pytest.mark.parametrize(("record", "words"), DISCRETE_CASES, ids=lambda x: type(x).__name__)
def test_discrete_words_are_the_old_sentences(record, words):
    assert discrete_words(record) == words


def test_the_subop_evidence_of_a_discrete_difference_and_of_the_null_in_words():
    nonfinite = NullTest(64, 3, 19, 0.0123, Cell("blk.2", 5, 0.01, 0.005), WORST, 0.02, nonfinite=2)
    assert null_words(nonfinite) == ("3 of 64 cells outside all 19 round-off twins (p = 0.012), 2 of them "
                                     "non-finite; worst blk.2 at position 7: 0.02 vs twins' 0.004")
    assert null_words(VARIANT.test) == "0 of 64 cells outside all 19 round-off twins (p = 1)"
    assert evidence_words(OpStructural("router", PICK)) == ("router: router: the candidate's pick at position 0 "
                                                            "differs and no round-off twin makes it")
    assert evidence_words(OpTie(PICK_TIE)) == DISCRETE_CASES[-1][1]
    assert evidence_words(OpDeparts("attention", EXACT_TEST)) == "attention: " + EXACT_WORDS
    assert evidence_words(OpExcess(EXACT_TEST)) == EXACT_WORDS
    with pytest.raises(TypeError, match="not a discrete difference record: str"):
        discrete_words("visible compressed rows 3 vs reference 4")


def test_pick_change_is_what_the_candidate_added_and_dropped():
    # candidate [5, 12, 30, -1] vs reference [5, 7, 30, -1]: 12 added, 7 dropped (padding ignored)
    assert pick_change(np.array([5, 12, 30, -1]), np.array([5, 7, 30, -1])) == ((12,), (7,))
    assert pick_change(np.array([1, 2]), np.array([1, 2])) == ((), ())
