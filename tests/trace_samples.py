"""Small, valid traces built directly from the data model (no engine, no model file), for reader tests.

`toy_trace(seed)`: 2 layers, H = 2 streams, D = 3, top-k 2, positions 0..2, every table filled, all numbers
drawn from `seed`; `with_vectors=True` adds full vectors for embed, blk.1 and logits (V = 5), and the ckpt records of
embed and blk.1 then hold those vectors' statistics and fingerprints, final_norm's the logits' argmax and top-k.
"""

from __future__ import annotations

import numpy as np

from parity.contract.checkpoints import trace_checkpoints
from parity.tracing.records import Table, Trace, TraceHeader, make_table
from parity.tracing.stats import FP_DIM, carrier_stats, top_k

H, D, K, E, S, V = 2, 3, 2, 2, 3, 5
LAYERS = 2
TOKENS = [4, 1, 3]


def toy_trace(seed: int = 0, with_vectors: bool = False) -> Trace:
    rng = np.random.default_rng(seed)
    names = trace_checkpoints(LAYERS)
    positions = list(range(len(TOKENS)))
    full = ["embed", "blk.1", "logits"] if with_vectors else []
    header = TraceHeader(
        engine="toy", engine_version=f"seed-{seed}",
        model={"file": "toy.gguf", "size": 1234, "header_sha256": "0123456789abcdef",
               "data_sha256": "fedcba9876543210"},
        dtype="float32", n_hc=H, dim=D, top_k=K, tokens=list(TOKENS), n_prompt=len(TOKENS), chunks=[len(TOKENS)],
        decode=0, positions=positions, checkpoints=names, full=full, flags={"seed": seed})
    rows = {c: [] for c in ("ck", "pos", "tok", "min", "max", "rms", "l2s", "sum_l2", "fp", "argmax", "top_ids",
                            "top_logits")}
    for ck, name in enumerate(names):
        for p in positions:
            final = name == "final_norm"
            ids = rng.permutation(V)[:K]
            for c, v in (("ck", ck), ("pos", p), ("tok", TOKENS[p]), ("min", -rng.random()), ("max", rng.random()),
                         ("rms", rng.random() + 0.5),
                         ("l2s", [rng.random(), np.nan] if final else rng.random(H).tolist()),
                         ("sum_l2", rng.random()), ("fp", rng.standard_normal(FP_DIM)),
                         ("argmax", ids[0] if final else -1), ("top_ids", ids if final else [-1] * K),
                         ("top_logits", np.sort(rng.standard_normal(K))[::-1] if final else [np.nan] * K)):
                rows[c].append(v)
    widths = {"H": H, "F": FP_DIM, "K": K, "E": E, "S": S}
    lp = [(layer, p) for layer in range(LAYERS) for p in positions]
    hc = {"layer": [], "sub": [], "pos": [], "pre": [], "post": [], "comb": []}
    for layer, p in lp:
        for sub in (0, 1):
            for c, v in (("layer", layer), ("sub", sub), ("pos", p), ("pre", rng.random(H)), ("post", rng.random(H)),
                         ("comb", rng.random(H * H))):
                hc[c].append(v)
    moe = {"layer": [l for l, _ in lp], "pos": [p for _, p in lp],
           "ids": [rng.permutation(4)[:E] for _ in lp], "w": [rng.random(E) for _ in lp],
           "margin": [np.nan if layer == 0 else rng.random() for layer, _ in lp]}
    attn = {"layer": [l for l, _ in lp], "pos": [p for _, p in lp], "n_comp": [p for _, p in lp],
            "has_sel": [layer == 1 for layer, _ in lp],
            "sel": [[0, -1, -1] if layer == 1 else [-1] * S for layer, _ in lp]}
    tables = {"ckpt": make_table("ckpt", rows, widths), "hc": make_table("hc", hc, widths),
              "moe": make_table("moe", moe, widths), "attn": make_table("attn", attn, widths)}
    vectors = None
    if with_vectors:
        P = len(positions)
        vectors = {"embed": rng.standard_normal((P, H, D)).astype(np.float32),
                   "blk.1": rng.standard_normal((P, H, D)).astype(np.float32),
                   "logits": rng.standard_normal((P, V)).astype(np.float32)}
        cols = dict(tables["ckpt"].cols)   # the records with a vector describe it (every reader checks)
        for name in ("embed", "blk.1"):
            rows = np.flatnonzero(cols["ck"] == names.index(name))
            for c, v in carrier_stats(vectors[name]).items():
                cols[c] = cols[c].copy()
                cols[c][rows] = v
        final = np.flatnonzero(cols["ck"] == names.index("final_norm"))
        ids, vals = top_k(vectors["logits"], K)
        for c, v in (("argmax", ids[:, 0]), ("top_ids", ids), ("top_logits", vals)):
            cols[c] = cols[c].copy()
            cols[c][final] = v
        tables["ckpt"] = Table(cols)
    return Trace(header, **tables, vectors=vectors)
