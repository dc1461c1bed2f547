"""The API's run functions take a run's tokens as a command parsed them (issue 26.5: parse -> one API call -> print):
token ids or a `TokenSource`, the plan built inside through `api.plan_run`; the keyword API with ids keeps working."""

from __future__ import annotations

import pytest

from parity import api
from parity.contract.errors import ParityError, TraceError
from parity.tracing.plan import PlanError, TokenSource, run_plan

PROMPT = [0, 17, 42, 99]


def test_plan_run_takes_ids_as_a_token_source_does(tiny_f32, tmp_path):
    (tmp_path / "ids.txt").write_text("0 17\n42, 99\n")
    from_ids = api.plan_run(tiny_f32, PROMPT, decode=2)
    assert from_ids == api.plan_run(tiny_f32, TokenSource(tokens_file=str(tmp_path / "ids.txt")), decode=2)
    assert from_ids == run_plan(PROMPT, 2)   # hand-counted positions 3, 4, 5 are run_plan's (test_run_plan.py)
    ref = api.trace("reference", tiny_f32, PROMPT, decode=1)
    with pytest.raises(PlanError, match="drop --tokens, --decode"):   # ids with a followed run: named as --tokens
        api.plan_run(tiny_f32, PROMPT, follow=ref, decode=1)


def test_trace_to_file_builds_its_plan_from_the_sources(tiny_f32, tmp_path):
    by_source = api.trace_to_file("reference", tiny_f32, TokenSource(tokens="0,17,42,99"), tmp_path / "s.trace",
                                  decode=2)
    by_ids = api.trace_to_file("reference", tiny_f32, PROMPT, tmp_path / "i.trace", decode=2)
    a, b = api.load_trace(tmp_path / "s.trace"), api.load_trace(tmp_path / "i.trace")
    assert by_source["positions"] == by_ids["positions"] == [3, 4, 5]
    assert a.header.tokens == b.header.tokens and a.header.tokens[:4] == PROMPT and len(a.header.tokens) == 6
    followed = api.trace_to_file("reference", tiny_f32, None, tmp_path / "f.trace", follow=tmp_path / "s.trace")
    assert followed["positions"] == [3, 4, 5] and api.load_trace(tmp_path / "f.trace").header.tokens == a.header.tokens
    with pytest.raises(TraceError, match="a RunPlan is the whole run: drop decode"):
        api.trace_to_file("reference", tiny_f32, run_plan(PROMPT), tmp_path / "x.trace", decode=1)
    with pytest.raises(PlanError, match="exactly one of"):
        api.trace_to_file("reference", tiny_f32, TokenSource(tokens="1", prompt="x"), tmp_path / "x.trace")


def test_convert_and_the_compare_refusals(tiny_f32, tmp_path):
    api.trace_to_file("reference", tiny_f32, PROMPT, tmp_path / "t.trace")
    api.convert(tmp_path / "t.trace", tmp_path / "t.npz")
    assert api.load_trace(tmp_path / "t.npz").header == api.load_trace(tmp_path / "t.trace").header
    with pytest.raises(ParityError, match="give check_model"):   # an envelope alone would judge by K x floor
        api.compare(tmp_path / "t.trace", tmp_path / "t.npz", envelope=tmp_path / "env.json")
    done = api.compare(tmp_path / "t.trace", tmp_path / "t.npz")
    assert bool(done.report) and done.checked is None and done.figure is None   # the same run agrees with itself
