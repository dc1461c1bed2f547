"""Logprob file readers (ds4 dump, official JSON, official.vec) and the byte-exact ds4 writer."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parity.contract.errors import ParityError
from parity.gguf.vocab import EOS
from parity.logprobs.io import (
    LogprobFileError,
    ds4_dump_text,
    json_piece,
    read_ds4_dump,
    read_official_json,
    read_official_vec,
    read_run,
    write_ds4_dump,
)

FIX = Path(__file__).parent / "fixtures" / "logprobs"
EOS_BYTES = EOS.encode()                       # 27 bytes, single U+FF5C bars
API_EOS_BYTES = "<｜｜end▁of▁sentence｜｜>".encode()  # 33 bytes, doubled bars
FRAGMENT = bytes([228, 189])                   # first two bytes of a 3-byte UTF-8 character


def test_eos_spellings_are_the_documented_lengths():
    assert len(EOS_BYTES) == 27 and len(API_EOS_BYTES) == 33


def test_ds4_dump_reads_bytes_ids_logits_and_truncated_top_k():
    run = read_ds4_dump(FIX / "ref.ds4.json")
    assert (run.format, run.source, run.top_k, run.greedy_only) == ("ds4-dump", "ds4", 3, False)
    assert run.meta == {"prompt_tokens": 12, "ctx": 4096, "top_k": 3}
    assert [s.selected.data for s in run.steps] == [b"16", FRAGMENT, EOS_BYTES]
    s1 = run.steps[1]
    # the text field is Latin-1 mojibake for a byte fragment; bytes are what count
    assert s1.selected.text == "\u00e4\u00bd" and s1.selected.id == 1004
    assert [(t.data, lp) for t, lp in s1.top] == [(FRAGMENT, -0.75), (b"\n", -0.8), (b"204", -4.5)]
    assert s1.logits == [20.0, 19.95, 16.25]


def test_official_json_greedy_only_drops_placeholders_and_keeps_lossy_text_out():
    run = read_official_json(FIX / "greedy.official.json")
    assert run.greedy_only and run.format == "official-json" and run.top_k == 4
    assert run.meta["finish_reason"] == "length"
    assert [s.dropped for s in run.steps] == [3, 3]                      # -9999 entries removed
    assert [[(t.data, lp) for t, lp in s.top] for s in run.steps] == [[(b"16", 0.0)], [(FRAGMENT, 0.0)]]
    assert run.steps[1].selected.text == "\ufffd"                        # the API's lossy text


def test_official_json_normalises_the_api_eos_spelling():
    run = read_official_json(FIX / "ranked.official.json")
    assert not run.greedy_only
    assert run.steps[0].top[2][0].data == EOS_BYTES
    assert run.steps[2].selected.data == EOS_BYTES


def test_official_vec_cases():
    run = read_official_vec(FIX / "cases.vec", "match_case")
    assert run.greedy_only and run.meta["ctx"] == 4096 and run.meta["prompt_file"] == "prompts/fixture.txt"
    assert [s.selected.data for s in run.steps] == [b"16", FRAGMENT]
    wrong = read_run(f"{FIX / 'cases.vec'}#wrong_case")
    assert wrong.steps[1].selected.data == b"\n" and wrong.steps[1].dropped == 1   # the -9999 line


def test_read_run_detects_each_format():
    assert read_run(FIX / "ref.ds4.json").format == "ds4-dump"
    assert read_run(FIX / "greedy.official.json").format == "official-json"
    with pytest.raises(LogprobFileError, match="holds 2 cases.*match_case, wrong_case"):
        read_run(FIX / "cases.vec")
    with pytest.raises(LogprobFileError, match="no case 'nope'"):
        read_run(f"{FIX / 'cases.vec'}#nope")


def _mutated(tmp_path, name, mutate) -> str:
    doc = json.loads((FIX / name).read_text())
    mutate(doc)
    p = tmp_path / name
    p.write_text(json.dumps(doc))
    return str(p)


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d["steps"][1]["top_logprobs"][2]["token"].pop("bytes"),
     r"step 1: field 'top_logprobs\[2\].token.bytes': missing"),
    (lambda d: d["steps"][0]["selected"]["bytes"].__setitem__(0, 300),
     r"step 0: field 'selected.bytes': expected integers 0..255"),
    (lambda d: d["steps"][2]["top_logprobs"][0].__setitem__("logprob", "x"),
     r"step 2: field 'top_logprobs\[0\].logprob': expected num"),
    (lambda d: d["steps"][1]["top_logprobs"][1].__setitem__("logprob", 0.5),
     r"step 1: field 'top_logprobs\[1\].logprob': a logprob must be <= 0"),
    (lambda d: d["steps"][1]["top_logprobs"][1].__setitem__("logprob", -0.7),
     r"step 1: field 'top_logprobs\[1\].logprob': .*descending"),
    (lambda d: d["steps"][2].__setitem__("step", 7), r"step 2: field 'step': expected 2"),
    (lambda d: d.__setitem__("top_k", 2), r"step 0: field 'top_logprobs': 3 entries; expected 0..top_k=2"),
    (lambda d: d["steps"][0]["top_logprobs"][1].__setitem__("logprob", -0.21),
     r"step 0: field 'top_logprobs': listed probabilities sum to"),
    (lambda d: d.pop("ctx"), r"field 'ctx': missing"),
    (lambda d: d["steps"][1]["selected"].__setitem__("text", "\\u00e4\\u00bd"),
     r"step 1: field 'selected.text': .* does not match its bytes"),
])
def test_malformed_ds4_dump_names_file_step_and_field(tmp_path, mutate, message):
    path = _mutated(tmp_path, "ref.ds4.json", mutate)
    with pytest.raises(LogprobFileError, match=message) as e:
        read_ds4_dump(path)
    assert path in str(e.value)


def test_malformed_official_json(tmp_path):
    path = _mutated(tmp_path, "ranked.official.json", lambda d: d["steps"][1]["top_logprobs"].pop(0))
    with pytest.raises(LogprobFileError, match="step 1: field 'token': the selected token is not among top_logprobs"):
        read_official_json(path)
    with pytest.raises(LogprobFileError, match="not JSON"):
        read_official_json(_write(tmp_path, "bad.json", '{"schema": '))
    with pytest.raises(LogprobFileError, match="field 'source': missing"):   # never a guessed source
        read_official_json(_mutated(tmp_path, "ranked.official.json", lambda d: d.pop("source")))
    # the id picks ds4_test's skip list: a missing one is refused, never read as "not a skipped case"
    with pytest.raises(LogprobFileError, match="field 'id': missing"):
        read_official_json(_mutated(tmp_path, "ranked.official.json", lambda d: d.pop("id")))
    with pytest.raises(LogprobFileError, match="field 'id': expected str"):
        read_official_json(_mutated(tmp_path, "ranked.official.json", lambda d: d.update(id=7)))


def _write(tmp_path, name, text) -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


@pytest.mark.parametrize("text, message", [
    ("case c 4096 1 p.txt\nstep 0 3136 2\ntop 3136 0\nend\n", "line 5: step 0: field 'top-count' says 2, found 1"),
    ("case c 4096 2 p.txt\nstep 0 3136 1\ntop 3136 0\nend\n", "line 5: case c: field 'steps' says 2, found 1"),
    ("case c 4096 1 p.txt\nstep 0 313 1\ntop 313 0\nend\n", "line 3: token hex '313'"),
    ("case c 4096 1 p.txt\nstep 0 3136 1\ntop 3136 0\n", "case c has no 'end'"),
    ("case c 4096 1 p.txt\nstep 1 3136 1\ntop 3136 0\nend\n", "line 3: step 1: field 'index': expected 0"),
    ("case c 4096 1 p.txt\nstep 0 3136 1\ntop 3136 abc\nend\n", "line 4: bad number"),
    ("case c 4096 1 p.txt\nbogus\n", "line 3: unexpected line 'bogus'"),
])
def test_malformed_official_vec_names_the_line(tmp_path, text, message):
    path = _write(tmp_path, "x.vec", "# ds4-official-logprob-vectors-v1\n" + text)
    with pytest.raises(LogprobFileError, match=message.replace("(", r"\(")):
        read_official_vec(path)


# ---- writer -------------------------------------------------------------------------------------

def _spec_vocab() -> list[str]:
    """The 3(+2)-token vocabulary of the spec's format-exact sample; other ids are padding."""
    vocab = [f"[PAD{i}]" for i in range(1005)]
    vocab[1], vocab[1001], vocab[1002], vocab[1003], vocab[1004] = EOS, "16", "204", "Ċ", "ä½"
    return vocab


def test_writer_reproduces_the_spec_sample_byte_for_byte(tmp_path):
    # spec ds4-formats §1.4: logits 31.25/22.5/20 then 28/18/10 over a vocab where only those ids are
    # finite (ds4 skips -inf); the expected logprobs are the spec's, computed independently of this code
    logits = np.full((3, 1005), -np.inf, np.float32)
    logits[0, [1001, 1002, 1]] = [31.25, 22.5, 20.0]
    logits[1, [1, 1003, 1004]] = [28.0, 18.0, 10.0]
    logits[2, 1001] = 5.0  # after EOS: must not be written
    out = tmp_path / "dump.json"
    write_ds4_dump(out, logits=logits, selected=[1001, 1, 1001], prompt_tokens=18, ctx=4096, top_k=3,
                   vocab_tokens=_spec_vocab())
    assert out.read_bytes() == (FIX / "spec_sample.ds4.json").read_bytes()


def test_writer_output_reads_back():
    text = ds4_dump_text(logits=np.array([[0.0, 1.0, 3.0, 3.0]], np.float32), selected=[2], prompt_tokens=2,
                         ctx=16, top_k=4, vocab_tokens=[EOS, "a", "b", "c"])
    top = json.loads(text)["steps"][0]["top_logprobs"]
    assert [e["token"]["id"] for e in top] == [2, 3, 1, 0]      # tie at 3.0: the lower id ranks first
    # hand: logsumexp(0,1,3,3) = 3 + log(2 + e^-2 + e^-3); logprob = logit - logsumexp, written as float32
    lse = 3 + np.log(2 + np.exp(-2) + np.exp(-3))
    assert np.array_equal(np.float32([e["logprob"] for e in top]), np.float32(np.array([3.0, 3.0, 1.0, 0.0]) - lse))


@pytest.mark.parametrize("data, expected", [
    (b"ab\"\\\n\r\t\x01\x7f", '"ab\\"\\\\\\n\\r\\t\\u0001\x7f"'),
    ("é日".encode(), '"é日"'),                         # valid UTF-8 is written raw
    (FRAGMENT, '"\\u00e4\\u00bd"'),                    # invalid: every byte >= 0x80 escaped
    (b"x\xe9", '"x\\u00e9"'),
])
def test_json_piece_escaping(data, expected):
    assert json_piece(data) == expected


@pytest.mark.parametrize("kwargs, message", [
    ({"top_k": 129}, "top_k must be 1..128"),
    ({"selected": [1]}, "selected token 1 is not ds4's argmax 2"),
    ({"ctx": 3}, "exceed ds4's cap"),
    ({"vocab_tokens": ["a", "b", "c"]}, "has no"),
])
def test_writer_refuses_what_ds4_could_not_have_written(kwargs, message):
    args = {"logits": np.array([[0.0, 1.0, 2.0]], np.float32), "selected": [2], "prompt_tokens": 2, "ctx": 16,
            "top_k": 2, "vocab_tokens": [EOS, "a", "b"], **kwargs}
    with pytest.raises(ParityError, match=message):
        ds4_dump_text(**args)


def test_writer_reader_round_trip_is_exact_for_float32(tmp_path):
    # %.9g round-trips every float32, so reading a dump back gives the writer's top-k exactly:
    # the ids by descending logit and logprob = logit - logsumexp (checked here in float64 by hand)
    rng = np.random.default_rng(7)
    vocab = [EOS] + [f"{b:02x}x" for b in range(40)] + ["Ã", "©"]  # byte-level "Ã" "©" = bytes c3, a9
    logits = rng.normal(0, 3, (4, len(vocab))).astype(np.float32)
    logits[:, 41:] += 6.0  # the byte fragments rank high
    logits[:, 0] = -50.0  # keep EOS out of the argmax so all 4 steps are written
    sel = logits.argmax(axis=1)
    out = tmp_path / "rt.json"
    write_ds4_dump(out, logits=logits, selected=sel, prompt_tokens=5, ctx=64, top_k=7, vocab_tokens=vocab)
    run = read_ds4_dump(out)
    for s, step in enumerate(run.steps):
        order = np.argsort(-logits[s].astype(np.float64), kind="stable")[:7]
        lse = np.log(np.exp(logits[s].astype(np.float64)).sum())
        assert [t.id for t, _ in step.top] == list(order)
        np.testing.assert_array_equal(np.float32([lp for _, lp in step.top]),
                                      np.float32(logits[s, order].astype(np.float64) - lse))
        np.testing.assert_array_equal(np.float32(step.logits), logits[s, order])
    expected = [EOS_BYTES] + [f"{b:02x}x".encode() for b in range(40)] + [b"\xc3", b"\xa9"]
    assert all(t.data == expected[t.id] for step in run.steps for t, _ in step.top)


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=12))
def test_json_piece_decodes_to_ds4_text(data):
    # a JSON parser reads ds4's escaping back as the UTF-8 text, or Latin-1 mojibake for a fragment
    text = json.loads(json_piece(data))
    try:
        assert text == data.decode("utf-8")
    except UnicodeDecodeError:
        assert text.encode("latin-1") == data
