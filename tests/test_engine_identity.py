"""The Engine protocol carries the model identity of the GGUF it opened, and traces take it from there."""

from __future__ import annotations

import pytest

from parity import api
from parity.contract.engine import Engine, RunOptions, load_engine
from parity.gguf.weights import Weights


@pytest.mark.parametrize("name", ["reference", "torch"])
def test_engine_identity_is_the_gguf_identity_and_lands_in_the_trace(tiny_f32, name):
    eng = load_engine(name, str(tiny_f32), RunOptions())
    assert isinstance(eng, Engine)
    want = Weights(tiny_f32).identity()
    assert eng.identity == want and {"size", "header_sha256", "data_sha256"} <= set(want)
    assert api.trace(eng, tiny_f32, [0, 5, 7]).header.model == want


def test_identity_is_not_the_file_name(tiny_f32, tiny_mxfp4):
    a = load_engine("reference", str(tiny_f32), RunOptions()).identity
    b = load_engine("reference", str(tiny_mxfp4), RunOptions()).identity
    assert a["header_sha256"] != b["header_sha256"] and a["data_sha256"] != b["data_sha256"]
