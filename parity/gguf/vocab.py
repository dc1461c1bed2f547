"""The small byte-level BPE vocabulary embedded in synthetic models (`tokenizer.ggml.*` keys).

Token strings use the GPT-2 byte-to-unicode mapping, as in the real V4 vocabulary. Ids 0 and 1 are
BOS and EOS, as in V4; the chat special tokens follow the byte tokens and the merges.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK = "<think>"
END_THINK = "</think>"
DSML = "｜DSML｜"
SPECIAL_TOKENS = (USER, ASSISTANT, THINK, END_THINK)
# The only specials ds4 recognises inside an already-rendered prompt (`tokenize_rendered_chat_vocab`).
RENDERED_SPECIALS = (BOS, EOS, USER, ASSISTANT, THINK, END_THINK, DSML)
# The official API spells EOS with doubled bars (33 bytes); the vocabulary has single bars (27 bytes).
API_EOS = "<｜｜end▁of▁sentence｜｜>"
LITERAL_MARK = "｜"  # U+FF5C: vocab strings containing it are literal text, not byte-level encoded

# The synthetic model's own chat template (written for v4parity, not copied): the DeepSeek-V4 prompt
# layout of spec §11 -- BOS, system text, <｜User｜> turns (consecutive user turns joined by a blank
# line), completed assistant turns as <｜Assistant｜></think>answer<EOS>, and the generation prompt
# <｜Assistant｜> followed by <think> (thinking) or </think> (non-thinking).
CHAT_TEMPLATE = r"""{%- set ns = namespace(system='', in_user=false) -%}
{%- for m in messages if m['role'] == 'system' -%}
  {%- set ns.system = ns.system ~ ('' if loop.first else '\n\n') ~ m['content'] -%}
{%- endfor -%}
{{- bos_token ~ ns.system -}}
{%- for m in messages -%}
  {%- if m['role'] == 'user' -%}
    {{- ('\n\n' if ns.in_user else '<｜User｜>') ~ m['content'] -}}
    {%- set ns.in_user = true -%}
  {%- elif m['role'] == 'assistant' -%}
    {{- '<｜Assistant｜></think>' ~ m['content'] ~ '<｜end▁of▁sentence｜>' -}}
    {%- set ns.in_user = false -%}
  {%- elif m['role'] != 'system' -%}
    {{- raise_exception('unsupported chat role: ' ~ m['role']) -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<｜Assistant｜>' ~ ('<think>' if thinking else '</think>') -}}
{%- endif -%}
"""

TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_CONTROL = 3

# Text the synthetic merges are learned from (deterministic; English + code + digits).
MERGE_CORPUS = (
    "the model computes the carrier of every layer and the reference checks the engine. "
    "def forward(self, x): return self.norm(x) + 1234 * attention(query, key, value)\n"
    "in the beginning there was a token, then a layer, then the logits of the next token. "
)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character map."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


def _learn_merges(corpus: str, n_merges: int) -> list[tuple[str, str]]:
    """Greedy BPE on whitespace-split words of `corpus` (most frequent pair, ties by first seen)."""
    table = bytes_to_unicode()
    words = [[table[b] for b in (" " + w if i else w).encode()] for i, w in enumerate(corpus.split(" ")) if w]
    merges: list[tuple[str, str]] = []
    for _ in range(n_merges):
        counts: dict[tuple[str, str], int] = {}
        for w in words:
            for pair in itertools.pairwise(w):
                counts[pair] = counts.get(pair, 0) + 1
        if not counts:
            break
        best = max(counts, key=lambda p: counts[p])  # dict order makes ties deterministic
        if counts[best] < 2:
            break
        merges.append(best)
        joined = best[0] + best[1]
        for i, w in enumerate(words):
            out, j = [], 0
            while j < len(w):
                if j + 1 < len(w) and (w[j], w[j + 1]) == best:
                    out.append(joined)
                    j += 2
                else:
                    out.append(w[j])
                    j += 1
            words[i] = out
    return merges


def byte_decoder() -> dict[str, int]:
    """Inverse of `bytes_to_unicode`: printable character -> byte."""
    return {c: b for b, c in bytes_to_unicode().items()}


def token_bytes(token: str, decoder: dict[str, int] | None = None) -> bytes:
    """The raw bytes a vocab string stands for, as ds4's `ds4_token_text` computes them.

    Strings containing U+FF5C (the chat specials) are literal UTF-8; all others are GPT-2 byte-level
    encoded and map back char by char. ds4 drops characters outside the byte map; so does this.
    """
    if LITERAL_MARK in token:
        return token.encode()
    table = decoder if decoder is not None else byte_decoder()
    return bytes(table[c] for c in token if c in table)


@dataclass(frozen=True)
class SyntheticVocab:
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    bos_id: int
    eos_id: int


def synthetic_vocab(n_merges: int = 120) -> SyntheticVocab:
    """BOS, EOS, the 256 byte tokens, learned merges, then the chat special tokens."""
    tokens = [BOS, EOS, *bytes_to_unicode().values()]
    types = [TOKEN_TYPE_CONTROL, TOKEN_TYPE_CONTROL] + [TOKEN_TYPE_NORMAL] * 256
    merges = _learn_merges(MERGE_CORPUS, n_merges)
    for a, b in merges:
        if a + b not in tokens:
            tokens.append(a + b)
            types.append(TOKEN_TYPE_NORMAL)
    tokens += list(SPECIAL_TOKENS)
    types += [TOKEN_TYPE_CONTROL] * len(SPECIAL_TOKENS)
    return SyntheticVocab(tokens, types, [f"{a} {b}" for a, b in merges], 0, 1)
