"""Chat templates and thinking over HTTP, with the scripted stage and the real ouro-tiny
tokenizer: the operator's template and its defaults, request template variables, tool fields
alike on chat and /tokenize, a history of tool calls, a tokenizer without a template, and
bounded thinking without a tokenizer. Other edges: ``test_http_edges.py``."""

from __future__ import annotations

import orjson
import pytest
from test_http_harness import (
    Script,
    ScriptedStage,
    error_of,
    running,
    scripted_factory,
    scripted_info,
    stage_for,
    tiny_checkpoint,
)

CHAT = {"messages": [{"role": "user", "content": "x"}]}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory)


async def test_thinking_errors_without_a_tokenizer_name_the_field(ckpt, tmp_path):
    """Bounded thinking needs the tokenizer's ``</think>`` (or explicit ids) and a text
    interruption needs the tokenizer: without one each is a 400 naming its field."""
    stage = ScriptedStage(scripted_info(tmp_path), Script([44]))
    async with running(tmp_path, client_factory=scripted_factory(stage)) as live:
        body = {"prompt": [5], "max_tokens": 2, "max_thinking_tokens": 1}
        status, _, raw = await live.post("/v1/completions", body)
        assert status == 400 and error_of(raw) == {
            "message": "thinking_end_token_ids: required (no tokenizer is loaded)",
            "type": "invalid_request_error",
            "param": "thinking_end_token_ids",
            "code": 400,
        }
        body = {**body, "thinking_end_token_ids": [4], "thinking_interruption": "Enough."}
        status, _, raw = await live.post("/v1/completions", body)
        error = error_of(raw)
        assert (status, error["param"]) == (400, "thinking_interruption"), error
        assert error["message"].startswith("thinking_interruption: text needs a tokenizer")
        body["thinking_interruption"] = None
        status, _, raw = await live.post("/v1/completions", body)
        assert status == 200, raw


async def test_the_operators_chat_template_renders_any_role_and_earlier_reasoning(ckpt, tmp_path):
    """``--chat-template`` (a file, or the template itself) replaces the checkpoint's, for chats
    and /tokenize alike; a role other than OpenAI's reaches the template as given (vLLM's custom
    roles) and so does an earlier answer's ``reasoning_content``."""
    from rltserve.models.tokenizer import load_tokenizer

    template = (
        "{% for m in messages %}[{{ m.role }}]{% if m.reasoning_content %}({{ m.reasoning_content"
        " }}){% endif %}{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}[Huginn]"
        "{% endif %}"
    )
    (tmp_path / "t.jinja").write_text(template)
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "Huginn", "content": "yo", "reasoning_content": "hmm"},
        {"role": "user", "content": "more"},
    ]
    want = load_tokenizer(ckpt).encode("[user]hi\n[Huginn](hmm)yo\n[user]more\n[Huginn]", False)
    for given in (str(tmp_path / "t.jinja"), template):
        stage = stage_for(ckpt)
        async with running(
            ckpt, client_factory=scripted_factory(stage), chat_template=given
        ) as live:
            status, _, raw = await live.post("/tokenize", {"messages": messages})
            assert status == 200 and orjson.loads(raw)["tokens"] == want, raw
            status, _, raw = await live.post("/v1/chat/completions", {"messages": messages})
            assert status == 200, raw
            assert stage.added_prompts == [want]


async def test_template_variables_of_requests_and_the_operators_defaults(ckpt):
    """``reasoning_effort`` and ``tools`` (with tool_choice "none") reach the template as
    variables, over ``chat_template_kwargs``' keys of the same name; the operator's
    ``--default-chat-template-kwargs`` lie under each request's (its keys win); an earlier
    answer's ``reasoning`` (vLLM's name) reaches the template as ``reasoning_content`` does.
    Chat and /tokenize render alike."""
    from rltserve.models.tokenizer import load_tokenizer

    template = (
        "{% for m in messages %}[{{ m.role }}]{% if m.reasoning %}({{ m.reasoning }}){% endif %}"
        "{{ m.content }}|{% endfor %}{% for t in tools or [] %}tool:{{ t.function.name }}|"
        "{% endfor %}effort={{ reasoning_effort }}|a={{ a }}|b={{ b }}"
    )
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo", "reasoning": "hmm"},
        {"role": "user", "content": "more"},
    ]
    tools = [{"type": "function", "function": {"name": "f"}}]
    tok = load_tokenizer(ckpt)
    stage = stage_for(ckpt)
    defaults = '{"a": "server", "b": "server", "reasoning_effort": "low"}'
    async with running(
        ckpt,
        client_factory=scripted_factory(stage),
        chat_template=template,
        default_chat_template_kwargs=defaults,
    ) as live:
        for extra, want in [
            ({}, "effort=low|a=server|b=server"),
            ({"chat_template_kwargs": {"b": "req", "reasoning_effort": "medium"}},
             "effort=medium|a=server|b=req"),
            ({"chat_template_kwargs": {"reasoning_effort": "medium"}, "reasoning_effort": "high"},
             "effort=high|a=server|b=server"),
            ({"tools": tools, "tool_choice": "none"}, "tool:f|effort=low|a=server|b=server"),
        ]:  # fmt: skip
            ids = tok.encode("[user]hi|[assistant](hmm)yo|[user]more|" + want, False)
            body = {"messages": messages, **extra}
            status, _, raw = await live.post("/v1/chat/completions", body)
            assert status == 200, raw
            assert stage.added_prompts[-1] == ids, tok.decode(stage.added_prompts[-1])
            status, _, raw = await live.post("/tokenize", body)  # (reasoning_effort too)
            assert status == 200 and orjson.loads(raw)["tokens"] == ids, raw


async def test_tool_fields_have_the_same_rules_on_chat_and_tokenize(ckpt):
    """Tool calling needs a forcing tool_choice: ``tools`` with tool_choice auto or absent, and
    the legacy ``functions`` / ``function_call``, are a 400 naming the field on chat and
    /tokenize alike; "none", "required" and a named function render the tools."""
    tools = [{"type": "function", "function": {"name": "f"}}]
    functions = [{"name": "f", "parameters": {}}]
    async with running(ckpt, client_factory=scripted_factory(stage_for(ckpt))) as live:
        for extra, param in [
            ({"tools": tools}, "tools"),
            ({"tools": tools, "tool_choice": "auto"}, "tool_choice"),
            ({"tool_choice": "required"}, "tool_choice"),
            ({"functions": functions}, "functions"),
            ({"functions": functions, "function_call": "auto"}, "functions"),
            ({"function_call": {"name": "f"}}, "function_call"),
        ]:
            for path in ("/v1/chat/completions", "/tokenize"):
                status, _, raw = await live.post(path, {**CHAT, **extra})
                assert (status, error_of(raw)["param"]) == (400, param), (path, extra, raw)
        named = {"type": "function", "function": {"name": "f"}}
        for extra in (
            {"tools": tools, "tool_choice": "none"},
            {"function_call": "none"},
            {"tools": tools, "tool_choice": "required"},
            {"tools": tools, "tool_choice": named},
        ):
            status, _, raw = await live.post("/tokenize", {**CHAT, **extra})
            assert status == 200, raw


async def test_a_tool_call_history_renders_as_transformers_templates_read_it(ckpt):
    """An answer's tool calls reach the template with their arguments as a dict (templates
    render ``arguments | tojson``, vLLM parses the JSON text for them) and a tool's result with
    its ``tool_call_id``, on chat and /tokenize alike."""
    from rltserve.models.tokenizer import load_tokenizer

    template = (
        "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% for c in m.tool_calls or [] %}"
        "<call {{ c.id }} {{ c.function.name }} {{ c.function.arguments | tojson }} "
        "city={{ c.function.arguments.city }}>{% endfor %}{% if m.tool_call_id %}"
        "(for {{ m.tool_call_id }}){% endif %}|{% endfor %}"
    )
    call = {"id": "c1", "type": "function", "function": {"name": "w", "arguments": '{"city":"P"}'}}
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "22 C"},
    ]
    rendered = '[user]hi|[assistant]<call c1 w {"city": "P"} city=P>|[tool]22 C(for c1)|'
    want = load_tokenizer(ckpt).encode(rendered, False)
    stage = stage_for(ckpt)
    factory = scripted_factory(stage)
    async with running(ckpt, client_factory=factory, chat_template=template) as live:
        status, _, raw = await live.post("/tokenize", {"messages": messages})
        assert status == 200 and orjson.loads(raw)["tokens"] == want, raw
        status, _, raw = await live.post("/v1/chat/completions", {"messages": messages})
        assert status == 200 and stage.added_prompts == [want], raw


def no_template_checkpoint(ckpt, path):
    """The tiny checkpoint's tokenizer, without its chat template, in ``path``."""
    path.joinpath("tokenizer.json").write_bytes(ckpt.joinpath("tokenizer.json").read_bytes())
    config = orjson.loads(ckpt.joinpath("tokenizer_config.json").read_bytes())
    del config["chat_template"]
    path.joinpath("tokenizer_config.json").write_bytes(orjson.dumps(config))
    return path


async def test_a_tokenizer_without_a_chat_template_is_a_400_naming_messages(ckpt, tmp_path):
    path = no_template_checkpoint(ckpt, tmp_path)
    stage = ScriptedStage(scripted_info(path), Script([44]))
    async with running(path, client_factory=scripted_factory(stage)) as live:
        status, _, raw = await live.post("/v1/chat/completions", CHAT)
        assert status == 400, raw
        assert error_of(raw) == {
            "message": f"messages: the tokenizer in {path} has no chat_template",
            "type": "invalid_request_error",
            "param": "messages",
            "code": 400,
        }
        assert stage.added == []


async def test_a_generation_prompt_that_closes_its_thinking_span_gets_no_prefix(ckpt):
    """A template whose generation prompt pre-fills a closed span (Nanbeige's and Qwen3's
    "thinking off", ``<think>\\n\\n</think>\\n\\n``), asked to think: the prompt is the
    template's (no ``<think>\\n`` after it), so the answer is content, not reasoning, and a
    thinking budget bounds nothing."""
    from rltserve.models.tokenizer import load_tokenizer

    template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n\n"
        "</think>\n\n{% endif %}"
    )
    want = load_tokenizer(ckpt).encode(
        "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n", False
    )
    stage = stage_for(ckpt)
    body = {**CHAT, "max_tokens": 2, "chat_template_kwargs": {"enable_thinking": True},
            "thinking_token_budget": 1}  # fmt: skip
    async with running(
        ckpt, client_factory=scripted_factory(stage), chat_template=template
    ) as live:
        status, _, raw = await live.post("/v1/chat/completions", body)
    assert status == 200, raw
    assert stage.added_prompts == [want]
    assert stage.added_params[0].max_thinking_tokens is None
    result = orjson.loads(raw)
    assert result["choices"][0]["message"] == {"role": "assistant", "content": "Hi"}
    assert "completion_tokens_details" not in result["usage"]


async def test_an_openai_answer_sent_back_in_a_history_is_taken(ckpt):
    """The OpenAI SDK's ``message.model_dump()`` of an answer, sent back as history: its null
    ``refusal``, ``annotations``, ``audio``, ``function_call`` and ``tool_calls`` (and empty
    ``annotations``) are known fields, under --strict-fields too, rendered as the plain message;
    a ``refusal`` text is not rendered (vLLM's), so with null content the turn is empty. An
    ``audio`` answer is a 400 (no audio), as is a ``refusal`` on a user's message."""
    plain = {"role": "assistant", "content": "yo"}
    dumped = {**plain, "refusal": None, "annotations": None, "audio": None,
              "function_call": None, "tool_calls": None}  # fmt: skip
    user, more = {"role": "user", "content": "x"}, {"role": "user", "content": "more"}
    refused = {"role": "assistant", "content": None, "refusal": "I can't", "annotations": []}

    async def tokens(live, message) -> tuple[int, bytes]:
        """/tokenize's answer for a history holding ``message`` (chat's status is the same)."""
        body = {"messages": [user, message, more]}
        chat, _, chat_raw = await live.post("/v1/chat/completions", body)
        status, _, raw = await live.post("/tokenize", body)
        assert chat == status, chat_raw
        return status, raw

    stage = stage_for(ckpt)
    async with running(ckpt, client_factory=scripted_factory(stage), strict_fields=True) as live:
        taken = [await tokens(live, m) for m in (plain, dumped, {**dumped, "annotations": []})]
        assert [status for status, _ in taken] == [200] * 3, taken
        assert {raw for _, raw in taken} == {taken[0][1]}
        assert stage.added_prompts[0] == stage.added_prompts[1] == stage.added_prompts[2]
        assert await tokens(live, refused) == await tokens(live, {**refused, "refusal": None})
        for message, param in [
            ({**dumped, "audio": {"id": "audio_1"}}, "messages[1].audio"),
            ({**user, "refusal": "no"}, "messages[1].refusal"),
        ]:
            status, raw = await tokens(live, message)
            assert (status, error_of(raw)["param"]) == (400, param), raw
