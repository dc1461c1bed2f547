"""`bisect`'s words and JSON stay byte for byte what they were while its culprit, sub-op results and summary turn
from stored text into data with printers (issue 26, point 1).

The fixtures (tests/fixtures/bisect_words: per case the JSON document exactly as `v4parity bisect --json` prints it
and the text summary) were written by the code of commit bea1a1f, before the change (this module's `main` as
committed in 6b2c0d5; `floors_router_loose` by the same calls). The cases are tests/test_bisect_fake.py's NumPy
engine with a known defect, judged by the round-off null (the reference has twins) and by the envelope's floors
(the same reference without twins: `compare_subops`' words for floats, non-finite values, emitted rows, selected
sets, near-tie flips and their cascade, QAT code flips), the drafter stage after a clean and a noisy trunk
(`drafter_*`, by the same calls at bea1a1f), and reports re-judged by a hand-made `check` report
(`parity.bisect.by_check`; check's headline and cause words, which are check's own, are compared as check's
printers write them). Timings are zeroed: the only values that change from run to run. `python
tests/test_bisect_words.py DIR` writes the fixtures of the code as it is now.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "bisect_words"


class NoTwins:
    """An engine without round-off twins (`RoundoffTwins`): bisect judges its sub-ops by the envelope's floors."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, attr: str) -> Any:
        if attr == "roundoff_twin":
            raise AttributeError(attr)
        return getattr(self.inner, attr)


def _fakes() -> tuple[type, type, list[int]]:
    from test_bisect_fake import PROMPT, FakeEngine

    class NaNAt2(FakeEngine):
        """A NaN in layer 2's output at position 3 (and in its last capture)."""

        def forward_layer(self, state, layer, *a, **kw):
            out = super().forward_layer(state, layer, *a, **kw)
            if layer == 2:
                out.carrier[3, 0, 0] = np.nan
                if out.captures:
                    out.captures["hc_ffn_post"][3, 0, 0] = np.nan
            return out

    return FakeEngine, NaNAt2, PROMPT


def cases() -> dict[str, tuple[Any, Any, list[int], int]]:
    """case -> (reference, candidate, prompt, decode steps)."""
    from parity.contract.engine import RunOptions

    fake, nan_at_2, prompt = _fakes()
    return {
        "clean": (fake(), fake(), prompt, 2),
        "attention": (fake(), fake(defect=(1, "attention")), prompt, 2),
        "router": (fake(), fake(defect=(0, "router")), prompt[:6], 0),
        "rope_flip": (fake(), fake(defect=(1, "rope", "flip")), prompt, 2),
        "nan": (fake(), nan_at_2(), prompt, 0),
        "head": (fake(), fake(defect=("head",)), prompt, 1),
        "bf16": (fake(), fake(RunOptions(dtype="bfloat16")), prompt, 2),
        "floors_attention": (NoTwins(fake()), fake(defect=(1, "attention")), prompt, 2),
        "floors_flip": (NoTwins(fake()), fake(defect=(1, "rope", "flip")), prompt, 2),
        "floors_router": (NoTwins(fake()), fake(defect=(0, "router")), prompt[:6], 0),
        "floors_indexer": (NoTwins(fake()), fake(defect=(3, "indexer_selection")), prompt, 2),
        "floors_rows": (NoTwins(fake()), fake(defect=(1, "compressor_rows", "decode")), prompt, 4),
        "floors_nan": (NoTwins(fake()), nan_at_2(), prompt, 0),
        "floors_bf16": (NoTwins(fake()), fake(RunOptions(dtype="bfloat16")), prompt, 2),
    }


# the hand-made check report's headline and cause evidence as the code at bea1a1f stored them (text fields)
OLD_HEADLINE, OLD_EVIDENCE = "{}: hand-made headline of check", "evidence in words"


def _check(verdict: str, layer: int | None, cause: str) -> Any:
    """A `check` report on the same run (hand-made: its verdict, culprit, one defect cause and one table row)."""
    from parity.check.check import Cause, CheckCulprit, CheckReport, CheckRow
    from parity.check.evidence import TieRule

    causes = (Cause("defect", cause, layer, None, TieRule("hand-made", 3)),) if verdict == "DEFECT" else ()
    culprit = CheckCulprit(layer, None, 3, None) if verdict == "DEFECT" else None
    table = (CheckRow("blk.1", 1e-6, 0.5, None, None, 1e-6, None, "ok"),)
    return CheckReport(verdict, culprit, causes, table, {}, (), 14)


def _check_words(report: Any) -> dict[str, str]:
    """The words of check's printers (`parity.check.check_report`) for the hand-made check report -> the words
    the fixtures hold in their place (check's words are check's business, pinned by its own tests)."""
    from parity.check.check_report import cause_words, headline

    check = report.by_check.check
    out = {headline(check): OLD_HEADLINE.format(check.verdict.value)}
    out |= {f"{c.name}: {cause_words(c)}": f"{c.name}: {OLD_EVIDENCE}" for c in check.causes}
    return out


def reports() -> dict[str, Any]:
    """case -> the bisect report, timings zeroed; `judged_*`: the attention and clean cases re-judged by check."""
    from parity.bisect.by_check import judged_by_check
    from parity.bisect.search import _drafter_verdict, bisect
    from parity.check.envelope import measure_envelope
    from parity.check.null import Cell, NullTest
    from parity.contract.engine import RunOptions

    fake, _, prompt = _fakes()
    env = measure_envelope(fake(), fake(RunOptions(dtype="float64")), fake(), prompt[:10], 3)
    out = {case: replace(bisect(ref, cand, p, decode, env), seconds={})
           for case, (ref, cand, p, decode) in cases().items()}
    # the router's flips inside a (loose) router-margin noise: near-tie flips and their cascade, a NOISE verdict
    loose = replace(env, router_margin={**env.router_margin, "0": 100.0})
    out["floors_router_loose"] = replace(bisect(NoTwins(fake()), fake(defect=(0, "router")), prompt[:6], 0, loose),
                                         seconds={})
    # the drafter stage after a trunk with no defect (a stand-in DraftCheck: its first departing row, or none)
    test = NullTest(16, 9, 19, 3.1e-7, Cell("mtp.0", 15, 2.5e-3, 4.2e-6), Cell("mtp.0", 12, 4.0e-3, 3.2e-6), 4.0e-3)
    departs = SimpleNamespace(first=SimpleNamespace(checkpoint="mtp.0", test=test, err=4.0e-3))
    out["drafter_inside"] = _drafter_verdict(out["clean"], SimpleNamespace(first=None), "torch", len(prompt))
    out["drafter_departs"] = _drafter_verdict(out["floors_flip"], departs, "torch", len(prompt))
    out["judged_same_layer"] = judged_by_check(out["attention"], _check("DEFECT", 1, "sink-dropped"))
    out["judged_other_layer"] = judged_by_check(out["attention"], _check("DEFECT", 2, "sink-dropped"))
    out["judged_clean_by_defect"] = judged_by_check(out["clean"], _check("DEFECT", 0, "unexplained"))
    out["judged_defect_by_match"] = judged_by_check(out["attention"], _check("MATCH", None, ""))
    return out


def json_text(report: Any) -> str:
    """The JSON document as `v4parity bisect --json` prints it (`parity.cli.common.echo_json`)."""
    return json.dumps(report.to_dict(), indent=1, allow_nan=False, ensure_ascii=False)


def summary_text(report: Any) -> str:
    """The text summary `v4parity bisect` prints."""
    from parity.bisect.bisect_report import summary

    return summary(report)


@pytest.fixture(scope="module")
def made() -> dict[str, Any]:
    return reports()


def test_every_case_has_its_fixture(made):
    assert sorted(made) == sorted(p.stem for p in FIXTURES.glob("*.json"))
    # the cases reach each kind of words: both verdict paths, every `compare_subops` evidence, check's re-judgement
    verdicts = {case: json.loads((FIXTURES / f"{case}.json").read_text())["verdict"] for case in made}
    assert set(verdicts.values()) == {"no defect", "noise", "defect"}


@pytest.mark.parametrize("case", sorted(p.stem for p in FIXTURES.glob("*.json")))
def test_bisect_json_and_text_are_byte_identical(made, case):
    got_json, got_text = json_text(made[case]), summary_text(made[case])
    want_json, want_text = (FIXTURES / f"{case}.json").read_text(), (FIXTURES / f"{case}.txt").read_text()
    if case.startswith("judged_"):   # check's words and JSON are check's (its own fixtures): compared as check prints
        report = made[case]
        got, want = json.loads(got_json), json.loads(want_json)
        assert got.pop("check") == json.loads(json.dumps(report.by_check.check.to_dict()))
        want.pop("check")
        got_json, want_json = (json.dumps(d, indent=1, allow_nan=False, ensure_ascii=False) for d in (got, want))
        for now, then in _check_words(report).items():
            got_json, got_text = got_json.replace(now, then), got_text.replace(now, then)
    assert got_json == want_json, case
    assert got_text == want_text, case


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for case, report in reports().items():
        (out / f"{case}.json").write_text(json_text(report))
        (out / f"{case}.txt").write_text(summary_text(report))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main(Path(sys.argv[1]))


def test_no_bisect_report_class_stores_words():
    # before: BisectReport.summary and Culprit.detail were str fields (the scan of tests/test_check_words.py)
    from test_check_words import _fields, stored_prose

    root = FIXTURES.parent.parent.parent
    files = sorted((root / "parity" / "bisect").glob("*.py"))
    seen = {(cls, name) for p in files for cls, name, _ in _fields(p.read_text())}
    assert {("BisectReport", "verdict"), ("Culprit", "finding")} <= seen   # the scan reads the classes
    found = [hit for p in files for hit in stored_prose(p.read_text(), str(p.relative_to(root)))]
    assert not found, found
    assert stored_prose("class Culprit:\n    detail: str\n")   # and would name the old field
