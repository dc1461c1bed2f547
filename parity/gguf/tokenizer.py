"""The BPE tokenizer of a deepseek4 GGUF (`tokenizer.ggml.*`), built with the `tokenizers` library.

Byte-level BPE (GPT-2 byte map) with the DeepSeek-V3 / `joyai-llm` pre-tokenizer of spec
v4-residual-ffn-gguf §11: split off runs of 1-3 digits, then CJK/kana runs, then the punctuation/letter/
whitespace alternatives, each piece kept ("isolated"). Special tokens are looked up by string, as ds4
does. Text is encoded two ways:
* `encode_text`: plain BPE, special-looking strings are ordinary text (ds4 `ds4_tokenize_text`);
* `encode_rendered`: the 7 specials ds4 recognises in a rendered prompt become their ids and the text
  between them is BPE'd span by span (ds4 `tokenize_rendered_chat_vocab`).
`encode_chat` gives the prompt ids: the file's chat template rendered with jinja2 when it has one (user and
system text spliced in as plain text), else ds4's fixed layout.

Two tokenizer modes. `model` (the default) follows the model's Unicode pre-tokenizer regex. `ds4` reproduces
ds4 exactly (`bpe_tokenize_text`): the same split rules over BYTES, where every byte >= 0x80 counts as a
letter (so `abc中文def`, `“x”`, `€`, NBSP, emoji join the neighbouring letters), CJK/kana runs still split
off at a piece start; and ds4 never reads `tokenizer.chat_template`, it builds the prompt itself
(`ds4_layout`, with the reasoning-effort prefix for think max). `mode_difference` says in one line when
the two modes disagree for a text.
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache
from pathlib import Path

from parity.contract.errors import MetadataError, ParityError
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
MODES = ("model", "ds4")


# ds4's pre-tokenizer (ds4.c `bpe_tokenize_text`), over the UTF-8 bytes of the text
def _alpha(c: int) -> bool:
    return 0x41 <= c <= 0x5A or 0x61 <= c <= 0x7A


def _digit(c: int) -> bool:
    return 0x30 <= c <= 0x39


def _space(c: int) -> bool:
    return c in b" \t\n\r\v\f"


def _newline(c: int) -> bool:
    return c in b"\n\r"


def _punct(c: int) -> bool:
    """ASCII punctuation and symbols: ! .. /, : .. @, [ .. `, { .. ~."""
    return 0x21 <= c <= 0x2F or 0x3A <= c <= 0x40 or 0x5B <= c <= 0x60 or 0x7B <= c <= 0x7E


def _char_len(b: bytes, pos: int) -> int:
    """Bytes of the UTF-8 character starting at pos by its first byte (1 for a stray byte or a cut end)."""
    c = b[pos]
    n = 1 if c < 0x80 else 2 if c & 0xE0 == 0xC0 else 3 if c & 0xF0 == 0xE0 else 4 if c & 0xF8 == 0xF0 else 1
    return n if pos + n <= len(b) else 1


def _letter(b: bytes, pos: int) -> bool:
    """ds4's letter test: ASCII letters, and every byte >= 0x80."""
    return b[pos] >= 0x80 or _alpha(b[pos])


def _cjk(b: bytes, pos: int) -> bool:
    if b[pos] < 0x80:
        return False
    cp = ord(b[pos:pos + _char_len(b, pos)].decode("utf-8", "replace")[0])
    return 0x4E00 <= cp <= 0x9FA5 or 0x3040 <= cp <= 0x309F or 0x30A0 <= cp <= 0x30FF


def _letters_end(b: bytes, pos: int) -> int:
    while pos < len(b) and _letter(b, pos):
        pos += _char_len(b, pos)
    return pos


def _piece_end(b: bytes, pos: int) -> int:
    """End of the piece starting at pos (ds4's rules, in ds4's order)."""
    n, c = len(b), b[pos]
    if _digit(c):
        end = pos
        while end < n and end - pos < 3 and _digit(b[end]):
            end += 1
        return end
    if _cjk(b, pos):
        end = pos + _char_len(b, pos)
        while end < n and _cjk(b, end):
            end += _char_len(b, end)
        return end
    if _punct(c) and pos + 1 < n and _alpha(b[pos + 1]):
        end = pos + 1
        while end < n and _alpha(b[end]):
            end += 1
        return end
    if _letter(b, pos):
        return _letters_end(b, pos)
    if not _newline(c) and not _punct(c) and pos + 1 < n and _letter(b, pos + 1):
        return _letters_end(b, pos + 1)
    if (c == 0x20 and pos + 1 < n and _punct(b[pos + 1])) or _punct(c):
        end = pos + 1 if c == 0x20 else pos
        while end < n and _punct(b[end]):
            end += 1
        while end < n and _newline(b[end]):
            end += 1
        return end
    if _space(c):
        end, last_newline = pos, 0
        while end < n and _space(b[end]):
            end += 1
            if _newline(b[end - 1]):
                last_newline = end
        if last_newline:
            return last_newline
        if end < n and end > pos + 1 and (_letter(b, end) or _punct(b[end])):
            return end - 1  # a single leading space joins the next word or punctuation run
        return end
    return pos + _char_len(b, pos)


def ds4_pieces(text: str) -> list[str]:
    """ds4's pre-tokenizer pieces of `text`."""
    b, pos, out = text.encode("utf-8"), 0, []
    while pos < len(b):
        end = _piece_end(b, pos)
        end = end if end > pos else pos + _char_len(b, pos)
        out.append(b[pos:end].decode("utf-8"))
        pos = end
    return out


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


def build_bpe(tokens: Sequence[str], merges: Sequence[tuple[str, str]], split: bool = True):
    """A `tokenizers.Tokenizer`: byte-level BPE with the DeepSeek-V3 pre-tokenizer (or, `split=False`, with
    the byte-level map only: one piece in, one BPE word), no added tokens."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=list(merges), fuse_unk=False,
                     byte_fallback=False)
    tok = Tokenizer(bpe)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_DIGITS), behavior="isolated"),
        pre_tokenizers.Split(Regex(SPLIT_CJK), behavior="isolated"),
        pre_tokenizers.Split(Regex(SPLIT_WORDS), behavior="isolated"),
        byte_level,
    ]) if split else byte_level
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
    merges: tuple[tuple[str, str], ...] = ()

    @cached_property
    def bpe_word(self):
        """The same BPE without a pre-tokenizer split (ds4 mode splits first, then BPEs each piece)."""
        return build_bpe(self.tokens, self.merges, split=False)

    def encode_text(self, text: str, mode: str = "model") -> list[int]:
        """Plain BPE of `text` (no BOS; special-looking strings stay text); `mode` model | ds4 (module doc)."""
        if mode not in MODES:
            raise ParityError(f"tokenizer mode must be one of {', '.join(MODES)}, got {mode!r}")
        if not text:
            return []
        if mode == "model":
            return list(self.bpe.encode(text, add_special_tokens=False).ids)
        return [i for piece in ds4_pieces(text) for i in self.bpe_word.encode(piece, add_special_tokens=False).ids]

    def encode_rendered(self, text: str, mode: str = "model") -> list[int]:
        """A rendered prompt: the ds4-recognised specials by id, the text between them BPE'd span by span."""
        ids: list[int] = []
        pattern = "(" + "|".join(re.escape(s) for s in sorted(self.specials, key=len, reverse=True)) + ")"
        for i, part in enumerate(re.split(pattern, text)):
            ids += [self.specials[part]] if i % 2 else self.encode_text(part, mode)
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
    return GGUFTokenizer(path, tokens, specials, specials[BOS], specials[EOS], template, build_bpe(tokens, merges),
                         tuple(merges))


@lru_cache(maxsize=4)
def _load(path: str, mtime_ns: int, size: int) -> GGUFTokenizer:
    return tokenizer_from_metadata(GGUFFile(path).kv, path)


def load_tokenizer(model_path: str | os.PathLike) -> GGUFTokenizer:
    """The tokenizer of a GGUF file (cached per file version)."""
    p = Path(model_path)
    st = p.stat()
    return _load(str(p), st.st_mtime_ns, st.st_size)


def chat_ids(tok: GGUFTokenizer, text: str, system: str = "", thinking: bool = False, mode: str = "model",
             think_max: bool = False) -> list[int]:
    """Prompt ids for one user turn (see `encode_chat`). `think_max` (implies thinking): the reasoning-effort
    prefix after BOS, as ds4 --think-max builds it (mode ds4; in mode model the template gets
    reasoning_effort='max')."""
    for s in CHAT_REQUIRED:
        tok.require(s)
    if text.startswith(BOS):  # ds4 takes a prompt that starts with BOS as already rendered
        return tok.encode_rendered(text, mode)
    thinking = thinking or think_max
    # free text goes through plain BPE (specials inside it are text), so render with sentinels
    # and splice the BPE of the real text in where they land
    marks = {f"\x00{uuid.uuid4().hex}\x00": t for t in (text, system)}
    mark_text, mark_sys = list(marks)
    if mode == "model" and tok.chat_template is not None:
        rendered = render_chat(tok.chat_template, chat_messages(mark_text, mark_sys if system else ""),
                               bos_token=BOS, eos_token=EOS, thinking=thinking,
                               **({"reasoning_effort": "max"} if think_max else {}))
    else:  # ds4 never reads the template: its own layout
        rendered = ds4_layout(mark_text, mark_sys if system else "", thinking, BOS, think_max=think_max)
    for mark, what in ((mark_text, "user text"), (mark_sys, "system text")):
        if (mark is mark_text or system) and rendered.count(mark) != 1:
            raise ChatTemplateError(f"{tok.path}: the chat template placed the {what} {rendered.count(mark)} times")
    ids: list[int] = []
    for i, part in enumerate(re.split("(" + "|".join(marks) + ")", rendered)):
        ids += tok.encode_text(marks[part], mode) if i % 2 else tok.encode_rendered(part, mode)
    return ids


def encode_chat(model_path: str, text: str, system: str = "", thinking: bool = False, mode: str = "model",
                think_max: bool = False) -> list[int]:
    """The prompt ids: BOS + system + <｜User｜> + text + <｜Assistant｜> + </think> | <think>."""
    return chat_ids(load_tokenizer(model_path), text, system, thinking, mode, think_max)


def mode_difference(tok: GGUFTokenizer, model_ids: Sequence[int], ds4_ids: Sequence[int]) -> str | None:
    """One line saying where the model's and ds4's ids for the same prompt part, None when they agree."""
    if list(model_ids) == list(ds4_ids):
        return None
    i = next((k for k, (x, y) in enumerate(zip(model_ids, ds4_ids, strict=False)) if x != y),
             min(len(model_ids), len(ds4_ids)))

    def at(ids: Sequence[int]) -> str:
        if i >= len(ids):
            return "end"
        piece = tok.piece(ids[i])
        try:
            return repr(piece.decode("utf-8"))
        except UnicodeDecodeError:
            return "<0x" + piece.hex() + ">"

    return (f"tokenizers disagree: the model's gives {len(model_ids)} tokens, ds4's {len(ds4_ids)}; first difference "
            f"at token {i} (model {at(model_ids)}, ds4 {at(ds4_ids)}); --tokenizer ds4 reproduces ds4")
