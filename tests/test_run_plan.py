"""The run plan (parity/tracing/plan.py, api.plan_run): one validation, one default for the positions (the API's
equals the CLI's), one follow rule, one token-range check, token sources read the same way for every command."""

from __future__ import annotations

import dataclasses

import pytest
from click.testing import CliRunner

from parity import api
from parity.cli import cli
from parity.contract.errors import TraceError
from parity.tracing.plan import PlanError, RunPlan, TokenSource, run_plan

PROMPT = [0, 17, 42, 99]


def test_run_plan_resolves_positions_and_is_frozen():
    # hand-written: 4 prompt tokens + 3 decode -> positions 0..6; default = prompt's last (3) and every decode one
    plan = run_plan(PROMPT, 3)
    assert plan == RunPlan((0, 17, 42, 99), 3, None, None, (3, 4, 5, 6))
    assert run_plan(PROMPT).positions == (3,)
    assert run_plan(PROMPT, 2, positions="all", chunk=3).positions == tuple(range(6))
    assert run_plan(PROMPT, 1, positions="0,2").positions == (0, 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.decode = 4


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"tokens": []}, "no tokens to trace"),
    ({"tokens": PROMPT, "decode": -1}, "decode must be >= 0"),
    ({"tokens": PROMPT, "decode": 2, "forced": [5]}, "1 forced decode tokens for 2 decode steps"),
    ({"tokens": PROMPT, "chunk": 0}, "chunk must be >= 1"),
    ({"tokens": PROMPT, "positions": "9"}, r"positions \[9\] out of range \[0, 4\)"),
    ({"tokens": [0, 300, 7], "vocab": 280}, r"token id\(s\) \[300\] out of range \[0, 280\)"),
])
def test_run_plan_refuses_naming_the_problem(kwargs, words):
    tokens = kwargs.pop("tokens")
    with pytest.raises(TraceError, match=words):
        run_plan(tokens, **kwargs)


def test_token_sources_are_exactly_one(tiny_f32, tmp_path):
    (tmp_path / "ids.txt").write_text("0 5\n12, 19\n")
    assert api.plan_run(tiny_f32, TokenSource(tokens_file=str(tmp_path / "ids.txt"))).tokens == (0, 5, 12, 19)
    with pytest.raises(PlanError, match="exactly one of --tokens, --tokens-file, --prompt, --prompt-file "
                                        r"\(given: --tokens, --prompt\)"):
        api.plan_run(tiny_f32, TokenSource(tokens="1", prompt="x"))
    with pytest.raises(PlanError, match="exactly one of"):
        api.plan_run(tiny_f32, TokenSource())
    with pytest.raises(PlanError, match="--tokens: token ids must be integers"):
        api.plan_run(tiny_f32, TokenSource(tokens="1,x"))
    (tmp_path / "bad.txt").write_bytes(b"caf\xe9")
    with pytest.raises(PlanError, match="is not UTF-8 \\(byte 3\\)"):
        api.plan_run(tiny_f32, TokenSource(prompt_file=str(tmp_path / "bad.txt")))


def test_builtin_prompt_and_range_check(tiny_f32):
    from parity.bisect.search import builtin_prompt
    from parity.gguf.weights import Weights

    cfg = Weights(tiny_f32).config
    plan = api.plan_run(tiny_f32, builtin=True, default_decode=4)
    assert list(plan.tokens) == builtin_prompt(cfg.vocab_size, cfg.bos_token_id) and plan.decode == 4
    with pytest.raises(PlanError, match=rf"\[{cfg.vocab_size}\] out of range \[0, {cfg.vocab_size}\)"):
        api.plan_run(tiny_f32, TokenSource(tokens=f"0,{cfg.vocab_size}"))


def test_follow_refuses_every_other_run_option_by_name(tiny_f32, tmp_path):
    ref = api.trace("reference", tiny_f32, PROMPT, decode=2, chunk=3)
    api.save_trace(ref, tmp_path / "ref.trace")
    plan = api.plan_run(tiny_f32, follow=tmp_path / "ref.trace")
    assert plan.kwargs() == api.follow(ref)
    assert (plan.tokens, plan.decode, plan.chunk) == (tuple(PROMPT), 2, 3)
    assert plan.forced == tuple(ref.header.tokens[4:])
    with pytest.raises(PlanError, match="drop --tokens, --decode, --positions"):
        api.plan_run(tiny_f32, TokenSource(tokens="1"), follow=ref, decode=0, positions="all")


def test_the_api_default_positions_are_the_clis(tiny_f32, tmp_path):
    """Without positions, `api.trace` and `v4parity trace` trace the same positions (with decode: the prompt's last
    and every decode position, hand-counted here: 4 prompt tokens + 2 decode -> 3, 4, 5)."""
    t = api.trace("reference", tiny_f32, PROMPT, decode=2)
    r = CliRunner().invoke(cli, ["trace", "--engine", "reference", "-m", str(tiny_f32), "--tokens", "0,17,42,99",
                                 "--decode", "2", "-o", str(tmp_path / "t.trace"), "--json"])
    assert r.exit_code == 0, r.output
    assert t.header.positions == [3, 4, 5] == api.load_trace(tmp_path / "t.trace").header.positions
