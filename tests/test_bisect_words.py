"""`bisect`'s words and JSON stay byte for byte what they were while its culprit, sub-op results and summary turn
from stored text into data with printers (issue 26, point 1).

The fixtures (tests/fixtures/bisect_words: per case the JSON document exactly as `v4parity bisect --json` prints it
and the text summary) were written by `python tests/test_bisect_words.py tests/fixtures/bisect_words` at commit
bea1a1f, before the change. The cases are tests/test_bisect_fake.py's NumPy engine with a known defect, judged by
the round-off null (the reference has twins) and by the envelope's floors (the same reference without twins:
`compare_subops`' words for floats, emitted rows, selected sets and QAT code flips), and a report re-judged by a
`check` report (`parity.bisect.by_check`). Timings are zeroed: the only values that change from run to run.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path
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


OLD_HEADLINE, OLD_EVIDENCE = "{}: hand-made headline of check", "evidence in words"   # the fixtures' check words


def _check(verdict: str, layer: int | None, cause: str) -> Any:
    """A `check` report on the same run (hand-made: its verdict, culprit and one defect cause)."""
    from parity.check import check
    from parity.check.check import Cause, CheckCulprit, CheckReport, CheckRow

    if hasattr(check, "EVIDENCE"):   # causes hold their evidence as records (helper s1's change in progress)
        from parity.check.evidence import TieRule

        evidence: Any = TieRule("hand-made", 3)
    else:
        evidence = OLD_EVIDENCE
    causes = (Cause("defect", cause, layer, None, evidence),) if verdict == "DEFECT" else ()
    culprit = CheckCulprit(layer, None, 3, None) if verdict == "DEFECT" else None
    words = {"headline": OLD_HEADLINE.format(verdict)} if "headline" in CheckReport.__dataclass_fields__ else {}
    table = (CheckRow("blk.1", 1e-6, 0.5, None, None, 1e-6, None, "ok"),)
    return CheckReport(verdict=verdict, culprit=culprit, causes=causes, table=table, layer_runs={}, notes=(),
                       n_prompt=14, **words)


def _check_words(report: Any) -> dict[str, str]:
    """The words this code prints for a hand-made check report -> the fixtures' spelling of them: its headline,
    its cause's evidence (check's own printers, `parity.check.check_report`, whose words are check's business)."""
    from parity.check import check_report

    c = report.check
    check = c.check if hasattr(c, "check") else c
    if isinstance(check, dict):   # bisect kept check's JSON only: its words are the fixtures'
        return {}
    out = {(check_report.headline(check) if hasattr(check_report, "headline") else check.headline):
           OLD_HEADLINE.format(check.verdict.value)}
    for cause in check.causes:
        words = check_report.cause_words(cause) if hasattr(check_report, "cause_words") else cause.evidence
        out[f"{cause.name}: {words}"] = f"{cause.name}: {OLD_EVIDENCE}"
    return out


def reports() -> dict[str, Any]:
    """case -> the bisect report, timings zeroed; `judged_*`: the attention and clean cases re-judged by check."""
    from parity.bisect.by_check import judged_by_check
    from parity.bisect.search import bisect
    from parity.check.envelope import measure_envelope
    from parity.contract.engine import RunOptions

    fake, _, prompt = _fakes()
    env = measure_envelope(fake(), fake(RunOptions(dtype="float64")), fake(), prompt[:10], 3)
    out = {case: replace(bisect(ref, cand, p, decode, env), seconds={})
           for case, (ref, cand, p, decode) in cases().items()}
    out["judged_same_layer"] = judged_by_check(out["attention"], _check("DEFECT", 1, "sink-dropped"))
    out["judged_other_layer"] = judged_by_check(out["attention"], _check("DEFECT", 2, "sink-dropped"))
    out["judged_clean_by_defect"] = judged_by_check(out["clean"], _check("DEFECT", 0, "unexplained"))
    out["judged_defect_by_match"] = judged_by_check(out["attention"], _check("MATCH", None, ""))
    return out


def json_text(report: Any) -> str:
    """The JSON document as `v4parity bisect --json` prints it (`parity.cli.common.echo_json`)."""
    from parity.bisect import bisect_report

    doc = report.to_dict() if hasattr(report, "to_dict") else bisect_report.to_json(report)
    return json.dumps(doc, indent=1, allow_nan=False, ensure_ascii=False)


def summary_text(report: Any) -> str:
    """The text summary `v4parity bisect` prints."""
    from parity.bisect import bisect_report

    return bisect_report.summary(report) if hasattr(bisect_report, "summary") else report.summary


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
        from parity.check.check_report import to_json

        report = made[case]
        checked = report.check.check if hasattr(report.check, "check") else report.check
        got, want = json.loads(got_json), json.loads(want_json)
        assert got.pop("check") == json.loads(json.dumps(checked if isinstance(checked, dict) else to_json(checked)))
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
