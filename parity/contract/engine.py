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

    def flags(self) -> dict[str, Any]:
        return {"fp8_kv": self.fp8_kv, "fp4_indexer": self.fp4_indexer, "dtype": self.dtype,
                "inject": list(self.inject), "routing_replay": self.expert_override is not None}


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
class CacheStats(Protocol):
    def cache_stats(self) -> dict[str, int]:
        """Statistics of the engine's weight cache (entries, bytes, budget, hits, misses, evictions)."""


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
        from parity.contract.errors import ParityError

        raise ParityError(f"unknown engine {name!r}; registered: {', '.join(sorted(eps)) or 'none'}")
    return eps[name].load()


def load_engine(name: str, model_path: str, options: RunOptions) -> Engine:
    """Construct the engine registered as `name` (no engine module is imported by name here)."""
    return engine_class(name)(model_path, options)


def engine_faults(name: str) -> tuple[str, ...]:
    """The fault switches engine `name` offers (empty when it offers none)."""
    cls = engine_class(name)
    return tuple(cls.faults) if isinstance(cls, FaultSwitches) else ()
