"""`check`'s plain-text report stays within 100 columns (wrapped by the printer, never in the data), and a
difference at the embedding is its own cause, never benign `amplified-drift` (issue 22, P5)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from reference_prompt import prompt_and_forced

from parity import api
from parity.cli import cli
from parity.contract.engine import RunOptions, load_engine

ENV_F32 = Path(__file__).resolve().parent.parent / "traces" / "tiny-f32.envelope.json"
DECODE = 4


@pytest.fixture(scope="module")
def prompt(tiny_f32):
    return prompt_and_forced(tiny_f32, DECODE)


def _trace(engine, model, prompt, path: Path) -> Path:
    p, forced = prompt
    api.save_trace(api.trace(engine, model, p, positions="all", full="all", decode=DECODE, forced=forced), path)
    return path


def _text(model, candidate: Path) -> tuple[int, list[str]]:
    res = CliRunner().invoke(cli, ["check", "-m", str(model), "--candidate", str(candidate),
                                   "--envelope", str(ENV_F32)])
    return res.exit_code, res.stdout.splitlines()


def _within_100_columns(lines: list[str]) -> None:
    assert max(len(line) for line in lines) <= 100, [line for line in lines if len(line) > 100]
    assert any(line.startswith("      ") for line in lines)    # a wrapped cause or note line's continuation


def _words(lines: list[str]) -> str:
    """The text with line breaks and indents as single spaces (wrapping splits at spaces only)."""
    return " ".join(" ".join(lines).split())


def test_a_noise_report_is_within_100_columns(tiny_f32, prompt, tmp_path):
    # the built-in prompt's one exact indexer tie broken the other way: NOISE, whose TIE cause line (pick lists,
    # evidence) runs past 100 columns unwrapped
    eng = load_engine("torch", str(tiny_f32), RunOptions(inject=("indexer-ties-highest",)))
    code, lines = _text(tiny_f32, _trace(eng, tiny_f32, prompt, tmp_path / "c.npz"))
    assert code == 0 and lines[0].startswith("NOISE"), lines[:3]
    _within_100_columns(lines)
    assert "cause (benign): tie at layer 4, indexer_selection: TIE: indexer selection at position 27: rows" \
        in _words(lines), lines


def test_an_embedding_difference_is_its_own_defect_within_100_columns(tiny_f32, prompt, tmp_path):
    # a candidate whose embedding lookup is off by 1e-3 (relative) and whose layers are correct on their inputs:
    # every layer is inside its twins teacher-forced, the free-running excess starts at `embed`. Not benign
    # amplified-drift: a DEFECT at the embedding, its own cause
    eng = load_engine("torch", str(tiny_f32), RunOptions())
    lookup = eng.embed
    eng.embed = lambda tokens: lookup(tokens) * np.float32(1 + 1e-3)
    code, lines = _text(tiny_f32, _trace(eng, tiny_f32, prompt, tmp_path / "e.npz"))
    assert code == 1, lines[:3]
    assert lines[0].startswith("DEFECT at the embedding (embed, before layer 0), prefill position 0"), lines[:3]
    _within_100_columns(lines)
    text = _words(lines)
    assert "cause (defect): embedding-differs at the embedding (embed, before layer 0): the candidate's " \
           "embedding of the same tokens differs" in text, lines
    assert "amplified-drift" not in text and text.count("cause (") == 1, lines
