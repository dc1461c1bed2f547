"""Self-test of the bisector on the real engines (issue 6, acceptance).

* every fault of the torch engine is injected and `bisect` must name the layer where the fault first acts,
  the sub-op, and for `no-decode-compression` the decode step. The expected layer is NOT taken from the
  bisector: it is the first layer whose output (or visible compressed-row count) differs at all, bitwise,
  between the torch engine with and without the fault, both fed the reference's tokens; the expected decode
  step comes from the config's compression schedule;
* no fault -> "no defect" on every synthetic model, float32 and bfloat16, judged with the committed envelopes
  (traces/tiny-*.envelope.json; measured on a different, seeded calibration prompt);
* the committed envelope still matches a fresh measurement (`v4parity envelope`), so it is not stale;
* probe non-perturbation: capture on vs off gives bit-identical logits on both engines.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from gpu_engine.faults import FAULTS
from parity.bisect.bisect_report import summary
from parity.bisect.findings import InheritedDrift, SubopNoise
from parity.bisect.search import bisect, builtin_prompt
from parity.check.envelope import load_envelope
from parity.cli import cli
from parity.compare.verdict import Verdict
from parity.contract.checkpoints import block
from parity.contract.engine import RunOptions, load_engine
from parity.gguf.weights import Weights
from parity.tracing.runner import run_sequence

TRACES = Path(__file__).resolve().parent.parent / "traces"
DECODE = 4

# Sub-op where each fault first acts, by the meaning of the fault (docs/torch-engine.md, gpu_engine/faults.py).
SUBOP = {
    "compress-ratios-u32": {"rope"},            # wrong RoPE base/YaRN on the first compressed layer (q first)
    "no-decode-compression": {"compressor_rows"},
    # At layer 0 the H streams are identical copies of the embedding, so C X and C^T X differ only by the
    # Sinkhorn residual (~1e-5) in the attention HC_post; the first clear departure is the FFN HC_post.
    "comb-not-transposed": {"hc_attn_post", "hc_ffn_post"},
    "rope-split-halves": {"rope"},
    "sink-dropped": {"attention"},
    "router-bias-in-weights": {"router"},       # weights from biased scores; ids unchanged
    "swiglu-symmetric-clamp": {"routed_experts"},
    "fp8-kv-off": {"rope"},                     # rope_kv is the KV row after RoPE + FP8 simulation
    "indexer-ties-highest": {"indexer_selection"},
    "csa-halves-swapped": {"compressor_rows"},
    "compressed-row-visible-late": {"indexer_selection"},  # a late row is missing from the selectable set
}


def _flips(culprit) -> tuple:
    """The QAT code flips a NOISE culprit names (the flip sub-op's records)."""
    f = culprit.finding
    result = f.flip if isinstance(f, InheritedDrift) else f.result if isinstance(f, SubopNoise) else None
    return result.flips if result is not None else ()


def _envelope(model: Path, dtype: str):
    return load_envelope(TRACES / f"{model.stem}.envelope.json", dtype, Weights(model).identity())


@pytest.fixture(scope="module")
def ref_f32(tiny_f32):
    return load_engine("reference", str(tiny_f32), RunOptions())


@pytest.fixture(scope="module")
def prompt(ref_f32):
    return builtin_prompt(ref_f32.config.vocab_size, ref_f32.config.bos_token_id)


@pytest.fixture(scope="module")
def torch_clean_run(tiny_f32, ref_f32, prompt):
    ref = run_sequence(ref_f32, prompt, DECODE)
    forced = np.concatenate([c.tokens for c in ref])[len(prompt):]
    return forced, run_sequence(load_engine("torch", str(tiny_f32), RunOptions()), prompt, DECODE, forced=forced)


def _first_acting_layer(engine, prompt, forced, clean) -> int:
    """First layer whose output or count of visible compressed rows differs (bitwise) from the fault-free
    torch engine's."""
    got = run_sequence(engine, prompt, DECODE, forced=forced)
    for l in range(engine.config.n_layers):
        for a, b in zip(clean, got, strict=True):
            if not (np.array_equal(a.checkpoints[block(l)], b.checkpoints[block(l)])
                    and np.array_equal(a.diags[l].n_comp_visible, b.diags[l].n_comp_visible)):
                return l
    raise AssertionError(f"fault {engine.options.inject} does not act on this prompt")


@pytest.mark.parametrize("fault", FAULTS)
def test_injected_fault_is_named(tiny_f32, ref_f32, prompt, torch_clean_run, fault):
    cand = load_engine("torch", str(tiny_f32), RunOptions(inject=(fault,)))
    layer = _first_acting_layer(cand, prompt, *torch_clean_run)
    r = bisect(ref_f32, cand, prompt, DECODE, _envelope(tiny_f32, "float32"))
    c = r.culprit
    if fault == "indexer-ties-highest":
        # one exact indexer-score tie on this prompt: the round-off twins break it either way, so no layer departs
        # locally, as `check` calls the same run a TIE (tests/test_check.py): one judgement in both commands
        assert r.verdict is not Verdict.DEFECT and r.attribution[layer].kind != "local", summary(r)
        return
    assert r.verdict is Verdict.DEFECT, summary(r)
    assert c.layer == layer and c.subop in SUBOP[fault], summary(r)
    assert r.attribution[layer].kind == "local", summary(r)
    if fault == "no-decode-compression":
        cfg = ref_f32.config
        m = cfg.ratio(min(l for l in range(cfg.n_layers) if cfg.ratio(l) > 0))
        first_emit = next(t for t in range(len(prompt), len(prompt) + DECODE) if (t + 1) % m == 0)
        assert (c.position, c.decode_step) == (first_emit, first_emit - len(prompt)), summary(r)
    elif c.subop != "hc_attn_post":  # comb-not-transposed's attention HC_post departs only by the Sinkhorn
        assert c.decode_step is None and c.position < len(prompt), summary(r)  # residual, wherever it peaks
    assert r.runs["splice"] <= 1 + int(np.ceil(np.log2(ref_f32.config.n_layers)))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("quant", ["f32", "real-mix", "mxfp4"])
def test_no_fault_no_defect(request, quant, dtype):
    model = request.getfixturevalue({"f32": "tiny_f32", "real-mix": "tiny_realmix", "mxfp4": "tiny_mxfp4"}[quant])
    ref = load_engine("reference", str(model), RunOptions())
    cand = load_engine("torch", str(model), RunOptions(dtype=dtype))
    r = bisect(ref, cand, builtin_prompt(ref.config.vocab_size, ref.config.bos_token_id), DECODE,
               _envelope(model, dtype))
    # A clean engine is NO DEFECT, or NOISE when the free-running drift (inside the envelope) tips a QAT code
    # over; then the flip must be named. Which prompts flip depends on the libraries' round-off: with torch
    # 2.13 / numpy 2.4.6 the built-in prompt on tiny-f32 float32 rounds one FP8 KV code of layer 4 at position 15
    # the other way (rope_kv rel-L2 4e-4 vs floor 4.7e-7, every layer's local excess <= 0.13), which it did not
    # when the envelope was measured.
    assert r.verdict is Verdict.MATCH or (r.verdict is Verdict.NOISE and _flips(r.culprit)), summary(r)
    assert r.runs["full"] == 2
    assert r.runs["splice"] == 0 or r.verdict is Verdict.NOISE, summary(r)  # a clean run costs two runs, nothing else


@pytest.mark.parametrize("seed", [500, 502, 507, 508])
def test_clean_engine_is_never_called_defective_on_random_prompts(tiny_f32, ref_f32, seed):
    # random prompts often trigger legitimate FP8 code flips between the engines (3 of these 4 did when written):
    # the verdict must then be NOISE with the flip named, never DEFECT
    prompt = [0, *np.random.default_rng(seed).integers(2, ref_f32.config.vocab_size, 27).tolist()]
    r = bisect(ref_f32, load_engine("torch", str(tiny_f32), RunOptions()), prompt, DECODE,
               _envelope(tiny_f32, "float32"))
    assert r.verdict in (Verdict.MATCH, Verdict.NOISE), summary(r)


def test_bf16_drift_is_real_but_inside_its_own_envelope(tiny_f32):
    env32, env16 = _envelope(tiny_f32, "float32"), _envelope(tiny_f32, "bfloat16")
    last = block(Weights(tiny_f32).config.n_layers - 1)
    assert env16.checkpoints[last] > 100 * env32.checkpoints[last]  # measured separately, and much wider
    assert set(env16.components) == {"oracle", "rechunk", "dtype"}


def test_committed_envelope_is_not_stale(tiny_f32, tmp_path):
    out = tmp_path / "e.json"
    res = CliRunner().invoke(cli, ["envelope", "-m", str(tiny_f32), "-o", str(out)])
    assert res.exit_code == 0, res.output
    fresh, committed = load_envelope(out, "float32"), _envelope(tiny_f32, "float32")
    # Round-off floors move with summation order, not by an order of magnitude, unless an engine changed. A QAT
    # code flip in the calibration run inflates the floors after it (deep layers only), so compare the median
    # ratio over checkpoints. Regenerate: `v4parity envelope -m tiny-f32.gguf -o traces/tiny-f32.envelope.json`
    ratios = [(fresh.checkpoints[n] + 1e-12) / (f + 1e-12) for n, f in committed.checkpoints.items()]
    assert 0.1 <= float(np.median(ratios)) <= 10, sorted(ratios)


@pytest.mark.parametrize(("engine", "dtype"), [("reference", "float32"), ("torch", "float32"), ("torch", "bfloat16")])
def test_probe_non_perturbation(tiny_f32, prompt, engine, dtype):
    e = load_engine(engine, str(tiny_f32), RunOptions(dtype=dtype))
    on = run_sequence(e, prompt, 2, capture=True)
    off = run_sequence(e, prompt, 2, capture=False)
    assert all(np.array_equal(a.logits, b.logits) for a, b in zip(on, off, strict=True))
    assert all(a.captures for a in on) and not any(b.captures for b in off)


def test_routing_replay_uses_reference_experts(tiny_f32, ref_f32, prompt):
    from parity.bisect.search import ReplayRouter

    router = ReplayRouter()
    cand = load_engine("torch", str(tiny_f32), RunOptions(dtype="bfloat16", expert_override=router))
    r = bisect(ref_f32, cand, prompt, DECODE, _envelope(tiny_f32, "bfloat16"), replay=router)
    assert r.verdict is Verdict.MATCH, summary(r)
    got = run_sequence(cand, prompt, DECODE, forced=r.tokens[len(prompt):])
    ref = run_sequence(ref_f32, prompt, DECODE, forced=r.tokens[len(prompt):])
    for a, b in zip(ref, got, strict=True):
        assert all(np.array_equal(da.expert_ids, db.expert_ids) for da, db in zip(a.diags, b.diags, strict=True))


def test_cli_bisect_json_plot_and_exit_status(tiny_f32, tmp_path):
    env = TRACES / "tiny-f32.envelope.json"
    png = tmp_path / "b.png"
    res = CliRunner().invoke(cli, ["bisect", "-m", str(tiny_f32), "--envelope", str(env), "--inject",
                                   "sink-dropped", "--decode", "1", "--json", "--plot", str(png)])
    assert res.exit_code == 1, res.output
    doc = json.loads(res.stdout)
    assert (doc["verdict"], doc["culprit"]["layer"], doc["culprit"]["subop"]) == ("defect", 0, "attention")
    assert len(doc["trajectory"]["steps"]) == 2 and len(doc["attribution"]) == 6
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    res = CliRunner().invoke(cli, ["bisect", "-m", str(tiny_f32), "--envelope", str(env), "--tokens", "0 5 99999"])
    assert res.exit_code == 2 and "out of range" in res.output
