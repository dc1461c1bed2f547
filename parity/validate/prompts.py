"""The prompts a validation runs: boundary prompts from the model's own constants, text or token-id files,
and the small text corpus shipped with the package (`corpus.txt`).

Boundary prompts are BOS + seeded random ids; their lengths (and prefill chunks) straddle every place where the
V4 attention changes behaviour (`boundary_shapes`). Prompt i takes shape i mod (number of shapes) and its own
ids drawn with seed (seed, i), so the prompts are deterministic by seed and no two are the same.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from parity.contract.errors import ParityError
from parity.gguf.config import ModelConfig

CORPUS = Path(__file__).with_name("corpus.txt")


class PromptError(ParityError):
    """A prompt source that cannot give the prompts asked for."""


@dataclass(frozen=True)
class Prompt:
    index: int
    source: str                    # boundary:<shape> | text:<file>:<line> | tokens:<file>:<line>
    tokens: tuple[int, ...]
    chunk: int | None = None       # prefill chunk size (None: one batched prefill)

    @property
    def sha(self) -> str:
        """Hash of the ids and the chunking (a resumed run checks its prompts against the stored records)."""
        return hashlib.sha256(json.dumps([list(self.tokens), self.chunk]).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Shape:
    name: str
    length: int
    chunk: int | None = None


def boundary_shapes(cfg: ModelConfig, decode: int) -> list[Shape]:
    """Prompt lengths (and chunks) at the model's boundaries, in a fixed order, each (length, chunk) once:
    * window-1/0/+1: around the raw sliding window W (the first position that drops a key);
    * ratio R: R-1 (incomplete group), R (first complete), R+1, 2R-1, 2R, 2R+1, for every compress ratio;
    * indexer: around R_csa*(top_k+1), the first length at which a CSA layer's indexer has more compressed
      rows than it keeps (its top-k becomes selective);
    * chunk C: 2C+1 tokens prefilled in chunks of C (W-1, W+1 and every R+1), so chunk edges fall inside groups;
    * decode-past-window: W - decode//2 tokens (at least 2), so the greedy decode crosses the window edge and
      compressed rows are emitted from the decode path."""
    W, k = cfg.window_size, cfg.index_topk
    ratios = sorted({r for r in cfg.compress_ratios if r})
    csa = sorted({cfg.ratio(l) for l in range(cfg.n_layers) if cfg.has_indexer(l)})
    shapes = [Shape(f"window{d:+d}", W + d) for d in (-1, 0, 1)]
    for r in ratios:
        shapes += [Shape(f"ratio{r}:{n}", n) for n in (r - 1, r, r + 1, 2 * r - 1, 2 * r, 2 * r + 1)]
    for r in csa:
        first = r * (k + 1)
        shapes += [Shape(f"indexer{r}{d:+d}", first + d) for d in (-1, 0, 1)]
    for c in (W - 1, W + 1, *(r + 1 for r in ratios)):
        if c >= 1:
            shapes.append(Shape(f"chunk{c}", 2 * c + 1, c))
    if decode:
        shapes.append(Shape("decode-past-window", max(2, W - decode // 2)))
    merged: dict[tuple[int, int | None], Shape] = {}
    for s in shapes:  # one prompt shape per (length, chunk), named after every boundary it sits on
        key = (s.length, s.chunk)
        if s.length >= 2:
            merged[key] = Shape(f"{merged[key].name}|{s.name}", *key) if key in merged else s
    return list(merged.values())


def boundary_prompts(cfg: ModelConfig, n: int, decode: int, seed: int, start: int = 0) -> list[Prompt]:
    """n boundary prompts, indices start..start+n-1 (see the module docstring)."""
    shapes = boundary_shapes(cfg, decode)
    out = []
    for j in range(n):
        i = start + j
        s = shapes[j % len(shapes)]
        rng = np.random.default_rng([seed, i])
        ids = rng.integers(2, cfg.vocab_size, s.length - 1)
        out.append(Prompt(i, f"boundary:{s.name}", (cfg.bos_token_id, *(int(t) for t in ids)), s.chunk))
    return out


def read_prompt_file(path: str | os.PathLike, model: str | os.PathLike) -> list[tuple[str, tuple[int, ...]]]:
    """(source, ids) per prompt of a file: `.jsonl` lines are objects with exactly one of `text` (rendered with
    the model's chat template, as `trace --prompt`) or `tokens` (a list of ids); any other file has one text
    prompt per non-empty line."""
    from parity.gguf.tokenizer import encode_chat

    p = Path(path)
    out = []
    for no, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{p.name}:{no}"
        if p.suffix != ".jsonl":
            out.append((f"text:{where}", tuple(encode_chat(str(model), line))))
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise PromptError(f"{where}: not a JSON object ({e.msg})") from None
        if not isinstance(obj, dict) or len(obj.keys() & {"text", "tokens"}) != 1 or set(obj) - {"text", "tokens"}:
            raise PromptError(f"{where}: expected an object with exactly one of 'text' or 'tokens'")
        if "text" in obj:
            if not isinstance(obj["text"], str) or not obj["text"]:
                raise PromptError(f"{where}: 'text' must be a non-empty string")
            out.append((f"text:{where}", tuple(encode_chat(str(model), obj["text"]))))
        else:
            ids = obj["tokens"]
            if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool)
                                                              for t in ids):
                raise PromptError(f"{where}: 'tokens' must be a non-empty list of integers")
            out.append((f"tokens:{where}", tuple(ids)))
    return out


def file_prompts(path: str | os.PathLike, model: str | os.PathLike, cfg: ModelConfig, n: int,
                 start: int = 0) -> list[Prompt]:
    """The first n prompts of a file (fewer is an error: prompts are never repeated to reach n)."""
    rows = read_prompt_file(path, model)
    if len(rows) < n:
        raise PromptError(f"{path}: {len(rows)} prompts, {n} needed (prompts are not repeated)")
    out = []
    for j, (source, ids) in enumerate(rows[:n]):
        bad = [t for t in ids if not 0 <= t < cfg.vocab_size]
        if bad:
            raise PromptError(f"{source}: token id(s) {bad[:5]} out of range [0, {cfg.vocab_size})")
        out.append(Prompt(start + j, source, ids))
    return out


def build_prompts(cfg: ModelConfig, model: str | os.PathLike, n: int, decode: int, seed: int,
                  prompt_file: str | os.PathLike | None, boundary: bool) -> list[Prompt]:
    """n prompts: all from the file, all boundary, or (both given) the first n//2 from the file and the rest
    boundary prompts."""
    if n < 1:
        raise PromptError(f"--n must be >= 1, got {n}")
    if prompt_file is None and not boundary:
        raise PromptError("no prompt source: give --prompts FILE, --corpus and/or --boundary")
    n_file = (n // 2 if boundary else n) if prompt_file is not None else 0
    out = file_prompts(prompt_file, model, cfg, n_file) if n_file else []
    if boundary:
        out += boundary_prompts(cfg, n - n_file, decode, seed, start=n_file)
    too_long = [p.index for p in out if len(p.tokens) + decode > cfg.context_length]
    if too_long:
        raise PromptError(f"prompts {too_long[:5]}: prompt + {decode} decode steps exceed the context "
                          f"length {cfg.context_length}")
    return out
