"""Fuzzing the logprob readers: the issue's two crashes, seeded mutations of every value in ds4 dumps and
official-API JSON (values of other types, huge integers, deep nesting, non-finite numbers), and line/byte
mutations of official.vec. Every input reads as a run or fails with a LogprobFileError naming the file."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from parity.logprobs.io import LogprobFileError, read_run

FIXTURES = Path(__file__).parent / "fixtures" / "logprobs"
N_JSON, N_VEC = 900, 300  # N_JSON over the three JSON fixtures
HUGE = int("9" * 400)


def _deep(n: int) -> str:
    return "[" * n + "]" * n


@pytest.mark.parametrize("edit", [
    lambda t: t.replace('"logprob":-0.2', f'"logprob":-{HUGE}', 1),
    lambda t: t.replace('"logprob":-0.2', '"logprob":' + "-" + "9" * 5000, 1),
    lambda t: t.replace('"ctx":4096', '"ctx":' + _deep(100000), 1),
    lambda t: t.replace('"logprob":-0.2', '"logprob":-Infinity', 1),
], ids=["400-digit-logprob", "5000-digit-logprob", "deep-nesting", "infinity"])
def test_the_issue_crashes_are_logprob_file_errors(tmp_path, edit):
    path = tmp_path / "d.json"
    path.write_text(edit((FIXTURES / "ref.ds4.json").read_text()))
    with pytest.raises(LogprobFileError, match=str(path).replace("\\", "\\\\")):
        read_run(path)


ODD = [None, True, False, 0, -1, 2**31, HUGE, -HUGE, 1.5, -1e308, float("nan"), float("inf"), "", "x", "\u00e4",
       [], [1, 2], [[[]]], {}, {"id": 1}, -0.0, 256, [256], [-1], "<｜｜end▁of▁sentence｜｜>"]


def _paths(doc, at=()):
    """Every (path) to a value inside a JSON document."""
    yield at
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _paths(v, (*at, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _paths(v, (*at, i))


def _set_at(doc, path, value):
    if not path:
        return value
    node = doc
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    return doc


def _dumps(doc) -> str:
    text = json.dumps(doc, allow_nan=True)
    return text if "DEEP" not in text else text.replace('"DEEP"', _deep(50000))


@pytest.mark.parametrize("fixture", ["ref.ds4.json", "greedy.official.json", "ranked.official.json"])
def test_json_value_mutations_read_or_are_refused(tmp_path, fixture):
    src = json.loads((FIXTURES / fixture).read_text())
    paths = list(_paths(src))
    rng = random.Random(fixture)
    outcomes = {"read": 0, "refused": 0}
    path = tmp_path / fixture
    for case in range(N_JSON // 3):
        doc = json.loads(json.dumps(src))
        for _ in range(rng.randint(1, 3)):
            p = rng.choice(paths)
            try:
                doc = _set_at(doc, p, rng.choice([*ODD, "DEEP"]))
            except (KeyError, IndexError, TypeError):
                continue  # the path went away with an earlier mutation
        path.write_text(_dumps(doc))
        try:
            read_run(path)
            outcomes["read"] += 1
        except LogprobFileError as e:
            assert str(path) in str(e), (case, str(e)[:200])
            outcomes["refused"] += 1
    assert outcomes["refused"] > N_JSON // 6
    print(fixture, outcomes)


def test_vec_line_and_byte_mutations_read_or_are_refused(tmp_path):
    src = (FIXTURES / "cases.vec").read_bytes()
    lines = src.split(b"\n")
    rng = random.Random(7)
    outcomes = {"read": 0, "refused": 0}
    path = tmp_path / "m.vec"
    for case in range(N_VEC):
        ls = list(lines)
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(len(ls))
            op = rng.randrange(5)
            words = ls[i].split(b" ")
            if op == 0:
                words[rng.randrange(len(words))] = rng.choice([b"-1", b"0", b"99999999999999999999", b"nan", b"inf",
                                                               b"zz", b"", b"1e999", str(HUGE).encode()])
                ls[i] = b" ".join(words)
            elif op == 1:
                del ls[i]
            elif op == 2:
                ls.insert(i, ls[i])
            elif op == 3:
                ls[i] = ls[i][: rng.randrange(len(ls[i]) + 1)]
            else:
                b = bytearray(ls[i] or b"x")
                b[rng.randrange(len(b))] = rng.randrange(256)
                ls[i] = bytes(b)
        path.write_bytes(b"\n".join(ls))
        try:
            read_run(f"{path}#match_case")
            outcomes["read"] += 1
        except LogprobFileError as e:
            assert str(path) in str(e), (case, str(e)[:200])
            outcomes["refused"] += 1
    assert outcomes["refused"] > N_VEC // 3
    print(outcomes)
