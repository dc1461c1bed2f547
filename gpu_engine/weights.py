"""Model weights on the device, kept in their GGUF block formats and dequantized by torch per use.

`QTensor` holds one tensor's raw blocks as uint8 [rows, row_bytes] on the device (on the CPU: a zero-copy view
of the file mapping); `.dense()` dequantizes the whole matrix, `.expert(e)` one expert's (out, in) slice,
`.rows(idx)` selected rows (embeddings).
Small F32 vectors (norms, sinks, HC scales) are read once as compute-dtype tensors.
`DeviceWeights.mat` / `.expert` keep recently dequantized matrices in a bounded LRU (`cache_mb`; 0 = dequantize
on every use). The cache holds exact dequantized values, so it changes speed only, never results.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Callable

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType as Q

from gpu_engine.dequant import dequantize
from parity.config import ModelConfig
from parity.errors import TensorError
from parity.inventory import expected_tensors
from parity.weights import Weights


class QTensor:
    """A GGUF tensor of numpy shape `shape` (reversed ne) held as raw blocks on the device."""

    def __init__(self, name: str, raw: np.ndarray, qtype: int, shape: tuple[int, ...], device: torch.device):
        self.name, self.qtype, self.shape = name, Q(qtype), tuple(shape)
        rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        view = np.ascontiguousarray(raw).reshape(rows, -1)
        with warnings.catch_warnings():  # zero-copy view of the read-only mapping; never written to
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            self.raw = torch.from_numpy(view).to(device)
        self._checked: set[str] = set()  # parts already proven finite (checked once, on first use)

    def _deq(self, raw: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, what: str) -> torch.Tensor:
        out = dequantize(raw, self.qtype).reshape(shape)
        if what not in self._checked:
            if not torch.isfinite(out).all():
                raise TensorError(f"tensor {what}: non-finite values after dequantization")
            self._checked.add(what)
        return out.to(dtype)

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole tensor dequantized.  -> shape"""
        return self._deq(self.raw, self.shape, dtype, self.name)

    def expert(self, e: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert e of a 3-D expert tensor (E, out, in).  -> [out, in]"""
        n_exp, out, inp = self.shape
        raw = self.raw.view(n_exp, out, -1)[e]
        return self._deq(raw, (out, inp), dtype, f"{self.name}[expert {e}]")

    def rows(self, idx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Selected rows of a 2-D tensor.  idx [n] -> [n, in]"""
        out = dequantize(self.raw[idx], self.qtype).reshape(idx.shape[0], self.shape[-1])
        if not torch.isfinite(out).all():
            raise TensorError(f"tensor {self.name}: non-finite values in rows {idx.tolist()}")
        return out.to(dtype)


class DeviceWeights:
    """Every tensor of a deepseek4 GGUF on `device`: matrices as `QTensor`, F32 vectors dense, I32 as int64."""

    def __init__(self, path: str, device: torch.device, act_dtype: torch.dtype, cache_mb: int = 0) -> None:
        self.source = Weights(path)
        self.cache_bytes, self._cache, self._cached = cache_mb << 20, OrderedDict(), 0
        self.config: ModelConfig = self.source.config
        self.device, self.act = device, act_dtype
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
                self.vec[name] = torch.from_numpy(self.source.tensor(name).copy()).to(device=device, dtype=act_dtype)
            else:
                self.q[name] = QTensor(name, self.source.raw(name), info.ggml_type, info.shape, device)

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

    def _cached_or(self, key: tuple, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """LRU of dequantized matrices bounded by `cache_bytes` (0: always `make()`)."""
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        out = make()
        size = out.numel() * out.element_size()
        if size <= self.cache_bytes:
            while self._cached + size > self.cache_bytes:
                _, old = self._cache.popitem(last=False)
                self._cached -= old.numel() * old.element_size()
            self._cache[key] = out
            self._cached += size
        return out

    def mat(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """Whole matrix `name` dequantized to dtype.  -> numpy shape of the tensor"""
        if name not in self.q:
            raise TensorError(f"tensor {name!r} is missing")
        return self._cached_or((name, -1, dtype), lambda: self.q[name].dense(dtype))

    def expert(self, name: str, e: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert e of 3-D expert tensor `name`.  -> [out, in]"""
        if name not in self.q:
            raise TensorError(f"tensor {name!r} is missing")
        return self._cached_or((name, e, dtype), lambda: self.q[name].expert(e, dtype))

    def v(self, name: str) -> torch.Tensor:
        if name not in self.vec:
            raise TensorError(f"tensor {name!r} is missing")
        return self.vec[name]

    def has(self, name: str) -> bool:
        return name in self.q or name in self.vec or name in self.ints
