"""The `Engine` protocol: the only way the harness reaches an engine.

Engines register a class under the entry-point group `v4parity.engines`; the class is constructed
as `EngineClass(model_path, options)`. An engine exposes four primitives; everything else
(prefill/decode loops, greedy generation, traces, teacher forcing, splicing) is built on them in
`parity`, so a user's own engine plugs in exactly like ours.

Arrays at the boundary are numpy, float32 (float64 in the oracle mode), shapes:
carrier [n, H, D]; tokens int64 [n]; final_norm [n, D]; logits [n, V].
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from parity.contract.errors import ParityError

if TYPE_CHECKING:
    from parity.gguf.config import ModelConfig

ENTRY_POINT_GROUP = "v4parity.engines"


@dataclass(frozen=True)
class RunOptions:
    """How an engine runs. The QAT simulations are on by default, as in the model definition."""

    fp8_kv: bool = True          # FP8-e4m3 round trip of KV nope dims (spec attention §6.1)
    fp4_indexer: bool = True     # Hadamard + FP4-e2m1 round trips in the indexer (§6.2-6.3)
    dtype: str = "float32"       # float32 | float64 (reference oracle) | bfloat16 (torch, approximate)
    device: str = "cpu"          # torch engine: auto | cuda | cpu
    inject: tuple[str, ...] = ()  # fault names the engine lists in its `faults` capability
    expert_override: Any = None  # routing replay: callable (layer, start_pos, n) -> int [n, K] ids, or None
    cache_gb: float = 4.0        # reference engine: budget of its dequantized-weight cache (GiB); no effect on results
    # Opt-in approximate numerics (off = the exact path). An engine that cannot honour a value refuses it.
    act_quant: str = "none"      # none | q8_0 | bf16 | f16: activations rounded before every quantized matmul
    kv_cache: str = "f32"        # f32 | f16: precision the raw KV window and compressed rows are stored in
    rope_angles: str = "exact"   # exact (official float32 recipe) | recurrence (ggml: θ_i = θ_{i-1}·B^(-2/r))
    engine_args: tuple[str, ...] = ()  # engine-specific NAME=VALUE settings, validated by the engine; in flags() if any
    # Monte-Carlo round-off twin (the `RoundoffTwins` capability): every sub-op output perturbed at the float32 ulp
    # level with this seed; None = the engine's own arithmetic. An engine without the capability refuses a seed.
    roundoff_seed: int | None = None

    def __post_init__(self) -> None:
        for name, allowed in NUMERICS_CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ParityError(f"run option {name}={getattr(self, name)!r}; expected one of {', '.join(allowed)}")

    def flags(self) -> dict[str, Any]:
        return {"fp8_kv": self.fp8_kv, "fp4_indexer": self.fp4_indexer, "dtype": self.dtype,
                "inject": list(self.inject), "routing_replay": self.expert_override is not None,
                "act_quant": self.act_quant, "kv_cache": self.kv_cache, "rope_angles": self.rope_angles,
                **({"engine_args": list(self.engine_args)} if self.engine_args else {}),
                **({"roundoff_seed": self.roundoff_seed} if self.roundoff_seed is not None else {})}

    def approximations(self) -> tuple[str, ...]:
        """The approximate modes that are on, as `option=value` (what an engine announces on stderr)."""
        exact = {name: allowed[0] for name, allowed in NUMERICS_CHOICES.items()}
        on = [f"{k}={getattr(self, k)}" for k, v in exact.items() if getattr(self, k) != v]
        return (*(["dtype=bfloat16"] if self.dtype == "bfloat16" else []), *on)


# Approximate-numerics options: the first value of each is the exact path.
NUMERICS_CHOICES: dict[str, tuple[str, ...]] = {
    "act_quant": ("none", "q8_0", "bf16", "f16", "llamacpp"),
    "kv_cache": ("f32", "f16"),
    "rope_angles": ("exact", "recurrence"),
}


def check_qat_shapes(options: RunOptions, nope_dim: int, index_head_dim: int, engine: str) -> None:
    """The QAT simulations need whole blocks: FP8 blocks of 64 KV nope dims, FP4 blocks of 32 indexer dims.
    One check for every engine, naming the option to turn off."""
    if options.fp8_kv and nope_dim % 64:
        raise ParityError(f"{engine}: --fp8-kv needs head_dim - rope_head_dim = {nope_dim} to be a multiple of 64 "
                          "(FP8 blocks of 64); run with --no-fp8-kv")
    if options.fp4_indexer and index_head_dim % 32:
        raise ParityError(f"{engine}: --fp4-indexer needs the indexer head dim {index_head_dim} to be a multiple of "
                          "32 (FP4 blocks of 32); run with --no-fp4-indexer")


def refuse_roundoff(options: RunOptions, engine: str) -> None:
    """An engine without the `RoundoffTwins` capability refuses a round-off seed, naming the option."""
    if options.roundoff_seed is not None:
        raise ParityError(f"{engine}: roundoff_seed={options.roundoff_seed}: this engine has no Monte-Carlo "
                          "round-off twins (the reference engine has)")


def check_tokens(tokens: np.ndarray, vocab_size: int, where: str) -> np.ndarray:
    """Token ids as int64 [n]: a non-empty 1-D array inside [0, vocab_size), else a ParityError naming `where`."""
    arr = np.asarray(tokens)
    if arr.ndim != 1 or len(arr) == 0:
        raise ParityError(f"{where}: expected a non-empty 1-D token array, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":  # a cast would truncate 3.7 to token 3
        raise ParityError(f"{where}: token ids must be integers, got dtype {arr.dtype}")
    tokens = arr.astype(np.int64)
    if tokens.min() < 0 or tokens.max() >= vocab_size:
        raise ParityError(f"{where}: token id outside [0, {vocab_size}): {tokens.min()}..{tokens.max()}")
    return tokens


def check_expert_ids(ids: np.ndarray, n_experts: int, where: str) -> None:
    """Expert ids (routing replay or a hash-routing table) must lie in [0, n_experts); names `where`."""
    ids = np.asarray(ids)
    bad = (ids < 0) | (ids >= n_experts)
    if bad.any():
        raise ParityError(f"{where}: expert id {int(ids[bad].flat[0])} out of range [0, {n_experts}) "
                          f"({int(bad.sum())} bad of {ids.size})")


@dataclass
class LayerDiag:
    """Per-layer diagnostics for the n positions of one forward_layer call."""

    hc_attn: tuple[np.ndarray, np.ndarray, np.ndarray]  # pre [n,H], post [n,H], comb [n,H,H]
    hc_ffn: tuple[np.ndarray, np.ndarray, np.ndarray]
    expert_ids: np.ndarray       # int [n, K] in selection order
    expert_weights: np.ndarray   # [n, K] final weights (after renormalisation and route_scale)
    router_margin: np.ndarray    # [n] selection-key gap between K-th and (K+1)-th; nan on hash layers
    n_comp_visible: np.ndarray   # int [n] compressed rows visible to each position (0 on ratio-0 layers)
    index_sel: np.ndarray | None = None  # int [n, top_k] selected rows (-1 padding); None off CSA layers


@dataclass
class LayerOutput:
    attn_carrier: np.ndarray     # [n, H, D] after the attention HC_post (checkpoint blk.l.attn)
    carrier: np.ndarray          # [n, H, D] after the FFN HC_post (checkpoint blk.l)
    diag: LayerDiag
    captures: dict[str, np.ndarray] = field(default_factory=dict)  # sub-op outputs, see checkpoints.SUBOPS


@runtime_checkable
class Engine(Protocol):
    name: str
    version: str
    config: ModelConfig
    options: RunOptions
    identity: dict[str, Any]  # the opened GGUF's model identity, `parity.gguf.weights.Weights(path).identity()`:
    #                           file, size, header_sha256, data_sha256 (hashed once, when the engine opens the file)

    def new_state(self) -> Any:
        """Fresh per-sequence state (every layer's raw KV window, compressed rows, compressor state)."""

    def embed(self, tokens: np.ndarray) -> np.ndarray:
        """tokens [n] -> carrier [n, H, D] (H identical copies of the embedding row)."""

    def forward_layer(self, state: Any, layer: int, carrier: np.ndarray, tokens: np.ndarray,
                      start_pos: int, capture: bool = False) -> LayerOutput:
        """Run layer `layer` on n new positions start_pos..start_pos+n-1 through that layer's cache
        in `state` (n = 1 is the decode path). With `capture`, fill `LayerOutput.captures`."""

    def head(self, carrier: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """carrier [n, H, D] -> (final_norm [n, D], logits [n, V])."""


# Optional capabilities. The harness asks an engine object (or its registered class) for these; it never
# imports an engine module to get them.


@runtime_checkable
class FaultSwitches(Protocol):
    """Class attribute `faults`: the known porting bugs the engine can reproduce (names for RunOptions.inject)."""

    faults: tuple[str, ...]


@runtime_checkable
class OpForcing(Protocol):
    def forward_ops(self, state: Any, layer: int, carrier: np.ndarray, tokens: np.ndarray, start_pos: int,
                    given: dict[str, np.ndarray]) -> LayerOutput:
        """Op-level teacher forcing: `forward_layer` with captures in which every sub-op consumes the candidate's
        value of its input sub-ops from `given` (capture names of `checkpoints.SUBOPS`, the HC mixes as
        `hc_attn.post` / `hc_attn.comb` / `hc_ffn.post` / `hc_ffn.comb`; `checkpoints.SUBOP_INPUTS` says which
        feeds which) instead of its own, so each captured output is that op run on the candidate's own input."""


@runtime_checkable
class LayerwiseState(Protocol):
    """Capability: a state keeps its caches per layer, so a layer may run over every chunk before the next layer
    starts and gives the outputs of the chunk-by-chunk order (`parity.tracing.runner.run_lockstep`, layer-major
    teacher forcing: a layer's weights dequantized once for all chunks and runs). An engine without it is run
    chunk by chunk through one state."""

    layerwise_state: bool


@runtime_checkable
class RoundoffTwins(Protocol):
    def roundoff_twin(self, seed: int) -> Engine:
        """The same engine (same options, weights and caches shared) with `RunOptions.roundoff_seed = seed`:
        every sub-op output perturbed by a seeded random relative error at the float32 ulp level (Monte-Carlo
        round-off). Twins of one engine differ only in their seeds."""


@runtime_checkable
class Variants(Protocol):
    def variant(self, options: RunOptions) -> Engine:
        """The same engine under other run options, sharing its opened weights and caches (no second copy of the
        model in memory); options it cannot change that way are refused, naming them."""


@runtime_checkable
class DraftHeads(Protocol):
    """An engine opened with a drafter (`EngineClass(model, options, draft=FILE)`): the MTP or DSpark head of spec
    v4-mtp-dspark §2-§3 (results in `parity.contract.draft`). The methods of the other kind refuse, naming it."""

    def new_mtp_state(self) -> Any: ...

    def mtp_forward(self, state: Any, carriers: np.ndarray, tokens: np.ndarray, start_pos: int,
                    pairing: str = "prev") -> Any: ...

    def mtp_chain(self, state: Any, last: Any, start_pos: int, depth: int) -> list[Any]: ...

    def new_dspark_state(self) -> Any: ...

    def dspark_round(self, state: Any, taps: np.ndarray, start_pos: int, anchor: int) -> Any: ...


@runtime_checkable
class StateSnapshots(Protocol):
    """Snapshot and restore of a decode state. With the verify batch, which is an ordinary prefill chunk over the
    trunk (`forward_layer` on q rows), this is what speculative decoding needs: snapshot, verify, then on a
    rejection restore and replay the accepted rows (parity.spec)."""

    def snapshot(self, state: Any) -> Any:
        """What `restore` needs to bring `state` (a trunk state of `new_state`, or a drafter state) back to now:
        every cache as it is (raw window rows, compressor and indexer accumulators and emitted rows, drafter
        rings); later writes to `state` leave it unchanged."""

    def restore(self, state: Any, saved: Any) -> Any:
        """The state to continue with: `state` brought back to when `saved = snapshot(state)` was taken (the
        returned object replaces `state`; an engine may return `saved` itself or roll `state` back in place)."""


@runtime_checkable
class VerifyPicks(Protocol):
    """An engine's own picks in a speculative round (spec v4-mtp-dspark §4.1, §4.2, §4.4), where it makes them
    itself: the driver asks these instead of applying the rules (first of equal maxima, row a′) on its own."""

    def verify_argmax(self, logits: np.ndarray) -> np.ndarray:
        """The greedy token of each verify row: logits [q, V] -> int [q] (the rule: the first of equal maxima)."""

    def next_row(self, accepted: int, verified: int) -> int:
        """The verify row whose argmax becomes the bonus token and the next anchor, after `accepted` (a′) of
        `verified` (γ) drafts were accepted (the rule: row a′)."""


@runtime_checkable
class StateView(Protocol):
    def state_arrays(self, state: Any) -> dict[str, np.ndarray]:
        """The caches of a trunk or drafter state as named arrays in one layout for every engine (state parity,
        spec v4-mtp-dspark §6.3.2). Trunk and MTP states, per layer l that has run: `blk.l.raw` [r, hd] the raw
        window rows of positions T-r..T-1 (r = min(W-1, T)); per compressor c in (`comp`, `index`): `blk.l.c.rows`
        [⌊T/m⌋, d_c] the emitted rows, `blk.l.c.pending_kv` / `blk.l.c.pending_score` [T mod m, w] the (κ, σ) of
        the incomplete block, and with overlap once a block completed `blk.l.c.previous_kv` /
        `blk.l.c.previous_score` [m, w] those of the last complete block. DSpark rings: `dspark.s.rows` [W, hd],
        `dspark.s.pos` [W] (-1 empty)."""


@runtime_checkable
class PartialStateView(Protocol):
    def visible_state(self, state: Any) -> tuple[dict[str, np.ndarray], str]:
        """What an engine without a full `StateView` can show of its trunk caches after a commit: some of
        `StateView.state_arrays`'s components (same names, same layout) and one sentence naming what it cannot
        show. State parity compares those components only and the report prints the sentence."""


@runtime_checkable
class CacheStats(Protocol):
    def cache_stats(self) -> dict[str, int]:
        """Statistics of the engine's weight cache (entries, bytes, budget, hits, misses, evictions)."""


@runtime_checkable
class PlainDecode(Protocol):
    """Capability: the engine's whole-model forward as its users run it, recording nothing (a whole-graph engine
    whose `forward_layer` copies out every layer's tensors is slower than that): for timing only
    (`parity.bench.engine_speed`)."""

    def new_plain(self) -> Any:
        """A fresh sequence for `plain_decode`."""

    def plain_decode(self, plain: Any, tokens: np.ndarray, start_pos: int) -> None:
        """Feed `tokens` at start_pos.. through the whole model (logits of the last row only, nothing copied)."""


@runtime_checkable
class Dequantizer(Protocol):
    @staticmethod
    def dequantizer(raw: np.ndarray, ggml_type: int, shape: tuple[int, int], device: str) -> Any:
        """A zero-argument callable that dequantizes `raw` (uint8 blocks of one tensor) to float32 `shape` on
        `device` and returns a numpy array (for benchmarks: any staging of the bytes happens before it)."""


def available_engines() -> dict[str, Any]:
    """Registered engine entry points by name."""
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def engine_class(name: str) -> type:
    """The class registered as `name` under the entry-point group (its module is imported by the entry point)."""
    eps = available_engines()
    if name not in eps:
        raise ParityError(f"unknown engine {name!r}; registered: {', '.join(sorted(eps)) or 'none'}")
    return eps[name].load()


def load_engine(name: str, model_path: str, options: RunOptions, draft: str | None = None) -> Engine:
    """Construct the engine registered as `name` (no engine module is imported by name here); `draft`: a drafter
    GGUF, given to the engine as `draft=` (an engine without draft heads refuses it, naming the engine)."""
    cls = engine_class(name)
    if draft is None:
        return cls(model_path, options)
    if not issubclass(cls, DraftHeads):
        raise ParityError(f"engine {name!r} has no draft heads (new_mtp_state, mtp_forward, mtp_chain, "
                          "new_dspark_state, dspark_round); it cannot take --draft")
    return cls(model_path, options, draft=draft)


def engine_faults(name: str) -> tuple[str, ...]:
    """The fault switches engine `name` offers (empty when it offers none)."""
    cls = engine_class(name)
    return tuple(cls.faults) if isinstance(cls, FaultSwitches) else ()
