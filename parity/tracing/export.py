"""Export a trace's full vectors as plain numpy arrays, so anyone can use our numbers without our code.

The .npz holds one array per recorded checkpoint, named by checkpoint (`embed`, `blk.0.attn`,
`blk.0`, ..., `final_norm`, `logits`): carriers [positions, streams, dim], `final_norm` [positions, dim],
`logits` [positions, vocab]; plus `positions` [P] (the traced positions, row order), `tokens` [P]
(the token fed at each of those positions) and `all_tokens` [T] (prompt + generated). A draft checkpoint (`mtp.*`,
`dspark.*`: docs/trace-format.md) is recorded at its own positions, a subset of them: `<name>.positions` [P_name]
lists them, row order (MTP `prev` pairing: no row at position 0).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from parity.contract.checkpoints import is_draft
from parity.contract.errors import TraceError
from parity.tracing.io import write_npz
from parity.tracing.records import Trace


def export_arrays(trace: Trace) -> dict[str, np.ndarray]:
    """The arrays `export_npz` writes, in depth order."""
    h = trace.header
    if not h.full or not trace.vectors:
        raise TraceError("this trace recorded no full vectors (fingerprints only); re-run `v4parity trace` with "
                         "--full all (or --full blk.2,final_norm,...) to export arrays")
    out = {name: np.asarray(trace.vectors[name], dtype=np.float32) for name in h.full}
    out |= {f"{name}.positions": np.asarray(h.positions_of(name), dtype=np.int64) for name in h.full if is_draft(name)}
    out["positions"] = np.asarray(h.positions, dtype=np.int64)
    out["tokens"] = np.asarray([h.tokens[p] for p in h.positions], dtype=np.int64)
    out["all_tokens"] = np.asarray(h.tokens, dtype=np.int64)
    return out


def export_npz(trace: Trace, out: str | os.PathLike) -> Path:
    """Write `export_arrays(trace)` to `out` (atomic, deterministic)."""
    return write_npz(out, export_arrays(trace))
