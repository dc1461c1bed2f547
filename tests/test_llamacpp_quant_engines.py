"""Files written by llama.cpp's own quantizer at the common file types (their per-tensor type mixes: Q4_K, Q5_0,
Q6_K, Q3_K, Q5_K, Q5_1, IQ4_XS, IQ4_NL, Q4_0, ...) run in both engines, which agree to float32 round-off; and with
act_quant=llamacpp the reference reproduces llama.cpp's own op outputs on llama.cpp's own inputs (issue 23)."""

from __future__ import annotations

import numpy as np
import pytest

from parity import api
from parity.check.check import candidate_chunks, reference_options, replay
from parity.check.inputs import candidate_subops, load_candidate
from parity.check.opforce import forced_run, op_cells
from parity.compare.metrics import rel_l2
from parity.contract.engine import RunOptions, load_engine
from parity.gguf.weights import Weights
from parity.tracing.runner import run_sequence, stack

FILE_TYPES = ("Q4_K_M", "Q2_K", "Q3_K_M", "Q5_K_M", "Q6_K", "IQ4_XS", "Q8_0")
TOKENS = [0, 243, 77, 33, 87, 12, 190, 45, 8, 230, 61, 77, 150, 3, 99, 201, 17, 40, 5, 260]


@pytest.mark.parametrize("file_type", FILE_TYPES)
def test_reference_and_torch_agree_on_llamacpp_quantized_files(llamacpp_quantized, file_type):
    model = str(llamacpp_quantized(file_type))
    # QAT simulations off: a flip-free strict comparison (with them on, one FP8 code flip moves a layer by ~1e-3)
    off = RunOptions(fp8_kv=False, fp4_indexer=False)
    runs = [run_sequence(load_engine(name, model, off), TOKENS, 4) for name in ("reference", "torch")]
    for name in runs[0][0].checkpoints:
        err = float(rel_l2(stack(runs[0], name), stack(runs[1], name)).max())
        assert err <= 2e-6, (file_type, name, err)   # measured 0.98e-6 .. 1.19e-6 (float32 summation order)


@pytest.mark.parametrize("file_type", FILE_TYPES)
def test_llamacpp_numerics_reproduce_llamacpp_op_outputs(llamacpp_quantized, tmp_path, file_type):
    # every op of every layer on llama.cpp's own dumped inputs, the reference with act_quant=llamacpp and ggml's
    # RoPE angle recurrence: >= 99 % of (op, position) cells within 1e-6 rel-L2 of llama.cpp's output
    model = llamacpp_quantized(file_type)
    api.capture_llamacpp(model, TOKENS * 2, tmp_path / "cap.npz", decode=4)
    w = Weights(model)
    trace = load_candidate(tmp_path / "cap.npz", w.config, w.identity(), None)
    dumps, _ = candidate_subops(tmp_path / "cap.npz", trace, w.config, None)
    opts, _ = reference_options(trace, w.config)
    engine = load_engine("reference", str(model), RunOptions(**{**opts.__dict__, "act_quant": "llamacpp",
                                                                "rope_angles": "recurrence"}))
    cand, _ = candidate_chunks(trace, replay(engine, trace.header.tokens, trace.header.chunks))
    errs = []
    for layer in range(w.config.n_layers):
        own = [type(r)(d.checkpoints[f"blk.{layer}.attn"], d.checkpoints[f"blk.{layer}"], d.diags[layer],
                       d.captures[layer]) for r, d in zip(forced_run(engine, cand, dumps, layer), dumps, strict=True)]
        errs += [e for e, _ in op_cells(forced_run(engine, cand, dumps, layer), own, w.config.ratio(layer)).values()]
    cells = np.concatenate(errs)
    assert np.mean(cells <= 1e-6) >= 0.99, (file_type, float(np.mean(cells <= 1e-6)), float(cells.max()))
