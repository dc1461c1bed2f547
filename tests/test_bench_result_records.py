"""The full-depth and spec-acceptance bench results as frozen typed records (issue 26.3): `to_dict()` writes the
bytes the dict-based bench wrote (tests/fixtures/bench, written by the old code: see its README), the records are
typed down to the verdicts and divergences, and `from_dict` refuses a malformed document by name."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from parity.bench import full_depth
from parity.bench.full_depth_report import CheckFound, FullDepthResult, StepRow
from parity.bench.spec_acceptance import render_markdown, write_spec_bench
from parity.bench.spec_bench_report import RunDivergence, SpecBenchResult
from parity.compare.verdict import Judged, Verdict
from parity.contract.errors import ParityError
from parity.spec.attribution import StateDivergence

FIXTURES = Path(__file__).parent / "fixtures" / "bench"


def _doc(name: str) -> dict:
    return json.loads((FIXTURES / name).read_text())


def test_full_depth_result_writes_the_old_bytes_and_is_typed(tmp_path):
    result = FullDepthResult.from_dict(_doc("full_depth.json"))
    full_depth.write_result(tmp_path, result)
    for name in ("full_depth.json", "full_depth.md"):
        assert (tmp_path / name).read_bytes() == (FIXTURES / name).read_bytes(), name
    steps = result.steps
    assert list(steps) == ["inspect", "trace-ref-24", "trace-torch-24", "diff-clean", "check-clean", "diff-fault",
                           "check-fault"]
    clean = steps["check-clean"].check
    assert isinstance(clean, CheckFound) and clean.verdict is Verdict.MATCH and clean.judged is Judged.LAYER_LEVEL
    assert steps["check-fault"].check is None and steps["check-fault"].error.endswith("beside it)")
    assert steps["diff-clean"].diff.agree is True and steps["diff-fault"].diff.agree is None
    assert steps["inspect"].check is steps["inspect"].diff is None and steps["inspect"].exit == 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        steps["inspect"].exit = 1  # type: ignore[misc]


def test_spec_bench_result_writes_the_old_bytes_and_is_typed(tmp_path):
    result = SpecBenchResult.from_dict(_doc("spec_acceptance.json"))
    write_spec_bench(tmp_path, result)
    for name in ("spec_acceptance.json", "spec_acceptance.md"):
        assert (tmp_path / name).read_bytes() == (FIXTURES / name).read_bytes(), name
    assert render_markdown(result) == (FIXTURES / "spec_acceptance.md").read_text()
    assert result.plan.engines == ("torch",) and result.plan.sims == (False, True)
    assert [(c.engine, c.head, c.sims) for c in result.cells] == [("torch", h, s) for s in (False, True)
                                                                  for h in ("mtp1", "dspark")]
    assert result.runs[-1].divergence == RunDivergence("WRONG", 0, False)
    states = [r.state_divergence for r in result.runs if r.state_divergence is not None]
    assert len(states) == 1 and isinstance(states[0], StateDivergence) and states[0].kind == "values"
    assert set(result.fits) == {"mtp", "dspark"} and result.fits["mtp"].steps == 3


def _step(**change: object) -> dict:
    row = dict(_doc("full_depth.json")["steps"]["check-clean"])
    row.update(change)
    return {k: v for k, v in row.items() if v is not _DROP}


_DROP = object()


@pytest.mark.parametrize(("change", "named"), [
    ({"exit_code": 0}, r"StepRow: unknown key\(s\) \['exit_code'\], missing key\(s\) \[\]"),
    ({"wall_s": _DROP}, r"StepRow: unknown key\(s\) \[\], missing key\(s\) \['wall_s'\]"),
    ({"exit": "0"}, r"StepRow: exit must be int, not str"),
    ({"exit": True}, r"StepRow: exit must be int, not bool"),
    ({"killed": 3}, r"StepRow: killed must be str \| None"),
    ({"argv": None}, r"StepRow: argv is null"),
    ({"verdict": "MATHC"}, r"CheckFound.verdict: 'MATHC' is not one of \['MATCH', 'NOISE', 'DEFECT'\]"),
    ({"judged": _DROP}, r"CheckFound: unknown key\(s\) \[\], missing key\(s\) \['judged'\]"),
])
def test_a_malformed_step_is_refused_by_name(change, named):
    with pytest.raises(ParityError, match=named):
        StepRow.from_dict(_step(**change))


def test_a_malformed_spec_document_is_refused_by_name():
    doc = _doc("spec_acceptance.json")
    doc["runs"][-1]["divergence"] = {"cls": "WRONG", "step": 0, "spec_induced": False}   # the field name, not "class"
    with pytest.raises(ParityError, match=r"SpecBenchResult.runs: RunRow.divergence: RunDivergence: unknown key\(s\) "
                                          r"\['cls'\], missing key\(s\) \['class'\]"):
        SpecBenchResult.from_dict(doc)
    doc = _doc("spec_acceptance.json")
    doc["runs"][1]["state_divergence"] = {"round": 1}
    with pytest.raises(ParityError, match="StateDivergence: expected exactly the keys"):
        SpecBenchResult.from_dict(doc)
    doc = _doc("spec_acceptance.json")
    doc["plan"]["engines"] = "torch"
    with pytest.raises(ParityError, match="SpecBenchPlan.engines: expected a JSON array, not str"):
        SpecBenchResult.from_dict(doc)
