"""Model weights on the device, kept in their GGUF block formats and dequantized by torch per use.

`QTensor` holds one tensor's raw blocks as uint8 [rows, row_bytes] on the device (on the CPU: a zero-copy view
of the file mapping); `.dense()` dequantizes the whole matrix, `.expert_linear(e, x)` applies one expert,
`.rows(idx)` selected rows (embeddings).
Small F32 vectors (norms, sinks, HC scales) are read once as compute-dtype tensors.
`DeviceWeights` hands out a matrix by name as a `gpu_engine.linear.Matrix` handle (`weight`); the free products of
`gpu_engine.linear` (`linear`, `grouped_linear`; an expert's handle: `expert_of`) return products, never the
dequantized matrix, so the reused buffers they dequantize into cannot outlive the product. Whole matrices are kept
while the budget (`cache_mb`; 0 = none) has room, first come first kept: the engine walks the layers cyclically,
where an evicting LRU smaller than the working set would never hit. Matrices not kept are dequantized into reused
scratch buffers, one per tensor kind; routed experts (each selected expert once per call, grouped by expert) are
dequantized a block of rows at a time, each block multiplied while it is in cache (`QTensor.expert_linear`).
On the CPU the compiled kernels (`gpu_engine.cpu_kernels`, unless the engine runs with cpu_kernels=torch) do the
decoding, and products with at most MATVEC_MAX_ROWS activation rows are their row-at-a-time `matvec` (no
dequantized matrix at all; its float32 sums run in a fixed order that differs from sgemm's). The C decoders cover
every type the torch dequantizers know (`cpu_kernels.TYPES`); a tensor of a type no dequantizer knows is refused at
load.
`matrix` returns a whole matrix the caller may keep (the cached one, or fresh memory). All hold exact dequantized
values.
Memory bound (`DeviceWeights.memory_bound`): nothing is dequantized at load (the raw blocks are the mapped file
on the CPU); dequantized weights held at any time are at most the kept matrices (<= cache_mb), one scratch buffer
per tensor kind (<= the kind's largest matrix, each <= SCRATCH_MAX_BYTES), one expert row block per thread, and the
fresh copy of one matrix larger than SCRATCH_MAX_BYTES while its product runs (e.g. the output head in a prefill of
more than MATVEC_MAX_ROWS rows). `cache_stats` counts what was kept, reused and dequantized.
"""

from __future__ import annotations

import itertools
import math
import threading
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as Q

from gpu_engine.cpu_kernels import TYPES as KERNEL_TYPES
from gpu_engine.cpu_kernels import Kernels
from gpu_engine.dequant import CHUNK_VALUES, DEQUANT, dequantize
from gpu_engine.linear import MapOp, Matrix
from parity.contract.errors import TensorError
from parity.gguf.config import ModelConfig
from parity.gguf.inventory import expected_tensors
from parity.gguf.weights import Weights

SCRATCH_MAX_BYTES = 256 << 20  # larger matrices (e.g. a real-vocabulary output head) get fresh memory per use
# products with at most this many activation rows use the CPU kernels' row-at-a-time matvec (no dequantized matrix);
# more rows: the matrix is decoded a block at a time and multiplied by torch (sgemm reuses each weight across rows)
MATVEC_MAX_ROWS = 32


def all_finite(x: torch.Tensor) -> bool:
    """True iff every element of x is finite: one sum (finite sum => finite elements; NaN/inf propagate), with the
    elementwise test only when the sum is not finite (which finite elements can also reach, by overflow)."""
    return bool(torch.isfinite(x.sum())) or bool(torch.isfinite(x).all())


class QTensor:
    """A GGUF tensor of numpy shape `shape` (reversed ne) held as raw blocks on the device."""

    def __init__(self, name: str, raw: np.ndarray, qtype: int, shape: tuple[int, ...], device: torch.device,
                 file: str, kernels: Kernels | None = None):
        self.name, self.qtype, self.shape, self.file = name, Q(qtype), tuple(shape), file
        if self.qtype not in DEQUANT:
            raise TensorError(f"{file}: tensor {name}: ggml type {self.qtype.name} has no dequantizer (supported: "
                              f"{', '.join(t.name for t in DEQUANT)})")
        # the CPU kernels, when the engine uses them and they decode this type (else torch ops decode it to float32)
        self.kernels = kernels if device.type == "cpu" and self.qtype in KERNEL_TYPES else None
        rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        view = np.ascontiguousarray(raw).reshape(rows, -1)
        with warnings.catch_warnings():  # zero-copy view of the read-only mapping; never written to
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            self.raw = torch.from_numpy(view).to(device)
        self._checked: set[str] = set()  # parts already proven finite (checked once, on first use)

    def _decode(self, raw: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        """raw blocks -> flat float32 values (into `out` when given): the CPU kernels when set, else torch ops."""
        if self.kernels is None:
            return dequantize(raw, self.qtype, out).reshape(-1)
        raw = raw.contiguous()
        if out is None:
            out = torch.empty(raw.numel() // self._block_bytes * self._block_values, dtype=torch.float32)
        self.kernels.dequantize(raw, self.qtype, out)
        return out

    @property
    def _block_bytes(self) -> int:
        return GGML_QUANT_SIZES[self.qtype][1]

    @property
    def _block_values(self) -> int:
        return GGML_QUANT_SIZES[self.qtype][0]

    def _deq(self, raw: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, what: str,
             out: torch.Tensor | None) -> torch.Tensor:
        y = self._decode(raw, out).reshape(shape)
        if what not in self._checked:
            if not all_finite(y):
                raise TensorError(f"{self.file}: tensor {what}: non-finite values after dequantization")
            self._checked.add(what)
        return y.to(dtype)

    def dense(self, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
        """The whole tensor dequantized (float32 stage written into `out` when given).  -> shape"""
        return self._deq(self.raw, self.shape, dtype, self.name, out)

    def expert_linear(self, e: int, x: torch.Tensor, scratch: Callable[[int], torch.Tensor | None]) -> torch.Tensor:
        """y = x W_eᵀ for expert e of a 3-D expert tensor (E, out, in).  x [n, in] (matmul dtype) -> [n, out]
        Few rows with the CPU kernels: `matvec` (one weight row decoded at a time). Otherwise W_e is dequantized one
        block of rows at a time into `scratch(n_values)` (on the CPU about CHUNK_VALUES per block, so each block's
        product reads it from cache; one block elsewhere)."""
        n_exp, n_out, n_in = self.shape
        raw = self.raw.view(n_exp, n_out, -1)[e]
        what = f"{self.name}[expert {e}]"
        if self.uses_matvec(x):
            return self.matvec(raw, x, what)
        step = max(1, min(n_out, CHUNK_VALUES // n_in)) if raw.device.type == "cpu" else n_out
        y = torch.empty(x.shape[0], n_out, dtype=x.dtype, device=x.device)
        for r in range(0, n_out, step):
            rows = raw[r : r + step]
            w = self._decode(rows, scratch(rows.shape[0] * n_in)).view(rows.shape[0], n_in)
            if what not in self._checked and not all_finite(w):
                raise TensorError(f"{self.file}: tensor {what}: non-finite values after dequantization")
            y[:, r : r + step] = x @ w.to(x.dtype).T
        self._checked.add(what)
        return y

    def uses_matvec(self, x: torch.Tensor) -> bool:
        """Whether a product with activations x goes through the CPU kernels' matvec (few float32 rows)."""
        return self.kernels is not None and x.dtype == torch.float32 and x.shape[0] <= MATVEC_MAX_ROWS

    def matvec(self, raw: torch.Tensor, x: torch.Tensor, what: str, run: MapOp = map, parts: int = 1) -> torch.Tensor:
        """y = x Wᵀ for W's raw rows [out, row_bytes], by the CPU kernels; the rows split into `parts` jobs for `run`.
        A non-finite product is traced to the weights (dequantized and checked) before it is returned.
        x [n, in] float32 -> [n, out]"""
        x = x.contiguous()
        y = torch.empty(x.shape[0], raw.shape[0], dtype=torch.float32)
        list(run(lambda r: self.kernels.matvec(raw, self.qtype, x, y, *r), row_ranges(raw.shape[0], parts)))
        if not all_finite(y) and not all_finite(self._decode(raw, None)):
            raise TensorError(f"{self.file}: tensor {what}: non-finite values after dequantization")
        return y

    def rows(self, idx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Selected rows of a 2-D tensor.  idx [n] -> [n, in]"""
        out = self._decode(self.raw[idx], None).reshape(idx.shape[0], self.shape[-1])
        if not all_finite(out):
            raise TensorError(f"{self.file}: tensor {self.name}: non-finite values in rows {idx.tolist()}")
        return out.to(dtype)


def row_ranges(rows: int, parts: int) -> list[tuple[int, int]]:
    """[0, rows) cut into `parts` contiguous (start, stop) ranges of near-equal size (empty ones dropped)."""
    cuts = [rows * i // parts for i in range(parts + 1)]
    return [(a, b) for a, b in itertools.pairwise(cuts) if b > a]


UNQUANTIZED = (Q.F32, Q.F16, Q.BF16)  # weight types whose matmuls never see rounded activations


class DeviceWeights:
    """Every tensor of a deepseek4 GGUF on `device`: matrices as `QTensor` (handed to the products as `Matrix`
    handles by `weight`), F32 vectors dense, I32 as int64. Products take activations in `act` and multiply in `mm`
    (bfloat16 on the approximate path); `act_quant`, when given, rounds the activations of every product whose
    weight is quantized (not F32/F16/BF16) first."""

    def __init__(self, path: str, device: torch.device, act: torch.dtype, mm: torch.dtype, cache_mb: int = 0,
                 act_quant: Callable[[torch.Tensor], torch.Tensor] | None = None, kernels: Kernels | None = None,
                 run: MapOp = map, threads: int = 1, source: Weights | None = None) -> None:
        self.source = Weights(path) if source is None else source   # `source`: the file at `path` already opened
        self.run, self.threads = run, threads  # how a dense matvec's row ranges are run
        self.kernels = kernels if device.type == "cpu" else None
        self.act_quant = act_quant
        self.cache_bytes, self._cache, self._cached = cache_mb << 20, {}, 0
        self._hits = self._misses = self._not_kept = 0
        self._scratch_bufs: dict[str, torch.Tensor] = {}
        self.config: ModelConfig = self.source.config
        self.device, self.act, self.mm = device, act, mm
        self._check_inventory()
        self.q: dict[str, QTensor] = {}
        self.vec: dict[str, torch.Tensor] = {}
        self.ints: dict[str, torch.Tensor] = {}
        for name in self.source.names:
            info = self.source.info(name)
            if info.ggml_type == Q.I32:
                arr = self.source.tensor(name)
                self.ints[name] = torch.from_numpy(arr.astype(np.int64)).to(device)
            elif len(info.shape) == 1:
                self.vec[name] = torch.from_numpy(self.source.tensor(name).copy()).to(device=device, dtype=act)
            else:
                self.q[name] = QTensor(name, self.source.raw(name), info.ggml_type, info.shape, device,
                                       Path(path).name, kernels)

    def _check_inventory(self) -> None:
        names = set(self.source.names)
        problems = []
        for spec in expected_tensors(self.config):
            if spec.name not in names:
                if spec.required:
                    problems.append(f"missing tensor {spec.name} (expected shape {spec.shape})")
            elif self.source.info(spec.name).shape != spec.shape:
                problems.append(f"tensor {spec.name}: shape {self.source.info(spec.name).shape}, expected {spec.shape}")
        if problems:
            raise TensorError(f"{self.source.paths[0]}: " + "; ".join(problems))

    def _scratch(self, name: str, n: int) -> torch.Tensor | None:
        """Reused float32 buffer (n values) for tensors of `name`'s kind (the name without `blk.{l}.`), or None when
        it would exceed SCRATCH_MAX_BYTES.  A buffer is rewritten by the next dequantization of the same kind."""
        if n * 4 > SCRATCH_MAX_BYTES:
            return None
        key = name.split(".", 2)[-1] if name.startswith("blk.") else name
        buf = self._scratch_bufs.get(key)
        if buf is None or buf.numel() < n:
            buf = self._scratch_bufs[key] = torch.empty(n, dtype=torch.float32, device=self.device)
        return buf[:n]

    def _qtensor(self, name: str) -> QTensor:
        if name not in self.q:
            raise TensorError(f"tensor {name!r} is missing")
        return self.q[name]

    def _whole(self, name: str, dtype: torch.dtype, scratch: bool) -> torch.Tensor:
        """Matrix `name` in dtype: the kept one, newly kept while the budget has room, else dequantized into the
        kind's scratch buffer (`scratch`; valid only until the next dequantization of that kind) or fresh memory."""
        qt, key = self._qtensor(name), (name, dtype)
        hit = self._cache.get(key)
        if hit is not None:
            self._hits += 1
            return hit
        self._misses += 1
        n = math.prod(qt.shape)
        size = n * torch.empty(0, dtype=dtype).element_size()
        if self._cached + size <= self.cache_bytes:
            self._cache[key] = out = qt.dense(dtype)
            self._cached += size
            return out
        self._not_kept += 1
        return qt.dense(dtype, self._scratch(name, n) if scratch else None)

    def cache_stats(self) -> dict[str, int]:
        """The kept matrices (entries, bytes, budget), hits (a kept matrix reused), misses (dequantized), not_kept
        (dequantized into scratch or fresh memory: the budget was full), evictions (always 0: nothing kept leaves),
        scratch_bytes (the scratch buffers allocated so far)."""
        return {"entries": len(self._cache), "bytes": self._cached, "budget": self.cache_bytes, "hits": self._hits,
                "misses": self._misses, "not_kept": self._not_kept, "evictions": 0,
                "scratch_bytes": sum(b.numel() * b.element_size() for b in self._scratch_bufs.values())}

    def memory_bound(self) -> dict[str, int]:
        """Upper bounds, in bytes, of the dequantized weights this object can hold at once (module docstring):
        kept (cache_mb), scratch (per 2-D tensor kind its largest matrix, if <= SCRATCH_MAX_BYTES, as float32),
        expert_blocks (one row block of the widest expert tensor, on the CPU about CHUNK_VALUES values, per expert
        thread and the calling thread), fresh (the largest matrix over SCRATCH_MAX_BYTES in float32, 0 if none), and
        their total. The bfloat16 path adds a transient bfloat16 copy of the matrix in use."""
        kinds: dict[str, int] = {}
        widest, fresh = 0, 0
        for name, qt in self.q.items():
            n = math.prod(qt.shape)
            if len(qt.shape) == 3:
                n_in = qt.shape[-1]
                rows = max(1, min(qt.shape[1], CHUNK_VALUES // n_in)) if self.device.type == "cpu" else qt.shape[1]
                widest = max(widest, rows * n_in)
            elif n * 4 > SCRATCH_MAX_BYTES:
                fresh = max(fresh, n * 4)
            else:
                key = name.split(".", 2)[-1] if name.startswith("blk.") else name
                kinds[key] = max(kinds.get(key, 0), n * 4)
        bound = {"kept": self.cache_bytes, "scratch": sum(kinds.values()),
                 "expert_blocks": widest * 4 * (self.threads + 1), "fresh": fresh}
        return bound | {"total": sum(bound.values())}

    def matrix(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """Whole matrix `name` dequantized to dtype, memory the caller may keep.  -> numpy shape of the tensor
        A caller multiplying with it bypasses `act_quant`: the engine refuses act_quant for such a quantized weight."""
        return self._whole(name, dtype, scratch=False)

    def weight(self, name: str) -> Matrix:
        """The handle of matrix `name` for the products (`gpu_engine.linear`): its raw blocks, rounded by
        `act_quant` first when it is quantized (not F32/F16/BF16), multiplied in `mm`, returned in `act`."""
        qt = self._qtensor(name)
        round_input = self.act_quant if qt.qtype not in UNQUANTIZED else None
        return Matrix(name, qt, round_input, self.act, self.mm, lambda: self._whole(name, self.mm, scratch=True),
                      # one expert buffer per thread: experts may run concurrently
                      lambda n: self._scratch(f"experts@{threading.get_ident()}", n), self.run, self.threads)

    def rows(self, name: str, idx: torch.Tensor) -> torch.Tensor:
        """Selected rows of 2-D tensor `name` (embeddings).  idx [n] -> [n, in] (activation dtype)"""
        return self._qtensor(name).rows(idx, self.act)

    def vector(self, name: str) -> torch.Tensor:
        if name not in self.vec:
            raise TensorError(f"tensor {name!r} is missing")
        return self.vec[name]

    def table(self, name: str) -> torch.Tensor:
        """An I32 tensor as int64 (the hash-routing table)."""
        if name not in self.ints:
            raise TensorError(f"tensor {name!r} is missing")
        return self.ints[name]
