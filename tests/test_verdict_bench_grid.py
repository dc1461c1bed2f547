"""The verdict bench's fault grid covers the tiny real-mix model too (QAT on and off), and cells of an earlier
result are taken from it instead of running again (issue 22, P5)."""

from __future__ import annotations

import dataclasses

from test_bench import verdict_row

from parity.bench import verdicts
from parity.contract.progress import Recording


def test_default_plan_injects_every_fault_into_both_tiny_models_with_qat_on_and_off():
    plan = verdicts.PLANS["default"]
    faults = ("a", "b")
    tasks = verdicts._tasks(plan, faults)
    cells = {(t["model"], t["qat"], t["fault"]) for t in tasks if t["kind"] == "fault"}
    assert cells == {(m, q, f) for m in ("f32", "real-mix") for q in (True, False) for f in faults}
    assert sum(t["kind"] == "fault" for t in tasks) == 2 * 2 * 2 * plan.fault_prompts
    # each model's faulty runs have clean QAT-off baselines among the correct runs
    base = {(t["model"], t["seed"]) for t in tasks if t["kind"] == "correct" and not t["qat"]
            and t["engine"] == "torch"}
    assert base == {(m, plan.seed0 + 1000 + i) for m in ("f32", "real-mix") for i in range(plan.fault_prompts)}


def test_cells_of_an_earlier_result_are_not_run_again(tiny_f32, tmp_path):
    plan = verdicts.VerdictPlan(torch_lengths={40: 2}, torch_models=("f32",), llamacpp_types=(),
                                faults=("sink-dropped",), fault_prompts=1, fault_qat=(True,))
    tasks = verdicts._tasks(plan, plan.faults)
    earlier = [verdicts._judge(verdict_row(**t, **({} if t["kind"] == "correct" else {"expected_layer": None})))
               for t in tasks]
    # a row written before `subops` existed is the same cell as subops=False
    earlier[0] = dataclasses.replace(earlier[0], subops=None)
    logged, new = Recording(), []
    result = verdicts.run_verdicts({"f32": tiny_f32}, plan, tmp_path, logged, done=earlier, on_row=new.append,
                                   plan_name="earlier cells")
    assert len(result.rows) == len(tasks) and all(r is e for r, e in zip(result.rows, earlier, strict=True))
    assert not logged.calls and not new
    assert verdicts.task_key(earlier[0]) == verdicts.task_key(tasks[0])
    assert verdicts.task_key({**tasks[0], "seed": 99}) != verdicts.task_key(tasks[0])


def test_the_tie_breaking_fault_runs_where_ties_exist_and_is_judged_by_its_changed_picks():
    plan = verdicts.PLANS["default"]
    ties = [t for t in verdicts._tasks(plan, ("a",)) if t["kind"] == "tie"]
    assert [(t["model"], t["seed"]) for t in ties] == [("f32", verdicts.MOTIF_SEED)] + [
        (verdicts.TIE_MODEL, plan.seed0 + 1000 + i) for i in range(plan.tie_prompts)]
    assert all(t["fault"] == "indexer-ties-highest" and t["qat"] for t in ties)

    def row(picks, verdict, causes, cause=None, culprit=None):
        r = verdicts._judge(verdict_row(kind="tie", fault="indexer-ties-highest", changed_picks=picks,
                                        expected_layer=4, verdict=verdict, causes=causes, cause=cause,
                                        culprit_layer=culprit))
        return r.expected, r.found

    assert row(1, "NOISE", ["benign:tie@4", "benign:fp8-code-flip@4"]) == ("TIE", True)
    assert row(1, "NOISE", ["benign:tie@2"]) == ("TIE", False)            # a tie, at another layer
    assert row(1, "DEFECT", ["benign:tie@4", "defect:indexer-ties-highest@4"], "indexer-ties-highest", 4) \
        == ("TIE", False)
    assert row(29, "DEFECT", ["defect:indexer-ties-highest@4"], "indexer-ties-highest", 4) == ("DEFECT", True)
    assert row(29, "NOISE", ["benign:tie@4"]) == ("DEFECT", False)
