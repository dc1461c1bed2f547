"""ds4 to the byte: `ds4_test --logprob-vectors` rules, the dump writer's corners and the reader's, each on bytes
written here by hand from ds4's formats (spec ds4-formats §1.4, §2.3, §2.4; ds4_test.c, ds4_cli.c)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from parity.cli import cli
from parity.gguf.vocab import EOS
from parity.logprobs.compare import LogprobPreflightError, compare_runs
from parity.logprobs.io import ds4_dump_text, read_ds4_dump, read_run

EOS_BYTES = list(EOS.encode())
API_EOS_BYTES = list("<｜｜end▁of▁sentence｜｜>".encode())


def tok(i: int, data: bytes) -> str:
    """A ds4 token object as `json_write_token` prints it (valid UTF-8 pieces here: the text unescaped)."""
    return f'{{"id":{i},"text":{json.dumps(data.decode(), ensure_ascii=False)},"bytes":[{",".join(map(str, data))}]}}'


def dump(tmp_path: Path, name: str, steps: list[tuple[tuple[int, bytes], list[tuple[int, bytes, str, str]]]],
         top_k: int, prompt_tokens: int = 12, ctx: int = 4096) -> Path:
    """A ds4 --dump-logprobs file: the fixed header, one line per step, steps joined by ',\\n'."""
    lines = []
    for s, ((sid, sdata), tops) in enumerate(steps):
        entries = ",".join(f'{{"token":{tok(i, d)},"logit":{lg},"logprob":{lp}}}' for i, d, lg, lp in tops)
        lines.append(f'    {{"step":{s},"selected":{tok(sid, sdata)},"top_logprobs":[{entries}]}}')
    text = (f'{{\n  "source":"ds4",\n  "prompt_tokens":{prompt_tokens},\n  "ctx":{ctx},\n  "top_k":{top_k},\n'
            f'  "steps":[\n' + ",\n".join(lines) + "\n  ]\n}\n")
    path = tmp_path / name
    path.write_bytes(text.encode())
    return path


def top20(first: list[tuple[int, bytes, str, str]]) -> list[tuple[int, bytes, str, str]]:
    """`first`, then filler tokens "t<k>" at -10 - k down to 20 entries (descending logprobs)."""
    rest = [(3000 + k, f"t{k}".encode(), str(10 - k), str(-10 - k)) for k in range(20 - len(first))]
    return first + rest


def vec(tmp_path: Path, body: str, case: str = "c") -> str:
    path = tmp_path / f"{case}.vec"
    path.write_text(f"# ds4-official-logprob-vectors-v1\ncase {case} 4096 1 prompts/p.txt\n{body}end\n")
    return f"{path}#{case}"


def test_official_logprob_is_float32_before_the_4_nat_comparison(tmp_path):
    b = read_run(dump(tmp_path, "b.json", [((1001, b"16"), top20([(1001, b"16", "20", "0")]))], top_k=20))
    # float32(-4.00000001) == -4.0: |0 - (-4)| = 4 is not > 4 in ds4_test (a float64 comparison would fail it)
    ok = compare_runs(read_run(vec(tmp_path, "step 0 3136 1\ntop 3136 -4.00000001\n")), b)
    assert ok.steps[0].ds4_test is True and ok.ds4_test() is True
    bad = compare_runs(read_run(vec(tmp_path, "step 0 3136 1\ntop 3136 -4.0001\n")), b)
    assert bad.ds4_test() is False and "|Δlogprob| = 4.00010014 > 4.0" in bad.steps[0].ds4_test_detail


def test_a_minus_9999_vec_line_is_checked_as_ds4_does(tmp_path):
    b = read_run(dump(tmp_path, "b.json", [((1001, b"16"), top20([(1001, b"16", "20", "-0.1"),
                                                                    (1002, b"204", "17", "-3")]))], top_k=20))
    listed = compare_runs(read_run(vec(tmp_path, "step 0 3136 2\ntop 3136 0\ntop 323034 -9999\n")), b)
    assert listed.ds4_test() is False and "'204': |Δlogprob| = 9996 > 4.0" in listed.steps[0].ds4_test_detail
    absent = compare_runs(read_run(vec(tmp_path, "step 0 3136 2\ntop 3136 0\ntop 7a7a -9999\n")), b)
    assert "reference top token 'zz' missing" in absent.steps[0].ds4_test_detail
    # the -9999 line is still no probability for every other metric
    assert read_run(vec(tmp_path, "step 0 3136 2\ntop 3136 0\ntop 7a7a -9999\n")).steps[0].dropped == 1


def test_first_local_entry_with_the_same_bytes_counts(tmp_path):
    # two local ids spell "16": ds4_test stops at the first (-0.1, within 4 nats), not the last (-5)
    b = read_run(dump(tmp_path, "b.json", [((1001, b"16"), top20([(1001, b"16", "20", "-0.1"),
                                                                    (2001, b"16", "15", "-5")]))], top_k=20))
    cmp = compare_runs(read_run(vec(tmp_path, "step 0 3136 1\ntop 3136 -0.5\n")), b)
    assert cmp.ds4_test() is True


def _official(tmp_path: Path, tops: list[tuple[list[int], float]]) -> Path:
    doc = {"schema": "ds4-official-logprobs-v1", "source": "deepseek-official-api", "id": "x",
           "steps": [{"step": 0, "token": {"text": "16", "bytes": [49, 54]}, "logprob": tops[0][1],
                      "top_logprobs": [{"token": {"text": bytes(b).decode(), "bytes": b}, "logprob": lp}
                                       for b, lp in tops]}]}
    path = tmp_path / "o.official.json"
    path.write_text(json.dumps(doc, ensure_ascii=False))
    return path


def test_api_spelled_eos_among_official_tops_is_missing_locally(tmp_path):
    b = read_run(dump(tmp_path, "b.json", [((1001, b"16"), top20([(1001, b"16", "20", "-0.2"),
                                                                    (1, bytes(EOS_BYTES), "18", "-2.5")]))],
                      top_k=20))
    a = read_run(_official(tmp_path, [([49, 54], -0.2), (API_EOS_BYTES, -2.5)]))
    cmp = compare_runs(a, b)
    assert cmp.steps[0].verdict == "MATCH" and cmp.steps[0].jaccard is not None  # our metrics normalise EOS
    assert cmp.ds4_test() is False and "missing from the candidate's top 20" in cmp.steps[0].ds4_test_detail
    same = compare_runs(read_run(_official(tmp_path, [([49, 54], -0.2), (EOS_BYTES, -2.5)])), b)
    assert same.ds4_test() is True


def test_empty_bytes_alternatives_of_an_official_json_are_dropped(tmp_path):
    a = read_run(_official(tmp_path, [([49, 54], -0.2), ([], -3.0), ([50, 48, 52], -9999.0)]))
    assert [t.data for t, _ in a.steps[0].top] == [b"16"] and a.steps[0].dropped == 2
    b = read_run(dump(tmp_path, "b.json", [((1001, b"16"), top20([(1001, b"16", "20", "-0.2")]))], top_k=20))
    assert compare_runs(a, b).ds4_test() is True


def test_top_k_below_20_is_na_and_above_20_passes_against_itself(tmp_path):
    small = read_run(dump(tmp_path, "s.json", [((1001, b"16"), [(1001, b"16", "20", "-0.1")])], top_k=5))
    cmp = compare_runs(read_run(vec(tmp_path, "step 0 3136 1\ntop 3136 0\n")), small)
    assert cmp.ds4_test() is None and "ds4_test: n/a (B lists top 5 < 20)" in cmp.summary_line()
    wide = top20([(1001, b"16", "20", "-0.1")]) + [(4000 + k, f"w{k}".encode(), "-20", "-40") for k in range(5)]
    big = dump(tmp_path, "big.json", [((1001, b"16"), wide)], top_k=25)
    assert compare_runs(read_run(big), read_run(big)).ds4_test() is True


def test_ds4_test_skips_long_memory_archive(tmp_path):
    b = read_run(dump(tmp_path, "b.json", [((1001, b"16"), top20([(1001, b"16", "20", "0")]))], top_k=20))
    cmp = compare_runs(read_run(vec(tmp_path, "step 0 6161 1\ntop 6161 0\n", case="long_memory_archive")), b)
    assert cmp.steps[0].verdict == "WRONG"  # still compared, still WRONG
    assert cmp.ds4_test() is None and "ds4_test skips case long_memory_archive" in cmp.summary_line()


def test_cli_exit_codes_incomplete_and_mismatched_runs(tmp_path):
    full = dump(tmp_path, "a.json", [((1001, b"16"), top20([(1001, b"16", "20", "-0.1")]))] * 5, top_k=20)
    cut = dump(tmp_path, "b.json", [((1001, b"16"), top20([(1001, b"16", "20", "-0.1")]))] * 2, top_k=20)
    r = CliRunner().invoke(cli, ["logprobs", str(full), str(cut)])
    assert r.exit_code == 1 and "ds4_test: FAIL; INCOMPLETE: B lacks 3 of A's 5 steps" in r.output
    r = CliRunner().invoke(cli, ["logprobs", str(full), str(cut), "--fail-on", "drift"])
    assert r.exit_code == 1 and "FAILED: incomplete" in r.output  # incomplete fails whatever the gates
    other = dump(tmp_path, "c.json", [((1001, b"16"), top20([(1001, b"16", "20", "-0.1")]))] * 5, top_k=20,
                 prompt_tokens=13, ctx=8192)
    r = CliRunner().invoke(cli, ["logprobs", str(full), str(other), "--json"])
    err = json.loads(r.output)
    assert r.exit_code == 2 and err["error"].endswith("prompt_tokens differs: A 12, B 13")  # ctx: the run fits
    assert CliRunner().invoke(cli, ["logprobs", str(full), str(other), "--force"]).exit_code == 0
    assert CliRunner().invoke(cli, ["logprobs", str(full), str(full)]).exit_code == 0


def test_a_different_ctx_is_compared_when_the_run_fits_the_smaller(tmp_path):
    """ds4 stops a run at ctx - prompt_tokens - 1 steps: a run that fits the smaller ctx is the same run in both."""
    step = ((1001, b"16"), top20([(1001, b"16", "20", "-0.1")]))
    a = read_run(dump(tmp_path, "a.json", [step] * 5, top_k=20, ctx=4096))
    b = read_run(dump(tmp_path, "b.json", [step] * 5, top_k=20, ctx=16384))
    cmp = compare_runs(a, b)
    assert "ctx differs (A 4096, B 16384); compared: the run (12 prompt tokens + 5 steps) fits in the smaller " \
           "ctx" in cmp.notes and cmp.ds4_test() is True
    # an official.vec case (ctx 4096, no prompt count) against a dump of another ctx: the dump's prompt count
    one = dump(tmp_path, "one.json", [((1001, b"16"), top20([(1001, b"16", "20", "0")]))], top_k=20, ctx=16384)
    r = CliRunner().invoke(cli, ["logprobs", vec(tmp_path, "step 0 3136 1\ntop 3136 -4.00000001\n"), str(one),
                                 "--fail-on", "ds4-test"])
    assert r.exit_code == 0, r.output
    assert "the run (12 prompt tokens + 1 steps) fits in the smaller ctx" in r.output.replace("\n  ", " ")
    # 12 prompt tokens + 6 steps + 1 = 19 > 18: the longer run does not fit the smaller ctx
    short = read_run(dump(tmp_path, "s.json", [step] * 5, top_k=20, ctx=18))
    longer = read_run(dump(tmp_path, "l.json", [step] * 6, top_k=20, ctx=4096))
    assert compare_runs(short, read_run(dump(tmp_path, "f.json", [step] * 5, top_k=20, ctx=4096))).notes
    with pytest.raises(LogprobPreflightError, match=r"ctx differs: A 18, B 4096 \(12 prompt tokens \+ 6 steps does "
                                                    r"not fit in ctx 18\)"):
        compare_runs(short, longer)


# ---------------------------------------------------------------------------------------------
# The writer's and reader's corners

VOCAB = ["a", "b", EOS]


def _text(row: list[float], selected: int) -> str:
    return ds4_dump_text(logits=np.array([row], np.float32), selected=[selected], prompt_tokens=2, ctx=16, top_k=2,
                         vocab_tokens=VOCAB)


def _one_step(line: str) -> str:
    return ('{\n  "source":"ds4",\n  "prompt_tokens":2,\n  "ctx":16,\n  "top_k":2,\n  "steps":[\n    '
            + line + "\n  ]\n}\n")


A, B = '{"id":0,"text":"a","bytes":[97]}', '{"id":1,"text":"b","bytes":[98]}'


def test_writer_flushes_subnormal_logits_to_zero():
    sub = float(np.float32(1e-45))  # the smallest float32 subnormal
    assert _text([sub, -np.inf, -np.inf], 0) == _one_step(
        f'{{"step":0,"selected":{A},"top_logprobs":[{{"token":{A},"logit":0,"logprob":0}}]}}')
    # a negative subnormal flushes to -0, which %.9g prints as -0
    assert _text([-sub, -np.inf, -np.inf], 0) == _one_step(
        f'{{"step":0,"selected":{A},"top_logprobs":[{{"token":{A},"logit":-0,"logprob":-0}}]}}')


def test_writer_writes_nan_inf_and_dead_rows_as_ds4():
    # NaN and +inf are skipped in the list; ds4's argmax starts at -inf: a NaN never wins, a +inf does
    assert _text([np.nan, 5.0, -np.inf], 1) == _one_step(
        f'{{"step":0,"selected":{B},"top_logprobs":[{{"token":{B},"logit":5,"logprob":0}}]}}')
    assert _text([3.0, np.inf, np.nan], 1) == _one_step(
        f'{{"step":0,"selected":{B},"top_logprobs":[{{"token":{A},"logit":3,"logprob":0}}]}}')
    dead = _text([-np.inf, -np.inf, -np.inf], 0)
    assert dead == _one_step(f'{{"step":0,"selected":{A},"top_logprobs":[]}}')
    assert _text([np.nan, np.nan, np.nan], 0) == dead


def test_reader_accepts_an_empty_top_logprobs(tmp_path):
    path = tmp_path / "dead.json"
    path.write_text(_one_step(f'{{"step":0,"selected":{A},"top_logprobs":[]}}'))
    run = read_ds4_dump(path)
    assert run.steps[0].top == [] and run.steps[0].selected.data == b"a"
