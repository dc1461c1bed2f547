"""Draft sources of the speculative driver: the MTP head (depth k), a DSpark block (B slots), or a script.

A source sees the trunk rows of the newly committed positions first..c (a `ChunkResult` of the prefill, of the
verify batch or of its replay), turns them into its inputs (`inputs`: MTP carriers X^(L) [n, H, D], DSpark taps
[n, m·D]), writes them into its own state and drafts after the anchor t_{c+1} (`draft`). The attribution feeds the
reference engine's source the candidate's own inputs, so both drafters draft on identical inputs (§6.1 d*).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from parity.contract.checkpoints import MTP_PAIRINGS, block, dspark_checkpoints, mtp_checkpoints
from parity.contract.engine import DraftHeads, Engine, StateSnapshots
from parity.contract.errors import ParityError
from parity.gguf.drafter import DrafterConfig
from parity.tracing.runner import ChunkResult


@dataclass(frozen=True)
class Proposal:
    """One round's drafts d_1..d_k, the DSpark raw confidence logits c_1..c_k (None for MTP and scripts), the
    logits each draft was taken from [k, V] (None for scripts) and the round's draft checkpoints in their order
    (`parity.contract.checkpoints`: MTP mtp.k.in / .attn / mtp.k / .logits of the row drafting d_{k+1}; DSpark
    dspark.main, dspark.{s}, the heads; empty for scripts)."""

    drafts: np.ndarray
    confidence: np.ndarray | None
    logits: np.ndarray | None
    checkpoints: dict[str, np.ndarray] = field(default_factory=dict)


def dspark_taps(carriers: Sequence[np.ndarray]) -> np.ndarray:
    """T = concat over the tapped layers of the stream mean of each layer's output carrier (spec §3.2).
    m carriers [n, H, D] -> [n, m·D]."""
    return np.concatenate([np.asarray(c).mean(axis=1) for c in carriers], axis=-1)


def need_snapshots(engine: Engine) -> StateSnapshots:
    """`engine` when it can snapshot its states, else a ParityError naming the capability."""
    if not isinstance(engine, StateSnapshots):
        raise ParityError(f"engine {engine.name!r} cannot run speculative decoding: it has no state snapshots "
                          "(the StateSnapshots capability)")
    return engine


def need_heads(engine: Engine) -> DraftHeads:
    """`engine` when it has draft heads and state snapshots, else a ParityError naming the capability."""
    need_snapshots(engine)
    if not isinstance(engine, DraftHeads):
        raise ParityError(f"engine {engine.name!r} has no draft heads (the DraftHeads capability): open it with "
                          "--draft FILE")
    return engine


class MTPSource:
    """MTP drafts of chain depth k with ring policy `replay` (§2.5): the pair of every committed position goes into
    the MTP ring, the chain's rows are scratch (`mtp_chain` on a copy). Pairing (§2.3, logged):

    * `prev` (llama.cpp, vLLM): pairs (X^(L)_{p-1}, t_p) at MTP position p-1; d_1 comes from the anchor's pair
      (X^(L)_c, t_{c+1}), d_2..d_k from the chain: k drafts.
    * `same` (ds4): pairs (X^(L)_p, t_p) at MTP position p; the pair of c predicts t_{c+1}, the anchor the trunk has
      already committed (ds4's draft 0, checked for free): when it is not the anchor the round drafts nothing (ds4:
      no speculation this round), else the chain from (X1, t_{c+1}) at c+1 drafts d_1..d_{k-1}: k - 1 drafts, so
      depth 1 would never draft (refused)."""

    kind = "mtp"

    def __init__(self, engine: Engine, depth: int, pairing: str = "prev") -> None:
        if pairing not in MTP_PAIRINGS:
            raise ParityError(f"MTP pairing {pairing!r}: expected one of {', '.join(MTP_PAIRINGS)}")
        if depth < (2 if pairing == "same" else 1):
            raise ParityError(f"--depth must be >= 1 for an MTP drafter, got {depth}" if depth < 1 else
                              "--depth 1 with pairing same never drafts (the pair of c predicts the anchor, which "
                              "is already committed; spec §2.3): give --depth >= 2")
        self.engine, self.depth, self.pairing = need_heads(engine), depth, pairing
        self.state = self.engine.new_mtp_state()

    def inputs(self, rows: ChunkResult) -> np.ndarray:
        return rows.checkpoints[block(self.engine.config.n_layers - 1)]

    def draft(self, inputs: np.ndarray, seq: Sequence[int], first: int,
              forced: np.ndarray | None = None) -> Proposal:
        """inputs: X^(L) of positions first..c; seq: committed tokens t_0..t_{c+1}. `forced`: chain on these
        drafts instead of the source's own (teacher forcing: the reference drafter on the candidate's drafts), on a
        snapshot of the MTP state used as scratch (the reference's snapshot is a deep copy)."""
        c = first + len(inputs) - 1
        anchor = int(seq[c + 1])
        if self.pairing == "prev":
            # the prev pairs of the rows first..c+1: X^(L)_{c+1} (the anchor's row, not run yet) is not paired
            carriers = np.concatenate([inputs, np.zeros_like(inputs[:1])])
            out = self.engine.mtp_forward(self.state, carriers, np.asarray(seq[first : c + 2], np.int64), first,
                                          "prev")
            steps = self.depth - 1
            chain_tokens = list(forced[: min(self.depth, len(forced)) - 1]) if forced is not None else None
        else:
            out = self.engine.mtp_forward(self.state, inputs, np.asarray(seq[first : c + 1], np.int64), first, "same")
            if forced is None and int(np.argmax(out.logits[-1])) != anchor:
                steps, chain_tokens = 0, None        # draft 0 is not the anchor: no speculation this round
            else:
                steps = self.depth - 1   # forced: as many chain steps as the candidate drafted (0 after its miss)
                chain_tokens = (None if forced is None else
                                [anchor, *forced[: min(steps, len(forced)) - 1]] if len(forced) else [])
        rows = [(out.input[-1], out.attn_carrier[-1], out.carrier[-1], out.logits[-1])]
        if chain_tokens is None:
            rows += [(o.input[0], o.attn_carrier[0], o.carrier[0], o.logits[0])
                     for o in (self.engine.mtp_chain(self.state, out, c + 1, steps + 1) if steps else [])]
        else:
            scratch, G = self.engine.snapshot(self.state), out.carrier[-1:]
            for k, t in enumerate(chain_tokens):
                step = self.engine.mtp_forward(scratch, G, np.asarray([t], np.int64), c + 1 + k, "same")
                G = step.carrier
                rows.append((step.input[0], step.attn_carrier[0], step.carrier[0], step.logits[0]))
        logits = np.stack([r[3] for r in rows])
        names = mtp_checkpoints(len(rows))
        checkpoints = dict(zip(names, (np.asarray(a) for r in rows for a in r), strict=True))
        drafted = logits if self.pairing == "prev" else logits[1:]    # same: row 0 predicts the anchor
        return Proposal(drafted.argmax(axis=1), None, drafted, checkpoints)


class DSparkSource:
    """One DSpark block of B drafts per round (§3.3-§3.5): the main rows of every newly committed position are
    written into each stage's ring, then the block [anchor, ν × (B-1)] drafts from start position c."""

    kind = "dspark"

    def __init__(self, engine: Engine, config: DrafterConfig) -> None:
        self.engine, self.config = need_heads(engine), config
        self.state = self.engine.new_dspark_state()

    def inputs(self, rows: ChunkResult) -> np.ndarray:
        return dspark_taps([rows.checkpoints[block(l)] for l in self.config.target_layer_ids])

    def draft(self, inputs: np.ndarray, seq: Sequence[int], first: int,
              forced: np.ndarray | None = None) -> Proposal:
        """inputs: taps of positions first..c; seq: committed tokens t_0..t_{c+1}. `forced` is not used: the
        Markov chain conditions on the source's own drafts (no teacher forcing inside a block)."""
        c = first + len(inputs) - 1
        if c < 1:
            raise ParityError("a DSpark round needs start position c >= 1: give a prompt of at least 2 tokens")
        r = self.engine.dspark_round(self.state, inputs, first, int(seq[c + 1]))
        values = [r.main, *r.stages, r.base_logits, r.bias, r.logits, r.confidence, np.asarray(r.drafts, np.float64)]
        names = dspark_checkpoints(len(r.stages))
        return Proposal(np.asarray(r.drafts, np.int64), np.asarray(r.confidence, np.float64), r.logits,
                        dict(zip(names, map(np.asarray, values), strict=True)))


class ScriptSource:
    """Scripted drafts (§6.4): the reference's greedy continuation `script` (t_0..), k drafts a round; with
    `reject_at = i` the i-th draft of every round is replaced by another token (so the verifier rejects it)."""

    kind = "script"

    def __init__(self, script: Sequence[int], depth: int, reject_at: int | None, vocab_size: int) -> None:
        if depth < 1:
            raise ParityError(f"--depth must be >= 1 for scripted drafts, got {depth}")
        if reject_at is not None and not 1 <= reject_at <= depth:
            raise ParityError(f"script reject-at:{reject_at}: the depth to reject must lie in 1..{depth}")
        self.script, self.depth, self.reject_at, self.vocab = list(script), depth, reject_at, vocab_size

    def inputs(self, rows: ChunkResult) -> np.ndarray:
        return np.zeros((len(rows.tokens), 0), np.float32)

    def draft(self, inputs: np.ndarray, seq: Sequence[int], first: int,
              forced: np.ndarray | None = None) -> Proposal:
        c = first + len(inputs) - 1
        drafts = np.asarray(self.script[c + 2 : c + 2 + self.depth], np.int64)
        if self.reject_at is not None and len(drafts) >= self.reject_at:
            drafts[self.reject_at - 1] = (drafts[self.reject_at - 1] + 1) % self.vocab
        return Proposal(drafts, None, None)


def parse_script(text: str) -> int | None:
    """`accept-all` -> None; `reject-at:I` -> I (the depth whose draft is made wrong); else a ParityError."""
    if text == "accept-all":
        return None
    kind, sep, value = text.partition(":")
    if kind == "reject-at" and sep and value.isdigit() and int(value) >= 1:
        return int(value)
    raise ParityError(f"script {text!r}: expected accept-all or reject-at:I with I >= 1")

