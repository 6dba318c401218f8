"""``ChatTemplate`` rendering details that transformers' ``apply_chat_template`` defines."""

from __future__ import annotations

from rltserve.models.chat_template import ChatTemplate, normalize_messages

NAMED = {"default": "D{{ tools is none }}", "tool_use": "T{{ tools | length }}"}


def test_an_empty_tool_list_still_selects_the_tool_use_template():
    # transformers picks ``tool_use`` whenever ``tools is not None``, even for [].
    template = ChatTemplate(NAMED)
    assert template.render([], True, {}, tools=[]) == "T0"
    assert template.render([], True, {}) == "DTrue"


def test_a_message_keeps_its_own_thinking_next_to_reasoning_content():
    message = {"role": "assistant", "thinking": "a", "reasoning_content": "b"}
    (got,) = normalize_messages([message])
    assert (got["thinking"], got["reasoning_content"]) == ("a", "b")


def test_dict_fromkeys_is_available_to_templates():
    template = ChatTemplate("{{ dict.fromkeys(['a', 'b'], 0) | tojson }}")
    assert template.render([], False, {}) == '{"a": 0, "b": 0}'


def test_tuple_variables_stay_tuples():
    template = ChatTemplate("{{ pair }} {{ pair is sequence }}")
    assert template.render([], False, {}, pair=(1, "x")) == "(1, 'x') True"
