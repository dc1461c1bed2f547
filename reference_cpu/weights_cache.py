"""Weight access for the reference: lazy dequantization through ONE function, a bounded LRU cache.

Every byte -> float conversion goes through `reference_cpu.dequant.dequantize` (vectorized, bit-identical to
gguf.quants: tests/test_dequant.py). Dense tensors and routed-expert slices are cached under one byte budget
(`cache_gb`); the least recently used entry is evicted first and an entry larger than the whole budget is used
without being cached, so memory never grows without bound. Embedding rows are dequantized per token.
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from collections.abc import Callable

import numpy as np

from parity.contract.errors import TensorError
from parity.gguf.weights import Weights
from reference_cpu.dequant import dequantize
from reference_cpu.linear import Matrix, MinTerm
from reference_cpu.numerics import block_mins, has_min_term, input_rounding, q8_1_roundtrip, q8_1_sum_residual


class LRUCache:
    """Arrays by key under a byte budget; least recently used first out."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget = budget_bytes
        self.items: OrderedDict[object, np.ndarray] = OrderedDict()
        self.nbytes = 0
        self.hits = self.misses = self.evictions = 0
        self.lock = threading.Lock()  # bookkeeping only; `make` runs unlocked so experts dequantize in parallel

    def get(self, key: object, make: Callable[[], np.ndarray]) -> np.ndarray:
        with self.lock:
            if key in self.items:
                self.hits += 1
                self.items.move_to_end(key)
                return self.items[key]
            self.misses += 1
        value = make()
        if value.nbytes > self.budget:
            return value
        with self.lock:
            if key in self.items:
                return self.items[key]
            while self.nbytes + value.nbytes > self.budget:
                _, old = self.items.popitem(last=False)
                self.nbytes -= old.nbytes
                self.evictions += 1
            self.items[key] = value
            self.nbytes += value.nbytes
        return value

    def stats(self) -> dict[str, int]:
        return {"entries": len(self.items), "bytes": self.nbytes, "budget": self.budget, "hits": self.hits,
                "misses": self.misses, "evictions": self.evictions}


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
        self.cache = LRUCache(int(cache_gb * 2**30))
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
        mins = self.cache.get(key, lambda: block_mins(*raw()).astype(self.dtype))
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

    def dense(self, name: str) -> np.ndarray:
        """A whole float tensor, numpy shape reversed(ne)."""
        def make() -> np.ndarray:
            info = self.weights.info(name)
            return self._convert(dequantize(self.weights.raw(name), info.ggml_type, info.shape), name)

        return self.cache.get(name, make)

    def table(self, name: str) -> np.ndarray:
        """An I32 tensor (e.g. ffn_gate_tid2eid) as int64."""
        def make() -> np.ndarray:
            info = self.weights.info(name)
            arr = dequantize(self.weights.raw(name), info.ggml_type, info.shape)
            if arr.dtype.kind != "i":
                raise TensorError(f"tensor {name}: expected an integer (I32) tensor, found {info.type_name}")
            return arr.astype(np.int64)

        return self.cache.get(name, make)

    def rows(self, name: str, ids: np.ndarray) -> np.ndarray:
        """Rows `ids` of a 2-D tensor (the embedding), dequantized row by row: [len(ids), ne0]."""
        info = self.weights.info(name)
        n_rows, width = info.shape
        per = info.nbytes // n_rows
        raw = self.weights.raw(name)
        picked = np.concatenate([raw[int(r) * per : (int(r) + 1) * per] for r in ids])
        return self._convert(dequantize(picked, info.ggml_type, (len(ids), width)), f"{name} rows {list(ids)}")

    def expert(self, name: str, e: int) -> np.ndarray:
        """Expert e's (out, in) slice of a 3-D expert tensor (E, out, in), cached as (name, e)."""
        def make() -> np.ndarray:
            return self._convert(dequantize(*self.weights.expert_raw(name, e)), f"{name}[expert {e}]")

        return self.cache.get((name, e), make)
