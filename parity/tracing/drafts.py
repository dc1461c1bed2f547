"""Draft checkpoints from an engine's draft heads (issue 24): the drafter run on a sequence's trunk carriers.

`draft_records` runs the MTP head or the DSpark head of an engine opened with a drafter (`DraftHeads`) on the
trunk output carriers of every position 0..T-1 (the run's own when tracing, the candidate's when `check` teacher-
forces the reference's drafter) and returns, per draft checkpoint, one vector per position it is recorded at
(`parity.contract.checkpoints.draft_positions`):

* MTP (pairing prev | same, depth K): the MTP block replays every pair up to each traced position p in order, in
  one `mtp_forward` call per traced position (pairs after the previous traced position .. p), so the ring holds
  exactly the committed pairs <= p when depth k > 0 chains from the pair at p (`mtp_chain`, scratch rows).
  Rows: mtp.k.in / mtp.k.attn / mtp.k [H, D], mtp.k.logits [V].
* DSpark: one round per traced position p >= 1, each the round a speculative engine runs at start position p
  (`dspark_commit_bases`): its ring is committed through an earlier round's start position q (-1: empty), and the
  round's one `dspark_round` call writes the main rows q+1..p (its multi-row ring write; spec v4-mtp-dspark §3.5:
  the round after the one at q accepted p-q-1 drafts commits p-q <= B+1 rows), then drafts the block [anchor,
  noise...] with anchor = t_{p+1}, the run's next token (at the last position the trunk's argmax there,
  `last_argmax`). The first commit starts at position 0, as a prefill. An engine that writes each row it is given
  draws the same ring at every round whatever the schedule (rows are per position); one that drops rows of a
  multi-row write (fault `dspark-stale-ring`) is caught at the first round that writes more than one row after
  position 0. The taps are the engine's own (`dspark_taps` of the tapped layers' carriers: concat over
  `target_layer_ids` l of mean_s X^(l+1)_p[s], spec v4-mtp-dspark §3.2).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from parity.contract.checkpoints import (
    DSPARK_HEADS,
    DSPARK_MAIN,
    MTP_PAIRINGS,
    draft_checkpoints,
    draft_positions,
    mtp_checkpoints,
)
from parity.contract.engine import Engine
from parity.contract.errors import TraceError


def draft_header(engine: Engine, pairing: str, depth: int) -> dict[str, Any]:
    """The trace header's `draft` entry for `engine`'s drafter: the file's identity, kind and layout, and for MTP
    the pairing and chain depth, for DSpark the stage count and block size."""
    d = drafter_of(engine)
    c = d.config
    ident = {k: v for k, v in d.weights.identity().items() if k in ("file", "size", "header_sha256", "data_sha256")}
    if c.kind == "mtp":
        if pairing not in MTP_PAIRINGS:
            raise TraceError(f"--mtp-pairing {pairing!r}; expected one of {', '.join(MTP_PAIRINGS)}")
        if depth < 1:
            raise TraceError(f"--mtp-depth must be >= 1, got {depth}")
        return {"kind": "mtp", "layout": c.layout, **ident, "pairing": pairing, "depth": int(depth)}
    if (pairing, depth) != ("prev", 1):
        raise TraceError(f"a DSpark drafter ({d.path.name}) takes no MTP pairing / depth (got {pairing}, {depth})")
    return {"kind": "dspark", "layout": c.layout, **ident, "stages": c.n_blocks, "block_size": c.block_size}


def draft_names(draft: Mapping[str, Any]) -> list[str]:
    """The draft checkpoints a header's `draft` entry implies, in order."""
    return draft_checkpoints(draft["kind"], draft["depth"] if draft["kind"] == "mtp" else draft["stages"])


def drafter_of(engine: Engine) -> Any:
    """The engine's opened drafter (an engine constructed with draft=FILE keeps it as `drafter`), or a TraceError
    saying the engine has none."""
    drafter = getattr(engine, "drafter", None)
    if drafter is None:
        raise TraceError(f"engine {engine.name}: no drafter opened (give --draft FILE / draft=FILE)")
    return drafter


def tapped_layers(engine: Engine, draft: Mapping[str, Any]) -> list[int]:
    """Trunk layers whose output carriers the drafter reads: MTP the last one, DSpark its target layers."""
    if draft["kind"] == "mtp":
        return [engine.config.n_layers - 1]
    return list(drafter_of(engine).config.target_layer_ids)


def draft_records(engine: Engine, draft: Mapping[str, Any], carriers: Mapping[int, np.ndarray], tokens: Sequence[int],
                  positions: Sequence[int], last_argmax: int) -> dict[str, np.ndarray]:
    """Every draft checkpoint's vectors at its positions (module doc). carriers: layer -> X^(l+1) [T, H, D] for
    `tapped_layers`; tokens [T]; positions: the traced positions; last_argmax: the trunk's argmax at T-1."""
    tokens = np.asarray(tokens, np.int64)
    if draft["kind"] == "mtp":
        return mtp_records(engine, carriers[engine.config.n_layers - 1], tokens, positions, draft["pairing"],
                           draft["depth"])
    taps = engine.dspark_taps([carriers[l] for l in drafter_of(engine).config.target_layer_ids])
    return dspark_records(engine, taps, tokens, positions, last_argmax)


def mtp_records(engine: Any, X: np.ndarray, tokens: np.ndarray, positions: Sequence[int], pairing: str,
                depth: int) -> dict[str, np.ndarray]:
    """MTP rows at every traced position with a pair (module doc). X [T, H, D] trunk output carriers."""
    at = draft_positions("mtp.0", positions, pairing)
    state, rows = engine.new_mtp_state(), {n: [] for n in mtp_checkpoints(depth)}
    prev = pairing == "prev"
    nxt = 1 if prev else 0     # the next pair's position (its token's)
    for p in at:
        first = nxt - 1 if prev else nxt    # the first carrier of this call = its MTP start position
        out = engine.mtp_forward(state, X[first : p + 1], tokens[first : p + 1], first, pairing)
        nxt = p + 1
        chain = engine.mtp_chain(state, out, p if prev else p + 1, depth) if depth > 1 else []
        for k, o in enumerate([out, *chain]):
            i = len(o.logits) - 1
            for suffix, arr in ((".in", o.input), (".attn", o.attn_carrier), ("", o.carrier), (".logits", o.logits)):
                rows[f"mtp.{k}{suffix}"].append(np.asarray(arr[i], np.float32))
    return {n: np.stack(v) for n, v in rows.items()}


def dspark_commit_bases(rounds: Sequence[int], block_size: int) -> list[int]:
    """For each DSpark round position p (ascending, >= 1), the position q < p its ring is committed through before
    the round writes rows q+1..p (-1: nothing committed, the round's write starts at position 0 like a prefill).

    A speculative engine's round at q drafts B = `block_size` slots; after accepting a' <= B of them its next round
    starts at q+1+a' and writes those a'+1 rows (spec v4-mtp-dspark §3.5). So q stays the commit base of every
    round up to q+B+1; the last round within that span becomes the next base (all B drafts accepted). With sparse
    positions a round further than B+1 from the base writes every row since it (as many rows as the gap).
    """
    if block_size < 1:
        raise TraceError(f"DSpark block size must be >= 1, got {block_size}")
    base, out = -1, []
    for i, p in enumerate(rounds):
        out.append(base)
        if i + 1 == len(rounds) or rounds[i + 1] - base > block_size + 1:
            base = p
    return out


def dspark_records(engine: Any, taps: np.ndarray, tokens: np.ndarray, positions: Sequence[int],
                   last_argmax: int) -> dict[str, np.ndarray]:
    """DSpark rounds at every traced position p >= 1 (module doc). taps [T, m·D]."""
    at = draft_positions(DSPARK_MAIN, positions, None)
    bases = dspark_commit_bases(at, drafter_of(engine).config.block_size)
    committed, rows = engine.new_dspark_state(), {}
    for i, (p, q) in enumerate(zip(at, bases, strict=True)):
        advance = i + 1 == len(at) or bases[i + 1] == p   # this round's ring is the next rounds' base
        state = committed if advance else copy.deepcopy(committed)
        anchor = int(tokens[p + 1]) if p + 1 < len(tokens) else int(last_argmax)
        r = engine.dspark_round(state, taps[q + 1 : p + 1], q + 1, anchor)
        committed = state if advance else committed
        got = {DSPARK_MAIN: r.main, **{f"dspark.{s}": x for s, x in enumerate(r.stages)},
               **dict(zip(DSPARK_HEADS, (r.base_logits, r.bias, r.logits, r.confidence, r.drafts), strict=True))}
        for name, arr in got.items():
            rows.setdefault(name, []).append(np.asarray(arr, np.float32))
    return {n: np.stack(v) for n, v in rows.items()}


def trunk_identity(identity: Mapping[str, Any]) -> dict[str, Any]:
    """An engine's model identity without the drafter entry an engine opened with one adds (`MergedWeights`): the
    trace header's `model` names the trunk, its `draft` the drafter."""
    return {k: v for k, v in identity.items() if k != "draft"}
