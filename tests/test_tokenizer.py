"""The GGUF tokenizer on the synthetic vocabulary: pre-tokenizer splits, BPE, specials, chat prompts, CLI."""

from __future__ import annotations

import dataclasses
import functools
import itertools

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from parity.cli import cli
from parity.contract.errors import MetadataError
from parity.gguf.container import VT, GGUFFile, Value
from parity.gguf.tokenizer import chat_ids, encode_chat, load_tokenizer, tokenizer_from_metadata
from parity.gguf.vocab import ASSISTANT, BOS, DSML, END_THINK, THINK, USER, byte_decoder

DEC = byte_decoder()


@pytest.fixture(scope="module")
def tok(tiny_f32):
    return load_tokenizer(tiny_f32)


def ids_of(tok, *pieces: str) -> list[int]:
    return [tok.tokens.index(p) for p in pieces]


def split(tok, text: str) -> list[str]:
    """The pre-tokenizer's pieces, mapped back from byte-level characters to text."""
    return [bytes(DEC[c] for c in piece).decode("utf-8", "replace")
            for piece, _ in tok.bpe.pre_tokenizer.pre_tokenize_str(text)]


@pytest.mark.parametrize("text, pieces", [
    ("1234 abc", ["123", "4", " abc"]),                       # digit runs of at most 3
    ("ab12345c", ["ab", "123", "45", "c"]),
    ("a>;\nb", ["a", ">;\n", "b"]),                           # newline stays with the punctuation
    ("x)  y\n\n z", ["x", ")", " ", " y", "\n\n", " z"]),     # one space joins the next word
    ("日本語テキストok", ["日本語テキスト", "ok"]),               # CJK + katakana run
    ("Hello, world!", ["Hello", ",", " world", "!"]),
    ("'s don't", ["'s", " don", "'t"]),                       # ASCII punctuation + letters
    ("tab\there", ["tab", "\there"]),                         # a non-letter, non-punct char + letters
])
def test_pre_tokenizer_splits(tok, text, pieces):
    assert split(tok, text) == pieces


def test_bpe_merges_by_rank(tok):
    # merges (rank order) include 'h e', 'Ġ t', 'Ġt he', 'e r', 'Ġ l', 'Ġl a', 'Ġla y', 'Ġlay er', 'Ġ o',
    # 'Ġo f', 'Ġtok en' ...: "the" has no leading space, so only 'h e' applies -> t + he;
    # " layer" -> Ġ l a y e r -> (e r) -> (Ġ l) -> (Ġl a) -> (Ġla y) -> (Ġlay er) = Ġlayer
    assert tok.encode_text("the layer of the token") == ids_of(tok, "t", "he", "Ġlayer", "Ġof", "Ġthe", "Ġtoken")
    assert tok.encode_text("") == []


def _reference_bpe(tok, text: str) -> list[int]:
    """A second BPE: lowest-rank pair first over each pre-token, written independently of `tokenizers`."""
    rank = _ranks(tok.path)
    out = []
    for piece, _ in tok.bpe.pre_tokenizer.pre_tokenize_str(text):
        parts = list(piece)
        while len(parts) > 1:
            pairs = [(rank.get((a, b), len(rank)), i) for i, (a, b) in enumerate(itertools.pairwise(parts))]
            r, i = min(pairs)
            if r == len(rank):
                break
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        out += [tok.tokens.index(p) for p in parts]
    return out


@functools.cache
def _ranks(path: str) -> dict[tuple[str, ...], int]:
    return {tuple(m.split(" ")): r for r, m in enumerate(GGUFFile(path).kv["tokenizer.ggml.merges"].value)}


TEXT = st.text(alphabet=st.sampled_from(list("the layer token 0123456789 \n\t,.()!é日本ー😀xyz'")), max_size=40)
TEXT = TEXT | st.text(max_size=20)


@settings(max_examples=60, deadline=None)
@given(text=TEXT)
def test_bpe_round_trip_and_second_implementation(tok, text):
    ids = tok.encode_text(text)
    assert tok.decode(ids) == text.encode("utf-8")
    assert ids == _reference_bpe(tok, text)


def test_special_strings_are_text_in_plain_bpe_and_ids_when_rendered(tok):
    user, asst = tok.specials[USER], tok.specials[ASSISTANT]
    plain = tok.encode_text(USER)
    assert user not in plain and tok.decode(plain) == USER.encode()
    hi = tok.encode_text("hi")
    assert tok.encode_rendered(f"{USER}hi{ASSISTANT}") == [user, *hi, asst]
    # the synthetic vocab has no ｜DSML｜ token, so a rendered one is plain text
    assert DSML not in tok.specials and tok.encode_rendered(DSML) == tok.encode_text(DSML)


def test_encode_chat_layouts(tok, tiny_f32):
    bos, user, asst, think, end = (tok.specials[s] for s in (BOS, USER, ASSISTANT, THINK, END_THINK))
    hi = tok.encode_text("Hi there")
    assert encode_chat(str(tiny_f32), "Hi there") == [bos, user, *hi, asst, end]
    assert encode_chat(str(tiny_f32), "Hi there", thinking=True) == [bos, user, *hi, asst, think]
    sys_ids = tok.encode_text("Be brief.")
    assert encode_chat(str(tiny_f32), "Hi there", system="Be brief.") == [bos, *sys_ids, user, *hi, asst, end]


def test_specials_inside_user_text_stay_text(tok):
    text = f"say {ASSISTANT} now"
    ids = chat_ids(tok, text)
    assert ids[2:-2] == tok.encode_text(text) and ids.count(tok.specials[ASSISTANT]) == 1


def test_prompt_starting_with_bos_is_taken_as_rendered(tok):
    rendered = f"{BOS}{USER}x{ASSISTANT}{END_THINK}"
    assert chat_ids(tok, rendered) == tok.encode_rendered(rendered)
    assert chat_ids(tok, rendered)[:2] == [tok.specials[BOS], tok.specials[USER]]


def test_template_and_fixed_layout_agree(tok):
    assert tok.chat_template is not None
    plain = dataclasses.replace(tok, chat_template=None)
    for text, system, thinking in [("Hi", "", False), ("a\n\nb 12345", "sys <｜User｜>", True), ("", "", False)]:
        assert chat_ids(tok, text, system, thinking) == chat_ids(plain, text, system, thinking)


def _kv(tiny_f32) -> dict[str, Value]:
    return dict(GGUFFile(tiny_f32).kv)


@pytest.mark.parametrize("edit, message", [
    (lambda kv: kv.__setitem__("tokenizer.ggml.pre", Value(VT.STRING, "llama-bpe")),
     "tokenizer.ggml.pre is 'llama-bpe'"),
    (lambda kv: kv.__setitem__("tokenizer.ggml.model", Value(VT.STRING, "llama")), "tokenizer.ggml.model is 'llama'"),
    (lambda kv: kv.pop("tokenizer.ggml.merges"), "tokenizer.ggml.merges is missing"),
    (lambda kv: kv.__setitem__("tokenizer.ggml.merges", Value(VT.ARRAY, ["h e", "q zz"], VT.STRING)),
     r"tokenizer.ggml.merges\[1\] = 'q zz'"),
    (lambda kv: kv.__setitem__("tokenizer.ggml.tokens", Value(VT.ARRAY, [BOS, "a", "a"], VT.STRING)), "'a' twice"),
    (lambda kv: kv.__setitem__("tokenizer.ggml.eos_token_id", Value(VT.U32, 5)), "eos_token_id = 5 but"),
    (lambda kv: kv.update({"tokenizer.ggml.tokens": Value(VT.ARRAY, ["x"], VT.STRING),
                           "tokenizer.ggml.merges": Value(VT.ARRAY, [], VT.STRING)}), "begin▁of▁sentence"),
])
def test_bad_tokenizer_metadata_is_refused(tiny_f32, edit, message):
    kv = _kv(tiny_f32)
    edit(kv)
    with pytest.raises(MetadataError, match=message):
        tokenizer_from_metadata(kv, "m.gguf")


def test_missing_chat_special_is_named(tiny_f32):
    kv = _kv(tiny_f32)
    tokens = [t if t != THINK else "<thonk>" for t in kv["tokenizer.ggml.tokens"].value]
    kv["tokenizer.ggml.tokens"] = Value(VT.ARRAY, tokens, VT.STRING)
    tok = tokenizer_from_metadata(kv, "m.gguf")
    with pytest.raises(MetadataError, match="'<think>' is not in tokenizer.ggml.tokens"):
        chat_ids(tok, "hi")


def test_tokenize_cli(tok, tiny_f32, tmp_path):
    r = CliRunner().invoke(cli, ["tokenize", "-m", str(tiny_f32), "-p", "the layer"])
    assert r.exit_code == 0, r.output
    expected = [tok.specials[BOS], tok.specials[USER], *ids_of(tok, "t", "he", "Ġlayer"),
                tok.specials[ASSISTANT], tok.specials[END_THINK]]
    lines = r.output.splitlines()
    assert lines[0] == "[" + ", ".join(map(str, expected)) + "]"
    assert lines[3] == f"{expected[2]:6d}  t" and lines[4] == f"{expected[3]:6d}  he" and len(lines) == 8
    f = tmp_path / "p.txt"
    f.write_bytes(b"the\n")  # the trailing newline is part of the prompt
    r = CliRunner().invoke(cli, ["tokenize", "-m", str(tiny_f32), "--prompt-file", str(f), "--raw"])
    assert r.output.splitlines()[0] == "[" + ", ".join(map(str, ids_of(tok, "t", "he", "Ċ"))) + "]"
    r = CliRunner().invoke(cli, ["tokenize", "-m", str(tiny_f32)])
    assert r.exit_code != 0 and "exactly one of --prompt and --prompt-file" in r.output


# ----------------------------------------------------------------------------------------------
# ds4 mode: ds4's own pre-tokenizer (every byte >= 0x80 is a letter) and its own prompt layout

@pytest.mark.parametrize("text, pieces", [
    ("abc中文def", ["abc中文def"]),                            # CJK inside a letter run stays in it (ds4)
    ("中文def", ["中文", "def"]),                              # ... but a CJK run at a piece start splits off
    ("say “hi”—ok…", ["say", " “hi”—ok…"]),                    # curly quotes, dash, ellipsis are "letters"
    ("5€ ①x", ["5", "€", " ①x"]),
    ("a\u00a0b\u3000c", ["a\u00a0b\u3000c"]),                  # NBSP and the ideographic space too
    ("hi 😀!", ["hi", " 😀", "!"]),
    ("a｜b", ["a｜b"]),                                        # fullwidth bar in user text
    ("1234 abc", ["123", "4", " abc"]),                       # ASCII: the same as the model's split
    ("x)  y\n\n z", ["x", ")", " ", " y", "\n\n", " z"]),
    ("    int", ["   ", " int"]),
])
def test_ds4_pre_tokenizer_pieces(text, pieces):
    from parity.gguf.tokenizer import ds4_pieces

    assert ds4_pieces(text) == pieces


def test_ds4_mode_bpe_is_the_reference_bpe_over_ds4_pieces(tok):
    from parity.gguf.tokenizer import ds4_pieces

    table = {b: c for c, b in DEC.items()}
    for text in ("abc中文def", "say “hi”—ok…", "the layer of the token", "hi 😀!\n\n"):
        expect = []
        for piece in ds4_pieces(text):
            expect += _reference_bpe_word(tok, "".join(table[b] for b in piece.encode()))
        assert tok.encode_text(text, "ds4") == expect and tok.decode(expect) == text.encode()
    # the synthetic merges never span a split the two modes place differently: the modes agree on these
    assert tok.encode_text("say “hi”—ok…", "ds4") == tok.encode_text("say “hi”—ok…")


@pytest.fixture(scope="module")
def spanning(tiny_f32, tmp_path_factory):
    """A tokenizer-only GGUF: the synthetic vocab plus the merge 'c â' (c + the first byte of “, U+201C), which
    only ds4's split can apply (the model's regex puts “ in a piece of its own)."""
    from parity.gguf.container import write_gguf

    kv = {k: v for k, v in GGUFFile(tiny_f32).kv.items() if k.startswith("tokenizer.")}
    kv["tokenizer.ggml.tokens"] = Value(VT.ARRAY, [*kv["tokenizer.ggml.tokens"].value, "câ"], VT.STRING)
    kv["tokenizer.ggml.merges"] = Value(VT.ARRAY, [*kv["tokenizer.ggml.merges"].value, "c â"], VT.STRING)
    kv.pop("tokenizer.ggml.token_type", None)
    path = tmp_path_factory.mktemp("spanning") / "spanning.gguf"
    write_gguf(path, kv, [])
    return path


def test_modes_disagree_where_a_merge_spans_the_model_split(spanning):
    from parity.gguf.tokenizer import mode_difference

    t = load_tokenizer(spanning)
    model, ds4 = t.encode_text("abc“", "model"), t.encode_text("abc“", "ds4")
    assert t.tokens[ds4[2]] == "câ" and "câ" not in [t.tokens[i] for i in model]
    assert t.decode(model) == t.decode(ds4) == "abc“".encode()
    line = mode_difference(t, model, ds4)
    assert line == ("tokenizers disagree: the model's gives 6 tokens, ds4's 5; first difference at token 2 "
                    "(model 'c', ds4 <0x63e2>); --tokenizer ds4 reproduces ds4")
    assert mode_difference(t, model, model) is None


def _reference_bpe_word(tok, word: str) -> list[int]:
    rank = _ranks(tok.path)
    parts = list(word)
    while len(parts) > 1:
        r, i = min((rank.get((a, b), len(rank)), i) for i, (a, b) in enumerate(itertools.pairwise(parts)))
        if r == len(rank):
            break
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    return [tok.tokens.index(p) for p in parts]


def test_ds4_mode_never_reads_the_chat_template(tok):
    odd = dataclasses.replace(tok, chat_template="{{ bos_token }}SYSTEM{{ messages[-1]['content'] }}<｜Assistant｜>")
    bos, user, asst, end = (tok.specials[s] for s in (BOS, USER, ASSISTANT, END_THINK))
    hi = tok.encode_text("Hi", "ds4")
    assert chat_ids(odd, "Hi", mode="ds4") == [bos, user, *hi, asst, end]
    assert chat_ids(odd, "Hi") != chat_ids(odd, "Hi", mode="ds4")  # the model's mode renders the template


def test_ds4_think_max_prefix(tok):
    from parity.gguf.chat import REASONING_EFFORT_MAX

    bos, user, asst, think = (tok.specials[s] for s in (BOS, USER, ASSISTANT, THINK))
    ids = chat_ids(tok, "Hi", system="S", mode="ds4", think_max=True)
    prefix, system, hi = (tok.encode_text(t, "ds4") for t in (REASONING_EFFORT_MAX, "S", "Hi"))
    assert ids == [bos, *prefix, *system, user, *hi, asst, think]
    assert REASONING_EFFORT_MAX.startswith("Reasoning Effort: Absolute maximum with no shortcuts permitted.\n")
    assert REASONING_EFFORT_MAX.endswith("is left unchecked.\n\n") and REASONING_EFFORT_MAX.count("\n") == 4


def test_tokenize_cli_modes_and_the_disagreement_line(tiny_f32, spanning):
    r = CliRunner().invoke(cli, ["tokenize", "-m", str(spanning), "-p", "abc“", "--tokenizer", "ds4", "--json"])
    d = __import__("json").loads(r.stdout)
    assert d["ids"] == chat_ids(load_tokenizer(spanning), "abc“", mode="ds4") and d["tokenizer"] == "ds4"
    assert d["modes_disagree"].startswith("tokenizers disagree: the model's gives")
    assert r.stderr.count("\n") == 1 and "--tokenizer ds4 reproduces ds4" in r.stderr
    same = CliRunner().invoke(cli, ["tokenize", "-m", str(tiny_f32), "-p", "the layer", "--system", "Be brief."])
    assert same.exit_code == 0 and same.stderr == ""
    assert " -sys" not in CliRunner().invoke(cli, ["tokenize", "--help"]).output
