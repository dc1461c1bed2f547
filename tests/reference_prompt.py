"""The built-in check prompt and the reference's greedy continuation of it, for tests that make candidate traces."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from parity.bisect.search import builtin_prompt
from parity.contract.engine import RunOptions, load_engine
from parity.tracing.runner import run_sequence


def prompt_and_forced(model: Path, decode: int, length: int | None = None) -> tuple[list[int], list[int]]:
    """(the built-in prompt, cut to `length` tokens when given; the reference's `decode` greedy tokens after it)."""
    ref = load_engine("reference", str(model), RunOptions())
    prompt = builtin_prompt(ref.config.vocab_size, ref.config.bos_token_id)[:length]
    forced = [int(t) for t in np.concatenate([c.tokens for c in run_sequence(ref, prompt, decode)])[len(prompt):]]
    return prompt, forced
