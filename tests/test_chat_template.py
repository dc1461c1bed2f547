"""Chat-template rendering against hand-written expected strings (the synthetic model's template)."""

from __future__ import annotations

import pytest

from parity.gguf.chat import ChatTemplateError, chat_messages, ds4_layout, render_chat
from parity.gguf.container import GGUFFile
from parity.gguf.vocab import BOS, CHAT_TEMPLATE, EOS

B, U, A, E = "<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>"


def render(messages, thinking=False, add_generation_prompt=True, template=CHAT_TEMPLATE):
    return render_chat(template, messages, bos_token=BOS, eos_token=EOS, thinking=thinking,
                       add_generation_prompt=add_generation_prompt)


@pytest.mark.parametrize("messages, thinking, expected", [
    (chat_messages("Hi"), False, B + U + "Hi" + A + "</think>"),
    (chat_messages("Hi"), True, B + U + "Hi" + A + "<think>"),
    (chat_messages("Hi", "Be brief."), False, B + "Be brief." + U + "Hi" + A + "</think>"),
    (chat_messages("line 1\nline 2  ", ""), False, B + U + "line 1\nline 2  " + A + "</think>"),
    ([{"role": "system", "content": "s1"}, {"role": "system", "content": "s2"}, {"role": "user", "content": "q"}],
     False, B + "s1\n\ns2" + U + "q" + A + "</think>"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}, {"role": "assistant", "content": "c"},
      {"role": "user", "content": "d"}], True,
     B + U + "a\n\nb" + A + "</think>c" + E + U + "d" + A + "<think>"),
])
def test_synthetic_template_renderings(messages, thinking, expected):
    assert render(messages, thinking) == expected


def test_without_generation_prompt():
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "r"}]
    assert render(msgs, add_generation_prompt=False) == B + U + "q" + A + "</think>r" + E


def test_template_matches_ds4_fixed_layout():
    for text, system, thinking in [("Hi", "", False), ("x", "sys", True)]:
        assert render(chat_messages(text, system), thinking) == ds4_layout(text, system, thinking, BOS)


def test_unknown_role_raises():
    with pytest.raises(ChatTemplateError, match="unsupported chat role: tool"):
        render([{"role": "tool", "content": "x"}])


def test_environment_filters_like_hugging_face():
    # tojson without HTML/ASCII escaping; from_json for tool arguments given as strings (V4 templates)
    tmpl = "{{ (messages[0]['content'] | from_json)['a'] | tojson }}|{{ bos_token }}"
    assert render([{"role": "user", "content": '{"a": "é<&>"}'}], template=tmpl) == '"é<&>"|' + B
    with pytest.raises(ChatTemplateError, match="does not parse"):
        render([], template="{% if %}")


def test_synthetic_model_embeds_the_template(tiny_f32):
    assert GGUFFile(tiny_f32).kv["tokenizer.chat_template"].value == CHAT_TEMPLATE
