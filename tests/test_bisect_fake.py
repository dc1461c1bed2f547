"""Bisector logic on a small NumPy engine with a switchable defect at a known layer and sub-op.

The fake engine implements the `Engine` protocol with every SUBOPS capture (a toy layer with a KV cache,
compressor rows every `ratio` tokens, an indexer, attention, a top-K router); `defect=(layer, subop)`
scales that sub-op's output by 1 + DELTA in that layer only, so the expected answer is known exactly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

import numpy as np
import pytest

from parity.bisect.bisect_report import summary
from parity.bisect.findings import SubopDeparts
from parity.bisect.search import bisect
from parity.bisect.trajectory import classify_steps
from parity.check.envelope import gate, load_envelope, measure_envelope, save_envelope
from parity.check.subop_evidence import OpDeparts, OpStructural
from parity.check.subops import is_code_flip
from parity.compare.metrics import rel_l2
from parity.compare.verdict import StepVerdict, Verdict
from parity.contract.checkpoints import SUBOP_NAMES
from parity.contract.engine import LayerDiag, LayerOutput, RunOptions
from parity.contract.errors import ParityError

DELTA = 0.01
H, D, NH, HD, E, K, TOPK, V = 2, 8, 2, 6, 4, 2, 2, 16
RATIOS = (0, 4, 0, 4)


@dataclass(frozen=True)
class FakeConfig:
    n_layers: int = len(RATIOS)
    vocab_size: int = V

    def ratio(self, layer: int) -> int:
        return RATIOS[layer]


def _fp8(v: np.ndarray) -> np.ndarray:
    """Round to 3 mantissa bits (e4m3-like grid, no clamp)."""
    m = np.maximum(np.abs(v), 1e-30)
    q = np.exp2(np.floor(np.log2(m)) - 3)
    return np.round(v / q) * q


def _rms(x: np.ndarray) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6)


class FakeEngine:
    """Toy V4-shaped engine. dtype float32 | float64 | bfloat16 (float32 with bf16-rounded layer outputs)."""

    version = "0"

    def __init__(self, options: RunOptions | None = None, defect: tuple | None = None, name: str = "fake",
                 twin: int | None = None):
        options = options or RunOptions()
        self.name, self.options, self.defect, self.config = name, options, defect, FakeConfig()
        self.twin = twin   # a round-off twin: every sub-op output times 1 + r * 4 ulps, r seeded per (twin, op)
        self.dt = np.float64 if options.dtype == "float64" else np.float32
        rng = np.random.default_rng(7)
        w = lambda *s: rng.standard_normal(s) / np.sqrt(s[-2] if len(s) > 1 else 1)  # noqa: E731
        self.embed_t = rng.standard_normal((V, D))
        self.layers = [dict(wq=w(D, NH * HD), wkv=w(D, HD), wir=w(HD, 4), wiq=w(D, 4), wo=w(NH * HD, D),
                            wr=w(D, E) * 3, we=w(E, D, D), ws=w(D, D)) for _ in RATIOS]
        self.w_out = w(D, V)

    def _hit(self, layer: int, sub: str) -> bool:
        return self.defect is not None and self.defect[:2] == (layer, sub)

    def roundoff_twin(self, seed: int) -> FakeEngine:
        return FakeEngine(self.options, self.defect, self.name, twin=seed)

    def _out(self, layer: int, sub: str, x: np.ndarray) -> np.ndarray:
        x = x.astype(self.dt)
        if self.twin is not None:
            rng = np.random.default_rng([self.twin, layer, *sub.encode()])
            x = x * (1 + rng.uniform(-1, 1, x.shape) * 4 * 2.0**-24).astype(self.dt)
        hit = self._hit(layer, sub) and len(self.defect) == 2
        return x + self.dt(DELTA) * np.roll(x, 1, axis=-1) if hit else x

    def new_state(self) -> dict:
        return {l: {"kv": [], "comp": []} for l in range(len(RATIOS))}

    def embed(self, tokens):
        return np.repeat(self.embed_t[tokens][:, None, :], H, axis=1).astype(self.dt)

    def head(self, carrier):
        f = _rms(carrier.mean(1)).astype(self.dt)
        if self.defect == ("head",):
            f = f + self.dt(DELTA) * np.roll(f, 1, axis=-1)
        return f, (f @ self.w_out.astype(self.dt)).astype(self.dt)

    def forward_layer(self, state, layer, carrier, tokens, start_pos, capture=False):
        p, st, m, n = self.layers[layer], state[layer], RATIOS[layer], len(tokens)
        W = {k: v.astype(self.dt) for k, v in p.items()}
        pos = start_pos + np.arange(n)
        c: dict[str, np.ndarray] = {}
        X = carrier.astype(self.dt)
        c["hc_attn_pre"] = u = self._out(layer, "hc_attn_pre", X.mean(1))
        c["attn_norm"] = x = self._out(layer, "attn_norm", _rms(u))
        c["q_path"] = q = self._out(layer, "q_path", (x @ W["wq"]).reshape(n, NH, HD))
        c["kv_latent"] = kv = self._out(layer, "kv_latent", x @ W["wkv"])
        rot = np.cos(0.3 * pos).astype(self.dt)
        c["rope_q"] = rq = self._out(layer, "rope", q * rot[:, None, None])
        rkv = kv * rot[:, None]
        c["rope_kv"] = rkv = self._out(layer, "rope", _fp8(rkv) if self.options.fp8_kv else rkv)
        if self.defect == (layer, "rope", "flip") and 5 in pos:   # one legitimate-looking FP8 code flip
            i = int(np.flatnonzero(pos == 5)[0])
            rkv[i, 0] += np.exp2(np.floor(np.log2(abs(rkv[i, 0]))) - 3)
        for t, row in zip(pos, rkv, strict=True):
            st["kv"].append(row)
            skip = self._hit(layer, "compressor_rows") and self.defect[2:] == ("decode",) and n == 1
            if m and (t + 1) % m == 0 and not skip:
                st["comp"].append(np.mean(st["kv"][t + 1 - m:t + 1], axis=0))
        comp = self._out(layer, "compressor_rows", np.array(st["comp"]).reshape(-1, HD))
        c["comp_rows"], c["index_rows"] = comp, (comp @ W["wir"]).astype(self.dt)
        iq = x @ W["wiq"]
        sel = -np.ones((n, TOPK), dtype=np.int64)
        for i, t in enumerate(pos):
            vis = [j for j in range(len(comp)) if m and (j + 1) * m <= t + 1]
            if vis:
                s = c["index_rows"][vis] @ iq[i]
                order = np.lexsort((vis, -s))[:TOPK]
                sel[i, :len(order)] = np.array(vis)[order]
        if self._hit(layer, "indexer_selection"):
            sel = np.where(sel >= 0, sel[:, ::-1], sel)
            sel[sel >= 0] = np.maximum(sel[sel >= 0] - 1, 0)
        c["index_sel"] = sel
        heads = np.zeros((n, NH, HD), self.dt)
        kv_all = np.array(st["kv"])
        for i, t in enumerate(pos):
            keys = np.concatenate([kv_all[: t + 1], comp[sel[i][sel[i] >= 0]]])
            s = rq[i] @ keys.T / np.sqrt(HD)
            pr = np.exp(s - s.max(1, keepdims=True))
            heads[i] = (pr / pr.sum(1, keepdims=True)) @ keys
        c["attn_heads"] = heads = self._out(layer, "attention", heads)
        c["attn_out"] = a = self._out(layer, "output_proj", heads.reshape(n, -1) @ W["wo"])
        c["hc_attn_post"] = Y = self._out(layer, "hc_attn_post", 0.8 * X + a[:, None, :])
        c["hc_ffn_pre"] = v = self._out(layer, "hc_ffn_pre", Y.mean(1))
        c["ffn_norm"] = y = self._out(layer, "ffn_norm", _rms(v))
        s = y @ W["wr"]
        srt = -np.sort(-s, axis=1)
        ids = np.argsort(-s, axis=1, kind="stable")[:, :K]
        if self._hit(layer, "router"):
            ids = np.argsort(s, axis=1, kind="stable")[:, :K]
        if self.options.expert_override is not None:
            ids = np.asarray(self.options.expert_override(layer, start_pos, n))
        sw = np.take_along_axis(s, ids, 1)
        wts = np.exp(sw) / np.exp(sw).sum(1, keepdims=True)
        c["expert_ids"], c["expert_weights"] = ids, wts.astype(self.dt)
        routed = sum(wts[:, k:k + 1] * np.tanh(np.einsum("nd,nde->ne", y, W["we"][ids[:, k]])) for k in range(K))
        c["routed_out"] = routed = self._out(layer, "routed_experts", routed)
        c["shared_out"] = sh = self._out(layer, "shared_expert", np.tanh(y @ W["ws"]))
        Xn = self._out(layer, "hc_ffn_post", 0.8 * Y + (routed + sh)[:, None, :])
        c["hc_ffn_post"] = Xn
        if self.options.dtype == "bfloat16":
            Xn = _bf16(Xn)
        diag = LayerDiag((u, u, u), (v, v, v), ids, wts, srt[:, K - 1] - srt[:, K],
                         np.array([sum((j + 1) * m <= t + 1 for j in range(len(comp))) if m else 0 for t in pos]),
                         sel if m else None)
        return LayerOutput(Y, Xn, diag, c if capture else {})


def _bf16(x: np.ndarray) -> np.ndarray:
    b = np.asarray(x, np.float32).view(np.uint32)
    b = ((b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000).astype(np.uint32)
    return b.view(np.float32)


PROMPT = [0, 5, 3, 9, 12, 7, 1, 4, 14, 2, 8, 6, 11, 13]


@pytest.fixture(scope="module")
def env32():
    return measure_envelope(FakeEngine(), FakeEngine(RunOptions(dtype="float64")), FakeEngine(), PROMPT[:10], 3)


@pytest.fixture(scope="module")
def envbf16():
    return measure_envelope(FakeEngine(), FakeEngine(RunOptions(dtype="float64")),
                            FakeEngine(RunOptions(dtype="bfloat16")), PROMPT[:10], 3, cand_f32=FakeEngine())


def test_rel_l2_hand_computed():
    ref = np.array([[3.0, 4.0], [0.0, 0.0], [1.0, 0.0], [0.0, 0.0]])
    got = np.array([[3.0, 4.5], [0.0, 0.0], [np.nan, 0.0], [0.0, 1.0]])
    assert np.allclose(rel_l2(ref, got), [0.1, 0.0, np.inf, np.inf])  # NaN and a zero reference row: inf
    assert gate(2e-6, 1e-7, k=10, eps=1e-6) == pytest.approx(1.0)


def test_envelope_is_measured_and_round_trips(env32, envbf16, tmp_path):
    assert env32.checkpoints["blk.3"] > 0            # float32 vs float64 drift measured, not assumed
    assert envbf16.checkpoints["blk.3"] > 30 * env32.checkpoints["blk.3"]  # bf16 floor measured separately
    assert set(envbf16.components) == {"oracle", "rechunk", "dtype"}
    path = tmp_path / "m.envelope.json"
    model = {"file": "m.gguf", "size": 100, "header_sha256": "ab" * 16}
    save_envelope(path, env32, model)
    save_envelope(path, envbf16, model)
    back = load_envelope(path, "bfloat16", model)
    assert back == envbf16
    assert load_envelope(path, "bfloat16", model | {"file": "renamed.gguf"}) == envbf16  # identity, not file name
    with pytest.raises(ParityError, match="measured on model"):
        load_envelope(path, "float32", model | {"header_sha256": "cd" * 16})
    doc = json.loads(path.read_text())
    del doc["dtypes"]["float32"]["k"]                   # a hand-edited section never falls back to the default k
    path.write_text(json.dumps(doc))
    with pytest.raises(ParityError, match=r"float32 section has missing fields \['k'\]"):
        load_envelope(path, "float32", model)
    with pytest.raises(ParityError, match="fp8_kv"):   # an envelope only judges runs with its QAT simulations
        bisect(FakeEngine(), FakeEngine(RunOptions(fp8_kv=False)), PROMPT, 0, env32)
    with pytest.raises(ParityError, match="no router-margin drift for layer 3"):   # never a silent 0
        bisect(FakeEngine(), FakeEngine(), PROMPT, 0, replace(env32, router_margin={"0": 0.0, "1": 0.0, "2": 0.0}))


def test_no_defect_float32_and_bf16(env32, envbf16):
    r = bisect(FakeEngine(), FakeEngine(), PROMPT, 4, env32)
    assert r.verdict is Verdict.MATCH, summary(r)
    rb = bisect(FakeEngine(), FakeEngine(RunOptions(dtype="bfloat16")), PROMPT, 4, envbf16)
    assert rb.verdict is Verdict.MATCH, summary(rb)
    # and bf16 judged against the float32 envelope is not "clean": the envelopes differ for a reason
    assert max(bisect(FakeEngine(), FakeEngine(RunOptions(dtype="bfloat16")), PROMPT, 4, env32).max_excess.values()) > 1


CASES = [(0, "hc_attn_pre"), (1, "attn_norm"), (2, "q_path"), (1, "kv_latent"), (3, "rope"),
         (1, "compressor_rows"), (3, "indexer_selection"), (2, "attention"), (0, "output_proj"),
         (1, "hc_attn_post"), (2, "hc_ffn_pre"), (3, "ffn_norm"), (0, "router"), (1, "routed_experts"),
         (2, "shared_expert"), (3, "hc_ffn_post")]


def test_cases_cover_every_subop():
    assert {s for _, s in CASES} == set(SUBOP_NAMES)


@pytest.mark.parametrize(("layer", "sub"), CASES, ids=[f"{s}@{l}" for l, s in CASES])
def test_defect_named_at_layer_and_subop(env32, layer, sub):
    r = bisect(FakeEngine(), FakeEngine(defect=(layer, sub)), PROMPT, 2, env32)
    assert r.verdict is Verdict.DEFECT, summary(r)
    assert (r.culprit.layer, r.culprit.subop) == (layer, sub), summary(r)
    assert r.attribution[layer].kind == "local"
    assert all(a.kind == "clean" for a in r.attribution[:layer])
    assert all(a.kind == "propagated" for a in r.attribution[layer + 1:])   # drift carried, not made, downstream
    assert r.runs["splice"] <= 1 + int(np.ceil(np.log2(len(RATIOS))))


def test_head_defect_is_named_head(env32):
    r = bisect(FakeEngine(), FakeEngine(defect=("head",)), PROMPT, 1, env32)
    assert (r.verdict, r.culprit.layer) == (Verdict.DEFECT, "head"), summary(r)
    assert all(a.kind == "clean" for a in r.attribution)


def test_decode_only_defect_names_the_decode_step(env32):
    # prompt of 14 tokens (positions 0..13); layer 1 (ratio 4) should emit at t=15 = decode step 1
    r = bisect(FakeEngine(), FakeEngine(defect=(1, "compressor_rows", "decode")), PROMPT, 4, env32)
    assert (r.culprit.layer, r.culprit.subop, r.culprit.position, r.culprit.decode_step) == \
        (1, "compressor_rows", 15, 1), summary(r)
    assert "decode step 1" in summary(r)


def test_an_isolated_code_step_no_round_off_twin_makes_is_a_defect(env32):
    # one FP8 code moved by a quantum at position 5 where no value sits on a rounding boundary: the envelope's
    # isolated-flip rule excused it as noise; by the round-off null (`check`'s judgement) no twin makes that
    # step, so the layer departs (issue 22 point 8). In rope it is one cell of rope_kv's 16 (not significant
    # alone: one cell outside all 19 twins is chance at 1 in 20 a cell); the attention that reads the moved KV row from
    # position 5 on is the first op whose cells depart significantly, from position 5
    r = bisect(FakeEngine(), FakeEngine(defect=(1, "rope", "flip")), PROMPT, 2, env32)
    assert r.verdict is Verdict.DEFECT, summary(r)
    assert (r.culprit.layer, r.culprit.subop, r.culprit.position) == (1, "attention", 5), summary(r)
    assert _null_test(r).exceed == 11 and (_null_test(r).cells, _null_test(r).twins) == (16, 19), summary(r)
    assert next(s for s in r.subops if s.name == "rope").status != "defect"


def test_routing_flip_is_judged_by_the_twins_not_by_the_envelopes_router_margin(env32):
    # the fake "router" defect picks the K lowest scores: a flip at margins of O(1), which no round-off twin makes
    r = bisect(FakeEngine(), FakeEngine(defect=(0, "router")), PROMPT[:6], 0, env32)
    assert r.verdict is Verdict.DEFECT and r.culprit.subop == "router", summary(r)
    assert isinstance(_culprit_evidence(r), OpStructural), summary(r)   # a pick no round-off twin makes
    # an envelope whose router-margin noise covers those margins calls the free-running flips noise, but the
    # drill-down's verdict is the null's (`check`'s), so it stays a defect at the router
    loose = replace(env32, router_margin={**env32.router_margin, "0": 100.0})
    r = bisect(FakeEngine(), FakeEngine(defect=(0, "router")), PROMPT[:6], 0, loose)
    assert r.routing[0].noise_flips == r.routing[0].flips > 0, summary(r)
    assert r.verdict is Verdict.DEFECT and r.culprit.subop == "router", summary(r)


def test_routing_replay_removes_router_defect(env32):
    ref = FakeEngine()
    bad = FakeEngine(defect=(0, "router"))
    base = bisect(ref, bad, PROMPT[:6], 0, env32)
    assert base.culprit.subop == "router"
    assert base.routing[0].flips == 6 and base.routing[0].noise_flips == 0 and base.routing[0].expert_overlap_min < 1
    from parity.tracing.runner import run_sequence
    diags = run_sequence(ref, PROMPT[:6]).pop().diags
    replay = FakeEngine(RunOptions(expert_override=lambda l, s, n: diags[l].expert_ids[s:s + n]),
                        defect=(0, "router"))
    again = bisect(ref, replay, PROMPT[:6], 0, env32)
    assert again.verdict is Verdict.MATCH and all(r.flips == 0 for r in again.routing)


def test_missing_capture_and_nan_are_clear_errors(env32):
    class NoCaptures(FakeEngine):
        def forward_layer(self, *a, **kw):
            out = super().forward_layer(*a, **kw)
            out.captures.pop("attn_out", None)
            return out

    with pytest.raises(ParityError, match="did not fill capture 'attn_out' at layer 1"):
        bisect(FakeEngine(), NoCaptures(defect=(1, "output_proj")), PROMPT, 0, env32)
    with pytest.raises(ParityError, match="benign run did not fill capture 'attn_out' at layer 0"):
        measure_envelope(FakeEngine(), NoCaptures(RunOptions(dtype="float64")), FakeEngine(), PROMPT[:10], 3)

    class NaNAttention(FakeEngine):
        def forward_layer(self, state, layer, *a, **kw):
            out = super().forward_layer(state, layer, *a, **kw)
            if layer == 2:
                out.carrier[3, 0, 0] = np.nan
                if out.captures:
                    out.captures["hc_ffn_post"][3, 0, 0] = np.nan
            return out

    r = bisect(FakeEngine(), NaNAttention(), PROMPT, 0, env32)
    assert (r.culprit.layer, r.culprit.subop, r.culprit.position) == (2, "hc_ffn_post", 3), summary(r)
    assert _null_test(r).nonfinite == 1, summary(r)   # the null: a NaN cell is outside every twin


def _culprit_evidence(r):
    """The one evidence record of the culprit sub-op the drill-down named."""
    assert isinstance(r.culprit.finding, SubopDeparts), r.culprit
    (e,) = r.culprit.finding.result.evidence
    return e


def _null_test(r):
    """The culprit sub-op's round-off null test."""
    e = _culprit_evidence(r)
    assert isinstance(e, OpDeparts), e
    return e.test


def test_code_flip_recognised_and_dense_rounding_is_not():
    a = _fp8(np.linspace(0.3, 2.0, 64))
    b = a.copy()
    b[10] = a[10] + np.exp2(np.floor(np.log2(a[10])) - 3)   # one code up
    assert is_code_flip(a, b, 1e-5, 3)
    assert not is_code_flip(a, np.linspace(0.3, 2.0, 64), 1e-5, 3)  # FP8 simulation skipped: every element off
    c = a.copy()
    c[10] = a[10] * 1.5                                         # far more than one code
    assert not is_code_flip(a, c, 1e-5, 3)


def test_tie_case_is_tie_flip_not_wrong(env32):
    ref = np.array([[5.0, 5.0 + 1e-7, -1.0, 0.0]])          # two logits equal within the envelope
    cand = np.array([[5.0 + 2e-7, 5.0, -1.0, 0.0]])
    rec = classify_steps(ref, cand, 0, env32)[0]
    assert rec.verdict is StepVerdict.TIE_FLIP and rec.ref_margin <= rec.tie_margin
    wide = classify_steps(np.array([[5.0, 5.3, -1.0, 0.0]]), np.array([[5.3, 5.0, -1.0, 0.0]]), 0, env32)[0]
    assert wide.verdict is StepVerdict.WRONG and wide.ref_margin == pytest.approx(0.3)
    # a pick outside the reference's top-5 is WRONG, with the gap to its 5th entry as the (lower-bound) margin
    far = classify_steps(np.array([[5.0, 4.0, 3.0, 2.0, 1.5, 1.0]]), np.array([[0.0, 0.0, 0.0, 0.0, 0.0, 9.0]]),
                         0, env32)[0]
    assert far.verdict is StepVerdict.WRONG and far.ref_margin == pytest.approx(3.5)


def test_trajectory_continues_after_tie_flip_and_maps_steps_to_layers(env32):
    from parity.bisect.trajectory import trajectory

    n_prompt, L = 3, len(RATIOS)
    ref = np.zeros((5, 4))
    ref[:, 0] = 5.0
    cand = ref.copy()
    ref[3, 1] = 5.0 - 1e-7           # step 1: candidate takes the runner-up inside the tie margin
    cand[3, 1] = 5.0 + 1e-7
    ref[4, 2] = 4.0                  # step 2: candidate picks a token the reference put 1.0 below
    cand[4, 2] = 6.0
    errs = {f"blk.{l}": np.zeros(5) for l in range(L)}
    errs["blk.1"][4] = 1.0           # ... explained by an excursion of layer 1 at that position
    t = trajectory(ref, cand, errs, n_prompt, L, env32)
    assert [s.verdict.value for s in t.steps] == ["MATCH", "TIE-FLIP", "WRONG"]
    assert t.first_divergent.step == 1 and t.first_wrong.step == 2
    assert t.divergence_rate == pytest.approx(2 / 3)
    assert t.first_layer_at(1) is None and t.first_layer_at(2) == 1
    assert t.step_layer_excess.shape == (3, L)


def test_probe_non_perturbation():
    from parity.tracing.runner import run_sequence
    for eng in (FakeEngine(), FakeEngine(RunOptions(dtype="bfloat16"))):
        on = run_sequence(eng, PROMPT, 2, capture=True)
        off = run_sequence(eng, PROMPT, 2, capture=False)
        assert all(np.array_equal(a.logits, b.logits) for a, b in zip(on, off, strict=True))
