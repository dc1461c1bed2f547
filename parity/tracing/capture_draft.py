"""Draft checkpoints in a llama.cpp capture (`v4parity capture llamacpp --draft FILE`, issue 24 item 4).

The capture of a run holds llama.cpp's trunk tensors by llama.cpp name (`parity.gguf.llamacpp`). With an MTP
drafter the engine's MTP graph is then run on the run's own final carriers X^(L) (`l_last-{L-1}`, every position)
exactly as `trace --engine llamacpp --draft` runs it (`parity.tracing.drafts.draft_records`: one MTP call per
position, chained to the header's depth), and each draft checkpoint is stored beside the trunk tensors:
`draft:<checkpoint>` [n, ...] (the vectors, `mtp.k.in` / `mtp.k.attn` / `mtp.k` [n, H, D], `mtp.k.logits` [n, V])
and `draft_positions:<checkpoint>` int [n] (the positions they are recorded at); the capture's meta gets the
trace header's `draft` entry. Readers that map only trunk tensors list these keys as unmapped.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from parity.contract.checkpoints import draft_positions
from parity.contract.engine import Engine
from parity.contract.errors import TraceError
from parity.gguf.llamacpp import LOGITS_NAME, key, rows
from parity.tracing.drafts import draft_records

DRAFT_PREFIX, POSITIONS_PREFIX = "draft:", "draft_positions:"


def capture_draft_arrays(engine: Engine, draft: Mapping[str, Any], arrays: Mapping[str, np.ndarray]
                         ) -> dict[str, np.ndarray]:
    """The draft checkpoints of a captured run (`arrays`: the engine's `capture` output; `draft`: the header entry
    of `draft_header`), keyed as in the module docstring."""
    cfg = engine.config
    last = key("l_last", cfg.n_layers - 1)
    for k in (last, LOGITS_NAME, "input_ids"):
        if k not in arrays:
            raise TraceError(f"capture: {k} missing; the draft checkpoints need the run's final carriers and logits")
    tokens = np.asarray(arrays["input_ids"], np.int64)
    X = rows(arrays[last], (cfg.hc_mult, cfg.dim), last)
    positions = list(range(len(tokens)))
    got = draft_records(engine, draft, {cfg.n_layers - 1: X}, tokens, positions,
                        int(np.argmax(np.asarray(arrays[LOGITS_NAME])[-1])))
    out: dict[str, np.ndarray] = {}
    for name, vectors in got.items():
        out[DRAFT_PREFIX + name] = vectors
        out[POSITIONS_PREFIX + name] = np.asarray(draft_positions(name, positions, draft.get("pairing")), np.int64)
    return out
