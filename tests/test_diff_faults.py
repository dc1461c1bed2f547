"""The localiser's witness: for every fault the torch engine can inject, the diff against the reference names
as first drifting checkpoint the layer where that fault first acts (gpu_engine/faults.py FAULT_TABLE).

Run: the golden prompt (15 tokens, then 6 decode steps teacher-forced to the reference's tokens), so that
position 3 emits the first compressed row, position 15 is a decode step that completes a CSA block while
the indexer still keeps every row, and positions 19-20 have more CSA rows than the indexer's top-k.
`indexer-ties-highest` only acts on tied indexer scores, which random weights never produce; it runs on
a copy of the model whose layer-2 indexer weight projection is zero (every score ties at 0).
"""

from __future__ import annotations

import pytest

from gpu_engine.faults import FAULTS
from parity import api
from parity.contract.engine import RunOptions
from parity.gguf.container import GGUFFile, TensorData, write_gguf

# fault -> (layer where it first acts on the tiny schedule 0,0,4,128,4,128 with hash layers 0-2, first position)
FIRST_ACTS = {
    "compress-ratios-u32": (2, None),          # first compressed layer: wrong RoPE base/YaRN from position 1
    "no-decode-compression": (2, 15),          # first decode step that completes a CSA block
    "comb-not-transposed": (0, 0),             # blk.0.attn mixes equal streams (C ~ C^T); blk.0 shows it
    "rope-split-halves": (0, None),
    "sink-dropped": (0, 0),
    "router-bias-in-weights": (3, None),       # first non-hash layer
    "swiglu-symmetric-clamp": (0, 0),          # layer 0 FFN
    "fp8-kv-off": (0, 0),
    "indexer-ties-highest": (2, 19),           # first position with more CSA rows (5) than top-k (4)
    "csa-halves-swapped": (2, 3),              # first emitted CSA row
    "compressed-row-visible-late": (2, 3),     # first block end
}
TIE_TENSOR = "blk.2.indexer.proj.weight"


def zero_tensor_copy(src, dst, name):
    """A copy of a GGUF with one tensor's bytes zeroed (same shapes and types)."""
    g = GGUFFile(src)
    tensors = [TensorData(n, i.ne, i.ggml_type, bytes(i.nbytes) if n == name else bytes(g.data(n)))
               for n, i in g.tensors.items()]
    write_gguf(dst, g.kv, tensors)
    return dst


@pytest.fixture(scope="module")
def models(tiny_f32, tmp_path_factory):
    tie = zero_tensor_copy(tiny_f32, tmp_path_factory.mktemp("tie") / "tiny-tie.gguf", TIE_TENSOR)
    return {"plain": tiny_f32, "tie": tie}


@pytest.fixture(scope="module")
def references(models):
    return {k: api.trace("reference", m, api.GOLDEN_PROMPT, positions="all", decode=api.GOLDEN_DECODE)
            for k, m in models.items()}


def test_table_covers_every_fault():
    assert set(FIRST_ACTS) == set(FAULTS)


def test_clean_torch_engine_agrees(models, references):
    r = api.diff(references["tie"], api.trace("torch", models["tie"], **api.follow(references["tie"])))
    assert r.first_drift is None, r.first_drift


@pytest.mark.parametrize("fault", FAULTS)
def test_first_drift_is_where_the_fault_first_acts(fault, models, references):
    which = "tie" if fault == "indexer-ties-highest" else "plain"
    ref = references[which]
    cand = api.trace("torch", models[which], options=RunOptions(inject=(fault,)), **api.follow(ref))
    r = api.diff(ref, cand)
    layer, pos = FIRST_ACTS[fault]
    assert r.first_drift is not None, f"{fault}: no drift found"
    assert r.first_drift["layer"] == layer, r.first_drift
    if pos is not None:
        assert r.first_drift["first_pos"] == pos, r.first_drift
    assert r.flags_differ["inject"] == [[], [fault]]
