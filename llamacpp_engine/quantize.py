"""llama.cpp's own quantizer (`llama_model_quantize`, what `llama-quantize` runs) and the ggml types llama.cpp
knows, reached by the harness through the `llamacpp` engine class (`parity.gguf.llamacpp.Quantizer`).

Nothing here re-implements a quantization: the file is written by llama.cpp, from its default parameters with
only the file type (and optionally the thread count) set. File types are llama.cpp's `LLAMA_FTYPE_*` names
without the prefix (`Q4_K_M`, `MXFP4_MOE`, `F32` for `LLAMA_FTYPE_ALL_F32`), read from the installed package.
"""

from __future__ import annotations

import ctypes
import os
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from parity.contract.errors import ParityError

_PREFIXES = ("LLAMA_FTYPE_MOSTLY_", "LLAMA_FTYPE_ALL_")
_NOT_A_FILE_TYPE = ("LLAMA_FTYPE_GUESSED",)   # a flag bit in llama.h, not a type to quantize to
_ERROR_WORDS = ("error", "failed", "offending", "target type", "warning", "requires")   # llama.cpp's words
_LOG = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
_QUIET = _LOG(lambda *_: None)   # installed after a run (module-level: outlives every call llama.cpp makes)


def llama_cpp_module() -> ModuleType:
    """`import llama_cpp`, or a ParityError saying how to install it."""
    try:
        import llama_cpp
    except ImportError as exc:
        raise ParityError("llama.cpp's quantizer needs llama-cpp-python, which is not importable here "
                          f"({exc}); install it with pip install 'v4parity[llamacpp]' (docs/peers.md)") from exc
    return llama_cpp


def file_types() -> dict[str, int]:
    """llama.cpp's quantization file types of the installed package: name -> `llama_ftype` value."""
    L = llama_cpp_module()
    out: dict[str, int] = {}
    for attr in dir(L):
        if attr in _NOT_A_FILE_TYPE:
            continue
        for prefix in _PREFIXES:
            if attr.startswith(prefix) and isinstance(getattr(L, attr), int):
                out[attr[len(prefix):]] = int(getattr(L, attr))
    return dict(sorted(out.items(), key=lambda kv: kv[1]))


def ggml_types() -> dict[int, str]:
    """Every ggml type the ggml library under llama-cpp-python knows (a block size > 0 in its type traits;
    removed types have none): type id -> ggml's own name."""
    L = llama_cpp_module()
    from llama_cpp._ggml import libggml

    libggml.ggml_type_name.restype = ctypes.c_char_p
    libggml.ggml_type_name.argtypes = [ctypes.c_int]
    libggml.ggml_blck_size.restype = ctypes.c_int64
    libggml.ggml_blck_size.argtypes = [ctypes.c_int]
    out: dict[int, str] = {}
    for t in range(int(L.GGML_TYPE_COUNT)):
        if libggml.ggml_blck_size(t) > 0:
            out[t] = (libggml.ggml_type_name(t) or b"").decode()
    return out


def quantize(src: str | os.PathLike, dst: str | os.PathLike, file_type: str, threads: int | None = None) -> dict:
    """Quantize the GGUF `src` to `dst` with llama.cpp's `llama_model_quantize` at `file_type` (a name of
    `file_types()`), default parameters otherwise; `threads` None = llama.cpp's default (every hardware
    thread). Returns {path, file_type, ftype, seconds, log}. A refusal (e.g. a type that needs an importance
    matrix) is a ParityError carrying llama.cpp's error lines."""
    L = llama_cpp_module()
    types = file_types()
    src, dst = _checked_paths(src, dst, file_type, types, threads)
    params = L.llama_model_quantize_default_params()
    params.ftype = types[file_type]
    if threads is not None:
        params.nthread = threads
    rc, seconds, log = _run_quantize(L, src, dst, params)
    if rc != 0:
        said = [" ".join(ln.split()) for ln in log.splitlines() if any(w in ln.lower() for w in _ERROR_WORDS)]
        tail = "\n  ".join(said[-6:]) or "llama.cpp logged no error"
        raise ParityError(f"llama.cpp could not quantize {src.name} to {file_type} (llama_model_quantize "
                          f"returned {rc}):\n  {tail}")
    return {"path": dst, "file_type": file_type, "ftype": types[file_type], "seconds": seconds, "log": log}


def _checked_paths(src: str | os.PathLike, dst: str | os.PathLike, file_type: str, types: dict[str, int],
                   threads: int | None) -> tuple[Path, Path]:
    """`quantize`'s arguments checked (a known file type, an existing input, another output, threads >= 1)."""
    if file_type not in types:
        raise ParityError(f"unknown llama.cpp file type {file_type!r}; valid: {', '.join(types)}")
    src, dst = Path(src), Path(dst)
    if not src.is_file():
        raise ParityError(f"quantize: input {src} is not a file")
    if dst.resolve() == src.resolve():
        raise ParityError(f"quantize: output {dst} is the input file")
    if threads is not None and threads < 1:
        raise ParityError(f"quantize: threads={threads}; expected an integer >= 1")
    return src, dst


def _run_quantize(L: Any, src: Path, dst: Path, params: Any) -> tuple[int, float, str]:
    """`llama_model_quantize` with llama.cpp's log collected: its return code, seconds and log text."""
    lines: list[str] = []

    @_LOG
    def collect(level: int, text: bytes | None, _user: Any) -> None:
        lines.append((text or b"").decode("utf-8", "replace"))

    L.llama_log_set(collect, None)
    L.llama_backend_init()
    t0 = time.perf_counter()
    try:
        rc = L.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    finally:
        seconds = time.perf_counter() - t0
        L.llama_log_set(_QUIET, None)
    return rc, seconds, "".join(lines)

