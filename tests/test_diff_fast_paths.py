"""The shortcuts that make `diff` of two large traces fast (docs/bench.md "Under load", issue 27 point 6) give the
answers of the general code: the layer diagnostics without a join when both traces hold the same rows, the
selection rule of the reader checked by blocks, and the memory-mapped `.npz` reader (every member bit for bit as
`np.load` reads it; a corrupted member an error naming it)."""

from __future__ import annotations

import zipfile

import numpy as np
import pytest
from trace_samples import toy_trace

from parity.bench.measure import synthetic_trace
from parity.compare import differ
from parity.contract.errors import TraceError
from parity.tracing import validate
from parity.tracing.io import read_trace, vectors_path, write_trace
from parity.tracing.records import Table, Trace
from parity.tracing.zipstore import StoredZip


def _planted() -> tuple[Trace, Trace, dict[str, tuple[int, int]]]:
    """Two synthetic 4-layer traces of 16 positions; B differs from A at known rows of its HC, routing and
    selection tables. -> (a, b, {what: (layer, pos) of the planted row})"""
    rng = np.random.default_rng(11)
    a = synthetic_trace(4, 16, rng)
    hc = {k: v.copy() for k, v in a.hc.cols.items()}
    moe = {k: v.copy() for k, v in a.moe.cols.items()}
    attn = {k: v.copy() for k, v in a.attn.cols.items()}
    hc["comb"][37, 5] += np.float32(0.5)
    moe["ids"][21, 0] = 999                                      # not among the row's ids (all < 256): a flip
    live = np.flatnonzero(attn["has_sel"])
    attn["sel"][live[3]] = attn["sel"][live[3]][::-1].copy()     # the same list in another order: no mismatch
    attn["sel"][live[9], 0] = 5000                               # a row no selection holds (all < 1024)
    attn["n_comp"][40] += 1
    b = Trace(a.header, a.ckpt, Table(hc), Table(moe), Table(attn))
    at = {"hc": (int(hc["layer"][37]), int(hc["pos"][37])), "moe": (int(moe["layer"][21]), int(moe["pos"][21])),
          "sel": (int(attn["layer"][live[9]]), int(attn["pos"][live[9]])),
          "n_comp": (int(attn["layer"][40]), int(attn["pos"][40]))}
    return a, b, at


def test_layer_diagnostics_without_a_join_equal_the_joined_ones(monkeypatch):
    a, b, at = _planted()
    positions = list(a.header.positions)
    taken = []
    aligned = differ._aligned_rows
    monkeypatch.setattr(differ, "_aligned_rows", lambda *args: taken.append(r := aligned(*args)) or r)
    fast = differ._layer_diags(a, b, positions)
    assert len(taken) == 3 and all(r is not None for r in taken)  # hc, moe, attn: no join
    monkeypatch.setattr(differ, "_aligned_rows", lambda *args: None)
    joined = differ._layer_diags(a, b, positions)
    assert fast.equals(joined)
    row = fast.set_index("layer")
    assert row.loc[at["hc"][0], "hc_max_abs"] == pytest.approx(0.5, abs=1e-6)
    assert row["hc_max_abs"].drop(at["hc"][0]).eq(0).all()
    assert row.loc[at["moe"][0], "expert_flips"] == 1 and row.loc[at["moe"][0], "first_flip_pos"] == at["moe"][1]
    assert row["expert_flips"].sum() == 1
    assert row.loc[at["sel"][0], "sel_mismatch"] == 1 and row["sel_mismatch"].sum() == 1
    assert row.loc[at["n_comp"][0], "n_comp_mismatch"] == 1 and row["n_comp_mismatch"].sum() == 1
    assert row["unmatched"].eq(0).all()


def _table(layer: list[int], sub: list[int], pos: list[int]) -> Table:
    return Table({"layer": np.asarray(layer, np.int32), "sub": np.asarray(sub, np.int32),
                  "pos": np.asarray(pos, np.int32)})


def test_aligned_rows_only_when_no_join_is_needed():
    key, keep = ("layer", "sub", "pos"), np.arange(4)
    t = _table([0, 0, 0, 1], [0, 1, 1, 0], [3, 0, 2, 1])
    assert differ._aligned_rows(t, t, key, keep).tolist() == [0, 1, 2, 3]
    assert differ._aligned_rows(t, _table([0, 0, 0, 1], [0, 1, 1, 0], [3, 0, 3, 1]), key, keep) is None  # keys
    assert differ._aligned_rows(t, t, key, np.arange(3)) is None               # a row at a position not compared
    twice = _table([0, 0, 0, 1], [0, 1, 1, 0], [3, 0, 0, 1])
    assert differ._aligned_rows(twice, twice, key, keep) is None               # a key twice: the join keeps the last
    unsorted = _table([0, 1, 0, 1], [0, 0, 1, 1], [0, 0, 0, 0])
    assert differ._aligned_rows(unsorted, unsorted, key, keep) is None
    assert differ._aligned_rows(t, _table([0], [0], [3]), key, keep) is None   # other lengths
    empty = _table([], [], [])
    assert differ._aligned_rows(empty, empty, key, keep) is None


def test_rows_without_a_selection_checked_by_blocks(monkeypatch):
    monkeypatch.setattr(validate, "SEL_BLOCK", 4)  # blocks all marked, none marked and mixed in a 10-row table
    rng = np.random.default_rng(3)
    for _ in range(300):
        marked = rng.random(10) < rng.choice([0.1, 0.5, 0.9])
        sel = np.where(marked[:, None], -1, rng.integers(-1, 9, (10, 3)))
        if rng.random() < 0.7:
            sel[rng.integers(10), rng.integers(3)] = rng.integers(-1, 9)
        want = all(v == -1 for i in range(10) if marked[i] for v in sel[i].tolist())
        assert validate._only_minus_one(sel, marked) == want
    assert validate._only_minus_one(np.zeros((4, 0), np.int32), np.ones(4, bool))


def test_memory_mapped_members_are_what_np_load_reads(tmp_path):
    path = write_trace(toy_trace(4, with_vectors=True), tmp_path / "t.npz")
    for file in (path, vectors_path(path)):
        z = StoredZip(file)
        with np.load(file) as ref:
            arrays = [n for n in ref.files if n != "header.json"]  # np.load lists the trace's JSON header too
            assert sorted(arrays) == sorted(z.npy_names()) and len(arrays) > 3
            for name in arrays:
                got, want = z.array(name, name), ref[name]
                assert got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == want.tobytes(), name
            if "header.json" in ref.files:
                assert z.text("header.json", "header.json").encode() == ref["header.json"]


def test_a_corrupted_member_is_an_error_naming_it(tmp_path):
    path = write_trace(toy_trace(5), tmp_path / "t.npz")
    with zipfile.ZipFile(path) as z:
        info = z.getinfo("attn.sel.npy")
    raw = bytearray(path.read_bytes())
    raw[info.header_offset + 30 + len(info.filename) + info.file_size - 1] ^= 0x01  # the member's last data byte
    path.write_bytes(bytes(raw))
    with pytest.raises(TraceError, match=r"t\.npz: field 'attn\.sel': bad CRC-32 for member attn\.sel\.npy"):
        read_trace(path)


def test_metrics_in_batches_are_the_one_checkpoint_answers(monkeypatch):
    """Every metric column, bit for bit (NaN where NaN), whether checkpoints are computed 8 at a time or alone;
    with non-finite fingerprints and statistics planted in B."""
    a, _, _ = _planted()
    rng = np.random.default_rng(5)
    ckpt = {k: v.copy() for k, v in a.ckpt.cols.items()}
    early = ckpt["ck"] < 5  # the rest equal to A's, so `exact` shows which fields each checkpoint compares
    ckpt["fp"][early] *= 1 + 1e-2 * rng.standard_normal(ckpt["fp"][early].shape).astype(np.float32)
    final = np.flatnonzero(ckpt["ck"] == len(a.header.checkpoints) - 1)
    ckpt["top_ids"][final[2], 1] += 1  # final_norm compares its top-k (and one l2 number), the others do not
    ckpt["fp"][[3, 40, 70], [0, 5, 63]] = [np.nan, np.inf, -np.inf]
    ckpt["rms"][[11, 60]] = [np.nan, 0.0]
    b = Trace(a.header, Table(ckpt), a.hc, a.moe, a.attn)
    names, positions = list(a.header.checkpoints), list(a.header.positions)
    th = differ.Thresholds()
    batched = differ._metrics_table(a, b, names, positions, th, a.n_layers)
    monkeypatch.setattr(differ, "METRIC_BATCH", 1)
    alone = differ._metrics_table(a, b, names, positions, th, a.n_layers)
    assert len(differ._batches(names, [positions] * len(names), [False] * len(names), positions)) > len(names) // 8
    assert list(batched.columns) == list(alone.columns) and len(batched) == len(names) * len(positions)
    for c in batched.columns:
        x, y = batched[c].to_numpy(), alone[c].to_numpy()
        assert x.dtype == y.dtype and (x.tobytes() == y.tobytes() if x.dtype != object else list(x) == list(y)), c
    assert not batched["finite"].all() and batched["drift"].any()
    last = batched[batched["checkpoint"] == "final_norm"]
    assert (~last["exact"]).sum() == 1 and batched[batched["checkpoint"] == "blk.3"]["exact"].all()
