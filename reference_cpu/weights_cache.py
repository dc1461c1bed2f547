"""Weight access for the reference: lazy dequantization through ONE function, a bounded LRU cache.

Every byte -> float conversion goes through `reference_cpu.dequant.dequantize` (vectorized, bit-identical to
gguf.quants: tests/test_dequant.py). Dense tensors, routed-expert slices and Q8_1 mins are cached under one byte
budget (`cache_gb`), grouped by layer (`layer_of`: `blk.N`, or `non-layer` for the output head's tensors): a
layer's arrays leave together, the least recently used layer first, so the cached arrays never exceed the budget.
A layer whose dense arrays alone need more than the budget is a TensorError naming the layer and the budget. Routed
expert slices are the exception, announced: a prefill may select more experts of a layer than the budget holds
(256 real experts: 24 GiB as float32), and each selected expert is used once per chunk, so one that does not fit
beside its layer is streamed (dequantized for that use, not cached; `streamed` in the stats; one line on stderr the
first time). Embedding rows are dequantized per token and not cached. The raw bytes of whatever was dequantized
are released from the process's resident set (`Weights.release`): the store holds floats, not the file's pages too.
"""

from __future__ import annotations

import copy
import math
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable

import numpy as np

from parity.contract.errors import TensorError
from parity.gguf.weights import Weights
from reference_cpu.dequant import dequantize
from reference_cpu.linear import Matrix, MinTerm
from reference_cpu.numerics import block_mins, has_min_term, input_rounding, q8_1_roundtrip, q8_1_sum_residual

NON_LAYER = "non-layer"  # the group of tensors outside the blocks (output head, output HC)


def layer_of(key: object) -> str:
    """The eviction group of a cache key: `blk.N` for a block tensor, NON_LAYER otherwise. Keys are a tensor name,
    (name, expert), ("mins", name) or ("mins", name, expert)."""
    parts = key if isinstance(key, tuple) else (key,)
    name = parts[1] if parts[0] == "mins" else parts[0]
    if not isinstance(name, str):
        raise TypeError(f"weight cache key {key!r} names no tensor")
    if name.startswith("blk."):
        return ".".join(name.split(".", 2)[:2])
    return NON_LAYER


class LayerCache:
    """Arrays by key under a byte budget, evicted by layer: least recently used layer first, all its arrays at once.
    A layer that alone needs more than the budget raises TensorError (no uncached fallback). Given the size of an
    array before it is made (`get(..., nbytes=)`), room is made first, so the cached arrays and the one being
    dequantized stay within the budget together (only the dequantizer's temporaries come on top)."""

    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes <= 0:
            raise TensorError(f"weight cache budget must be > 0 bytes, got {budget_bytes}")
        self.budget = budget_bytes
        self.layers: OrderedDict[str, dict[object, np.ndarray]] = OrderedDict()  # least recently used first
        self.layer_bytes: dict[str, int] = {}
        self.streamable: dict[str, set[object]] = {}  # the expert slices each layer holds
        self.nbytes = self.peak = 0
        self.hits = self.misses = self.evictions = self.layer_evictions = self.streamed = 0
        self.lock = threading.Lock()  # bookkeeping only; `make` runs unlocked so experts dequantize in parallel

    def get(self, key: object, make: Callable[[], np.ndarray], nbytes: int | None = None,
            streamable: bool = False) -> np.ndarray:
        """The array under `key`, made by `make()` on a miss; `nbytes`: its size when known before it is made;
        `streamable` (routed expert slices): returned uncached, and counted, when it does not fit beside its layer
        instead of raising."""
        layer = layer_of(key)
        with self.lock:
            held = self.layers.get(layer)
            if held is not None and key in held:
                self.hits += 1
                self.layers.move_to_end(layer)
                return held[key]
            self.misses += 1
            stream = nbytes is not None and streamable and self._over(layer, nbytes)
            if stream:
                self._count_stream(layer)
            elif nbytes is not None:
                self._make_room(layer, nbytes, streamable)
        value = make()
        if stream:
            return value
        with self.lock:
            held = self.layers.get(layer, {})
            if key in held:
                self.layers.move_to_end(layer)
                return held[key]
            if streamable and self._over(layer, value.nbytes):
                self._count_stream(layer)
                return value
            self._make_room(layer, value.nbytes, streamable)
            held = self.layers.setdefault(layer, held)
            held[key] = value
            if streamable:
                self.streamable.setdefault(layer, set()).add(key)
            self.layer_bytes[layer] = self.layer_bytes.get(layer, 0) + value.nbytes
            self.nbytes += value.nbytes
            self.peak = max(self.peak, self.nbytes)
        return value

    def _over(self, layer: str, nbytes: int) -> bool:
        return self.layer_bytes.get(layer, 0) + nbytes > self.budget

    def _count_stream(self, layer: str) -> None:
        """Count a streamed array (lock held); the first one is announced on stderr."""
        self.streamed += 1
        if self.streamed == 1:
            print(f"reference weight cache: layer {layer}'s selected experts do not fit beside it in cache_gb = "
                  f"{self.budget / 2**30:.3f} GiB; experts that do not fit are dequantized per use (not cached): "
                  f"raise cache_gb for speed", file=sys.stderr)

    def _make_room(self, layer: str, nbytes: int, streamable: bool = False) -> None:
        """Evict least recently used layers other than `layer` until `nbytes` more fit (lock held); for a dense
        array, `layer`'s own expert slices first if the layer would not fit; a TensorError when `layer`'s dense
        arrays alone would exceed the budget."""
        if not streamable and self._over(layer, nbytes):
            self._drop_streamable(layer)
        need = self.layer_bytes.get(layer, 0) + nbytes
        if need > self.budget:
            raise TensorError(f"reference weight cache: layer {layer} needs at least {need / 2**30:.3f} GiB "
                              f"of dequantized weights, more than the budget cache_gb = "
                              f"{self.budget / 2**30:.3f} GiB; raise cache_gb (RunOptions.cache_gb)")
        if layer in self.layers:
            self.layers.move_to_end(layer)
        while self.nbytes + nbytes > self.budget:  # never reaches `layer` itself: need <= budget
            self._evict_oldest()

    def _drop_streamable(self, layer: str) -> None:
        """Evict `layer`'s expert slices (lock held): its dense arrays need the room."""
        held = self.layers.get(layer, {})
        for key in self.streamable.pop(layer, set()):
            gone = held.pop(key).nbytes
            self.layer_bytes[layer] -= gone
            self.nbytes -= gone
            self.evictions += 1

    def _evict_oldest(self) -> None:
        old, arrays = self.layers.popitem(last=False)
        self.streamable.pop(old, None)
        self.nbytes -= self.layer_bytes.pop(old, 0)
        self.evictions += len(arrays)
        self.layer_evictions += 1

    def stats(self) -> dict[str, int]:
        """entries and bytes held, budget, peak bytes held, hits, misses, arrays evicted (evictions) and layers
        evicted (layer_evictions), layers held, expert slices streamed (not cached: no room beside their layer)."""
        with self.lock:
            return {"entries": sum(map(len, self.layers.values())), "bytes": self.nbytes, "budget": self.budget,
                    "peak_bytes": self.peak, "hits": self.hits, "misses": self.misses, "evictions": self.evictions,
                    "layer_evictions": self.layer_evictions, "layers": len(self.layers), "streamed": self.streamed}


def q8_1_min_term(mins: np.ndarray, perturb: Callable[[np.ndarray], np.ndarray] | None) -> MinTerm:
    """llama.cpp's Q4_1 / Q5_1 x Q8_1 min term for a weight with per-block mins M [out, in/32]: quantize(x) =
    (q8_1_roundtrip(x̃), q8_1_sum_residual(x̃)) with x̃ = perturb(x) (round-off twins; x itself when None), so
    `linear` gives y = W x' + M c, per block d_w·d_x·Σ q_w·q_x + m_w·s_x as ggml's vec_dot_q{4,5}_1_q8_1."""
    def quantize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        xp = x if perturb is None else perturb(x)
        return q8_1_roundtrip(xp), q8_1_sum_residual(xp)

    return MinTerm(mins, quantize)


class WeightStore:
    """Tensors of one model in the working dtype (float32, or float64 for the oracle), dequantized on demand.

    `act_quant` (RunOptions) decides the input rounding of the matmul weights `matrix` / `expert_matrix` return, and
    under llamacpp their per-block min term for Q4_1 / Q5_1 weights (`q8_1_min_term`; the mins are cached too).
    """

    def __init__(self, weights: Weights, dtype: np.dtype, cache_gb: float, act_quant: str) -> None:
        if not cache_gb > 0:
            raise TensorError(f"cache_gb must be > 0, got {cache_gb}")
        self.weights = weights
        self.dtype = np.dtype(dtype)
        self.cache = LayerCache(int(cache_gb * 2**30))
        self.act_quant = act_quant
        self.input_jitter: Callable[[np.ndarray, str, int], np.ndarray] | None = None

    def with_act_quant(self, act_quant: str) -> WeightStore:
        """This store (weights and cache shared) with another `act_quant` and no input jitter."""
        twin = copy.copy(self)
        twin.act_quant, twin.input_jitter = act_quant, None
        return twin

    def with_input_jitter(self, jitter: Callable[[np.ndarray, str, int], np.ndarray]) -> WeightStore:
        """This store (weights and cache shared) for a round-off twin: a matmul input that gets rounded (an
        approximate `act_quant`) is perturbed first, jitter(x, name, row length), so codes on a rounding
        boundary flip in the twins as they do between two engines."""
        twin = copy.copy(self)
        twin.input_jitter = jitter
        return twin

    def _rounding(self, name: str) -> Callable[[np.ndarray], np.ndarray] | None:
        r = input_rounding(self.act_quant, self.weights.info(name).ggml_type)
        jit = self.input_jitter
        if r is None or jit is None:
            return r
        return lambda x: r(jit(x, name, x.shape[-1]))

    def _min_term(self, name: str, key: object, raw: Callable[[], tuple[np.ndarray, int, tuple[int, ...]]],
                  ggml_type: int) -> MinTerm | None:
        """The Q8_1 min term of a product with tensor `name` (None unless llamacpp before Q4_1 / Q5_1), its mins
        [out, in/32] cached under `key`; the input is perturbed as `_rounding` perturbs it (same jitter, same name)."""
        if not has_min_term(self.act_quant, ggml_type):
            return None
        expert = isinstance(key, tuple) and len(key) == 3  # ("mins", name, e): an expert's, streamable like it

        def make() -> np.ndarray:
            mins = block_mins(*raw()).astype(self.dtype)
            self.weights.release(name, key[2] if expert else None)
            return mins

        mins = self.cache.get(key, make, streamable=expert)
        jit = self.input_jitter
        return q8_1_min_term(mins, None if jit is None else lambda x: jit(x, name, x.shape[-1]))

    def matrix(self, name: str) -> Matrix:
        """A 2-D matmul weight with the input rounding its type gets under `act_quant` (and its min term)."""
        info = self.weights.info(name)
        term = self._min_term(name, ("mins", name), lambda: (self.weights.raw(name), info.ggml_type, info.shape),
                              info.ggml_type)
        return Matrix(self.dense(name), self._rounding(name), term)

    def expert_matrix(self, name: str, e: int) -> Matrix:
        """Expert e's slice of a 3-D expert tensor as a matmul weight (see `matrix`)."""
        info = self.weights.info(name)
        term = self._min_term(name, ("mins", name, e), lambda: self.weights.expert_raw(name, e), info.ggml_type)
        return Matrix(self.expert(name, e), self._rounding(name), term)

    def _convert(self, arr: np.ndarray, what: str) -> np.ndarray:
        # min/max propagate NaN and expose ±inf: the finiteness check without a full boolean temporary
        if not (np.isfinite(arr.min()) and np.isfinite(arr.max())):
            bad = int(np.flatnonzero(~np.isfinite(arr.ravel()))[0])
            raise TensorError(f"{self.weights.paths[0].name}: tensor {what}: non-finite value {arr.ravel()[bad]} at "
                              f"flat index {bad}")
        return arr.astype(self.dtype, copy=False)  # float32 dequantizer output is used as is (no second copy)

    def _decode(self, raw: np.ndarray, ggml_type: int, shape: tuple[int, ...], name: str,
                e: int | None = None) -> np.ndarray:
        """`dequantize(raw)` (always a new array), then tensor `name`'s raw pages (expert e's) released from the
        resident set (`Weights.release`)."""
        arr = dequantize(raw, ggml_type, shape)
        self.weights.release(name, e)
        return arr

    def dense(self, name: str) -> np.ndarray:
        """A whole float tensor, numpy shape reversed(ne)."""
        def make() -> np.ndarray:
            info = self.weights.info(name)
            return self._convert(self._decode(self.weights.raw(name), info.ggml_type, info.shape, name), name)

        return self.cache.get(name, make, math.prod(self.weights.info(name).shape) * self.dtype.itemsize)

    def table(self, name: str) -> np.ndarray:
        """An I32 tensor (e.g. ffn_gate_tid2eid) as int64."""
        def make() -> np.ndarray:
            info = self.weights.info(name)
            arr = self._decode(self.weights.raw(name), info.ggml_type, info.shape, name)
            if arr.dtype.kind != "i":
                raise TensorError(f"tensor {name}: expected an integer (I32) tensor, found {info.type_name}")
            return arr.astype(np.int64)

        return self.cache.get(name, make, math.prod(self.weights.info(name).shape) * 8)

    def rows(self, name: str, ids: np.ndarray) -> np.ndarray:
        """Rows `ids` of a 2-D tensor (the embedding), dequantized row by row: [len(ids), ne0]."""
        info = self.weights.info(name)
        n_rows, width = info.shape
        per = info.nbytes // n_rows
        raw = self.weights.raw(name)
        picked = np.concatenate([raw[int(r) * per : (int(r) + 1) * per] for r in ids])
        self.weights.release(name)
        return self._convert(dequantize(picked, info.ggml_type, (len(ids), width)), f"{name} rows {list(ids)}")

    def expert(self, name: str, e: int) -> np.ndarray:
        """Expert e's (out, in) slice of a 3-D expert tensor (E, out, in), cached as (name, e)."""
        def make() -> np.ndarray:
            return self._convert(self._decode(*self.weights.expert_raw(name, e), name, e), f"{name}[expert {e}]")

        return self.cache.get((name, e), make, math.prod(self.weights.info(name).shape[1:]) * self.dtype.itemsize,
                              streamable=True)
