"""``tool_choice: "auto"`` on a server started with ``--enable-auto-tool-choice
--tool-call-parser hermes`` (``http.auto_tools``), through the official ``openai`` SDK: a
scripted stage writes Hermes calls (a tiny random model never would), whole and streamed (the
SDK's own stream accumulator), with text before them, after a thinking span, cut short, and the
conversation going on with the tool's result; the real engine (ouro-tiny) answering in plain
text gets the ordinary message, and with ``guided_regex`` (structured outputs apply, vLLM's)
writes a call that is read as one."""

from __future__ import annotations

import json

import openai
import pytest
import pytest_asyncio
from test_http_harness import Script, ScriptedStage, running, scripted_factory, scripted_info
from test_http_harness import tiny_checkpoint as _tiny_checkpoint

from rltserve.models.tokenizer import load_tokenizer

module_loop = pytest.mark.asyncio(loop_scope="module")
AUTO = {"enable_auto_tool_choice": True, "tool_call_parser": "hermes"}
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time"}},
]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
CALLS = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)
CALLED = [["get_weather", '{"city": "Paris"}'], ["get_time", "{}"]]
END = 2  # (<|im_end|>: an eos id of ``scripted_info``)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return _tiny_checkpoint(tmp_path_factory)


class AnswerStage(ScriptedStage):
    """A scripted stage whose every request is answered with ``answer``'s tokens, then the
    end of the turn (``answer`` is set by each test)."""

    def __init__(self, ckpt) -> None:
        super().__init__(scripted_info(ckpt, max_model_len=1024), Script([END]))
        self.tokenizer = load_tokenizer(ckpt)

    def answer(self, text: str, end: bool = True) -> None:
        self.script.tokens = self.tokenizer.encode(text) + ([END] if end else [])


def sdk(live) -> openai.AsyncOpenAI:
    http = openai.DefaultAsyncHttpxClient(trust_env=False)
    return openai.AsyncOpenAI(
        base_url=live.url + "/v1", api_key="k", max_retries=0, http_client=http
    )


@pytest.fixture(scope="module")
def stage(ckpt):
    return AnswerStage(ckpt)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(ckpt, stage):
    async with (
        running(ckpt, client_factory=scripted_factory(stage), **AUTO) as live,
        sdk(live) as client,
    ):
        yield client


def calls_of(message) -> list[list[str]]:
    for call in message.tool_calls or []:
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
    return [[c.function.name, c.function.arguments] for c in message.tool_calls or []]


async def both(client, **params):
    """The answer whole, and streamed as the SDK accumulates it (its final completion), with
    the stream's usage."""
    params = {"model": "tiny", "messages": MESSAGES, "tools": TOOLS, **params}
    done = await client.chat.completions.create(**params)
    options = {"include_usage": True}
    async with client.chat.completions.stream(**params, stream_options=options) as stream:
        async for _ in stream:
            pass
        # (the accumulated answer: ``get_final_completion`` would refuse a "length" one)
        final = stream.current_completion_snapshot
    assert final.usage.completion_tokens == done.usage.completion_tokens
    assert final.usage.prompt_tokens == done.usage.prompt_tokens
    return done.choices[0], final.choices[0]


@module_loop
async def test_the_model_calls_tools_after_some_text(client, stage):
    stage.answer(f"Let me check.\n{CALLS}")
    done, streamed = await both(client)  # (tool_choice left out: "auto", its default)
    for choice in (done, streamed):
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content == "Let me check.\n"
        assert calls_of(choice.message) == CALLED
    stage.answer(CALLS + "\n")
    done, streamed = await both(client, tool_choice="auto", n=2)
    assert done.message.content is None  # (a stream's role chunk sends content "")
    for choice in (done, streamed):
        assert choice.finish_reason == "tool_calls" and not choice.message.content
        assert calls_of(choice.message) == CALLED
    # parallel_tool_calls false: the first call only
    done, streamed = await both(client, parallel_tool_calls=False)
    assert calls_of(done.message) == calls_of(streamed.message) == CALLED[:1]


@module_loop
async def test_a_streams_chunks_open_each_call_then_send_its_arguments(client, stage):
    stage.answer(f"Hi{CALLS}")
    stream = await client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, stream=True
    )
    chunks = [chunk.choices[0] async for chunk in stream]
    contents = [c.delta.content for c in chunks if c.delta.content]
    assert "".join(contents) == "Hi" and not any("<" in text for text in contents)
    deltas = [c.delta.tool_calls[0] for c in chunks if c.delta.tool_calls]
    assert [(d.index, d.id is not None, d.function.name) for d in deltas] == [
        (0, True, "get_weather"), (0, False, None), (1, True, "get_time"), (1, False, None)
    ]  # fmt: skip
    assert [d.function.arguments for d in deltas] == ["", CALLED[0][1], "", CALLED[1][1]]
    assert [c.finish_reason for c in chunks] == [None] * (len(chunks) - 1) + ["tool_calls"]


@module_loop
async def test_answers_that_call_nothing_or_are_cut_short(client, stage):
    stage.answer("Paris is sunny; <tool_call> is how I would call a tool.")
    done, streamed = await both(client)
    for choice in (done, streamed):
        assert choice.finish_reason == "stop" and choice.message.tool_calls is None
        assert choice.message.content == "Paris is sunny; <tool_call> is how I would call a tool."
    # cut short by max_tokens: the calls whose blocks are whole, finish_reason "length"
    stage.answer(CALLS, end=False)
    cut = len(stage.tokenizer.encode(CALLS[: CALLS.index("\n<tool_call>")]))
    done, streamed = await both(client, max_tokens=cut + 3)
    assert done.message.content == streamed.message.content  # (what the cut left of a tag)
    assert "\n<tool_call>".startswith(done.message.content or "")
    for choice in (done, streamed):
        assert choice.finish_reason == "length" and calls_of(choice.message) == CALLED[:1]


@module_loop
async def test_arguments_that_hold_the_end_tag_or_are_named_parameters(client, stage):
    """A file a call writes may hold "</tool_call>": inside a JSON string it ends no block;
    arguments a model writes as ``parameters`` are the call's, not dropped for "{}"."""
    page = 'Close each call with </tool_call> (a "tag").'
    written = json.dumps({"name": "write_file", "arguments": {"text": page}})
    asked = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    stage.answer(f"Done.\n<tool_call>\n{written}\n</tool_call>\n<tool_call>\n{asked}\n</tool_call>")
    done, streamed = await both(client)
    for choice in (done, streamed):
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Done.\n"
        assert calls_of(choice.message) == [
            ["write_file", json.dumps({"text": page})], ["get_weather", '{"city": "Paris"}']
        ]  # fmt: skip


@module_loop
async def test_calls_are_read_after_the_thinking_span_only(client, stage):
    """With the prompt's thinking span open, a block inside it is reasoning, not a call."""
    thought = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    stage.answer(f"Maybe {thought}.</think>Sure.\n{CALLS}")
    kwargs = {"chat_template_kwargs": {"enable_thinking": True}}
    done, streamed = await both(client, extra_body=kwargs)
    for choice in (done, streamed):
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure.\n"
        assert calls_of(choice.message) == CALLED
        assert choice.message.model_extra["reasoning"] == f"Maybe {thought}."


@module_loop
async def test_none_and_forcing_choices_are_served_as_without_the_flags(client, stage):
    stage.answer(CALLS)
    done, streamed = await both(client, tool_choice="none")
    for choice in (done, streamed):
        assert choice.message.content == CALLS and choice.message.tool_calls is None
        assert choice.finish_reason == "stop"
    stage.answer('{"city": "Rome"}')
    named = {"type": "function", "function": {"name": "get_weather"}}
    done = await client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=named
    )
    assert calls_of(done.choices[0].message) == [["get_weather", '{"city": "Rome"}']]


@module_loop
async def test_the_conversation_goes_on_with_the_tools_result(client, stage):
    stage.answer(CALLS)
    done = await client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS)
    message = done.choices[0].message
    results = [
        {"role": "tool", "tool_call_id": call.id, "content": "22 C"} for call in message.tool_calls
    ]
    stage.answer("It is 22 C in Paris.")
    history = [*MESSAGES, message.model_dump(), *results]
    after = await client.chat.completions.create(model="tiny", messages=history, tools=TOOLS)
    choice = after.choices[0]
    assert choice.message.content == "It is 22 C in Paris." and choice.message.tool_calls is None
    assert choice.finish_reason == "stop"
    rendered = stage.tokenizer.decode(stage.added_prompts[-1])
    assert rendered.count("22 C") == 2, rendered  # (both results reach the template)


@module_loop
async def test_the_real_engine_answering_in_text_gets_an_ordinary_message(ckpt):
    async with running(ckpt, **AUTO) as live, sdk(live) as client:
        params = {"max_tokens": 12, "temperature": 0}
        done, streamed = await both(client, **params)
        for choice in (done, streamed):
            assert choice.message.tool_calls is None and choice.finish_reason in ("stop", "length")
        assert done.message.content == streamed.message.content
        # structured outputs still apply (vLLM's): the constrained answer is read for calls
        regex = r'Sure\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Rome"\}\}'
        regex += r"\n</tool_call>"
        guided = {"max_tokens": 200, "temperature": 0, "extra_body": {"guided_regex": regex}}
        done, streamed = await both(client, **guided)
        for choice in (done, streamed):
            assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure.\n"
            (call,) = choice.message.tool_calls
            assert json.loads(call.function.arguments) == {"city": "Rome"}


@module_loop
async def test_auto_is_refused_in_vllms_words_without_the_flags(ckpt, stage):
    async with running(ckpt, client_factory=scripted_factory(stage)) as live, sdk(live) as client:
        for choice, param in (("auto", "tool_choice"), (openai.NOT_GIVEN, "tools")):
            with pytest.raises(openai.BadRequestError) as err:
                await client.chat.completions.create(
                    model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=choice
                )
            assert err.value.param == param
            assert (
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                "to be set" in err.value.message
            )
