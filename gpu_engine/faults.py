"""Fault injection: known porting bugs, each a one-line switch.

`Faults.parse(names)` validates the names (`FAULTS` and `DRAFT_FAULTS`, the keys of `FAULT_TABLE` and
`DRAFT_FAULT_TABLE`) and yields an object with one boolean per fault (dashes become underscores). A fault is an
alternative op of the same signature as the model's: `compose` puts it in place of the correct op in the engine's
`Ops` (one line per fault); the one fault that is not an op (`compress-ratios-u32`, a wrong read of the layer
schedule) is one line in `TorchEngine.__init__`, and `spec-no-compressor-restore` (an incomplete state snapshot) one
line in `TorchEngine.restore`; `spec-logits-row-stale` and `spec-tie-last-max` replace the engine's own picks in a
speculative round (`Ops.next_row`, `Ops.verify_argmax`: the `VerifyPicks` capability the driver asks).
`FAULT_TABLE` documents the trunk's faults, `DRAFT_FAULT_TABLE` the draft heads' (which never act on the trunk: its
ops are not theirs), `SPEC_FAULT_TABLE` the speculative path's (verify batches, snapshots and the round's own picks:
plain decode is unchanged); all for `--help`/docs.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from gpu_engine.attention import attend_ring_exact_window, n_visible_late, sink_attention_no_sink
from gpu_engine.compressor import (
    completed_blocks_multi_token,
    csa_slots_halves_swapped,
    pool_blocks_verify_frontier,
)
from gpu_engine.draft import (
    dspark_mask_causal,
    dspark_taps_summed,
    markov_chain_unconditioned,
    mtp_carrier_no_ffn_post,
    mtp_input_hnorm_flat,
    mtp_pairs_same,
    ring_write_newest_row,
    trunk_hc_head,
)
from gpu_engine.hc import hc_post_not_transposed
from gpu_engine.indexer import select_rows_ties_highest
from gpu_engine.model import Ops
from gpu_engine.moe import biased_keys
from gpu_engine.ops import apply_rope_split_halves, identity, swiglu_symmetric_clamp
from gpu_engine.verify import last_max_rows, last_verify_row
from parity.contract.errors import ParityError

# name -> (where the switch lives, what it breaks, first layer kind where it acts)
FAULT_TABLE: dict[str, tuple[str, str, str]] = {
    "compress-ratios-u32": ("engine.TorchEngine.__init__ (schedule read)",
                            "ratio array read with the wrong integer width: empty schedule, every layer SWA with the "
                            "main RoPE base (no compressor, no indexer, no YaRN)", "first compressed layer"),
    "no-decode-compression": ("compressor.completed_blocks_multi_token",
                              "compressed rows emitted only in multi-token chunks, never in 1-token decode",
                              "first compressed layer, first decode step that completes a block"),
    "comb-not-transposed": ("hc.hc_post_not_transposed", "HC_post mixes with C X instead of C^T X",
                            "layer 0 (blk.0.attn)"),
    "rope-split-halves": ("ops.apply_rope_split_halves", "NeoX split-halves pairing instead of interleaved pairs",
                          "layer 0"),
    "sink-dropped": ("attention.sink_attention_no_sink", "attention sink left out of the softmax denominator",
                     "layer 0"),
    "router-bias-in-weights": ("moe.biased_keys", "routing weights from the biased selection scores",
                               "first non-hash layer"),
    "swiglu-symmetric-clamp": ("ops.swiglu_symmetric_clamp", "gate clamped to [-c, c] instead of (-inf, c]",
                               "layer 0 (FFN)"),
    "fp8-kv-off": ("ops.identity in place of ops.fp8_sim_nope", "FP8 e4m3 KV simulation skipped although enabled",
                   "layer 0 (needs --fp8-kv, the default)"),
    "indexer-ties-highest": ("indexer.select_rows_ties_highest", "top-k ties broken towards the highest row index",
                             "first CSA layer with > top_k rows, only where scores tie at the cut"),
    "csa-halves-swapped": ("compressor.csa_slots_halves_swapped", "CSA overlap (A) and current (B) halves swapped",
                           "first CSA layer, first emitted row"),
    "compressed-row-visible-late": ("attention.n_visible_late", "row j visible only when (j+1)*m <= t (one token late)",
                                    "first compressed layer, first block end"),
}

# draft-head fault -> (alternative op, what it breaks, first draft quantity where it acts, public origin: spec §4.6)
DRAFT_FAULT_TABLE: dict[str, tuple[str, str, str, str]] = {
    "mtp-pairing-same": ("draft.mtp_pairs_same", "asked for the prev pairing, pairs X^(L)_p with t_p",
                         "mtp.0.in (MTPOutput.input)",
                         "pairing convention, spec §2.3: ds4 same, llama.cpp / vLLM prev"),
    "mtp-hnorm-flat": ("draft.mtp_input_hnorm_flat", "hnorm over the flat H*D carrier instead of per stream",
                       "mtp.0.in", "D7: GDzhu01/vllm-ascend-deepseekv4 PR #132, ROCm/ATOM #1742"),
    "mtp-no-hc-post": ("draft.mtp_carrier_no_ffn_post", "MTP block's FFN HC_post skipped: X1 = Y",
                       "mtp.0 (MTPOutput.carrier; mtp.0.in and mtp.0.attn unchanged)",
                       "D6: vllm-project/vllm PR #45240 (syncing #44821, #43746)"),
    "mtp-trunk-hc-head": ("draft.trunk_hc_head", "the trunk's output_hc_* head on the MTP carrier",
                          "mtp.0.logits (carriers unchanged)",
                          "spec §5.1: llama.cpp's MTP file names the MTP's head output_hc_* (spec-derived)"),
    "dspark-tap-sum": ("draft.dspark_taps_summed", "taps = stream sum instead of stream mean",
                       "the taps (x H exactly); dspark.main only through main_norm's eps",
                       "spec §3.2 (spec-derived; the spec expects it nearly invisible)"),
    "dspark-causal-block": ("draft.dspark_mask_causal", "causal mask inside the block instead of bidirectional",
                            "dspark.0, every slot but the last (B-1 sees all rows either way)",
                            "spec §3.4 / §4.6 (spec-derived)"),
    "dspark-markov-unconditioned": ("draft.markov_chain_unconditioned",
                                    "Markov bias W2 W1[anchor] for every slot instead of W1[previous draft]",
                                    "dspark.bias from slot 1 (base logits unchanged)",
                                    "spec §3.3, PAPER eq. 5 (spec-derived)"),
    "dspark-stale-ring": ("draft.ring_write_newest_row", "after the prompt, one ring row per round (the newest)",
                          "dspark.0 of the second round (the first round writes the prompt in full)",
                          "D9: TensorSharp TS_DSV4_DSPARK_CAPTURE=0"),
}

# speculative-path fault -> (where the switch lives, what it breaks, where it acts first, spec §4.6)
SPEC_FAULT_TABLE: dict[str, tuple[str, str, str, str]] = {
    "spec-ring-exact-window": ("attention.attend_ring_exact_window",
                               "a verify batch in a ring of exactly W slots, written before attending: early rows "
                               "read the batch's later rows in place of their oldest keys",
                               "the first verify batch of n >= 2 rows ending at a position >= W (plain decode as is)",
                               "D1: ds4 metal_graph_raw_cap_for_context rationale"),
    "spec-no-compressor-restore": ("attention.restore_keeping_rows (TorchEngine.restore)",
                                   "a restore after a rejection brings back the windows and the compressors' "
                                   "pending state but keeps the rows the verify batch emitted (phantom rows)",
                                   "the first rejection after a verify batch that completed a compressed block",
                                   "D2: GDzhu01/vllm-ascend-deepseekv4 #131, PR #132"),
    "spec-commit-verify-frontier": ("compressor.pool_blocks_verify_frontier",
                                    "a multi-row chunk after the prompt (a verify batch, or the replay of >= 2 "
                                    "accepted rows) keeps the compressor rows its batched path pooled (rounded to "
                                    "bfloat16) instead of the ones sequential decode computes",
                                    "the first verify batch or replay of >= 2 rows that completes a compressed "
                                    "block (state blk.L.comp.rows, values)",
                                    "D3: ds4 #658 -> #659 (#695, #731, #733)"),
    "spec-logits-row-stale": ("verify.last_verify_row (Ops.next_row, TorchEngine.next_row)",
                              "after a partial accept (a' < gamma) the bonus token and next anchor come from the last "
                              "verify row, a rejected draft's row, instead of row a'",
                              "the first partial accept whose last verify row picks another token than row a' (state "
                              "component `anchor`)", "D4: ds4 #750 (spurious BOS injection)"),
    "spec-tie-last-max": ("verify.last_max_rows (Ops.verify_argmax, TorchEngine.verify_argmax)",
                          "the verify argmax takes the last of equal maxima (ggml's argmax) instead of the first",
                          "only where a verify row has an exact tie at its maximum (none on the tiny model's own "
                          "logits: it needs a vocabulary with equal output rows)",
                          "spec §4.2 (spec-derived: ggml_vec_argmax_f32, llama.cpp's Markov chain)"),
}

FAULTS: tuple[str, ...] = tuple(FAULT_TABLE)               # the trunk's: each acts on a trunk layer
DRAFT_FAULTS: tuple[str, ...] = tuple(DRAFT_FAULT_TABLE)   # the draft heads': the trunk is unchanged bit for bit
SPEC_FAULTS: tuple[str, ...] = tuple(SPEC_FAULT_TABLE)     # the speculative path's: plain decode is unchanged


@dataclass(frozen=True)
class Faults:
    compress_ratios_u32: bool = False
    no_decode_compression: bool = False
    comb_not_transposed: bool = False
    rope_split_halves: bool = False
    sink_dropped: bool = False
    router_bias_in_weights: bool = False
    swiglu_symmetric_clamp: bool = False
    fp8_kv_off: bool = False
    indexer_ties_highest: bool = False
    csa_halves_swapped: bool = False
    compressed_row_visible_late: bool = False
    mtp_pairing_same: bool = False
    mtp_hnorm_flat: bool = False
    mtp_no_hc_post: bool = False
    mtp_trunk_hc_head: bool = False
    dspark_tap_sum: bool = False
    dspark_causal_block: bool = False
    dspark_markov_unconditioned: bool = False
    dspark_stale_ring: bool = False
    spec_ring_exact_window: bool = False
    spec_no_compressor_restore: bool = False
    spec_commit_verify_frontier: bool = False
    spec_logits_row_stale: bool = False
    spec_tie_last_max: bool = False

    @classmethod
    def parse(cls, names: tuple[str, ...] | list[str]) -> Faults:
        """Validated switches for the given fault names (`FAULT@LAYERS` entries included: `fault_layers` checks
        their layer lists); an unknown name is a ParityError."""
        known = FAULTS + DRAFT_FAULTS + SPEC_FAULTS
        bare = [n.split("@", 1)[0] for n in names]
        unknown = [n for n in bare if n not in known]
        if unknown:
            raise ParityError(f"unknown fault(s) {', '.join(map(repr, unknown))}; known: {', '.join(known)}")
        return cls(**{n.replace("-", "_"): True for n in bare})

    def without(self, names: set[str] | frozenset[str]) -> Faults:
        """These switches with the faults `names` off."""
        return replace(self, **{n.replace("-", "_"): False for n in names})

    @property
    def active(self) -> tuple[str, ...]:
        return tuple(f.name.replace("_", "-") for f in fields(self) if getattr(self, f.name))


# faults that are an op of a trunk layer: `FAULT@LAYERS` may restrict them to some layers (compress-ratios-u32 is a
# read of the whole schedule; the draft heads' and the speculative path's faults act outside the trunk's layers)
LAYER_FAULTS: tuple[str, ...] = tuple(f for f in FAULTS if f != "compress-ratios-u32")


def layer_list(text: str, entry: str, n_layers: int) -> frozenset[int]:
    """'3', '1,4', '2-5' or a mix ('0,2-3') -> the layers, each in [0, n_layers); anything else is a ParityError
    naming `entry`."""
    layers: set[int] = set()
    for part in text.split(","):
        lo, dash, hi = part.strip().partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise ParityError(f"--inject {entry!r}: bad layer list {text!r} (layers, ranges a-b, commas: 3, 1,4 or "
                              "2-5)")
        a, b = int(lo), int(hi) if dash else int(lo)
        if a > b:
            raise ParityError(f"--inject {entry!r}: empty layer range {part.strip()!r} ({a} > {b})")
        if b >= n_layers:
            raise ParityError(f"--inject {entry!r}: layer {b} out of range [0, {n_layers}) (the model has "
                              f"{n_layers} layers)")
        layers.update(range(a, b + 1))
    return frozenset(layers)


def fault_layers(names: tuple[str, ...] | list[str], n_layers: int) -> dict[str, frozenset[int]]:
    """The `FAULT@LAYERS` entries of `names`: fault -> the layers it acts on (faults named without `@` act on
    every layer and are not in the result). A fault that is not a per-layer trunk op, or named twice, is refused."""
    at: dict[str, frozenset[int]] = {}
    seen: set[str] = set()
    for entry in names:
        name, sep, text = entry.partition("@")
        if name in seen:
            raise ParityError(f"--inject {entry!r}: fault {name!r} named twice (give one layer list: {name}@1,4)")
        seen.add(name)
        if not sep:
            continue
        if name not in LAYER_FAULTS:
            what = ("reads the whole layer schedule" if name == "compress-ratios-u32" else
                    "acts in the draft heads" if name in DRAFT_FAULTS else "acts on the speculative path")
            raise ParityError(f"--inject {entry!r}: {name} {what}, not in one layer's ops: it takes no @LAYERS "
                              f"(per-layer faults: {', '.join(LAYER_FAULTS)})")
        at[name] = layer_list(text, entry, n_layers)
    return at


def compose(f: Faults, ops: Ops) -> Ops:
    """`ops` with the alternative op of every fault switched on in `f` (compress-ratios-u32 is not an op).
    A draft fault replaces an op only the draft heads call, so the trunk runs the same ops with or without it."""
    return replace(
        ops,
        completed_blocks=completed_blocks_multi_token if f.no_decode_compression else ops.completed_blocks,
        hc_post=hc_post_not_transposed if f.comb_not_transposed else ops.hc_post,
        rope=apply_rope_split_halves if f.rope_split_halves else ops.rope,
        attention=sink_attention_no_sink if f.sink_dropped else ops.attention,
        weight_scores=biased_keys if f.router_bias_in_weights else ops.weight_scores,
        swiglu=swiglu_symmetric_clamp if f.swiglu_symmetric_clamp else ops.swiglu,
        kv_round=identity if f.fp8_kv_off else ops.kv_round,
        select_rows=select_rows_ties_highest if f.indexer_ties_highest else ops.select_rows,
        csa_slots=csa_slots_halves_swapped if f.csa_halves_swapped else ops.csa_slots,
        pool=pool_blocks_verify_frontier if f.spec_commit_verify_frontier else ops.pool,
        n_visible=n_visible_late if f.compressed_row_visible_late else ops.n_visible,
        mtp_pairs=mtp_pairs_same if f.mtp_pairing_same else ops.mtp_pairs,
        mtp_input=mtp_input_hnorm_flat if f.mtp_hnorm_flat else ops.mtp_input,
        mtp_carrier=mtp_carrier_no_ffn_post if f.mtp_no_hc_post else ops.mtp_carrier,
        mtp_hc_head=trunk_hc_head if f.mtp_trunk_hc_head else ops.mtp_hc_head,
        dspark_taps=dspark_taps_summed if f.dspark_tap_sum else ops.dspark_taps,
        dspark_mask=dspark_mask_causal if f.dspark_causal_block else ops.dspark_mask,
        markov_chain=markov_chain_unconditioned if f.dspark_markov_unconditioned else ops.markov_chain,
        ring_write=ring_write_newest_row if f.dspark_stale_ring else ops.ring_write,
        attend=attend_ring_exact_window if f.spec_ring_exact_window else ops.attend,
        next_row=last_verify_row if f.spec_logits_row_stale else ops.next_row,
        verify_argmax=last_max_rows if f.spec_tie_last_max else ops.verify_argmax,
    )


assert set(FAULTS) | set(DRAFT_FAULTS) | set(SPEC_FAULTS) == {f.name.replace("_", "-") for f in fields(Faults)}
