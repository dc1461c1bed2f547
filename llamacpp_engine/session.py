"""One llama.cpp model and its contexts, driven through llama-cpp-python's low-level API.

`Context.decode` feeds tokens at given positions (all logits requested, one `llama_decode` per ubatch of at
most `n_ubatch` rows; with `hidden`, each row also carries a hidden-state vector in the batch's `embd`: the
input of llama.cpp's MTP graph) and, through the eval callback, copies out the mapped tensors by capture key
(`parity.gguf.llamacpp`: `<name>-<layer>`, `#2` for a layer's second tensor of that name) and overwrites
the tensors named in `overrides` right after llama.cpp computed them, before anything reads them (this is
how a layer is run on a given input carrier: the rest of the graph consumes the written values).
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from llamacpp_engine import ggml
from parity.contract.errors import ParityError
from parity.gguf.llamacpp import CACHE_ROWS, base_name, rows

KV_TYPES = {"f32": 0, "f16": 1}   # ggml types of the K/V cache


@dataclass(frozen=True)
class Settings:
    """How llama.cpp runs (every field is recorded in the trace header through the engine's options)."""

    kv: str = "f32"           # K/V cache type: f32 | f16
    flash_attn: bool = False
    threads: int = 1
    n_ctx: int = 4096         # positions a sequence may use
    n_ubatch: int = 512       # rows per llama_decode (a longer chunk is fed as consecutive ubatches)
    rs_seq: int = 16          # rollback planes per sequence (`n_rs_seq`): how many positions `seq_rm` can take back

    def args(self) -> tuple[str, ...]:
        return (f"lcp_kv={self.kv}", f"lcp_flash_attn={'on' if self.flash_attn else 'off'}",
                f"lcp_threads={self.threads}", f"lcp_ctx={self.n_ctx}", f"lcp_ubatch={self.n_ubatch}",
                f"lcp_rs_seq={self.rs_seq}")


def _lib():
    try:
        import llama_cpp
    except ImportError as e:
        raise ParityError("the llamacpp engine needs llama-cpp-python==0.3.36: pip install 'v4parity[llamacpp]' "
                          f"(built from its sdist; see docs/peers.md) — {e}") from None
    return llama_cpp


_LOG_CALLBACK = None


def _silence(lib) -> None:
    """Install a silent log callback once (the default one can raise UnicodeDecodeError on load messages)."""
    global _LOG_CALLBACK
    if _LOG_CALLBACK is None:
        _LOG_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)(lambda *_: None)
        lib.llama_log_set(_LOG_CALLBACK, None)
        lib.llama_backend_init()


class Model:
    """A loaded llama.cpp model (weights on the CPU); contexts are made from it. `mtp`: an MTP file loaded with
    `load_mtp` (its NextN block), whose contexts run llama.cpp's MTP graph (`LLAMA_CONTEXT_TYPE_MTP`)."""

    def __init__(self, path: str, settings: Settings, shapes: Mapping[str, tuple[int, ...]],
                 mtp: bool = False) -> None:
        self.lib = _lib()
        _silence(self.lib)
        self.settings, self.shapes, self.mtp = settings, dict(shapes), mtp
        params = self.lib.llama_model_default_params()
        params.n_gpu_layers = 0
        params.load_mtp = mtp
        self.ptr = self.lib.llama_model_load_from_file(str(path).encode(), params)
        if not self.ptr:
            raise ParityError(f"llama.cpp could not load {path} (its deepseek4 loader refused the file)")
        self.wanted = frozenset(base_name(k) for k in shapes)

    def __del__(self) -> None:
        if getattr(self, "ptr", None):
            self.lib.llama_model_free(self.ptr)
            self.ptr = None


class Context:
    """One llama.cpp context = one sequence's caches."""

    def __init__(self, model: Model, observed: bool = True) -> None:
        """`observed`: install the eval callback that copies out and overwrites tensors (`decode`); without it the
        context only runs the graph (`feed`)."""
        self.model, lib, s = model, model.lib, model.settings
        self.observed = observed
        self.lib = lib
        self._collect: dict[str, np.ndarray] = {}
        self._overrides: Mapping[str, np.ndarray] = {}
        self._capture = True
        self._stop: str | None = None
        self._count: dict[str, int] = {}
        self._error: Exception | None = None
        self._cb = lib.ggml_backend_sched_eval_callback(self._on_tensor)
        p = lib.llama_context_default_params()
        p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max = s.n_ctx, s.n_ubatch, s.n_ubatch, 1
        p.n_rs_seq = s.rs_seq   # DSV4: compressor states kept per position for `llama_memory_seq_rm` rollback
        p.n_threads = p.n_threads_batch = s.threads
        p.type_k = p.type_v = KV_TYPES[s.kv]
        p.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_ENABLED if s.flash_attn else lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
        if observed:
            p.cb_eval, p.cb_eval_user_data = self._cb, None
        if model.mtp:
            p.ctx_type = lib.LLAMA_CONTEXT_TYPE_MTP
        self.ptr = lib.llama_init_from_model(model.ptr, p)
        if not self.ptr:
            raise ParityError(f"llama.cpp could not create a context (n_ctx {s.n_ctx}, n_ubatch {s.n_ubatch})")
        if model.mtp:  # the MTP context hands out its output carriers (h_nextn) for every output row
            from llama_cpp import llama_cpp_ext

            llama_cpp_ext.llama_set_embeddings_nextn(self.ptr, True, True)
        self.next_pos = 0
        self.empty = True   # nothing fed: llama.cpp accepts any first position of the sequence

    def __del__(self) -> None:
        if getattr(self, "ptr", None):
            self.lib.llama_free(self.ptr)
            self.ptr = None

    def clear(self) -> None:
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ptr), True)
        self.next_pos, self.empty = 0, True

    def truncate(self, pos: int) -> None:
        """Remove the sequence's rows at positions >= pos (`llama_memory_seq_rm`); the next chunk starts at pos."""
        if not self.lib.llama_memory_seq_rm(self.lib.llama_get_memory(self.ptr), 0, pos, -1):
            raise ParityError(f"llamacpp: llama_memory_seq_rm refused to remove the rows from position {pos} (of "
                              f"{self.next_pos}; llama.cpp's DSV4 cache takes back at most lcp_rs_seq="
                              f"{self.model.settings.rs_seq} positions)")
        self.next_pos = pos

    def _on_tensor(self, ptr, ask, _user) -> bool:
        try:
            t = ggml.tensor_at(ptr)
            name = ggml.name_of(t)
            if base_name(name) not in self.model.wanted:
                return False
            if ask:
                return True
            n = self._count[name] = self._count.get(name, 0) + 1
            k = name if n == 1 else f"{name}#{n}"
            if k in self._overrides:
                ggml.write(t, self._overrides[k])
            if self._capture and k in self.model.shapes:
                self._collect[k] = ggml.read(t)
            return k != self._stop   # False ends the graph computation here
        except Exception as e:  # an exception must not cross the C callback: re-raised after llama_decode
            self._error = e
        return True

    def decode(self, tokens: np.ndarray, start_pos: int, overrides: Mapping[str, np.ndarray] | None = None,
               capture: bool = True, stop_after: str | None = None,
               hidden: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """Feed tokens at start_pos.. (positions must continue this context's sequence; an empty context starts
        anywhere). Returns the mapped tensors by capture key, [rows, *shape]: per-token ones for every fed row,
        cache views as of the end. `stop_after`: end each graph once that tensor is computed (the context's
        caches are then unusable: only for a scratch context that is cleared before its next use). `hidden`
        [n, width]: a hidden-state row per token, fed in the batch's `embd` next to the token."""
        if not self.observed:
            raise ParityError("llamacpp: decode() copies tensors out; this context was made without the eval "
                              "callback (feed() only)")
        tokens = np.asarray(tokens, np.int64)
        n, s = len(tokens), self.model.settings
        if hidden is not None and (hidden.ndim != 2 or len(hidden) != n):
            raise ParityError(f"llamacpp: hidden rows of shape {hidden.shape} for {n} tokens")
        if not self.empty and start_pos != self.next_pos:
            raise ParityError(f"llamacpp: chunk starts at position {start_pos}, the context expects {self.next_pos}")
        if start_pos + n > s.n_ctx:
            raise ParityError(f"llamacpp: positions up to {start_pos + n - 1} exceed the context of {s.n_ctx} "
                              "(raise lcp_ctx)")
        parts: dict[str, list[np.ndarray]] = {}
        overrides = overrides or {}
        for i0 in range(0, n, s.n_ubatch):
            i1 = min(n, i0 + s.n_ubatch)
            got = self._ubatch(tokens[i0:i1], start_pos + i0,
                               {k: v[i0:i1] for k, v in overrides.items()}, capture, stop_after,
                               None if hidden is None else hidden[i0:i1])
            for k, v in got.items():
                parts.setdefault(k, []).append(v)
        self.next_pos, self.empty = start_pos + n, False
        return {k: v[-1] if base_name(k) in CACHE_ROWS else np.concatenate(v) for k, v in parts.items()}

    def feed(self, tokens: np.ndarray, start_pos: int) -> None:
        """Feed tokens at start_pos.. as llama.cpp's users do: in a context made with `observed=False` (no eval
        callback), only the last row's logits computed (capability `PlainDecode`; the sequence rules are
        `decode`'s)."""
        if self.observed:
            raise ParityError("llamacpp: feed() times the plain graph; this context has the eval callback")
        tokens = np.asarray(tokens, np.int64)
        n, s = len(tokens), self.model.settings
        if not self.empty and start_pos != self.next_pos:
            raise ParityError(f"llamacpp: chunk starts at position {start_pos}, the context expects {self.next_pos}")
        if start_pos + n > s.n_ctx:
            raise ParityError(f"llamacpp: positions up to {start_pos + n - 1} exceed the context of {s.n_ctx} "
                              "(raise lcp_ctx)")
        for i0 in range(0, n, s.n_ubatch):
            self._ubatch(tokens[i0:i0 + s.n_ubatch], start_pos + i0, {}, False, None, None, last_logits_only=True)
        self.next_pos, self.empty = start_pos + n, False

    def _ubatch(self, tokens: np.ndarray, pos0: int, overrides: Mapping[str, np.ndarray],
                capture: bool, stop_after: str | None, hidden: np.ndarray | None,
                last_logits_only: bool = False) -> dict[str, np.ndarray]:
        lib, n = self.lib, len(tokens)
        batch = lib.llama_batch_init(n, 0 if hidden is None else hidden.shape[1], 1)
        token_rows = None
        try:
            if hidden is not None:  # a batch made with embd has no token array: give it one (MTP protocol)
                token_rows = (lib.llama_token * n)()
                batch.token = ctypes.cast(token_rows, ctypes.POINTER(lib.llama_token))
                rows_in = np.ascontiguousarray(hidden, np.float32)
                ctypes.memmove(batch.embd, rows_in.ctypes.data, rows_in.nbytes)
            for i, tok in enumerate(tokens):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = int(tok), pos0 + i, 1
                batch.seq_id[i][0], batch.logits[i] = 0, int(not last_logits_only or i == n - 1)
            batch.n_tokens = n
            self._collect, self._overrides, self._capture, self._count, self._error = {}, overrides, capture, {}, None
            self._stop = stop_after
            rc = lib.llama_decode(self.ptr, batch)
        finally:
            if token_rows is not None:   # ours, not llama_batch_free's
                batch.token = ctypes.POINTER(lib.llama_token)()
            lib.llama_batch_free(batch)
            self._overrides, self._stop = {}, None
        if self._error is not None:
            raise ParityError(f"llamacpp eval callback failed: {self._error}") from self._error
        if rc != 0:
            raise ParityError(f"llama_decode returned {rc} for {n} tokens at position {pos0}")
        unused = [k for k in overrides if self._count.get(k.split("#")[0], 0) < (int(k.split("#")[1])
                                                                                if "#" in k else 1)]
        if unused:
            raise ParityError(f"llamacpp: the graph has no tensor {unused[0]!r} to overwrite")
        shapes = self.model.shapes
        return {k: rows(v, shapes[k], k) for k, v in self._collect.items()}
