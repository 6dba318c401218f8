"""Tool calling as vLLM serves it without a model-specific parser (``http.tool_calls``): a named
function's or "required"'s calls read from the constrained output, whole and streamed, and the
official ``openai`` SDK against the real engine (ouro-tiny): parsed calls whose arguments match
the schema, a stream that accumulates to the same calls, ``n``, usage and the SDK's
BadRequestError naming the field."""

from __future__ import annotations

import json
import random

import openai
import pytest
import pytest_asyncio
from test_http_harness import running, tiny_checkpoint

from rltserve.http.tool_calls import ToolCallStream, finish_reason, tool_calls
from rltserve.http.tool_choice import ForcedTools

module_loop = pytest.mark.asyncio(loop_scope="module")
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}
CLOCK = {"type": "object", "properties": {"hour": {"type": "integer"}}, "required": ["hour"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": CLOCK}},
]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
REQUIRED = ForcedTools(TOOLS)
ARRAY = (
    '[ {"name" : "get_weather", "parameters": {"city": "Pa\\"r}is", "n": [1, {"x": 2}]} } ,'
    '{"name":"g\\u00e9t","parameters":{}}]'
)


def joined(stream: ToolCallStream, pieces: list[str]) -> list[list[str]]:
    """The calls a client accumulates from the streamed entries: [name, arguments] each."""
    calls: dict[int, list[str]] = {}
    for piece in pieces:
        for entry in stream.feed(piece):
            if "id" in entry:  # (a call's opening entry: its arguments start "")
                assert entry["type"] == "function" and entry["function"]["arguments"] == ""
                assert entry["id"].startswith("chatcmpl-tool-") and len(entry["id"]) == 46
                calls[entry["index"]] = [entry["function"]["name"], ""]
            else:
                calls[entry["index"]][1] += entry["function"]["arguments"]
    return [calls[i] for i in sorted(calls)]


def test_required_calls_read_alike_whole_and_in_any_pieces():
    whole = [
        [c["function"]["name"], c["function"]["arguments"]] for c in tool_calls(REQUIRED, ARRAY)
    ]
    assert whole == [["get_weather", '{"city": "Pa\\"r}is", "n": [1, {"x": 2}]}'], ["gét", "{}"]]
    for seed in range(50):
        rng, cuts = random.Random(seed), [0]
        while cuts[-1] < len(ARRAY):
            cuts.append(cuts[-1] + rng.randint(1, 5))
        pieces = [ARRAY[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]
        assert joined(ToolCallStream(REQUIRED), pieces) == whole, pieces


def test_named_calls_and_answers_cut_short():
    named = ForcedTools(TOOLS, "get_weather")
    stream = ToolCallStream(named)
    assert joined(stream, ["", '{"city"', ': "x"}']) == [["get_weather", '{"city": "x"}']]
    assert [c["function"]["arguments"] for c in tool_calls(named, '{"ci')] == ['{"ci']
    # cut short: the calls begun so far, their arguments as far as they got
    cut = tool_calls(REQUIRED, '[{"name": "get_time", "parameters": {"hour": 1')
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in cut] == [
        ("get_time", '{"hour": 1')
    ]
    assert tool_calls(REQUIRED, '[{"name": "get_ti') == []
    assert finish_reason(REQUIRED, "stop") == "tool_calls"
    assert finish_reason(REQUIRED, "length") == "length"
    assert finish_reason(named, "stop") == "stop"  # (OpenAI's and vLLM's, for a named call)


def matches_schema(arguments: str, schema: dict) -> bool:
    """The JSON text holds exactly the schema's required keys, of their types (by hand)."""
    value = json.loads(arguments)
    if set(value) != set(schema["required"]):
        return False
    for key, spec in schema["properties"].items():
        if spec["type"] == "string":
            ok = isinstance(value[key], str) and value[key] in spec.get("enum", [value[key]])
            ok = ok and len(value[key]) <= spec.get("maxLength", len(value[key]))
        else:
            ok = isinstance(value[key], int) and not isinstance(value[key], bool)
        if not ok:
            return False
    return True


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(ckpt):
    async with running(ckpt) as live:
        http = openai.DefaultAsyncHttpxClient(trust_env=False)
        base = live.url + "/v1"
        async with openai.AsyncOpenAI(
            base_url=base, api_key="k", max_retries=0, http_client=http
        ) as client:
            yield client


async def streamed(client, **params) -> tuple[dict, dict, dict]:
    """A stream's calls per choice ([id, name, arguments] each), finish reasons and usage."""
    stream = await client.chat.completions.create(
        **params, stream=True, stream_options={"include_usage": True}
    )
    calls: dict[int, dict[int, list[str]]] = {}
    finish, usage = {}, None
    async for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            assert choice.delta.content in (None, "")
            for call in choice.delta.tool_calls or []:
                if call.id is not None:
                    assert call.function.arguments == ""
                    calls.setdefault(choice.index, {})[call.index] = [
                        call.id,
                        call.function.name,
                        "",
                    ]
                else:
                    calls[choice.index][call.index][2] += call.function.arguments
            if choice.finish_reason is not None:
                finish[choice.index] = choice.finish_reason
    return calls, finish, usage


@module_loop
async def test_a_named_function_call_with_the_sdk(client):
    params = {
        "model": "tiny",
        "messages": MESSAGES,
        "tools": TOOLS,
        "tool_choice": NAMED,
        "max_tokens": 200,
        "temperature": 0,  # (the stream's calls are the same)
        "n": 2,
    }
    done = await client.chat.completions.create(**params)
    for choice in done.choices:
        assert choice.finish_reason == "stop" and choice.message.content == ""
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
        assert call.function.name == "get_weather"
        assert matches_schema(call.function.arguments, WEATHER), call.function.arguments
    calls, finish, usage = await streamed(client, **params)
    assert finish == {0: "stop", 1: "stop"}
    for choice in done.choices:  # (the same calls, under fresh ids)
        got = [[name, args] for _, name, args in calls[choice.index].values()]
        assert got == [[c.function.name, c.function.arguments] for c in choice.message.tool_calls]
    assert usage.completion_tokens == done.usage.completion_tokens
    assert usage.prompt_tokens == done.usage.prompt_tokens


@module_loop
async def test_required_calls_with_the_sdk(client):
    params = {
        "model": "tiny",
        "messages": MESSAGES,
        "tools": TOOLS,
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_tokens": 200,
        "temperature": 0,
        "n": 3,
    }
    done = await client.chat.completions.create(**params)
    schemas = {"get_weather": WEATHER, "get_time": CLOCK}
    for choice in done.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content == ""
        (call,) = choice.message.tool_calls  # (parallel_tool_calls false: one)
        assert matches_schema(call.function.arguments, schemas[call.function.name])
    calls, finish, _ = await streamed(client, **params)
    assert finish == {0: "tool_calls", 1: "tool_calls", 2: "tool_calls"}
    for choice in done.choices:
        got = [[name, args] for _, name, args in calls[choice.index].values()]
        assert got == [[c.function.name, c.function.arguments] for c in choice.message.tool_calls]


@module_loop
async def test_a_conversation_goes_on_after_the_tools_answer(client):
    """The answer's message, as the SDK dumps it, and the tool's result render in the next
    request's history."""
    params = {"model": "tiny", "tools": TOOLS, "max_tokens": 100}
    done = await client.chat.completions.create(**params, messages=MESSAGES, tool_choice=NAMED)
    message = done.choices[0].message
    result = {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "22 C"}
    history = [*MESSAGES, message.model_dump(), result]
    after = await client.chat.completions.create(**params, messages=history, tool_choice="required")
    assert after.choices[0].message.tool_calls


@module_loop
@pytest.mark.parametrize(
    ("extra", "param", "fragment"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
         "'nope' is not among tools"),
        ({"tool_choice": "auto"}, "tool_choice", "requires --enable-auto-tool-choice"),
        ({}, "tools", "requires --enable-auto-tool-choice and --tool-call-parser"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "x"}}}],
          "tool_choice": {"type": "function", "function": {"name": "f"}}},
         "tools[0].function.parameters", "cannot use this schema"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "x"}}}],
          "tool_choice": "required"}, "tools", "cannot use this schema"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}},
         "response_format", "not with a named or required tool_choice"),
    ],
)  # fmt: skip
async def test_refusals_are_bad_requests_naming_the_field(client, extra, param, fragment):
    params = {"model": "tiny", "messages": MESSAGES, "tools": TOOLS, "max_tokens": 8, **extra}
    with pytest.raises(openai.BadRequestError) as err:
        await client.chat.completions.create(**params)
    assert err.value.param == param and fragment in err.value.message, err.value.message
