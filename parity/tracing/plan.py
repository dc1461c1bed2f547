"""The run plan: what one engine run feeds and records (`RunPlan`: prompt tokens, decode steps, forced decode
tokens, prefill chunk, traced positions), validated once, and where its tokens come from (`TokenSource`: a token
list, a token file, a prompt or a prompt file; `resolve_tokens`).

Every spelling lives here once: the default positions, the token-range check, the follow rule (a followed trace
gives the whole run, so no other run option may be given with it). `parity.api.plan_run` builds a plan from a
command's options; `parity.api.trace` validates its own arguments through `run_plan`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from parity.contract.errors import TraceError
from parity.contract.progress import Note
from parity.tracing.recorder import resolve_positions
from parity.tracing.records import TraceHeader
from parity.tracing.runner import chunk_schedule


class PlanError(TraceError):
    """A run's options contradict each other or name no tokens: a usage error (the CLI exits 2 with it)."""


@dataclass(frozen=True)
class RunPlan:
    """One run: `tokens` (the prompt), `decode` greedy steps, `forced` (the decode tokens fed instead of the engine's
    argmax, None: its own), `chunk` (prefill chunk size, None: one chunk), `positions` (sorted, every one traced)."""

    tokens: tuple[int, ...]
    decode: int
    forced: tuple[int, ...] | None
    chunk: int | None
    positions: tuple[int, ...]

    def kwargs(self) -> dict[str, Any]:
        """The plan as `parity.api.trace` keywords (lists, as `api.follow` has always returned them)."""
        return {"tokens": list(self.tokens), "decode": self.decode, "chunk": self.chunk,
                "forced": None if self.forced is None else list(self.forced), "positions": list(self.positions)}


def default_positions(n_prompt: int, decode: int) -> str | list[int]:
    """The positions traced when none are given: the last position without decode; with decode, the prompt's last
    position and every decode position (so 'which decode step' is never lost)."""
    return "last" if decode == 0 else list(range(n_prompt - 1, n_prompt + decode))


def check_token_range(tokens: Sequence[int], vocab: int) -> None:
    """Every id in [0, vocab) (PlanError naming the first five that are not)."""
    bad = [t for t in tokens if not 0 <= t < vocab]
    if bad:
        raise PlanError(f"token id(s) {bad[:5]} out of range [0, {vocab}) for this model")


def run_plan(tokens: Sequence[int], decode: int = 0, *, forced: Sequence[int] | None = None,
             chunk: int | None = None, positions: str | Sequence[int] | None = None,
             vocab: int | None = None) -> RunPlan:
    """The validated plan: a non-empty prompt (ids in [0, vocab) when `vocab` is given), decode >= 0, as many
    forced tokens as decode steps, a valid chunk, positions resolved ('last' | 'all' | '0,5,9' | ints; None:
    `default_positions`)."""
    ids = tuple(int(t) for t in tokens)
    if not ids:
        raise TraceError("no tokens to trace")
    if vocab is not None:
        check_token_range(ids, vocab)
    if decode < 0:
        raise TraceError(f"decode must be >= 0, got {decode}")
    if forced is not None and len(forced) != decode:
        raise TraceError(f"{len(forced)} forced decode tokens for {decode} decode steps")
    chunk_schedule(len(ids), chunk)
    spec = default_positions(len(ids), decode) if positions is None else positions
    return RunPlan(ids, decode, None if forced is None else tuple(int(t) for t in forced), chunk,
                   tuple(resolve_positions(spec, len(ids) + decode)))


def follow_plan(header: TraceHeader) -> RunPlan:
    """The plan that makes a new run token-identical to the trace with `header`: same prompt, same decode length,
    decode tokens forced to the trace's generated ones, same positions and prefill chunks."""
    prefill = header.chunks[: len(header.chunks) - header.decode]
    chunk = None if len(prefill) == 1 else prefill[0]
    if chunk_schedule(header.n_prompt, chunk) != prefill:
        raise TraceError(f"cannot replay the prefill chunks {prefill}: a run prefills in one chunk or in equal "
                         f"pieces of --chunk (the last one shorter)")
    return run_plan(header.tokens[: header.n_prompt], header.decode, forced=header.tokens[header.n_prompt:],
                    chunk=chunk, positions=header.positions)


def refuse_with_follow(given: Sequence[str]) -> None:
    """A followed trace gives the run: the run options also given (flag names) are refused, all named."""
    if given:
        raise PlanError(f"--follow replays the followed trace's run (prompt, decode tokens, positions, chunking); "
                        f"drop {', '.join(given)}")


@dataclass(frozen=True)
class TokenSource:
    """Where a run's prompt comes from, as a command was given it: at most one of a token list (`tokens`, e.g.
    '0,17,42'), a file of ids (`tokens_file`), user text (`prompt`) or a file of it (`prompt_file`, read raw as
    UTF-8); prompts go through `tokenizer`'s chat layout (model | ds4)."""

    tokens: str | None = None
    tokens_file: str | None = None
    prompt: str | None = None
    prompt_file: str | None = None
    tokenizer: str = "model"

    def given(self) -> list[str]:
        """The flags of the sources given (e.g. ['--tokens'])."""
        return [f"--{f.name.replace('_', '-')}" for f in fields(self)
                if f.name != "tokenizer" and getattr(self, f.name) is not None]


def read_token_list(text: str, source: str) -> list[int]:
    """'1,2,3' or whitespace/comma separated ids -> list of ints (PlanError naming `source` on anything else)."""
    parts = [p for p in text.replace(",", " ").split() if p]
    try:
        ids = [int(p) for p in parts]
    except ValueError:
        raise PlanError(f"{source}: token ids must be integers, got {text[:60]!r}") from None
    if not ids:
        raise PlanError(f"{source}: no token ids")
    return ids


def read_prompt_file(path: str) -> str:
    """A prompt file's text, raw bytes as ds4 reads them: no newline translation, always UTF-8."""
    try:
        return Path(path).read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise PlanError(f"{path} is not UTF-8 (byte {e.start})") from None


def resolve_tokens(model: str | Path, source: TokenSource, note: Note | None = None,
                   required: bool = True) -> list[int] | None:
    """Exactly one source (at most one when not `required`: None for none) -> ids. When the model's and ds4's
    tokenizers disagree on a prompt, `note` hears one line saying so."""
    given = source.given()
    if len(given) > 1 or (required and not given):
        raise PlanError("give exactly one of --tokens, --tokens-file, --prompt, --prompt-file"
                        + (f" (given: {', '.join(given)})" if given else ""))
    if not given:
        return None
    if source.tokens is not None:
        return read_token_list(source.tokens, "--tokens")
    if source.tokens_file is not None:
        return read_token_list(Path(source.tokens_file).read_text(), source.tokens_file)
    from parity.gguf.tokenizer import chat_ids, load_tokenizer, mode_difference

    text = source.prompt if source.prompt is not None else read_prompt_file(source.prompt_file)
    tok = load_tokenizer(model)
    ids = {mode: chat_ids(tok, text, mode=mode) for mode in ("model", "ds4")}
    difference = mode_difference(tok, ids["model"], ids["ds4"])
    if difference and note is not None:
        note(f"note: {difference}")
    return ids[source.tokenizer]
