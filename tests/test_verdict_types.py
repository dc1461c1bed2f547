"""The harness's verdicts are typed (issue 26, point 1): one `Verdict` enum and typed sub-statuses in
`parity.compare.verdict`, QAT code flips as records, and no decision made by searching prose.

* the enums cover every verdict and status value the reports emit: collected from the JSON of real runs (`check` on
  the tiny f32 model, `bisect` on the fake NumPy engine and on torch vs the reference, the logprob comparison of the
  committed ds4 fixtures), never from the enums themselves;
* the JSON and text of those reports are what the code wrote before the enums (tests/fixtures/verdict_types, written
  by `python tests/verdict_cases.py DIR` at commit 4ceead2): check's byte for byte, bisect's with keys only added;
* no `"..." in x.detail` (or `.evidence`, `.summary`, `.headline`) test and no `x.verdict == "DEFECT"`-style
  comparison of a verdict / status / kind attribute with a spelled verdict remains in parity/ (AST scans, each shown
  to fail on a planted case).
"""

from __future__ import annotations

import ast
import json
from enum import StrEnum
from pathlib import Path
from typing import Any

import pytest
import verdict_cases as vc

from parity.bisect.bisect_report import culprit_words, verdict_word
from parity.compare.verdict import (
    CauseKind,
    Judged,
    LayerKind,
    QuantFlip,
    QuantFormat,
    RowStatus,
    StepVerdict,
    SubopStatus,
    Verdict,
    flip_words,
)

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures" / "verdict_types"
LOGPROBS = Path(__file__).resolve().parent / "fixtures" / "logprobs"
PROSE = {"detail", "evidence", "summary", "headline"}   # attributes that hold words, never decisions


@pytest.fixture(scope="module")
def check_reports(tiny_f32, tmp_path_factory):
    return vc.check_reports(tiny_f32, tmp_path_factory.mktemp("verdicts"))


@pytest.fixture(scope="module")
def bisect_reports(tiny_f32):
    return {**vc.bisect_reports(), "torch_clean": vc.torch_bisect_report(tiny_f32)}


def _values(enum: type[StrEnum]) -> set[str]:
    return {m.value for m in enum}


def _logprob_docs() -> list[dict[str, Any]]:
    from parity.logprobs.compare import compare_runs
    from parity.logprobs.io import read_run

    pairs = [("ref.ds4.json", "cand_drift.ds4.json"), ("ref.ds4.json", "cand_tie.ds4.json"),
             ("cases.vec#wrong_case", "ref.ds4.json")]
    return [compare_runs(read_run(LOGPROBS / a), read_run(LOGPROBS / b)).to_dict() for a, b in pairs]


def test_the_enums_cover_every_value_the_reports_emit(check_reports, bisect_reports):
    checks = [vc.documents(r)["json"] for r in check_reports.values()]
    bisects = [vc.bisect_documents(r)["json"] for r in bisect_reports.values()]
    emitted = {
        Verdict: {d["verdict"] for d in checks},
        Judged: {d["judged"] for d in checks},
        CauseKind: {c["kind"] for d in checks for c in d["causes"]},
        RowStatus: {r["status"] for d in checks for r in d["table"]},
        SubopStatus: {s["status"] for d in bisects for s in d["subops"]},
        LayerKind: {a["kind"] for d in bisects for a in d["attribution"]},
        StepVerdict: {s["verdict"] for d in _logprob_docs() for s in d["steps"] if s["verdict"] is not None}
        | {s["verdict"] for d in bisects if d["trajectory"] for s in d["trajectory"]["steps"]},
    }
    for enum, seen in emitted.items():
        assert seen and seen <= _values(enum), (enum.__name__, sorted(seen - _values(enum)))
    # the runs reach more than one member where the model makes them: a clean pair that is NOISE (one FP8 code flip
    # named) and a DEFECT; bisect's three words (a defect, a clean fake pair, torch's named flip)
    assert emitted[Verdict] == {"NOISE", "DEFECT"}
    assert {d["verdict"] for d in bisects} == {verdict_word(v) for v in Verdict} == {"no defect", "noise", "defect"}
    assert {"ok", "noise", "defect"} == emitted[SubopStatus]


def test_check_json_and_text_are_what_they_were(check_reports):
    for case, report in check_reports.items():
        want = json.loads((FIXTURES / f"check_{case}.json").read_text())
        got = vc.documents(report)
        assert got["json"] == want["json"], case
        assert got["text"] == want["text"], case


def _only_added(want: Any, got: Any, where: str = "") -> None:
    """`got` is `want` with keys only added (at any depth)."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and set(want) <= set(got), (where, sorted(set(want) - set(got or {})))
        for k, v in want.items():
            _only_added(v, got[k], f"{where}.{k}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), where
        for i, (a, b) in enumerate(zip(want, got, strict=True)):
            _only_added(a, b, f"{where}[{i}]")
    else:
        assert got == want, (where, want, got)


def test_bisect_json_gains_keys_only_and_its_summary_is_unchanged(bisect_reports):
    for case, report in bisect_reports.items():
        want = json.loads((FIXTURES / f"bisect_{case}.json").read_text())
        got = vc.bisect_documents(report)
        _only_added(want["json"], got["json"], case)
        assert got["text"] == want["text"], case


def test_a_code_flip_is_a_record_and_its_words_are_printed_from_it(bisect_reports):
    # torch vs the reference on tiny f32: NOISE, decided on the flip record (not on the words of its detail)
    # (the flip's numbers as tests/test_bisect_engines.py measured them: one FP8 KV code of layer 4, position 15)
    r = bisect_reports["torch_clean"]
    assert r.verdict is Verdict.NOISE
    assert (r.culprit.layer, r.culprit.subop) == (4, "rope")
    f = QuantFlip("rope_kv", QuantFormat.FP8_E4M3, 1, 15)
    assert flip_words(f) == "1 isolated FP8 e4m3 code flip(s) in rope_kv from position 15"
    assert r.culprit.finding.flip.flips == (f,)
    assert culprit_words(r.culprit).endswith(f"shows rope: {flip_words(f)}")
    assert (QuantFormat.FP8_E4M3.mbits, QuantFormat.FP4_E2M1.mbits) == (3, 1)   # e4m3, e2m1


def test_checks_flip_cause_carries_the_flip_the_old_words_described(check_reports):
    # the code before the records wrote this cause's evidence from prose (fixture); the record prints the same words
    cause = next(c for c in check_reports["clean"].causes if c.flips)
    want = json.loads((FIXTURES / "check_clean.json").read_text())["json"]["causes"]
    old = next(c for c in want if c["name"] == cause.name)
    assert (cause.name, cause.layer, cause.subop) == (old["name"], old["layer"], old["subop"]) == ("fp8-code-flip", 4,
                                                                                                  "rope")
    assert [f.format for f in cause.flips] == [QuantFormat.FP8_E4M3]
    assert old["evidence"].endswith(": " + "; ".join(flip_words(f) for f in cause.flips))


def test_verdicts_are_checked_where_they_are_built():
    from parity.check.check import Cause, CheckRow
    from parity.check.subops import SubopResult

    with pytest.raises(ValueError, match="'DEFECTIVE' is not a valid Verdict"):
        Verdict("DEFECTIVE")
    from parity.bisect.bisect_report import BisectReport

    with pytest.raises(ValueError, match="'no defect' is not a valid Verdict"):   # bisect's words are printed only
        BisectReport("no defect", None, 1, 0, [0], {}, {})
    with pytest.raises(ValueError, match="not a valid SubopStatus"):
        SubopResult("rope", "fine", 0.0, 0.0, 0.0, None)
    with pytest.raises(ValueError, match="not a valid RowStatus"):
        CheckRow("embed", None, None, None, None, 0.0, None, "OK")
    with pytest.raises(ValueError, match="not a valid CauseKind"):
        Cause("harmless", "x", 0, None, "")
    assert [verdict_word(v) for v in Verdict] == ["no defect", "noise", "defect"]   # MATCH, NOISE, DEFECT
    assert Verdict.of_causes([]) is Verdict.MATCH and Verdict.of_causes([CauseKind.BENIGN]) is Verdict.NOISE
    assert Verdict.of_causes([CauseKind.BENIGN, CauseKind.DEFECT]) is Verdict.DEFECT


def prose_tests(source: str, path: str = "<string>") -> list[str]:
    """`"..." in x.detail`-style tests in `source` (a string searched for inside an attribute that holds words)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        for op, right in zip(node.ops, node.comparators, strict=True):
            if isinstance(op, (ast.In, ast.NotIn)) and isinstance(right, ast.Attribute) and right.attr in PROSE:
                out.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
    return out


def test_no_decision_searches_prose_in_parity():
    assert prose_tests('if s.status == "noise" and "code flip" in s.detail:\n    pass\n')   # the scan can fail
    assert prose_tests('x = "FP8" not in flip.evidence\n')
    found = [hit for p in sorted((ROOT / "parity").rglob("*.py"))
             for hit in prose_tests(p.read_text(), str(p.relative_to(ROOT)))]
    assert not found, found


VERDICT_ATTRS = {"verdict", "status", "kind", "judged"}
ENUMS = (Verdict, CauseKind, Judged, LayerKind, RowStatus, StepVerdict, SubopStatus)


def spelled_verdicts(source: str, path: str = "<string>") -> list[str]:
    """Comparisons of a verdict-holding attribute or key (`x.verdict`, `.status`, `.kind`, `.judged`, `row["verdict"]`)
    with a string that spells a member of one of the enums (`r.verdict == "DEFECT"`, `s.status in ("noise", ...)`)."""
    words = {m.value for e in ENUMS for m in e}
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        attrs = any((isinstance(x, ast.Attribute) and x.attr in VERDICT_ATTRS)
                    or (isinstance(x, ast.Subscript) and isinstance(x.slice, ast.Constant)
                        and x.slice.value in VERDICT_ATTRS) for x in sides)
        consts = [c for x in sides for c in ([x] if isinstance(x, ast.Constant) else
                                              x.elts if isinstance(x, (ast.Tuple, ast.List, ast.Set)) else [])]
        if attrs and any(isinstance(c, ast.Constant) and c.value in words for c in consts):
            out.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
    return out


def test_no_verdict_is_compared_with_its_spelling_in_parity():
    assert spelled_verdicts('ok = report.verdict != "DEFECT"\n')   # the scan can fail
    assert spelled_verdicts('x = [s for s in subs if s.status in ("noise", "defect")]\n')
    assert spelled_verdicts('bad = row["verdict"] == "DEFECT"\n')
    assert not spelled_verdicts('ok = report.verdict != Verdict.DEFECT\n')
    found = [hit for p in sorted((ROOT / "parity").rglob("*.py"))
             for hit in spelled_verdicts(p.read_text(), str(p.relative_to(ROOT)))]
    assert not found, found
