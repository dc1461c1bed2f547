"""Poisoned weights through both engines: a model whose tensors are finite but make the run non-finite, or whose
hash-routing table holds an impossible expert id, ends in a ParityError naming the problem, never in a trace."""

from __future__ import annotations

import re

import numpy as np
import pytest

from parity import api
from parity.contract.engine import LayerDiag
from parity.contract.errors import ParityError, TensorError
from parity.gguf.container import GGUFFile, TensorData, write_gguf
from parity.tracing.recorder import Recorder
from parity.tracing.runner import ChunkResult

PROMPT = [0, 5, 7]


def _poisoned(src, dst, name, edit):
    """A copy of an F32/I32 GGUF with tensor `name`'s values replaced by edit(values)."""
    g = GGUFFile(src)
    tensors = []
    for n, info in g.tensors.items():
        raw = bytes(g.data(n))
        if n == name:
            dtype = "<i4" if info.type_name == "I32" else "<f4"
            raw = np.ascontiguousarray(edit(np.frombuffer(raw, dtype).copy()), dtype).tobytes()
        tensors.append(TensorData(n, info.ne, info.ggml_type, raw))
    write_gguf(dst, g.kv, tensors)
    return dst


POISONS = {
    # finite weights, logits overflow to inf / NaN (the issue: written into the trace with exit 0)
    "output-3e38": ("output.weight", lambda w: np.where(w > 0, 3e38, -3e38), r"non-finite|logits"),
    # an attention output projection at the float32 limit: the layer-1 carrier overflows
    "attn-out-3e38": ("blk.1.attn_output_b.weight", lambda w: np.where(w > 0, 3e38, -3e38), r"non-finite|not finite"),
    # hash routing to expert -1 (torch crashed with "index -1 is out of bounds")
    "tid2eid-minus-1": ("blk.0.ffn_gate_tid2eid.weight", lambda t: np.full_like(t, -1), r"expert|tid2eid"),
}


@pytest.fixture(scope="module")
def poisoned(tiny_f32, tmp_path_factory):
    d = tmp_path_factory.mktemp("poison")
    return {case: _poisoned(tiny_f32, d / f"{case}.gguf", name, edit) for case, (name, edit, _) in POISONS.items()}


@pytest.mark.parametrize("engine", ["reference", "torch"])
@pytest.mark.parametrize("case", sorted(POISONS))
def test_poisoned_weights_are_an_error_not_a_trace(poisoned, engine, case):
    with pytest.raises(ParityError, match=POISONS[case][2]) as e:
        api.trace(engine, poisoned[case], PROMPT, full="all")
    assert len(str(e.value)) < 1000


def _chunk(poison: str | None) -> ChunkResult:
    """One chunk of a 1-layer run (H = 2, D = 3, V = 4, K = 2) with one recorded value made NaN or inf."""
    rng = np.random.default_rng(0)
    n = 2
    diag = LayerDiag(hc_attn=(rng.random((n, 2)), rng.random((n, 2)), rng.random((n, 2, 2))),
                     hc_ffn=(rng.random((n, 2)), rng.random((n, 2)), rng.random((n, 2, 2))),
                     expert_ids=np.array([[0, 1], [1, 0]]), expert_weights=rng.random((n, 2)),
                     router_margin=np.array([np.nan, np.nan]), n_comp_visible=np.zeros(n, np.int64))
    r = ChunkResult(0, np.array([1, 2]), {"embed": rng.random((n, 2, 3)), "blk.0": rng.random((n, 2, 3)),
                                           "final_norm": rng.random((n, 3))}, rng.random((n, 4)), [diag])
    if poison == "logits":
        r.logits[1, 3] = np.inf
    elif poison == "carrier":
        r.checkpoints["blk.0"][0, 1, 2] = np.nan
    elif poison == "hc":
        diag.hc_ffn[2][1, 0, 1] = np.nan
    elif poison == "weights":
        diag.expert_weights[0, 0] = -np.inf
    elif poison == "margin":
        diag.router_margin[1] = np.inf
    return r


@pytest.mark.parametrize("poison,what", [("logits", "logits at position 1"), ("carrier", "checkpoint blk.0 at "
                                         "position 0"), ("hc", "blk.0 hc_ffn comb at position 1"),
                                         ("weights", "blk.0 expert weights at position 0"),
                                         ("margin", "blk.0 router margin at position 1")])
def test_the_recorder_refuses_every_non_finite_recorded_value(poison, what):
    rec = Recorder(["embed", "blk.0", "final_norm"], [0, 1], [], 2, 2)
    rec.add(_chunk(None))  # NaN margins (hash layer) are recorded as "no margin"
    with pytest.raises(TensorError, match=f"{what}: non-finite value"):
        Recorder(["embed", "blk.0", "final_norm"], [0, 1], [], 2, 2).add(_chunk(poison))


@pytest.mark.parametrize("engine", ["reference", "torch"])
def test_a_non_finite_weight_is_an_error_naming_file_and_tensor(tiny_f32, tmp_path, engine):
    name = "blk.0.attn_output_b.weight"
    path = _poisoned(tiny_f32, tmp_path / "nan-weight.gguf", name, lambda w: np.where(w == w.flat[7], np.nan, w))
    with pytest.raises(TensorError, match=rf"nan-weight\.gguf: tensor {re.escape(name)}.*non-finite"):
        api.trace(engine, path, PROMPT)
