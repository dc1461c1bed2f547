"""`synth --preset flash`: a full-depth DeepSeek-V4-Flash-shaped deepseek4 GGUF, written streaming.

The real V4-Flash shape (spec v4-residual-ffn-gguf §1, §3, §4; v4-attention): 43 layers, hidden 4096, 64 heads x 512
with 64 rotary dims, q rank 1024, 8 output groups x 1024, window 128, indexer 64 x 128 with top-k 512, hc 4, the
release compression schedule (ratio 0 for layers 0-1, 4 for even layers >= 2, 128 for odd layers >= 3), 3 hash-routed
layers, YaRN (factor 16 over 65 536), the real vocabulary size (129 280: the synthetic BPE vocabulary padded with
`[PAD{i}]` tokens of type UNUSED, as llama.cpp's converter pads missing ids) and the DS4 2-bit release's tensor
types (`REAL_RELEASE_TYPES`). The one knob is the routed expert count (`experts`, default 16 with 6 active, width
2048), which keeps the file near 10 GB instead of 80.

Streaming: every tensor is produced in pieces of at most `PIECE_ELEMS` elements while the file is written
(`container.TensorData` with a callable payload), so peak memory is a few hundred MB whatever the file size. Each
piece draws from its own stream `default_rng([seed, crc32(name), piece])`: same experts and seed give the same bytes.
Small tensors (norms, HC, sinks, ...) are drawn whole, exactly as `parity.gguf.synth` draws them.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from parity.gguf.config import ModelConfig
from parity.gguf.container import VT, TensorData, Value, write_gguf
from parity.gguf.inventory import REAL_RELEASE_TYPES, TensorSpec, expected_tensors
from parity.gguf.quant_blocks import RANDOM_BLOCK_TYPES, random_blocks
from parity.gguf.synth import encode, init_weight, metadata, tid2eid
from parity.gguf.synth_real import V4_FLASH_LAYER, real_config
from parity.gguf.vocab import synthetic_vocab

FLASH_LAYERS = 43
FLASH_VOCAB = 129280
FLASH_HASH_LAYERS = 3
DEFAULT_EXPERTS = 16
PIECE_ELEMS = 1 << 24          # elements drawn at once for a big tensor (64 MB as float32)
TOKEN_TYPE_UNUSED = 5          # llama.cpp's type for its [PAD{i}] filler tokens


def flash_schedule(n_layers: int) -> tuple[int, ...]:
    """The release's compression ratios: 0 for layers 0 and 1, then 4 (CSA) on even and 128 (HCA) on odd layers."""
    return tuple(0 if il < 2 else (4 if il % 2 == 0 else 128) for il in range(n_layers))


def flash_config(experts: int = DEFAULT_EXPERTS, **overrides: object) -> ModelConfig:
    """The flash preset's `ModelConfig` with `experts` routed experts. `overrides` (`n_layers`, `vocab_size` or any
    V4-Flash layer dimension) scale it down for tests; the schedule and clamp lists follow `n_layers`."""
    if experts < V4_FLASH_LAYER["n_activated_experts"]:
        raise ValueError(f"--experts {experts}: fewer than the {V4_FLASH_LAYER['n_activated_experts']} experts "
                         "each token uses")
    unknown = set(overrides) - {"n_layers", "vocab_size", *V4_FLASH_LAYER}
    if unknown:
        raise ValueError(f"flash_config: unknown override(s) {', '.join(sorted(unknown))}")
    n_layers = int(overrides.pop("n_layers", FLASH_LAYERS))  # type: ignore[call-overload]
    vocab_size = int(overrides.pop("vocab_size", FLASH_VOCAB))  # type: ignore[call-overload]
    if vocab_size < len(synthetic_vocab().tokens):
        raise ValueError(f"vocab_size {vocab_size} is smaller than the {len(synthetic_vocab().tokens)} "
                         "synthetic tokens")
    cfg = real_config(flash_schedule(n_layers), vocab_size)
    return dataclasses.replace(cfg, n_routed_experts=experts, n_hash_layers=min(FLASH_HASH_LAYERS, n_layers),
                               **overrides)  # type: ignore[arg-type]


def flash_metadata(cfg: ModelConfig, name: str) -> dict:
    """`synth.metadata` with the token list padded to `cfg.vocab_size` ([PAD{i}], type UNUSED)."""
    kv = metadata(cfg, name)
    vocab = synthetic_vocab()
    pad = range(len(vocab.tokens), cfg.vocab_size)
    kv["tokenizer.ggml.tokens"] = Value(VT.ARRAY, [*vocab.tokens, *(f"[PAD{i}]" for i in pad)], VT.STRING)
    kv["tokenizer.ggml.token_type"] = Value(VT.ARRAY, [*vocab.token_types, *[TOKEN_TYPE_UNUSED] * len(pad)],
                                            VT.I32)
    return kv


def _pieces(spec: TensorSpec, cfg: ModelConfig, seed: int) -> Iterator[bytes]:
    """A tensor's bytes in the release type, `PIECE_ELEMS` elements (whole rows) at a time."""
    qtype = REAL_RELEASE_TYPES[spec.klass]
    size = int(np.prod(spec.shape))
    if spec.klass == "i32" or size <= PIECE_ELEMS:   # small: drawn whole, as parity.gguf.synth draws it
        rng = np.random.default_rng([seed, zlib.crc32(spec.name.encode())])
        if spec.klass == "i32":
            yield encode(tid2eid(cfg, rng), qtype, 0.0, rng)
        else:
            arr, std = init_weight(spec, cfg, rng)
            yield encode(arr, qtype, std, rng)
        return
    width = spec.shape[-1]      # big: a linear map, expert stack or embedding; rows of `width` values
    _, std = init_weight(dataclasses.replace(spec, shape=(1, width)), cfg, np.random.default_rng(0))
    rows, per_piece = size // width, max(1, PIECE_ELEMS // width)
    for i, start in enumerate(range(0, rows, per_piece)):
        rng = np.random.default_rng([seed, zlib.crc32(spec.name.encode()), i])
        shape = (min(per_piece, rows - start), width)
        if qtype in RANDOM_BLOCK_TYPES:
            yield random_blocks(qtype, shape, std, rng).tobytes()
        else:
            yield encode((std * rng.standard_normal(shape, dtype=np.float32)), qtype, std, rng)


def write_flash(path: str | Path, experts: int = DEFAULT_EXPERTS, seed: int = 0, **overrides: object) -> Path:
    """Write the flash preset (`flash_config(experts, **overrides)`) to `path`, streaming; returns its path."""
    cfg = flash_config(experts, **overrides)
    tensors = [TensorData(s.name, s.ne, int(REAL_RELEASE_TYPES[s.klass]),
                          lambda s=s: _pieces(s, cfg, seed))  # type: ignore[misc]
               for s in expected_tensors(cfg) if s.required]
    write_gguf(path, flash_metadata(cfg, "flash"), tensors)
    return Path(path)
