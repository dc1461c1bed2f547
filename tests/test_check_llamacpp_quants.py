"""`check` on llama.cpp runs of files quantized by llama.cpp's own quantizer (issue 22's acceptance: five prompts of
40 tokens + 8 decode steps per file type). Before the round-off null and op-level forcing every one
of these was DEFECT "unexplained"; each must be MATCH or NOISE with every cause a named benign one."""

from __future__ import annotations

import numpy as np
import pytest

from parity import api
from parity.check.check_report import headline
from parity.gguf.weights import Weights

FILE_TYPES = ("F16", "BF16", "Q8_0", "MXFP4_MOE", "Q4_K_M", "Q2_K")
BENIGN = {"act-quant-llamacpp", "act-quant-q8_0", "act-f16", "act-bf16", "rope-angle-recurrence", "tie",
          "routing-flip", "amplified-drift", "fp8-code-flip", "fp4-code-flip"}


def _prompt(model, seed: int) -> list[int]:
    cfg = Weights(model).config
    rng = np.random.default_rng(seed)
    return [cfg.bos_token_id, *(int(t) for t in rng.integers(2, cfg.vocab_size, 39))]


def _judge(model, tmp_path, seed: int):
    cap = tmp_path / "cap.npz"
    api.capture_llamacpp(model, _prompt(model, seed), cap, decode=8)
    return api.check(cap, model)


@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("file_type", FILE_TYPES)
def test_llamacpp_quantized_runs_are_never_defects(llamacpp_quantized, tmp_path, monkeypatch, file_type, seed):
    monkeypatch.chdir(tmp_path)      # no stored envelope found: judged from any directory
    r = _judge(llamacpp_quantized(file_type), tmp_path, seed=seed)
    assert r.verdict in ("MATCH", "NOISE"), headline(r)
    assert r.judged == "op-level", r.notes
    assert all(c.kind == "benign" and c.name in BENIGN for c in r.causes), r.causes
    assert r.verdict == "MATCH" or any(c.name.startswith("act-") for c in r.causes), r.causes


def test_llamacpp_run_of_our_own_real_mix_file_is_never_a_defect(tiny_realmix, tmp_path, monkeypatch):
    from requires import require

    require("llama_cpp")
    monkeypatch.chdir(tmp_path)
    r = _judge(tiny_realmix, tmp_path, seed=2)
    assert r.verdict in ("MATCH", "NOISE") and r.judged == "op-level", headline(r)
    assert all(c.kind == "benign" and c.name in BENIGN for c in r.causes), r.causes
