"""Fitted tiny drafters (`synth --draft mtp|dspark --fit`, parity/spec/fit.py, gpu_engine/fit.py), tiny F32 trunk.

The fitted forwards are the torch engine's own draft heads (checked against `mtp_forward` / `dspark_round` on the
same weights); the fitted files, read back by the REFERENCE engine, draft the trunk's greedy tokens on the
trajectories they were fitted to far more often than the seeded random drafters; two fits with one seed write the
same bytes; refusals name what is wrong. Held-out prompts: measured and stated (docs/drafters.md), not the bar (the
heads do not learn the 6-layer random trunk's chaotic greedy map from 4 prompts).
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
from parity.spec.fit import dspark_agreement, fit_drafter, greedy_trajectory, seeded_prompts

OPTS = RunOptions(fp8_kv=False, fp4_indexer=False)
FORWARD_TOL = 1e-5   # trainable forwards vs the engine, rel-L2 per row (measured: 4.5e-7, chain 4.2e-7, DSpark 7.1e-7)
FITTED_MIN = 0.5     # issue 25: acceptance above 50 % (measured in these fits: 1.0 in every slot, all three heads)
RANDOM_MAX = 0.2     # the seeded random drafters, far lower (measured: MTP 0 of 128, chain 0 of 9, DSpark <= 1 of 12)


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """`v4parity synth --draft mtp --fit` through the CLI (--json): the trunk, the fitted file and the report."""
    d = tmp_path_factory.mktemp("fit")
    res = CliRunner().invoke(cli, ["synth", "-o", str(d / "tiny.gguf"), "--draft", "mtp", "--draft-layout", "ds4",
                                   "--draft-out", str(d / "fitted.gguf"), "--fit", "--fit-steps", "10", "--json"])
    assert res.exit_code == 0, res.output
    return d / "tiny.gguf", d / "fitted.gguf", json.loads(res.output)["draft"]["fit"]


def test_trainable_forward_is_the_engines_mtp_forward(tiny_f32, tmp_path):
    """Pairs from position 0 (`mtp_forward`), then a depth-3 chain after pair 12 fed the engine's own drafts."""
    from gpu_engine.attention import new_layer_cache
    from gpu_engine.engine import TorchEngine
    from gpu_engine.fit import TrainableWeights, drafter_plan, mtp_chain_logits, mtp_logits, mtp_rows

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
        got = mtp_logits(TrainableWeights(tensors), cfg, drafter_plan(cfg, 6), torch.from_numpy(X[:-1]),
                         torch.from_numpy(tokens[1:])).numpy()
    assert rel_l2(want, got).max() <= FORWARD_TOL
    np.testing.assert_array_equal(want.argmax(axis=1), got.argmax(axis=1))
    state = eng.new_mtp_state()
    last = eng.mtp_forward(state, X[:14], tokens[:14], 0, "prev")       # pairs 0..12
    chain = eng.mtp_chain(state, last, 13, 3)
    drafts = torch.tensor([int(np.argmax(last.logits[-1])), int(np.argmax(chain[0].logits[0]))])
    w, plan = TrainableWeights(tensors), drafter_plan(cfg, 6)
    with torch.no_grad():
        _, X1, keys = mtp_rows(w, cfg, plan, new_layer_cache(cfg, 0, torch.device("cpu"), torch.float32),
                               torch.from_numpy(X[:13]), torch.from_numpy(tokens[1:14]), 0)
        ours = mtp_chain_logits(w, cfg, plan, keys, X1, 12, drafts)
    for theirs, mine in zip(chain, ours, strict=True):
        assert rel_l2(theirs.logits, mine.numpy()).max() <= FORWARD_TOL


def test_fitted_drafter_drafts_what_the_trunk_decodes(fitted):
    _, _, fit = fitted
    agree = fit["agreement_per_slot"]
    assert fit["steps"] == 10                 # a quarter of the default 40 (time): measured 100 % fitted after 10
    assert agree["fitted_prompts"][0] > FITTED_MIN
    assert agree["random_drafter_fitted_prompts"][0] < RANDOM_MAX
    assert agree["heldout_prompts"][0] >= agree["random_drafter_heldout_prompts"][0]
    assert fit["counted"] == [4 * 32, 2 * 32]   # 4 fitted + 2 held-out prompts, 32 greedy tokens: one pair each


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
    a = fit_drafter(tiny_f32, tmp_path / "a.gguf", "mtp", seed=3, **kw).path.read_bytes()
    c = fit_drafter(tiny_f32, tmp_path / "c.gguf", "mtp", seed=4, **kw).path.read_bytes()
    assert a != c
    open_drafter(tmp_path / "a.gguf", Weights(tiny_f32).config)   # a valid drafter of the trunk
    given = fit_drafter(tiny_f32, tmp_path / "d.gguf", "mtp", seed=3, steps=2, decode=3, heldout=1,
                        train_prompts=seeded_prompts(3, 1, 8, 290, 1)).path.read_bytes()
    assert given == a   # a second fit with seed 3 (its prompt given as train_prompts): the same bytes
    kw = dict(steps=2, prompts=1, decode=5, heldout=1)
    e = fit_drafter(tiny_f32, tmp_path / "e.gguf", "dspark", seed=3, **kw).path.read_bytes()
    f = fit_drafter(tiny_f32, tmp_path / "f.gguf", "dspark", seed=3, **kw).path.read_bytes()
    assert e == f


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
    with pytest.raises(ParityError, match="'dflash' is not a mtp layout"):
        fit_drafter(tiny_f32, tmp_path / "x.gguf", "mtp", layout="dflash")
    with pytest.raises(ParityError, match=r"decode \(3\) must be >= the DSpark block size 5"):
        fit_drafter(tiny_f32, tmp_path / "x.gguf", "dspark", decode=3)
    res = CliRunner().invoke(cli, ["synth", "-o", str(tmp_path / "t.gguf"), "--fit"])
    assert res.exit_code == 2 and "--fit needs --draft, --draft-layout and --draft-out" in res.output


def test_trainable_dspark_rounds_are_the_engines_dspark_round(tiny_f32, tmp_path):
    """Five rounds batched in one call (block-diagonal keys, shifted positions) vs one engine round each."""
    from gpu_engine.engine import TorchEngine
    from gpu_engine.fit import FIXED, TrainableWeights, drafter_plan, dspark_logits

    path = synthesize_drafter(tmp_path / "rand.gguf", tiny_f32, "dspark", "ds4-dspark", seed=5)
    eng = TorchEngine(str(tiny_f32), OPTS, draft=str(path))
    t = greedy_trajectory(eng, np.random.default_rng(7).integers(2, 290, 20), 1, eng.drafter.config.target_layer_ids)
    dc, cfg, W = eng.drafter.config, eng.drafter.model_config, eng.config.window_size
    ps = [1, 3, 7, 12, 19]                       # rings of 2, 4, 8 (full), 8 and 8 rows
    want = [eng.dspark_round(eng.new_dspark_state(), t.taps[max(0, p - W + 1) : p + 1], max(0, p - W + 1),
                             int(t.tokens[p + 1])) for p in ps]
    trunk = Weights(tiny_f32)
    tensors = {k: torch.from_numpy(a) for k, (a, _) in random_drafter_weights(dc, cfg, 5).items()}
    tensors |= {k: torch.from_numpy(trunk.tensor(k)) for k in FIXED}
    blocks = torch.tensor([[int(t.tokens[p + 1])] + [dc.noise_token_id] * (dc.block_size - 1) for p in ps])
    with torch.no_grad():
        base, _ = dspark_logits(TrainableWeights(tensors), cfg, [drafter_plan(cfg, 6 + k) for k in range(3)],
                                [torch.from_numpy(t.taps[max(0, p - W + 1) : p + 1]) for p in ps], blocks)
    for r, got in zip(want, base.numpy(), strict=True):
        assert rel_l2(r.base_logits, got).max() <= FORWARD_TOL
        np.testing.assert_array_equal(r.base_logits.argmax(axis=1), got.argmax(axis=1))


def test_fitted_dspark_drafter_drafts_every_slot(tiny_f32, tmp_path):
    """A smaller DSpark fit than the default (1 prompt, 16 tokens, 40 steps: time), then an independent recount:
    the reference engine's rounds written one committed row at a time (incremental ring, as a speculative loop
    does) on fitted prompt 0."""
    from reference_cpu.engine import ReferenceEngine

    r = fit_drafter(tiny_f32, tmp_path / "dspark.gguf", "dspark", steps=40, prompts=1, decode=16, heldout=1)
    assert r.counted == (12, 12)                # rounds p = 7 .. 18 of 24-token trajectories
    assert min(r.agreement["fitted"]) > FITTED_MIN
    assert max(r.agreement["random_fitted"]) < RANDOM_MAX
    eng = ReferenceEngine(str(tiny_f32), OPTS, draft=str(r.path))
    dc = eng.drafter.config
    t = greedy_trajectory(eng, seeded_prompts(0, 1, 8, 290, 1)[0], 16, dc.target_layer_ids)
    state, hits = eng.new_dspark_state(), np.zeros(dc.block_size)
    eng.dspark_round(state, t.taps[:7], 0, int(t.tokens[7]))          # prefill rows 0..6 (its draft unused)
    for p in range(7, 19):
        got = eng.dspark_round(state, t.taps[p : p + 1], p, int(t.tokens[p + 1]))
        hits += got.drafts == t.argmax[p + 1 : p + 6]
    assert (hits / 12).min() > FITTED_MIN
    assert dspark_agreement(eng, [t], dc, eng.config.window_size)[0] == tuple(hits / 12)


def test_fitted_mtp_chain_drafts_depth_two(tiny_f32, tmp_path):
    """depth=2 fits the chained draft d_2 too (a small fit: 1 prompt, 10 tokens, 10 steps; measured 100 / 100 %)."""
    r = fit_drafter(tiny_f32, tmp_path / "chain.gguf", "mtp", depth=2, steps=10, prompts=1, decode=10, heldout=1)
    assert r.counted == (9, 9)                  # anchors c = 7 .. 15 of an 18-token trajectory
    assert min(r.agreement["fitted"]) > FITTED_MIN
    assert max(r.agreement["random_fitted"]) < RANDOM_MAX
