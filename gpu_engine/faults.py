"""Fault injection: known porting bugs, each a one-line switch read at the exact place the bug lives.

`Faults.parse(names)` validates the names (`FAULTS`, the keys of `FAULT_TABLE`) and yields an object with one
boolean per fault (dashes become underscores). The engine consults the switch where the correct code
runs; there is no separate faulty code path. `FAULT_TABLE` documents each fault for `--help`/docs.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from parity.contract.errors import ParityError

# name -> (where the switch lives, what it breaks, first layer kind where it acts)
FAULT_TABLE: dict[str, tuple[str, str, str]] = {
    "compress-ratios-u32": ("engine.TorchEngine.__init__ (schedule read)",
                            "ratio array read with the wrong integer width: empty schedule, every layer SWA with the "
                            "main RoPE base (no compressor, no indexer, no YaRN)", "first compressed layer"),
    "no-decode-compression": ("attention.AttentionLayer.forward (emit flag for attention.compress)",
                              "compressed rows emitted only in multi-token chunks, never in 1-token decode",
                              "first compressed layer, first decode step that completes a block"),
    "comb-not-transposed": ("hc.hc_post", "HC_post mixes with C X instead of C^T X", "layer 0 (blk.0.attn)"),
    "rope-split-halves": ("ops.rope", "NeoX split-halves pairing instead of interleaved pairs", "layer 0"),
    "sink-dropped": ("attention.sink_attention", "attention sink left out of the softmax denominator", "layer 0"),
    "router-bias-in-weights": ("moe.route", "routing weights from the biased selection scores",
                               "first non-hash layer"),
    "swiglu-symmetric-clamp": ("ops.swiglu", "gate clamped to [-c, c] instead of (-inf, c]", "layer 0 (FFN)"),
    "fp8-kv-off": ("attention.AttentionLayer.fp8_on", "FP8 e4m3 KV simulation skipped although enabled",
                   "layer 0 (needs --fp8-kv, the default)"),
    "indexer-ties-highest": ("attention.select_rows", "top-k ties broken towards the highest row index",
                             "first CSA layer with > top_k rows, only where scores tie at the cut"),
    "csa-halves-swapped": ("attention.compress (pooling)", "CSA overlap (A) and current (B) halves swapped",
                           "first CSA layer, first emitted row"),
    "compressed-row-visible-late": ("attention.n_visible", "row j visible only when (j+1)*m <= t (one token late)",
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


assert set(FAULT_TABLE) == set(FAULTS) == {f.name.replace("_", "-") for f in fields(Faults)}
