"""Acceptance: our engines' ds4-format dumps on the tiny model compare as MATCH; an injected fault diverges."""

from __future__ import annotations

import numpy as np
import pytest

from parity.contract.engine import RunOptions, load_engine
from parity.gguf.tokenizer import encode_chat, load_tokenizer
from parity.logprobs.compare import compare_runs
from parity.logprobs.io import read_ds4_dump, write_ds4_dump
from parity.tracing.runner import run_sequence

STEPS = 5
# Both engines compute in float32 on the CPU. Measured on this prompt: max |Δlogprob| over the listed tokens
# 1.4e-6..2.4e-6 per step (top-1: 2.3e-7..1.7e-6), reference top-1/top-2 gaps 0.15..0.55 nats; the fault moves
# step 0 by 0.45 nats. 2e-5 leaves 8x headroom over the rounding and is 1e4x below the fault.
F32_TOL = 2e-5


def dump(engine: str, options: RunOptions, model, prompt: list[int], path) -> None:
    """Greedy run, written as ds4 would: step 0 from the prefill's last row, step i from decode step i."""
    results = run_sequence(load_engine(engine, str(model), options), prompt, decode_steps=STEPS - 1)
    logits = np.stack([r.logits[-1] for r in results])  # one prefill chunk, then one row per decode step
    write_ds4_dump(path, logits=logits, selected=logits.argmax(axis=1).tolist(), prompt_tokens=len(prompt),
                   ctx=4096, top_k=20, vocab_tokens=load_tokenizer(model).tokens)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Tiny matrices: threads only add contention on a shared 2-core machine (10x slower measured)."""
    import torch
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def prompt(tiny_f32) -> list[int]:
    return encode_chat(str(tiny_f32), "the layer of the token then the logits")


@pytest.fixture(scope="module")
def reference_dump(tiny_f32, prompt, tmp_path_factory):
    path = tmp_path_factory.mktemp("dumps") / "reference.json"
    dump("reference", RunOptions(), tiny_f32, prompt, path)
    return path


def test_reference_and_torch_dumps_match_at_every_step(tiny_f32, prompt, reference_dump, tmp_path):
    dump("torch", RunOptions(), tiny_f32, prompt, tmp_path / "torch.json")
    ref, cand = read_ds4_dump(reference_dump), read_ds4_dump(tmp_path / "torch.json")
    assert len(ref.steps) == STEPS and ref.meta["prompt_tokens"] == len(prompt)
    cmp = compare_runs(ref, cand, tie_margin=F32_TOL, drift_tol=F32_TOL)
    assert [s.verdict for s in cmp.steps] == ["MATCH"] * STEPS, cmp.summary_line()
    assert all(s.jaccard == 1.0 and s.max_abs_dlogprob < F32_TOL for s in cmp.steps)
    assert cmp.ds4_test() is True and cmp.first_divergent_step() is None


def test_injected_fault_shows_the_first_divergent_step(tiny_f32, prompt, reference_dump, tmp_path):
    dump("torch", RunOptions(inject=("compress-ratios-u32",)), tiny_f32, prompt, tmp_path / "fault.json")
    cmp = compare_runs(read_ds4_dump(reference_dump), read_ds4_dump(tmp_path / "fault.json"),
                       tie_margin=F32_TOL, drift_tol=F32_TOL)
    first = cmp.first_divergent_step()
    assert first is not None, cmp.summary_line()
    assert cmp.steps[first].verdict in ("WRONG", "TIE-FLIP") and not cmp.steps[first].same_token
    assert all(s.same_token for s in cmp.steps[:first])
    assert all(s.verdict is None and "contexts differ" in s.note for s in cmp.steps[first + 1:])
    # the fault (every layer read as ratio 0) moves the logits long before it flips a token
    assert cmp.steps[0].max_abs_dlogprob > 100 * F32_TOL
    assert f"first divergent step: {first}" in cmp.summary_line()
