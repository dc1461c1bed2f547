"""Chat-template rendering: a GGUF's `tokenizer.chat_template` (Jinja) -> the prompt string.

The environment mirrors what Hugging Face's `apply_chat_template` gives a template (sandboxed Jinja,
`trim_blocks`/`lstrip_blocks`, `tojson` without HTML escaping, `raise_exception`, `strftime_now`) plus
the `from_json` filter the DeepSeek-V4 templates use for tool-call arguments. Without a template the
prompt layout is ds4's fixed one (spec v4-residual-ffn-gguf §11), see `ds4_layout`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

from parity.contract.errors import ParityError
from parity.gguf.vocab import ASSISTANT, END_THINK, THINK, USER

# ds4's think-max prefix (ds4.c DS4_REASONING_EFFORT_MAX_PREFIX; DeepSeek's "Think Max" text), BPE'd after BOS.
REASONING_EFFORT_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
    "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
    "scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n")


class ChatTemplateError(ParityError):
    """The chat template does not parse, or raised while rendering."""


def _raise(message: str) -> None:
    raise ChatTemplateError(f"chat template: {message}")


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


@lru_cache(maxsize=8)
def _compile(template: str):
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = _tojson
    env.filters["from_json"] = json.loads
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except TemplateError as e:
        raise ChatTemplateError(f"chat template does not parse: {e}") from None


def chat_messages(text: str, system: str = "") -> list[dict[str, str]]:
    """One user turn, preceded by a system message when `system` is non-empty (ds4 drops an empty one)."""
    msgs = [{"role": "system", "content": system}] if system else []
    return [*msgs, {"role": "user", "content": text}]


def render_chat(template: str, messages: Sequence[dict[str, Any]], *, bos_token: str, eos_token: str,
                thinking: bool, add_generation_prompt: bool = True, **extra: Any) -> str:
    """Render `messages` with a Jinja chat template (the generation prompt appended by default)."""
    from jinja2 import TemplateError

    tmpl = _compile(template)
    try:
        return tmpl.render(messages=list(messages), bos_token=bos_token, eos_token=eos_token,
                           thinking=thinking, add_generation_prompt=add_generation_prompt, **extra)
    except TemplateError as e:
        raise ChatTemplateError(f"chat template failed to render: {e}") from None


def ds4_layout(text: str, system: str, thinking: bool, bos_token: str, think_max: bool = False) -> str:
    """BOS + [reasoning-effort prefix] + system + <｜User｜> + text + <｜Assistant｜> + (<think> | </think>):
    ds4's `encode_chat_prompt` (think max: the prefix, then <think>)."""
    prefix = REASONING_EFFORT_MAX if think_max else ""
    return bos_token + prefix + system + USER + text + ASSISTANT + (THINK if thinking or think_max else END_THINK)
