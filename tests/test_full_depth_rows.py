"""The full-depth bench's rows built as records from what a step printed (parity/bench/full_depth.py: `verdict`,
`drift`, `render_markdown`; issue 26.3). The stdout documents are hand-made in the shape `check --json` and
`diff --json` print; the expected fields and table cells are read off them by hand."""

from __future__ import annotations

import json

import pytest

from parity.bench.full_depth import drift, render_markdown, verdict
from parity.bench.full_depth_report import CheckFound, DiffFound, FullDepthResult, StepRow
from parity.compare.verdict import Judged, Verdict
from parity.contract.errors import ParityError

CULPRIT = {"layer": 3, "checkpoint": "blk.3.ffn"}
CHECK = {"verdict": "DEFECT", "judged": "op-level", "notes": ["..."], "seconds": 1.5,
         "envelope": {"source": "env.json", "seconds": 0.01}, "culprit": CULPRIT,
         "causes": [{"kind": "defect", "name": "comb-not-transposed", "layer": 3}], "table": []}
DIFF = {"agree": False, "first_drift": {"checkpoint": "blk.3.ffn", "layer": 3}, "flags_differ": [],
        "worst": [{"checkpoint": "blk.3.ffn", "rel_l2": 0.25}, {"checkpoint": "final_norm", "rel_l2": 0.5}],
        "logits": [{"pos": 0, "rel_l2": 0.125}, {"pos": 1, "rel_l2": 0.375}]}


def _out(tmp_path, doc: object, name: str = "step.out"):
    path = tmp_path / name
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return path


def test_check_and_diff_outputs_become_typed_records(tmp_path):
    found, error = verdict(_out(tmp_path, CHECK))
    assert error is None
    assert found == CheckFound(Verdict.DEFECT, Judged.OP_LEVEL, CULPRIT, CHECK["causes"], 1.5, "env.json")
    assert verdict(_out(tmp_path, {"error": "no such file"})) == (None, "no such file")
    assert verdict(_out(tmp_path, "Traceback ...")) == (None, None)          # not JSON: the step failed
    assert drift(_out(tmp_path, DIFF)) == DiffFound(False, DIFF["first_drift"],
                                                    {"blk.3.ffn": 0.25, "final_norm": 0.5}, 0.375)
    assert drift(tmp_path / "missing.out") is None


def test_a_verdict_without_its_fields_is_refused_by_name(tmp_path):
    with pytest.raises(ParityError, match="printed a verdict without judged, seconds"):
        verdict(_out(tmp_path, {k: v for k, v in CHECK.items() if k not in ("judged", "seconds")}))


def test_rows_print_their_outcome_and_spell_the_old_keys(tmp_path):
    measured = {"argv": ["v4parity"], "exit": 1, "killed": None, "wall_s": 2.0, "cpu_s": 1.0, "user_s": 0.75,
                "sys_s": 0.25, "peak_rss": 2**30, "peak_anon": 2**29, "load_before": 3.0, "load_after": 4.0,
                "log": "x.log", "what": "w", "sizes": {"t.npz": 2**20}}
    found, _ = verdict(_out(tmp_path, CHECK))
    check = StepRow(**measured, check=found)
    diff = StepRow(**{**measured, "exit": 0}, diff=drift(_out(tmp_path, DIFF)))
    failed = StepRow(**measured, error="boom")
    result = FullDepthResult({"check-fault": check, "diff-fault": diff, "check-clean": failed})
    lines = render_markdown(result).splitlines()[2:]
    assert [line.split(" | ")[-1] for line in lines] == [   # in STEPS order, not insertion order
        "boom |",
        "agree False, first drift {'checkpoint': 'blk.3.ffn', 'layer': 3}, worst rel-L2 final_norm 5.00e-01, "
        "logits 3.75e-01 |",
        f"DEFECT (op-level), culprit {CULPRIT}, causes {CHECK['causes']} |"]
    assert lines[0].startswith("| check-clean: w | 2.0 s | 1.0 s | 1.00 / 0.50 GiB | 3.0 -> 4.0 | t.npz 1.0 MiB |")
    doc = result.to_dict()["steps"]
    assert list(doc["check-fault"])[-6:] == ["verdict", "judged", "culprit", "causes", "seconds", "envelope_source"]
    assert doc["check-fault"]["verdict"] == "DEFECT" and doc["check-clean"]["error"] == "boom"
    assert FullDepthResult.from_dict(json.loads(json.dumps(result.to_dict()))) == result
