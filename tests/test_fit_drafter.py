"""Fitted tiny MTP drafters (`synth --draft mtp --fit`, parity/spec/fit.py, gpu_engine/fit.py) on the tiny F32 trunk.

The fitted forward is the torch engine's own MTP head (checked against `mtp_forward` on the same weights); the
fitted file, read back by the REFERENCE engine, drafts the trunk's next-next token on the trajectories it was fitted
to far more often than the seeded random drafter; two fits with one seed write the same bytes; refusals name what
is wrong. Held-out prompts: measured and stated (docs/drafters.md), not the bar (a 1-layer head does not learn the
6-layer random trunk's chaotic greedy map from 4 prompts).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from parity.cli import cli
from parity.compare.metrics import rel_l2
from parity.contract.engine import RunOptions
from parity.contract.errors import ParityError
from parity.gguf.drafter import extend_config, open_drafter
from parity.gguf.synth_draft import random_drafter_weights, synthesize_drafter, tiny_drafter_config
from parity.gguf.weights import Weights
from parity.spec.fit import fit_mtp_drafter

OPTS = RunOptions(fp8_kv=False, fp4_indexer=False)
FORWARD_TOL = 1e-5      # trainable forward vs the engine's mtp_forward, rel-L2 per row (brief; measured: see test)
STEPS = 40              # the CLI default
FITTED_MIN = 0.5        # issue 25: acceptance above 50 % (measured: 1.0 on the fitted trajectories)
RANDOM_MAX = 0.05       # the random drafter (measured: 0.0, about 1/V = 0.3 % expected by chance)


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """`v4parity synth --draft mtp --fit` through the CLI (--json): the trunk, the fitted file and the report."""
    d = tmp_path_factory.mktemp("fit")
    res = CliRunner().invoke(cli, ["synth", "-o", str(d / "tiny.gguf"), "--draft", "mtp", "--draft-layout", "ds4",
                                   "--draft-out", str(d / "fitted.gguf"), "--fit", "--fit-steps", str(STEPS),
                                   "--json"])
    assert res.exit_code == 0, res.output
    return d / "tiny.gguf", d / "fitted.gguf", json.loads(res.output)["draft"]["fit"]


def test_trainable_forward_is_the_engines_mtp_forward(tiny_f32, tmp_path):
    from gpu_engine.engine import TorchEngine
    from gpu_engine.fit import TrainableWeights, mtp_logits, mtp_plan

    path = synthesize_drafter(tmp_path / "rand.gguf", tiny_f32, "mtp", "ds4-mtp", seed=5)
    eng = TorchEngine(str(tiny_f32), OPTS, draft=str(path))
    tokens = np.random.default_rng(7).integers(2, 290, 20)
    state, X = eng.new_state(), eng.embed(tokens)
    for layer in range(eng.config.n_layers):
        X = eng.forward_layer(state, layer, X, tokens, 0).carrier
    want = eng.mtp_forward(eng.new_mtp_state(), X, tokens, 0, "prev").logits
    trunk, cfg = Weights(tiny_f32), eng.drafter.model_config
    dc = tiny_drafter_config("mtp", "ds4-mtp", trunk.config)
    tensors = {k: torch.from_numpy(a) for k, (a, _) in random_drafter_weights(dc, cfg, 5).items()}
    tensors |= {k: torch.from_numpy(trunk.tensor(k)) for k in ("token_embd.weight", "output.weight")}
    with torch.no_grad():
        got = mtp_logits(TrainableWeights(tensors), cfg, mtp_plan(cfg, 6), torch.from_numpy(X[:-1]),
                         torch.from_numpy(tokens[1:])).numpy()
    assert rel_l2(want, got).max() <= FORWARD_TOL
    np.testing.assert_array_equal(want.argmax(axis=1), got.argmax(axis=1))


def test_fitted_drafter_drafts_what_the_trunk_decodes(fitted):
    _, _, fit = fitted
    agree = fit["agreement"]
    assert agree["fitted_prompts"] > FITTED_MIN
    assert agree["random_drafter_fitted_prompts"] < RANDOM_MAX
    assert agree["heldout_prompts"] >= agree["random_drafter_heldout_prompts"]
    assert fit["pairs"] == [4 * 32, 2 * 32]   # 4 fitted + 2 held-out prompts, 32 greedy tokens: one pair each


def test_the_reference_engine_reads_the_fitted_file_as_fitted(fitted):
    """An independent count on fitted prompt 0: the reference engine's own greedy run and mtp_forward."""
    from reference_cpu.engine import ReferenceEngine

    trunk, path, _ = fitted
    eng = ReferenceEngine(str(trunk), OPTS, draft=str(path))
    prompt = np.random.default_rng([0, 1]).integers(2, 290, 8)   # the first seeded training prompt (seed 0)
    tokens, state = list(prompt), eng.new_state()
    X, rows, logits = eng.embed(prompt), [], None
    for step in range(33):
        for layer in range(eng.config.n_layers):
            X = eng.forward_layer(state, layer, X, np.array(tokens[-len(X):]), len(tokens) - len(X)).carrier
        rows.append(X)
        logits = eng.head(X)[1]
        if step < 32:
            tokens.append(int(np.argmax(logits[-1])))
            X = eng.embed(np.array(tokens[-1:]))
    carriers = np.concatenate(rows)
    trunk_next = np.append(np.array(tokens[1:]), np.argmax(logits[-1]))   # argmax at every row
    drafts = eng.mtp_forward(eng.new_mtp_state(), carriers, np.array(tokens), 0, "prev").logits.argmax(axis=1)
    assert (drafts[7:] == trunk_next[8:]).mean() > FITTED_MIN


def test_one_seed_one_file(tiny_f32, tmp_path):
    kw = dict(steps=2, prompts=1, decode=3, heldout=1)
    a = fit_mtp_drafter(tiny_f32, tmp_path / "a.gguf", seed=3, **kw).path.read_bytes()
    b = fit_mtp_drafter(tiny_f32, tmp_path / "b.gguf", seed=3, **kw).path.read_bytes()
    c = fit_mtp_drafter(tiny_f32, tmp_path / "c.gguf", seed=4, **kw).path.read_bytes()
    assert a == b
    assert a != c
    open_drafter(tmp_path / "a.gguf", Weights(tiny_f32).config)   # a valid drafter of the trunk


def test_refusals_name_the_problem(tiny_f32, tmp_path):
    trunk = Weights(tiny_f32)
    dc = tiny_drafter_config("mtp", "ds4-mtp", trunk.config)
    good = {k: a for k, (a, _) in random_drafter_weights(dc, extend_config(trunk.config, 1), 0).items()}
    with pytest.raises(ValueError, match=r"missing \['mtp.norm.weight'\]"):
        synthesize_drafter(tmp_path / "x.gguf", tiny_f32, "mtp", "ds4-mtp", weights={
            k: v for k, v in good.items() if k != "mtp.norm.weight"})
    with pytest.raises(ValueError, match="'mtp.e_proj.weight' of shape \\(256, 255\\)"):
        synthesize_drafter(tmp_path / "x.gguf", tiny_f32, "mtp", "ds4-mtp",
                           weights=good | {"mtp.e_proj.weight": good["mtp.e_proj.weight"][:, 1:]})
    with pytest.raises(ParityError, match="'dflash' is not an MTP layout"):
        fit_mtp_drafter(tiny_f32, tmp_path / "x.gguf", layout="dflash")
    res = CliRunner().invoke(cli, ["synth", "-o", str(tmp_path / "t.gguf"), "--draft", "dspark", "--draft-layout",
                                   "ds4", "--draft-out", str(tmp_path / "d.gguf"), "--fit"])
    assert res.exit_code == 2 and "--fit fits an MTP drafter" in res.output
