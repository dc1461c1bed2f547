"""The BPE tokenizer of a deepseek4 GGUF (`tokenizer.ggml.*`), built with the `tokenizers` library.

Byte-level BPE (GPT-2 byte map) with the DeepSeek-V3 / `joyai-llm` pre-tokenizer of spec
v4-residual-ffn-gguf §11: split off runs of 1-3 digits, then CJK/kana runs, then the punctuation/letter/
whitespace alternatives, each piece kept ("isolated"). Special tokens are looked up by string, as ds4
does. Text is encoded two ways:
* `encode_text`: plain BPE, special-looking strings are ordinary text (ds4 `ds4_tokenize_text`);
* `encode_rendered`: the 7 specials ds4 recognises in a rendered prompt become their ids and the text
  between them is BPE'd span by span (ds4 `tokenize_rendered_chat_vocab`).
`encode_chat` gives the prompt ids ds4 would use: the file's chat template rendered with jinja2 when it
has one (user and system text spliced in as plain text), else ds4's fixed layout.
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from parity.contract.errors import MetadataError
from parity.gguf.chat import ChatTemplateError, chat_messages, ds4_layout, render_chat
from parity.gguf.container import VT, GGUFFile, Value
from parity.gguf.vocab import ASSISTANT, BOS, END_THINK, EOS, RENDERED_SPECIALS, THINK, USER, byte_decoder, token_bytes

# tokenizer.ggml.pre values that mean the DeepSeek-V3 split (llama.cpp maps both to the same regexes).
DEEPSEEK_V3_PRE = ("joyai-llm", "deepseek-v3")
SPLIT_DIGITS = r"\p{N}{1,3}"
SPLIT_CJK = "[一-龥぀-ゟ゠-ヿ]+"
SPLIT_WORDS = (r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
               r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
CHAT_REQUIRED = (BOS, USER, ASSISTANT, THINK, END_THINK)


def _string_array(kv: dict[str, Value], key: str, path: str) -> list[str]:
    v = kv.get(key)
    if v is None:
        raise MetadataError(f"{path}: required key {key} is missing")
    if v.type != VT.ARRAY or v.elem_type != VT.STRING:
        raise MetadataError(f"{path}: {key} must be array[STRING], got {v.type_name()}")
    return list(v.value)


def _string(kv: dict[str, Value], key: str, path: str) -> str:
    v = kv.get(key)
    if v is None:
        raise MetadataError(f"{path}: required key {key} is missing")
    if v.type != VT.STRING:
        raise MetadataError(f"{path}: {key} must be STRING, got {v.type_name()}")
    return v.value


def _merge_pairs(merges: list[str], vocab: dict[str, int], path: str) -> list[tuple[str, str]]:
    pairs = []
    for rank, m in enumerate(merges):
        parts = m.split(" ")
        if len(parts) != 2 or not all(parts) or any(p not in vocab for p in parts) or "".join(parts) not in vocab:
            raise MetadataError(f"{path}: tokenizer.ggml.merges[{rank}] = {m!r} is not 'a b' with a, b and ab "
                                "in the vocabulary")
        pairs.append((parts[0], parts[1]))
    return pairs


def build_bpe(tokens: Sequence[str], merges: Sequence[tuple[str, str]]):
    """A `tokenizers.Tokenizer`: byte-level BPE with the DeepSeek-V3 pre-tokenizer, no added tokens."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=list(merges), fuse_unk=False,
                     byte_fallback=False)
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_DIGITS), behavior="isolated"),
        pre_tokenizers.Split(Regex(SPLIT_CJK), behavior="isolated"),
        pre_tokenizers.Split(Regex(SPLIT_WORDS), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    return tok


@dataclass(frozen=True)
class GGUFTokenizer:
    """A GGUF's vocabulary, merges, special ids and chat template, with ds4's encoders."""

    path: str
    tokens: list[str]
    specials: dict[str, int]          # the RENDERED_SPECIALS present in the vocabulary
    bos_id: int
    eos_id: int
    chat_template: str | None
    bpe: object                       # tokenizers.Tokenizer

    def encode_text(self, text: str) -> list[int]:
        """Plain BPE of `text` (no BOS; special-looking strings stay text)."""
        if not text:
            return []
        return list(self.bpe.encode(text, add_special_tokens=False).ids)

    def encode_rendered(self, text: str) -> list[int]:
        """A rendered prompt: the ds4-recognised specials by id, the text between them BPE'd span by span."""
        ids: list[int] = []
        pattern = "(" + "|".join(re.escape(s) for s in sorted(self.specials, key=len, reverse=True)) + ")"
        for i, part in enumerate(re.split(pattern, text)):
            ids += [self.specials[part]] if i % 2 else self.encode_text(part)
        return ids

    def piece(self, token_id: int) -> bytes:
        """The raw bytes of one token (ds4 `ds4_token_text`)."""
        if not 0 <= token_id < len(self.tokens):
            raise MetadataError(f"{self.path}: token id {token_id} outside the vocabulary (0..{len(self.tokens) - 1})")
        return token_bytes(self.tokens[token_id], _DECODER)

    def decode(self, ids: Sequence[int]) -> bytes:
        return b"".join(self.piece(i) for i in ids)

    def require(self, special: str) -> int:
        if special not in self.specials:
            raise MetadataError(f"{self.path}: special token {special!r} is not in tokenizer.ggml.tokens")
        return self.specials[special]


_DECODER = byte_decoder()


def tokenizer_from_metadata(kv: dict[str, Value], path: str) -> GGUFTokenizer:
    """Build the tokenizer from `tokenizer.ggml.*` keys (errors name the key)."""
    model = _string(kv, "tokenizer.ggml.model", path)
    if model != "gpt2":
        raise MetadataError(f"{path}: tokenizer.ggml.model is {model!r}; only 'gpt2' (byte-level BPE) is supported")
    pre = _string(kv, "tokenizer.ggml.pre", path)
    if pre not in DEEPSEEK_V3_PRE:
        raise MetadataError(f"{path}: tokenizer.ggml.pre is {pre!r}; supported: {', '.join(DEEPSEEK_V3_PRE)}")
    tokens = _string_array(kv, "tokenizer.ggml.tokens", path)
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        if t in vocab:
            raise MetadataError(f"{path}: tokenizer.ggml.tokens has {t!r} twice (ids {vocab[t]} and {i})")
        vocab[t] = i
    merges = _merge_pairs(_string_array(kv, "tokenizer.ggml.merges", path), vocab, path)
    specials = {s: vocab[s] for s in RENDERED_SPECIALS if s in vocab}
    for key, name in (("tokenizer.ggml.bos_token_id", BOS), ("tokenizer.ggml.eos_token_id", EOS)):
        if name not in specials:
            raise MetadataError(f"{path}: special token {name!r} is not in tokenizer.ggml.tokens")
        if key in kv and kv[key].value != specials[name]:
            raise MetadataError(f"{path}: {key} = {kv[key].value} but {name!r} has id {specials[name]}")
    template = _string(kv, "tokenizer.chat_template", path) if "tokenizer.chat_template" in kv else None
    return GGUFTokenizer(path, tokens, specials, specials[BOS], specials[EOS], template, build_bpe(tokens, merges))


@lru_cache(maxsize=4)
def _load(path: str, mtime_ns: int, size: int) -> GGUFTokenizer:
    return tokenizer_from_metadata(GGUFFile(path).kv, path)


def load_tokenizer(model_path: str | os.PathLike) -> GGUFTokenizer:
    """The tokenizer of a GGUF file (cached per file version)."""
    p = Path(model_path)
    st = p.stat()
    return _load(str(p), st.st_mtime_ns, st.st_size)


def chat_ids(tok: GGUFTokenizer, text: str, system: str = "", thinking: bool = False) -> list[int]:
    """Prompt ids for one user turn (see `encode_chat`)."""
    for s in CHAT_REQUIRED:
        tok.require(s)
    if text.startswith(BOS):  # ds4 takes a prompt that starts with BOS as already rendered
        return tok.encode_rendered(text)
    # free text goes through plain BPE (specials inside it are text), so render with sentinels
    # and splice the BPE of the real text in where they land
    marks = {f"\x00{uuid.uuid4().hex}\x00": t for t in (text, system)}
    mark_text, mark_sys = list(marks)
    if tok.chat_template is not None:
        rendered = render_chat(tok.chat_template, chat_messages(mark_text, mark_sys if system else ""),
                               bos_token=BOS, eos_token=EOS, thinking=thinking)
    else:
        rendered = ds4_layout(mark_text, mark_sys if system else "", thinking, BOS)
    for mark, what in ((mark_text, "user text"), (mark_sys, "system text")):
        if (mark is mark_text or system) and rendered.count(mark) != 1:
            raise ChatTemplateError(f"{tok.path}: the chat template placed the {what} {rendered.count(mark)} times")
    ids: list[int] = []
    for i, part in enumerate(re.split("(" + "|".join(marks) + ")", rendered)):
        ids += tok.encode_text(marks[part]) if i % 2 else tok.encode_rendered(part)
    return ids


def encode_chat(model_path: str, text: str, system: str = "", thinking: bool = False) -> list[int]:
    """The exact prompt ids ds4 uses: BOS + system + <｜User｜> + text + <｜Assistant｜> + </think> | <think>."""
    return chat_ids(load_tokenizer(model_path), text, system, thinking)
