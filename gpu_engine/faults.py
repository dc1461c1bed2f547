"""Fault injection: known porting bugs, each a one-line switch.

`Faults.parse(names)` validates the names (`FAULTS`, the keys of `FAULT_TABLE`) and yields an object with one
boolean per fault (dashes become underscores). A fault is an alternative op of the same signature as the model's:
`compose` puts it in place of the correct op in the engine's `Ops` (one line per fault); the one fault that is
not an op (`compress-ratios-u32`, a wrong read of the layer schedule) is one line in `TorchEngine.__init__`.
`FAULT_TABLE` documents each fault for `--help`/docs.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from gpu_engine.attention import n_visible_late, sink_attention_no_sink
from gpu_engine.compressor import completed_blocks_multi_token, csa_slots_halves_swapped
from gpu_engine.hc import hc_post_not_transposed
from gpu_engine.indexer import select_rows_ties_highest
from gpu_engine.model import Ops
from gpu_engine.moe import biased_keys
from gpu_engine.ops import apply_rope_split_halves, identity, swiglu_symmetric_clamp
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


FAULTS: tuple[str, ...] = tuple(FAULT_TABLE)


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

    @classmethod
    def parse(cls, names: tuple[str, ...] | list[str]) -> Faults:
        """Validated switches for the given fault names; an unknown name is a ParityError."""
        unknown = [n for n in names if n not in FAULTS]
        if unknown:
            raise ParityError(f"unknown fault(s) {', '.join(map(repr, unknown))}; known: {', '.join(FAULTS)}")
        return cls(**{n.replace("-", "_"): True for n in names})

    @property
    def active(self) -> tuple[str, ...]:
        return tuple(f.name.replace("_", "-") for f in fields(self) if getattr(self, f.name))


def compose(f: Faults, ops: Ops) -> Ops:
    """`ops` with the alternative op of every fault switched on in `f` (compress-ratios-u32 is not an op)."""
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
        n_visible=n_visible_late if f.compressed_row_visible_late else ops.n_visible,
    )


assert set(FAULT_TABLE) == set(FAULTS) == {f.name.replace("_", "-") for f in fields(Faults)}
