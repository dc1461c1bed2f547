"""Memory-mapped access to a deepseek4 GGUF (single file or `-0000k-of-0000N` shards).

`Weights.tensor(name)` dequantizes a whole tensor to float32 in spec shape (reversed ne);
`Weights.expert(name, e)` dequantizes only expert e's slice of a 3-D expert tensor. Dequantization
is `gguf.quants.dequantize` on the mapped bytes; nothing is read before it is asked for.
"""

from __future__ import annotations

import hashlib
import os
import re
import struct
from pathlib import Path

import numpy as np
from gguf import quants
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from parity.contract.errors import GGUFError, ParityError, TensorError
from parity.gguf.config import ModelConfig, config_from_metadata
from parity.gguf.container import GGUFFile, TensorInfo

SHARD_RE = re.compile(r"^(?P<stem>.*)-(?P<idx>\d{5})-of-(?P<n>\d{5})\.gguf$")


def shard_paths(path: str | os.PathLike) -> list[Path]:
    """All shards of a split model given any one of them; a plain file is its own single shard."""
    path = Path(path)
    m = SHARD_RE.match(path.name)
    if not m:
        return [path]
    n = int(m["n"])
    paths = [path.with_name(f"{m['stem']}-{i:05d}-of-{n:05d}.gguf") for i in range(1, n + 1)]
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        raise GGUFError(f"{path}: split model is missing shard(s): {', '.join(missing)}")
    return paths


def dequantize_bytes(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...], name: str = "?") -> np.ndarray:
    """Dequantize raw tensor bytes to float32 of numpy `shape` (I32 stays int32); `name` is for errors."""
    qtype = GGMLQuantizationType(ggml_type)
    if qtype == GGMLQuantizationType.I32:
        return np.frombuffer(raw, dtype="<i4").reshape(shape)
    if qtype == GGMLQuantizationType.F32:
        return np.frombuffer(raw, dtype="<f4").reshape(shape)
    block, size = GGML_QUANT_SIZES[qtype]
    rows = np.asarray(raw).reshape(-1, shape[-1] // block * size)
    try:
        out = quants.dequantize(rows, qtype)
    except NotImplementedError:
        raise TensorError(f"tensor {name!r}: ggml type {qtype.name} cannot be dequantized by this reader "
                          "(gguf-py has no dequantizer for it)") from None
    return out.astype(np.float32, copy=False).reshape(shape)


class Weights:
    """The tensors of one model, memory-mapped; `config` is read and validated on open."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.paths = shard_paths(path)
        self.files = [GGUFFile(p) for p in self.paths]
        self._where: dict[str, tuple[GGUFFile, TensorInfo]] = {}
        for f in self.files:
            for name, info in f.tensors.items():
                if name in self._where:
                    raise GGUFError(f"{f.path}: tensor {name!r} also appears in {self._where[name][0].path}")
                self._where[name] = (f, info)
        self.kv = self.files[0].kv
        shapes = {name: info.shape for name, (_, info) in self._where.items()}
        self.config: ModelConfig = config_from_metadata(self.kv, str(self.paths[0]), shapes)

    @property
    def names(self) -> list[str]:
        return list(self._where)

    def tensor_infos(self) -> dict[str, TensorInfo]:
        """The tensor table of all shards together."""
        return {name: info for name, (_, info) in self._where.items()}

    def info(self, name: str) -> TensorInfo:
        if name not in self._where:
            raise TensorError(f"{self.paths[0]}: tensor {name!r} is missing")
        return self._where[name][1]

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 view of the mapping."""
        self.info(name)
        f, _ = self._where[name]
        return f.data(name)

    def tensor(self, name: str) -> np.ndarray:
        """Whole tensor, dequantized, numpy shape = reversed(ne); non-finite values are an error."""
        info = self.info(name)
        out = dequantize_bytes(self.raw(name), info.ggml_type, info.shape, f"{self.paths[0]}: {name}")
        _check_finite(out, f"{self.paths[0]}: {name}")
        return out

    def expert_raw(self, name: str, e: int) -> tuple[np.ndarray, int, tuple[int, int]]:
        """Expert e's bytes of a 3-D expert tensor (numpy (E, out, in)): (raw, ggml_type, (out, in))."""
        info = self.info(name)
        if len(info.shape) != 3:
            raise TensorError(f"{self.paths[0]}: tensor {name!r} is not a 3-D expert tensor (shape {info.shape})")
        n_exp, rows, cols = info.shape
        if not 0 <= e < n_exp:
            raise TensorError(f"{self.paths[0]}: tensor {name!r}: expert {e} out of range [0, {n_exp})")
        per = info.nbytes // n_exp
        return self.raw(name)[e * per : (e + 1) * per], info.ggml_type, (rows, cols)

    def release(self, name: str, e: int | None = None) -> None:
        """Drop tensor `name`'s raw pages (expert e's, when given) from the process's resident set, for a reader
        that keeps its own decoded copy (`parity.gguf.mapping`: read back from the page cache when next used).
        Bytes this object serves from a copy (a drafter's split tensor) have no pages to drop."""
        raw = self.raw(name) if e is None else self.expert_raw(name, e)[0]
        for f in self.files:
            f.release(raw)

    def expert(self, name: str, e: int) -> np.ndarray:
        """Expert e of a 3-D expert tensor (numpy (E, out, in)) as a float32 (out, in) matrix."""
        out = dequantize_bytes(*self.expert_raw(name, e), f"{self.paths[0]}: {name}[expert {e}]")
        _check_finite(out, f"{self.paths[0]}: {name}[expert {e}]")
        return out

    def identity(self) -> dict:
        """Model identity for trace headers: total size, a hash of every header + tensor table, and a sampled
        hash of the tensor data (`data_sha256`, see `data_sha256`)."""
        h = hashlib.sha256()
        size = 0
        for f in self.files:
            h.update(f.header_bytes())
            size += Path(f.path).stat().st_size
        return {"file": Path(self.paths[0]).name, "size": size, "header_sha256": h.hexdigest()[:32],
                "data_sha256": data_sha256(self.files)}


SAMPLE_BLOCK = 4096      # bytes per sampled block
SAMPLE_BLOCKS = 16       # blocks per tensor larger than WHOLE_LIMIT
WHOLE_LIMIT = 64 * 1024  # tensors up to this size are hashed whole


def data_sha256(files: list[GGUFFile]) -> str:
    """A cheap content hash of the tensor data (first 32 hex digits of a sha256).

    For every tensor, shard by shard in tensor-table order, the hash takes the name (UTF-8), a NUL, its byte
    count (u64 little-endian) and its bytes: all of them when the tensor has at most 64 KiB, else 16 blocks
    of 4 KiB starting at byte k * (nbytes - 4096) // 15, k = 0..15 (first and last 4 KiB included). It reads at
    most 64 KiB per tensor (~85 MB for V4-Flash's 1 328 tensors), so a change to the weights outside the
    sampled blocks is not seen; any re-quantisation, re-seeding or re-conversion changes sampled bytes.
    """
    h = hashlib.sha256()
    for f in files:
        for name, info in f.tensors.items():
            raw = f.data(name)
            h.update(name.encode() + b"\0" + struct.pack("<Q", info.nbytes))
            if info.nbytes <= WHOLE_LIMIT:
                h.update(raw)
                continue
            for k in range(SAMPLE_BLOCKS):
                at = k * (info.nbytes - SAMPLE_BLOCK) // (SAMPLE_BLOCKS - 1)
                h.update(raw[at: at + SAMPLE_BLOCK])
    return h.hexdigest()[:32]


def same_model(a: dict, b: dict, *, compare_file: bool = False) -> bool:
    """Whether two model identities name the same model: size, header hash and, when both carry it (identities
    written before the data hash lack it), the data hash; the file name only with `compare_file`."""
    keys = ["size", "header_sha256"] + (["data_sha256"] if "data_sha256" in a and "data_sha256" in b else [])
    keys += ["file"] if compare_file else []
    missing = [k for k in keys for ident in (a, b) if k not in ident]
    if missing:  # two identities that both lack a key would otherwise compare equal on it
        raise ParityError(f"model identity without {missing[0]!r}: cannot tell whether two models are the same")
    return all(a[k] == b[k] for k in keys)


def _check_finite(arr: np.ndarray, what: str) -> None:
    if arr.dtype.kind == "f" and not np.isfinite(arr).all():
        bad = int(np.flatnonzero(~np.isfinite(arr.ravel()))[0])
        raise TensorError(f"tensor {what}: non-finite value {arr.ravel()[bad]} at flat index {bad}")
