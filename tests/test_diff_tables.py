"""Differ at the table level: the vectorised per-layer diagnostics and metric table against a plain row-by-row
second implementation (Python sets, dicts, loops) on random trace pairs with mismatching expert sets, permuted and
changed indexer selections, NaN / inf entries, keys present on one side only, a duplicated key and a position that
only one trace has; and the memory-mapped .npz read path (same report as in memory, CRC corruption refused)."""

from __future__ import annotations

import copy
import math
import zipfile

import click
import numpy as np
import pandas as pd
import pytest
from trace_samples import toy_trace

from parity import api
from parity.compare.differ import PreflightError
from parity.compare.printers import layer_differences
from parity.contract.checkpoints import trace_checkpoints
from parity.contract.errors import TraceError
from parity.tracing.io import write_trace
from parity.tracing.records import Trace, TraceHeader, make_table
from parity.tracing.stats import FP_DIM

L, P, H, E, S, K = 4, 7, 2, 3, 6, 3  # layers, positions, streams, active experts, index width, top-k


def _header(positions: list[int], n_tokens: int) -> TraceHeader:
    return TraceHeader(engine="random", engine_version="0", dtype="float32", n_hc=H, dim=8, top_k=K,
                       model={"file": "m.gguf", "size": 1, "header_sha256": "0" * 8}, tokens=list(range(n_tokens)),
                       n_prompt=n_tokens, chunks=[n_tokens], decode=0, positions=positions,
                       checkpoints=trace_checkpoints(L), full=[], flags={})


def _sprinkle(rng: np.random.Generator, x: np.ndarray, p: float, values: tuple[float, ...]) -> np.ndarray:
    """Copy of x with a fraction p of its entries replaced by a random choice of `values`."""
    x = x.copy()
    hit = rng.random(x.shape) < p
    x[hit] = rng.choice(values, int(hit.sum()))
    return x


def _expert_ids(rng: np.random.Generator, ids: np.ndarray) -> np.ndarray:
    """Per row one of: same, permuted, one id changed (a flip), same set with a repeated id, all changed."""
    out = ids.copy()
    for i, kind in enumerate(rng.integers(0, 5, len(ids))):
        if kind == 1:
            out[i] = rng.permutation(ids[i])
        elif kind == 2:
            out[i, rng.integers(E)] = 100 + i
        elif kind == 3:
            out[i] = [ids[i, 0], ids[i, 0], ids[i, 1]]
            ids[i] = [ids[i, 0], ids[i, 1], ids[i, 1]]  # a: {x, y, y}, b: {x, x, y}: equal sets, not equal rows
        elif kind == 4:
            out[i] = rng.choice(np.arange(200, 300), E, replace=False)
    return out


def _selection(rng: np.random.Generator, sel: np.ndarray) -> np.ndarray:
    """Per row one of: same, permuted, one index changed, a padding slot written as -7 instead of -1, one dropped."""
    out = sel.copy()
    for i, kind in enumerate(rng.integers(0, 5, len(sel))):
        row = out[i]
        if kind == 1:
            out[i] = rng.permutation(row)
        elif kind == 2:
            row[rng.integers(S)] = 500 + i
        elif kind == 3:
            row[row < 0] = -7
        elif kind == 4:
            row[rng.integers(S)] = -1
    return out


def _pair(seed: int, storable: bool = False, nan: bool = True) -> tuple[Trace, Trace]:
    """Two random traces over the same tokens; b's header lacks position 5, b's tables miss some rows.

    `storable`: only what a trace file may hold (no repeated key, no -7 padding), as the readers enforce;
    `nan`: sprinkle NaN into a's HC pre and expert weights and into b's HC mixes of layers 2 and 3."""
    rng = np.random.default_rng(seed)
    names = trace_checkpoints(L)
    f32 = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    widths = {"H": H, "F": FP_DIM, "K": K, "E": E, "S": S}

    n = len(names) * P
    ck, pos = np.repeat(np.arange(len(names)), P), np.tile(np.arange(P), len(names))
    final = ck == len(names) - 1
    ckpt = {"ck": ck, "pos": pos, "tok": pos, "min": -1 - np.abs(f32(n)), "max": 1 + np.abs(f32(n)),
            "rms": 1 + np.abs(f32(n)), "sum_l2": 1 + np.abs(f32(n)),
            "l2s": np.where(final[:, None] & (np.arange(H) > 0), np.nan, 1 + np.abs(f32(n, H))),
            "fp": f32(n, FP_DIM), "argmax": np.where(final, pos, -1),
            "top_ids": np.where(final[:, None], pos[:, None] + np.arange(K), -1),
            "top_logits": np.where(final[:, None], -np.arange(K, dtype=np.float32), np.nan)}
    late = ck >= 3  # embed, blk.0.attn and blk.0 stay identical
    drift = late & (ck >= 5) & (rng.random(n) < 0.5)  # fingerprints drift from blk.2.attn on, at some positions
    ckpt_b = {**ckpt, "fp": np.where(drift[:, None], ckpt["fp"] * (1 + 0.1 * f32(n, FP_DIM)), ckpt["fp"]),
              "rms": np.where(late, _sprinkle(rng, ckpt["rms"], 0.05, (np.nan,)), ckpt["rms"]),
              "l2s": np.where(late[:, None], ckpt["l2s"] * (1 + 0.01 * f32(n, H)), ckpt["l2s"])}

    lp = np.repeat(np.arange(L), P), np.tile(np.arange(P), L)
    m = L * P
    hc = {"layer": np.repeat(lp[0], 2), "sub": np.tile([0, 1], m), "pos": np.repeat(lp[1], 2),
          "pre": f32(2 * m, H), "post": f32(2 * m, H), "comb": f32(2 * m, H * H)}
    late_hc = (hc["layer"] >= 2)[:, None]
    p_nan = 0.05 if nan else 0.0
    hc_b = {**hc, **{c: np.where(late_hc, _sprinkle(rng, hc[c], p_nan, (np.nan,)), hc[c])
                     + (rng.random(hc[c].shape) < 0.3) * f32(*hc[c].shape) for c in ("pre", "post", "comb")}}
    hc_b["post"][[2, 3, 8, 9], 1] = np.inf  # layer-0 rows (positions 1 and 4): layer 0's HC max-abs is inf
    hc = {**hc, "pre": np.where(late_hc, _sprinkle(rng, hc["pre"], p_nan, (np.nan,)), hc["pre"])}
    ids = np.array([rng.choice(64, E, replace=False) for _ in range(m)])
    ids_b = _expert_ids(rng, ids)
    w = f32(m, E)
    margin = np.where(lp[0] == 0, np.nan, f32(m))  # layer 0 hash-routed: no margin on either side
    moe = {"layer": lp[0], "pos": lp[1], "ids": ids, "w": _sprinkle(rng, w, p_nan, (np.nan,)), "margin": margin}
    moe_b = {**moe, "ids": ids_b, "w": w + (rng.random((m, E)) < 0.5) * f32(m, E),
             "margin": np.where(rng.random(m) < 0.3, margin + f32(m), margin)}
    sel = np.array([np.concatenate([rng.choice(40, k, replace=False), np.full(S - k, -1)])
                    for k in rng.integers(0, S + 1, m)])
    n_comp = lp[1] // 2
    has_sel = lp[0] % 2 == 0
    sel_b = _selection(rng, sel)
    twice = np.flatnonzero(((sel >= 0).sum(axis=1) >= 1) & ((sel < 0).sum(axis=1) >= 1))
    for i in twice[::3]:  # B selects one of A's rows twice (the same set, another list); at twice[::6] A does too
        sel_b[i] = sel[i]
        sel_b[i, np.flatnonzero(sel[i] < 0)[0]] = sel[i, np.flatnonzero(sel[i] >= 0)[0]]
    for i in twice[::6]:
        sel[i] = sel_b[i]
    if storable:
        sel[~has_sel], sel_b[~has_sel] = -1, -1
        sel_b[sel_b < -1] = -1
    attn = {"layer": lp[0], "pos": lp[1], "n_comp": n_comp, "has_sel": has_sel, "sel": sel}
    attn_b = {**attn, "n_comp": n_comp + (rng.random(m) < 0.2), "sel": sel_b}

    def drop(rows: dict, p: float) -> dict:
        keep = rng.random(len(rows["pos"])) >= p
        if storable:
            keep &= np.asarray(rows["pos"]) != 5
        return {c: np.asarray(v)[keep] for c, v in rows.items()}

    def duplicate_last(rows: dict) -> dict:  # the last row again with other values: a repeated key, last one counts
        extra = {c: np.asarray(v)[-1:] for c, v in rows.items()}
        for c, v in extra.items():
            if v.dtype.kind == "f":
                extra[c] = v + 1
        return {c: np.concatenate([np.asarray(rows[c]), extra[c]]) for c in rows}

    a = Trace(_header(list(range(P)), P), make_table("ckpt", ckpt, widths), make_table("hc", hc, widths),
              make_table("moe", moe, widths), make_table("attn", attn, widths))
    b_pos = [p for p in range(P) if p != 5]
    keep_b = np.isin(ckpt_b["pos"], b_pos)
    b = Trace(_header(b_pos, P), make_table("ckpt", {c: np.asarray(v)[keep_b] for c, v in ckpt_b.items()}, widths),
              make_table("hc", drop(hc_b, 0.1) if storable else duplicate_last(drop(hc_b, 0.1)), widths),
              make_table("moe", drop(moe_b, 0.1), widths), make_table("attn", drop(attn_b, 0.1), widths))
    return a, b


# ----------------------------------------------------------------------------------------------
# The second implementation, row by row

def _plain_layers(a: Trace, b: Trace, positions: list[int]) -> pd.DataFrame:
    keep = set(positions)

    def index(tab, key):  # key -> row; a key given twice maps to its last row
        out = {}
        for i in range(len(tab)):
            if int(tab["pos"][i]) in keep:
                out[tuple(int(tab[c][i]) for c in key)] = i
        return out

    def diff(x, y):  # NaN never compares equal: an infinite difference
        d = abs(x - y)
        return math.inf if math.isnan(d) else d

    layers: dict[int, dict] = {}

    def at(layer):
        return layers.setdefault(layer, {"layer": layer, "hc_max_abs": 0.0, "expert_flips": 0, "first_flip_pos": -1,
                                         "weight_max_abs": 0.0, "order_mismatch": 0, "margin_max_abs": 0.0,
                                         "n_comp_mismatch": 0, "sel_mismatch": 0, "unmatched": 0,
                                         "sel_dup_a": 0, "sel_dup_b": 0})

    def joined(tab_a, tab_b, key):
        ia, ib = index(tab_a, key), index(tab_b, key)
        for k in sorted(set(ia) ^ set(ib)):
            at(k[0])["unmatched"] += 1
        return ia, ib, sorted(set(ia) & set(ib))

    ia, ib, keys = joined(a.hc, b.hc, ("layer", "sub", "pos"))
    for k in keys:
        e = at(k[0])
        for c in ("pre", "post", "comb"):
            for x, y in zip(a.hc[c][ia[k]].tolist(), b.hc[c][ib[k]].tolist(), strict=True):
                e["hc_max_abs"] = max(e["hc_max_abs"], diff(x, y))
    ia, ib, keys = joined(a.moe, b.moe, ("layer", "pos"))
    for k in keys:
        e = at(k[0])
        xa, xb = a.moe["ids"][ia[k]].tolist(), b.moe["ids"][ib[k]].tolist()
        wa, wb = a.moe["w"][ia[k]].tolist(), b.moe["w"][ib[k]].tolist()
        if set(xa) != set(xb):
            e["expert_flips"] += 1
            if e["first_flip_pos"] == -1:
                e["first_flip_pos"] = k[1]
        elif xa != xb:
            e["order_mismatch"] += 1
        if sorted(xa) == sorted(xb):  # the same experts: compare each expert's weight
            oa, ob = sorted(range(len(xa)), key=xa.__getitem__), sorted(range(len(xb)), key=xb.__getitem__)
            for i, j in zip(oa, ob, strict=True):
                e["weight_max_abs"] = max(e["weight_max_abs"], diff(wa[i], wb[j]))
        ma, mb = float(a.moe["margin"][ia[k]]), float(b.moe["margin"][ib[k]])
        if not (math.isnan(ma) or math.isnan(mb)):  # NaN: no margin recorded (hash layer, import)
            e["margin_max_abs"] = max(e["margin_max_abs"], abs(ma - mb))
    ia, ib, keys = joined(a.attn, b.attn, ("layer", "pos"))
    for k in keys:
        e = at(k[0])
        if int(a.attn["n_comp"][ia[k]]) != int(b.attn["n_comp"][ib[k]]):
            e["n_comp_mismatch"] += 1
        sa = sorted(v for v in a.attn["sel"][ia[k]].tolist() if v >= 0)  # lists: a row selected twice counts twice
        sb = sorted(v for v in b.attn["sel"][ib[k]].tolist() if v >= 0)
        e["sel_dup_a"] += len(set(sa)) < len(sa)
        e["sel_dup_b"] += len(set(sb)) < len(sb)
        if sa != sb or bool(a.attn["has_sel"][ia[k]]) != bool(b.attn["has_sel"][ib[k]]):
            e["sel_mismatch"] += 1
    return pd.DataFrame([layers[k] for k in sorted(layers)], columns=list(at(0)))


def _plain_row(a: Trace, b: Trace, name: str, p: int, rel_tol: float, norm_tol: float) -> dict:
    """Fingerprint metrics of one (checkpoint, position) from the two ckpt rows, in plain Python."""
    def row(t):
        k = t.header.checkpoints.index(name)
        i = next(i for i in range(len(t.ckpt)) if t.ckpt["ck"][i] == k and t.ckpt["pos"][i] == p)
        return {c: t.ckpt[c][i] for c in t.ckpt.cols}

    ra, rb = row(a), row(b)
    fa, fb = ra["fp"].tolist(), rb["fp"].tolist()
    norm = lambda v: math.sqrt(math.fsum(x * x for x in v))  # noqa: E731
    rel = norm([y - x for x, y in zip(fa, fb, strict=True)]) / norm(fa)
    cos = math.fsum(x * y for x, y in zip(fa, fb, strict=True)) / (norm(fa) * norm(fb))
    ratio = float(rb["rms"]) / float(ra["rms"])
    finite = all(math.isfinite(float(r[s])) for r in (ra, rb) for s in ("min", "max", "rms", "sum_l2")) and \
        all(math.isfinite(v) for v in fa + fb)
    final = name == "final_norm"  # l2s: one number; argmax and top-k compared too
    cells = lambda r: ([float(r[s]) for s in ("min", "max", "rms", "sum_l2")] + r["fp"].tolist()  # noqa: E731
                       + r["l2s"].tolist()[: 1 if final else H]
                       + ([int(r["argmax"]), *r["top_ids"].tolist(), *r["top_logits"].tolist()] if final else []))
    exact = all(x == y for x, y in zip(cells(ra), cells(rb), strict=True))  # NaN == NaN is False
    drift = not finite or not rel <= rel_tol or not abs(ratio - 1) <= norm_tol
    return {"rel_l2": rel, "cosine": min(1.0, cos), "norm_ratio": ratio, "finite": finite, "exact": exact,
            "drift": drift}


# ----------------------------------------------------------------------------------------------
# Tests

@pytest.mark.parametrize("seed", [0, 1, 2])
def test_layer_diagnostics_match_a_row_by_row_implementation(seed):
    a, b = _pair(seed)
    r = api.diff(a, b, force=True)
    positions = [p for p in range(P) if p != 5]
    expected = _plain_layers(a, b, positions)
    pd.testing.assert_frame_equal(r.layers, expected, check_exact=True)
    # the random pair exercises every kind of difference, not only agreement
    for c in ("expert_flips", "sel_mismatch", "n_comp_mismatch", "weight_max_abs", "order_mismatch",
              "margin_max_abs", "unmatched", "sel_dup_a", "sel_dup_b"):
        assert (expected[c] > 0).any(), c
    hc = expected["hc_max_abs"]
    assert hc[0] == np.inf and hc[3] == np.inf and ((hc > 0) & (hc < np.inf)).any()  # 2..3: NaN, 1: finite
    assert not r.exact


def test_layer_diagnostics_of_identical_tables_are_zero():
    a, _ = _pair(3, nan=False)
    r = api.diff(a, a)
    expected = _plain_layers(a, a, list(range(P)))
    pd.testing.assert_frame_equal(r.layers, expected, check_exact=True)
    assert (r.layers.drop(columns=["layer", "first_flip_pos", "sel_dup_a", "sel_dup_b"]) == 0).all().all()
    assert (r.layers["first_flip_pos"] == -1).all()
    assert (r.layers["sel_dup_a"] > 0).any() and (r.layers["sel_dup_a"] == r.layers["sel_dup_b"]).all()
    assert r.exact
    a.hc["pre"][0, 0] = a.moe["w"][0, 0] = np.nan  # NaN never compares equal, not even with itself
    r = api.diff(a, a)
    assert not r.exact and (r.layers["hc_max_abs"] == np.inf).any() and (r.layers["weight_max_abs"] == np.inf).any()


@pytest.mark.parametrize("seed", [0, 4])
def test_metric_table_and_first_drift_match_a_row_by_row_implementation(seed):
    a, b = _pair(seed)
    r = api.diff(a, b, force=True)
    positions = [p for p in range(P) if p != 5]
    names = a.header.checkpoints
    assert r.table["checkpoint"].tolist() == [n for n in names for _ in positions]
    assert r.table["pos"].tolist() == positions * len(names)
    first = None
    for row in r.table.to_dict(orient="records"):
        want = _plain_row(a, b, row["checkpoint"], row["pos"], 1e-3, 1e-3)
        for c in ("finite", "exact", "drift"):
            assert row[c] == want[c], (row["checkpoint"], row["pos"], c)
        for c in ("rel_l2", "cosine", "norm_ratio"):
            assert row[c] == pytest.approx(want[c], rel=1e-12, abs=1e-15, nan_ok=True), (row["checkpoint"], c)
        if want["drift"] and first is None:
            first = row["checkpoint"]  # table rows are in depth order
    assert first is not None and r.first_drift["checkpoint"] == first
    assert r.table[r.table["depth"] < 1.5]["exact"].all()


def test_npz_files_give_the_in_memory_report(tmp_path):
    a, b = _pair(5, storable=True)
    pa, pb = write_trace(a, tmp_path / "a.npz"), write_trace(b, tmp_path / "b.npz")
    assert api.diff(pa, pb, force=True).to_dict() == api.diff(a, b, force=True).to_dict()


def test_corrupt_npz_column_is_refused(tmp_path):
    a, _ = _pair(6, storable=True)
    path = write_trace(a, tmp_path / "a.npz")
    with zipfile.ZipFile(path) as z:
        info = z.getinfo("hc.comb.npy")
    raw = bytearray(path.read_bytes())
    raw[info.header_offset + info.compress_size] ^= 0x40  # a byte inside the column's data (past the headers)
    path.write_bytes(bytes(raw))
    with pytest.raises(TraceError, match="CRC"):
        api.load_trace(path)


# ----------------------------------------------------------------------------------------------
# No silent matches: every recorded field that differs makes the report non-exact (or is refused)

def _changed(edit) -> tuple[Trace, Trace]:
    a = toy_trace(7, with_vectors=True)
    b = copy.deepcopy(a)
    edit(b)
    return a, b


SILENT = {
    "hc-gate-nan": lambda t: t.hc["pre"].__setitem__((0, 0), np.nan),
    "expert-weight-nan": lambda t: t.moe["w"].__setitem__((1, 0), np.nan),
    "expert-weight": lambda t: t.moe["w"].__setitem__((1, 0), t.moe["w"][1, 0] + 1e-3),
    "expert-order": lambda t: t.moe["ids"].__setitem__(2, t.moe["ids"][2][::-1].copy()),
    "router-margin": lambda t: t.moe["margin"].__setitem__(-1, t.moe["margin"][-1] * 1.5),
    "top-k-id": lambda t: t.ckpt["top_ids"].__setitem__((-1, 1), t.ckpt["top_ids"][-1, 1] + 7),
    "top-k-logit": lambda t: t.ckpt["top_logits"].__setitem__((-1, 0), t.ckpt["top_logits"][-1, 0] + 1),
    "argmax": lambda t: t.ckpt["argmax"].__setitem__(-1, t.ckpt["argmax"][-1] + 1),
    "n-comp": lambda t: t.attn["n_comp"].__setitem__(0, t.attn["n_comp"][0] + 1),
    "has-sel": lambda t: t.attn["has_sel"].__setitem__(0, True),
    "fingerprint": lambda t: t.ckpt["fp"].__setitem__((0, 0), t.ckpt["fp"][0, 0] * (1 + 1e-6)),
    "side-file-logits": lambda t: t.vectors["logits"].__setitem__((1, 2), t.vectors["logits"][1, 2] + 1e-5),
}


@pytest.mark.parametrize("case", sorted(SILENT))
def test_a_changed_field_is_never_an_exact_match(case):
    a, b = _changed(SILENT[case])
    assert api.diff(a, a).exact
    r = api.diff(a, b)
    assert not r.exact, case


def test_side_file_logits_are_compared_and_can_drift():
    a, b = _changed(lambda t: t.vectors["logits"].__setitem__(1, t.vectors["logits"][1] * 1.5))
    r = api.diff(a, b)
    assert r.first_drift["checkpoint"] == "logits" and r.first_drift["first_pos"] == 1 and not r
    rel = np.linalg.norm(0.5 * a.vectors["logits"][1]) / np.linalg.norm(a.vectors["logits"][1])  # = 0.5
    assert r.logits["rel_l2"].tolist()[1] == pytest.approx(rel, rel=1e-6)
    assert r.to_dict()["logits"][1]["drift"] is True
    from parity.compare.gate import markdown, run_gate

    gate = run_gate(a, b)  # the gate fails where the diff drifts, on the logits too
    logits = [c for c in gate.cases if c["checkpoint"] == "logits"]
    assert not gate.passed and len(logits) == 1 and not logits[0]["passed"]
    assert logits[0]["max_rel_l2"] == pytest.approx(rel, rel=1e-6) and "| logits | **FAIL** |" in markdown(gate)
    assert run_gate(a, a).passed


@pytest.mark.parametrize("field,value,reason", [
    ("dim", 4, "model dimensions differ"),
    ("top_k", 3, "top-k widths differ"),
    ("model", {"file": "toy.gguf", "size": 1234, "header_sha256": "0123456789abcdef",
               "data_sha256": "00000000000000ff"}, "model identity differs"),
])
def test_header_differences_are_refused(field, value, reason):
    a = toy_trace(7)
    b = copy.deepcopy(a)
    setattr(b.header, field, value)
    with pytest.raises(PreflightError, match=reason):
        api.diff(a, b)


def test_an_old_identity_is_compared_on_size_and_header_hash():
    """Traces written before the data hash: same size + header hash compare (as before), another size refuses."""
    a, b = toy_trace(7), toy_trace(7)
    b.header.model = {k: v for k, v in a.header.model.items() if k != "data_sha256"}
    assert api.diff(a, b).exact
    b.header.model["size"] += 1
    with pytest.raises(PreflightError, match="no data hash \\(old identity\\)"):
        api.diff(a, b)


def test_diff_refuses_traces_of_two_synth_models_of_different_seeds(tmp_path):
    """Same preset, other seed: same size and header hash (the old identity could not tell them apart). The fake
    engine ignores the weights, so without the data hash these traces would even compare as exact."""
    from fake_engine import FakeEngine

    from parity.gguf.synth import synthesize

    a_model = synthesize(tmp_path / "a.gguf", "tiny", "real-mix", seed=1)
    b_model = synthesize(tmp_path / "b.gguf", "tiny", "real-mix", seed=2)
    a = api.trace(FakeEngine(str(a_model)), a_model, [0, 5, 7])
    b = api.trace(FakeEngine(str(b_model)), b_model, [0, 5, 7])
    assert (a.header.model["size"], a.header.model["header_sha256"]) == \
        (b.header.model["size"], b.header.model["header_sha256"])
    with pytest.raises(PreflightError, match="model identity differs"):
        api.diff(a, b)
    assert api.diff(a, b, force=True).exact  # what the old identity would have reported


def test_a_logits_drift_renders_in_every_report_form():
    from parity.compare.plot import drift_figure
    from parity.compare.printers import to_markdown, verdict_line

    a, b = _changed(lambda t: t.vectors["logits"].__setitem__(1, t.vectors["logits"][1] * 1.5))
    r = api.diff(a, b)
    assert verdict_line(r).startswith("first drifting checkpoint: logits")
    assert "logits" in to_markdown(r)
    fig = drift_figure(r)  # no checkpoint to mark: the figure still renders, with the verdict in its title
    assert "first drift: logits" in fig.get_suptitle() and len(fig.axes) >= 3


# Each layer diagnostic a printed report must name when it alone differs (the words come from the printer; the
# point is that no recorded difference is invisible in the console and Markdown output).
PRINTED = {
    "expert-weight": "expert weights",
    "expert-order": "same experts in another order",
    "router-margin": "router margins",
    "hc-gate-nan": "HC mixes",
    "n-comp": "visible-compressed-row count",
    "side-file-logits": "full logits: worst rel-L2",
}


@pytest.mark.parametrize("case", sorted(PRINTED))
def test_every_differing_diagnostic_is_printed(case):
    from parity.compare.printers import print_report, to_markdown

    a, b = _changed(SILENT[case])
    r = api.diff(a, b)
    lines: list[str] = []
    print_report(r, echo=lambda s="", **_: lines.append(click.unstyle(str(s))))
    console = " ".join(" ".join(lines).split())  # undo the 100-column wrapping
    assert PRINTED[case] in console, console
    assert PRINTED[case] in " ".join(to_markdown(r).split())


def test_a_table_only_one_trace_recorded_is_named_not_silently_skipped():
    a, b = toy_trace(0), toy_trace(0)
    empty = make_table("moe", {k: np.asarray(v)[:0] for k, v in b.moe.cols.items()},
                       {"E": b.moe["ids"].shape[1]})
    b = Trace(b.header, b.ckpt, b.hc, empty, b.attn)
    report = api.diff(a, b)
    assert report.warnings == ["routing (expert ids, weights, margins): only A (toy) recorded them, so they are not "
                               "compared"]
    assert api.diff(a, a).warnings == []


@pytest.mark.parametrize("side", ["A", "B"])
def test_a_compressed_row_selected_twice_is_a_selection_mismatch_and_named(side):
    """Selections compare as the sorted lists they are: [0, 0, -1] is not [0, -1, -1] (equal as sets), and the
    layer's report names the side that selects a row twice."""
    ok = toy_trace(7)
    twice = copy.deepcopy(ok)
    row = int(np.flatnonzero(twice.attn["has_sel"])[0])
    assert twice.attn["sel"][row].tolist() == [0, -1, -1]
    twice.attn["sel"][row] = [0, 0, -1]
    a, b = (twice, ok) if side == "A" else (ok, twice)
    r = api.diff(a, b)
    layer = int(twice.attn["layer"][row])
    e = r.layers.set_index("layer").loc[layer]
    assert (e["sel_mismatch"], e["sel_dup_a"], e["sel_dup_b"]) == (1, int(side == "A"), int(side == "B"))
    assert not r.exact
    words = dict(layer_differences(r))[layer]
    assert f"{side} selects a compressed row twice in 1 indexer selection(s)" in words
    assert "1 indexer selection mismatch(es)" in words
