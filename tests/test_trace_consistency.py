"""A trace's records must describe their own full vectors (issue 28, item 4): a writer with correct vectors and
wrong fingerprints or statistics is refused when the trace is read, naming the first such record."""

from __future__ import annotations

import re

import numpy as np
import pytest

from parity import api
from parity.contract.errors import TraceError
from parity.tracing.records import Table, Trace
from parity.tracing.stats import sign_matrix

TOKENS = [0, 5, 7, 9]


@pytest.fixture(scope="module")
def clean(tiny_f32):
    return api.trace("reference", tiny_f32, TOKENS, positions="all", full="all", decode=1)


def _edited(trace: Trace, **cols) -> Trace:
    """The trace with some ckpt columns replaced (the vectors untouched)."""
    return Trace(trace.header, Table({**trace.ckpt.cols, **cols}), trace.hc, trace.moe, trace.attn,
                 vectors=trace.vectors)


@pytest.mark.parametrize("form", ["trace", "npz"])
def test_clean_trace_reads_back(clean, tmp_path, form):
    path = api.save_trace(clean, tmp_path / f"clean.{form}")
    assert api.load_trace(path) == clean


@pytest.mark.parametrize("form", ["trace", "npz"])
def test_zeroed_fingerprints_with_correct_vectors_are_refused(clean, tmp_path, form):
    path = api.save_trace(_edited(clean, fp=np.zeros_like(clean.ckpt["fp"])), tmp_path / f"zero.{form}")
    with pytest.raises(TraceError) as e:
        api.load_trace(path)
    msg = str(e.value)
    # the first record in depth order is embed at position 0; every record holds a vector (full all), so all disagree
    assert re.search(r"checkpoint embed at position 0: fp\[\d+\] recorded 0, computed", msg), msg
    assert f"; {len(clean.ckpt)} record(s) in all disagree" in msg, msg
    assert str(path) in msg
    api.load_trace(path, load_vectors=False)   # fingerprint-only reading has nothing to check against


def test_one_wrong_statistic_is_named(clean, tmp_path):
    h, ck = clean.header, clean.ckpt
    ci = h.checkpoints.index("blk.2")
    row = int(np.flatnonzero((ck["ck"] == ci) & (ck["pos"] == 3))[0])
    rms = ck["rms"].copy()
    rms[row] *= np.float32(1.01)      # 1e-2 relative: 100x the tolerance
    path = api.save_trace(_edited(clean, rms=rms), tmp_path / "rms.trace")
    with pytest.raises(TraceError, match=r"checkpoint blk\.2 at position 3: rms recorded .*; 1 record\(s\) in all"):
        api.load_trace(path)


def test_float32_summation_order_is_within_tolerance(clean, tmp_path):
    # an engine that sums its fingerprint sequentially in float32 (not float64 like the recorder) is not refused
    h = clean.header
    fp = clean.ckpt["fp"].copy()
    for ci, name in enumerate(h.checkpoints):
        rows = np.flatnonzero(clean.ckpt["ck"] == ci)
        x = clean.vectors[name].reshape(len(rows), -1)
        s = sign_matrix(x.shape[1]).astype(np.float32)
        fp[rows] = np.cumsum(x[:, None, :] * s[None], axis=-1, dtype=np.float32)[..., -1] / np.float32(8)
    assert not np.array_equal(fp, clean.ckpt["fp"])   # the order did change some bits
    path = api.save_trace(_edited(clean, fp=fp), tmp_path / "f32.trace")
    assert api.load_trace(path).ckpt["fp"].tolist() == fp.tolist()


def test_top_k_that_is_not_the_logits_vectors_is_named(clean, tmp_path):
    h, ck = clean.header, clean.ckpt
    assert "logits" in h.full
    ci = h.checkpoints.index("final_norm")
    rows = np.flatnonzero(ck["ck"] == ci)
    row = int(rows[np.flatnonzero(ck["pos"][rows] == 2)[0]])
    logits = clean.vectors["logits"][h.positions.index(2)]
    ids = ck["top_ids"].copy()
    ids[row] = np.argsort(logits)[:ids.shape[1]]     # the K smallest logits' ids, recorded top logits kept
    path = api.save_trace(_edited(clean, top_ids=ids), tmp_path / "topk.trace")
    with pytest.raises(TraceError, match=r"checkpoint final_norm at position 2: top_ids: .*; 1 record\(s\) in all"):
        api.load_trace(path)
