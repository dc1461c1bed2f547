"""llama.cpp's own MTP graph (`graph_mtp`, spec v4-mtp-dspark §2, §5.3), driven as llama-cpp-python 0.3.36's
`MTPDraftProvider` drives it.

The MTP file (llama.cpp's layout: `blk.L.nextn.*`, root `output_hc_*`, copies of the trunk's embedding and head)
is loaded with `load_mtp`; its context has `ctx_type = LLAMA_CONTEXT_TYPE_MTP` and hands out `h_nextn`
(`llama_set_embeddings_nextn(ctx, True, True)`). A batch row is a token t_p at position p together with a
hidden-state row, the trunk's final carrier X^(L) flattened to H·D, in the batch's `embd`:
* `prev` (llama.cpp's own pairing, `process()`): t_p with X^(L)_{p-1};
* `same` (ds4's): t_p with X^(L)_p.
llama.cpp places a pair at its token's position; v4parity's engines at its carrier's (one less under `prev`).
The MTP block attends only to its own rows with relative RoPE and no YaRN, so the two placements give the same
drafts up to RoPE-table rounding (§2.3) — what the tests measure. Chaining (depth k+1) feeds the block's own
output carrier of depth k, read back with `llama_get_embeddings_nextn_ith`, with its first-argmax draft at the
next position; the chain rows are scratch, removed with `llama_memory_seq_rm` afterwards (§2.5, replay).
`ctx_other` is left unset: llama.cpp keeps no link for this model (`llama_get_ctx_other` answers NULL even when
it is set) and the hidden rows reach the graph through the batch alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from llamacpp_engine.session import Context, Model, Settings
from parity.contract.draft import MTPOutput
from parity.contract.errors import ParityError
from parity.gguf.config import ModelConfig
from parity.gguf.llamacpp import mtp_names, mtp_output

PAIRINGS = {"prev": 1, "same": 0}   # pairing -> the token's position minus the carrier's


def mtp_pairs(carriers: np.ndarray, tokens: np.ndarray, pairing: str) -> tuple[np.ndarray, np.ndarray]:
    """(carrier, token) pairs of trunk rows at consecutive positions: prev (X_{p-1}, t_p), n-1 pairs; same
    (X_p, t_p), n pairs. carriers [n, H, D], tokens [n] -> hidden rows [n', H·D], tokens [n']."""
    if pairing not in PAIRINGS:
        raise ParityError(f"mtp_pairing must be one of {', '.join(PAIRINGS)}, got {pairing!r}")
    flat = carriers.reshape(len(carriers), -1)
    return (flat[:-1], tokens[1:]) if pairing == "prev" else (flat, tokens)


@dataclass
class MTPState:
    """One sequence of the MTP context: its rows and the pairing they were fed with (positions depend on it)."""

    ctx: Context
    pairing: str | None = None


class MTPHead:
    """The MTP model of one llama.cpp MTP file, for the trunk config `cfg`."""

    def __init__(self, path: str, settings: Settings, cfg: ModelConfig) -> None:
        self.cfg = cfg
        self.model = Model(path, settings, mtp_names(cfg), mtp=True)
        width = int(self.model.lib.llama_model_n_embd_out(self.model.ptr))
        if width != cfg.hc_mult * cfg.dim:   # the hidden row of a batch: one carrier, H·D floats
            raise ParityError(f"llamacpp: {path}: llama.cpp's MTP model takes hidden rows of {width} floats, the "
                              f"trunk's carriers have H·D = {cfg.hc_mult * cfg.dim}")
        from llama_cpp import llama_cpp_ext

        self.ext = llama_cpp_ext

    def new_state(self) -> MTPState:
        return MTPState(Context(self.model))

    def forward(self, state: MTPState, carriers: np.ndarray, tokens: np.ndarray, start_pos: int,
                pairing: str) -> MTPOutput:
        """The MTP graph on the pairs of trunk rows at positions start_pos.. (carriers [n, H, D], tokens [n]);
        start_pos is the first carrier's position, as in the other engines."""
        cfg = self.cfg
        if carriers.shape != (len(tokens), cfg.hc_mult, cfg.dim):
            raise ParityError(f"mtp_forward: carriers of shape {carriers.shape} for {len(tokens)} tokens, expected "
                              f"({len(tokens)}, {cfg.hc_mult}, {cfg.dim})")
        hidden, tau = mtp_pairs(np.asarray(carriers, np.float32), tokens, pairing)
        if len(tau) == 0:
            raise ParityError(f"mtp_forward: {len(tokens)} rows make no {pairing} pair")
        if state.pairing not in (None, pairing):
            raise ParityError(f"mtp_forward: mtp_pairing={pairing} on an MTP state fed with {state.pairing} pairs "
                              "(llama.cpp places a pair at its token's position: one pairing per state)")
        state.pairing = pairing
        t = state.ctx.decode(tau, int(start_pos) + PAIRINGS[pairing], hidden=hidden)
        return mtp_output(t, cfg, len(tau))

    def chain(self, state: MTPState, last: MTPOutput, start_pos: int, depth: int) -> list[MTPOutput]:
        """Depths 2..depth after the pair `last` (its last row): depth k+1 feeds (the output carrier of depth k,
        its first-argmax draft) at the next position (start_pos: the carrier position after `last`'s last pair).
        Depth 2 starts from `last.carrier` (the graph's `h_nextn` tensor), deeper ones from llama.cpp's own
        readout `llama_get_embeddings_nextn_ith`. The chain rows are removed from the state afterwards."""
        if depth < 1:
            raise ParityError(f"mtp_chain: depth must be >= 1, got {depth}")
        if state.pairing is None:
            raise ParityError("mtp_chain: the MTP state has no pair yet (call mtp_forward first)")
        ctx = state.ctx
        pos = int(start_pos) + PAIRINGS[state.pairing]
        if pos != ctx.next_pos:
            raise ParityError(f"mtp_chain: start_pos {start_pos} is not the position after the state's last pair "
                              f"({ctx.next_pos - PAIRINGS[state.pairing]})")
        h, logits, outs = last.carrier[-1].reshape(-1), last.logits[-1], []
        try:
            for k in range(depth - 1):
                t = ctx.decode(np.array([int(np.argmax(logits))]), pos + k, hidden=h[None])
                outs.append(mtp_output(t, self.cfg, 1))
                h, logits = self._nextn_row(ctx), outs[-1].logits[0]
        finally:
            ctx.truncate(pos)
        return outs

    def _nextn_row(self, ctx: Context) -> np.ndarray:
        """llama.cpp's own readout of the MTP context's latest output carrier (`llama_get_embeddings_nextn_ith`,
        what its chains feed on): [H·D]."""
        ptr = self.ext.llama_get_embeddings_nextn_ith(ctx.ptr, -1)
        if not ptr:
            raise ParityError("mtp_chain: llama.cpp has no h_nextn row for the MTP context's last output")
        return np.ctypeslib.as_array(ptr, shape=(self.cfg.hc_mult * self.cfg.dim,)).copy()
