"""A ctypes view of ggml's `struct ggml_tensor` (the ggml vendored by llama-cpp-python 0.3.36) and host-memory
reads/writes of a tensor's data through its byte strides (CPU backend: `data` is a host pointer)."""

from __future__ import annotations

import ctypes

import numpy as np

from parity.contract.errors import ParityError

GGML_MAX_DIMS, GGML_MAX_NAME, GGML_MAX_SRC, GGML_MAX_OP_PARAMS = 4, 64, 10, 64
GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_I32 = 0, 1, 26
DTYPES = {GGML_TYPE_F32: np.float32, GGML_TYPE_F16: np.float16, GGML_TYPE_I32: np.int32}   # F16: an f16 KV cache


class GgmlTensor(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * GGML_MAX_DIMS),
        ("nb", ctypes.c_size_t * GGML_MAX_DIMS),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * (GGML_MAX_OP_PARAMS // 4)),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * GGML_MAX_SRC),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * GGML_MAX_NAME),
        ("extra", ctypes.c_void_p),
        ("padding", ctypes.c_char * 8),
    ]


def tensor_at(ptr: int) -> GgmlTensor:
    return ctypes.cast(ptr, ctypes.POINTER(GgmlTensor)).contents


def name_of(t: GgmlTensor) -> str:
    return t.name.decode("utf-8", "replace")


def _view(t: GgmlTensor) -> np.ndarray:
    """A numpy view of the tensor's data: shape = reversed ne, strides = reversed nb (no copy)."""
    if t.type not in DTYPES:
        raise ParityError(f"llama.cpp tensor {name_of(t)!r} has ggml type {t.type}; only F32, F16 and I32 are read")
    if not t.data:
        raise ParityError(f"llama.cpp tensor {name_of(t)!r} has no host data (not a CPU backend buffer)")
    ne, nb = list(t.ne), list(t.nb)
    item = np.dtype(DTYPES[t.type]).itemsize
    span = sum((n - 1) * s for n, s in zip(ne, nb, strict=True)) + item
    buf = (ctypes.c_char * span).from_address(t.data)
    return np.ndarray(tuple(reversed(ne)), DTYPES[t.type], buffer=buf, strides=tuple(reversed(nb)))


def read(t: GgmlTensor) -> np.ndarray:
    """A copy of the tensor: numpy shape = ggml ne reversed (4-D, leading axes of size 1 included)."""
    return np.array(_view(t))


def write(t: GgmlTensor, values: np.ndarray) -> None:
    """Overwrite the tensor's data with `values` (same number of elements, rows in ggml order)."""
    v = _view(t)
    src = np.asarray(values, dtype=v.dtype)
    if src.size != v.size:
        raise ParityError(f"cannot write {src.size} values into llama.cpp tensor {name_of(t)!r} of {v.size}")
    v[...] = src.reshape(v.shape)
