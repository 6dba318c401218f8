"""vLLM's chat ``echo`` on a scripted stage with the real ouro-tiny tokenizer: the last
message's text before each choice's content where that message is the assistant's (whole and
streamed, as exact bytes), with no logprobs and no usage of its own, beside a reasoning split
and for every choice of n; nothing echoed after another role's message."""

from __future__ import annotations

import pytest
from test_http_harness import (
    body_of,
    running,
    scripted_factory,
    sse_payloads,
    stage_for,
    tiny_checkpoint,
)

from rltserve.http.config import ServerConfig

H_ID, I_ID, END = 44, 77, 4  # "H", "i", </think> on ouro-tiny
PREFILL = {
    "messages": [
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Sure"},
    ],
    "max_tokens": 2,
    "temperature": 0,
    "echo": True,
    "add_generation_prompt": False,
    "continue_final_message": True,
}
HEAD = (
    b'data: {"id":"chatcmpl-test","object":"chat.completion.chunk","created":1730000000,'
    b'"model":"tiny","choices":['
)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory)


def chunk(delta: bytes, usage: bytes, finish: bytes = b"null") -> bytes:
    """A stream's chunk; the one that ends the choice (a finish) has the weight version."""
    metadata = b"" if finish == b"null" else b',"metadata":{"weight_version":"0"}'
    return (
        HEAD + b'{"index":0,"delta":' + delta + b',"logprobs":null,"finish_reason":' + finish
        + b'}],"usage":' + usage + metadata + b"}\n\n"
    )  # fmt: skip


async def test_echo_puts_the_continued_message_before_the_answer(ckpt):
    """Whole: "Sure" + "Hi". Streamed with running usage: the echo is a chunk of its own right
    after the role chunk, counting no completion tokens (as vLLM's). Under --strict-fields the
    field is known (``echo: false`` too, which echoes nothing)."""
    stage = stage_for(ckpt, [H_ID, I_ID])
    stream = {
        **PREFILL,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    async with running(ckpt, client_factory=scripted_factory(stage), strict_fields=True) as live:
        rendered = {key: PREFILL[key] for key in ("messages", "add_generation_prompt",
                                                   "continue_final_message")}  # fmt: skip
        _, _, tokenized = await live.post("/tokenize", rendered)
        status, _, raw = await live.post("/v1/chat/completions", PREFILL)
        assert status == 200, raw
        status, _, streamed = await live.post("/v1/chat/completions", stream)
        assert status == 200, streamed
        status, _, plain = await live.post("/v1/chat/completions", {**PREFILL, "echo": False})
        assert status == 200, plain
    n = len(body_of(tokenized)["tokens"])
    usage = b'{"prompt_tokens":%d,"completion_tokens":2,"total_tokens":%d}' % (n, n + 2)
    assert raw == (
        b'{"id":"chatcmpl-test","object":"chat.completion","created":1730000000,"model":"tiny",'
        b'"choices":[{"index":0,"message":{"role":"assistant","content":"SureHi"},'
        b'"logprobs":null,"finish_reason":"length","stop_reason":null}],"usage":' + usage
        + b',"metadata":{"weight_version":"0"}}'
    )  # fmt: skip

    def running_usage(done: int) -> bytes:
        return b'{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d}' % (
            n, done, n + done
        )  # fmt: skip

    assert streamed == (
        chunk(b'{"role":"assistant","content":""}', running_usage(0))
        + chunk(b'{"content":"Sure"}', running_usage(0))
        + chunk(b'{"content":"H"}', running_usage(1))
        + chunk(b'{"content":"i"}', running_usage(2), b'"length","stop_reason":null')
        + HEAD + b'],"usage":' + usage + b"}\n\n"
        + b"data: [DONE]\n\n"
    )  # fmt: skip
    assert body_of(plain)["choices"][0]["message"]["content"] == "Hi"


async def test_echo_has_no_logprobs_and_comes_with_every_choice(ckpt):
    """n=2 with logprobs: each choice's stream has its echo chunk after its role chunk, with
    null logprobs; the logprobs (streamed or whole) are the generated tokens' alone."""
    stage = stage_for(ckpt, [H_ID, I_ID])
    body = {**PREFILL, "n": 2, "logprobs": True}
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        _, _, raw = await live.post("/v1/chat/completions", body)
        _, _, streamed = await live.post("/v1/chat/completions", {**body, "stream": True})
    for choice in body_of(raw)["choices"]:
        assert choice["message"] == {"role": "assistant", "content": "SureHi"}
        assert [e["token"] for e in choice["logprobs"]["content"]] == ["H", "i"]
    events = sse_payloads(streamed)
    assert events[-1] == "[DONE]"
    for index in (0, 1):
        entries = [c for e in events[:-1] for c in e["choices"] if c["index"] == index]
        assert [(c["delta"], c["logprobs"] is None) for c in entries[:2]] == [
            ({"role": "assistant", "content": ""}, True),
            ({"content": "Sure"}, True),
        ]
        assert "".join(c["delta"]["content"] for c in entries) == "SureHi"
        tokens = [e["token"] for c in entries[2:] for e in c["logprobs"]["content"]]
        assert tokens == ["H", "i"]


async def test_echo_is_content_beside_reasoning_and_only_the_assistants(ckpt):
    """A continued prefill that opened ``<think>``: the answer is split, the echoed text (its
    ``<think>`` included) is content, as vLLM's; an answer still thinking has the echo alone
    as content. Content parts are echoed joined; a last message of another role (a user's)
    is not echoed."""
    messages = [PREFILL["messages"][0], {"role": "assistant", "content": "<think>\nPlan"}]
    stage = stage_for(ckpt, [H_ID, END, I_ID])
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        body = {**PREFILL, "messages": messages, "max_tokens": 3}
        _, _, split = await live.post("/v1/chat/completions", body)
        _, _, thinking = await live.post("/v1/chat/completions", {**body, "max_tokens": 1})
        _, _, streamed = await live.post("/v1/chat/completions", {**body, "stream": True})
        parts = [{"type": "text", "text": "Su"}, {"type": "text", "text": "re"}]
        joined = [PREFILL["messages"][0], {"role": "assistant", "content": parts}]
        one = {**PREFILL, "messages": joined, "max_tokens": 1}
        _, _, raw_parts = await live.post("/v1/chat/completions", one)
        user = {"messages": PREFILL["messages"][:1], "max_tokens": 1, "echo": True}
        _, _, raw_user = await live.post("/v1/chat/completions", user)
    assert body_of(split)["choices"][0]["message"] == {
        "role": "assistant", "content": "<think>\nPlani", "reasoning": "H",
        "reasoning_content": "H",
    }  # fmt: skip
    assert body_of(thinking)["choices"][0]["message"] == {
        "role": "assistant", "content": "<think>\nPlan", "reasoning": "H",
        "reasoning_content": "H",
    }  # fmt: skip
    deltas = [e["choices"][0]["delta"] for e in sse_payloads(streamed)[:-1]]
    assert deltas == [
        {"role": "assistant", "content": ""},
        {"content": "<think>\nPlan"},
        {"reasoning": "H", "reasoning_content": "H"},
        {"content": "i"},
    ]
    assert body_of(raw_parts)["choices"][0]["message"]["content"] == "Su\nreH"
    assert body_of(raw_user)["choices"][0]["message"]["content"] == "H"


async def test_response_role_names_the_answers_role(ckpt):
    """``--response-role`` (vLLM's): the role of an answer the template opened, whole and in a
    stream's role chunk (the flag was refused); an answer that continues the last message
    (add_generation_prompt false) takes that message's role, and echo follows the role."""
    stage = stage_for(ckpt, [H_ID, I_ID])
    user = {"messages": PREFILL["messages"][:1], "max_tokens": 2, "echo": True}
    role = {"response_role": "bot"}
    async with running(ckpt, client_factory=scripted_factory(stage), **role) as live:
        _, _, whole = await live.post("/v1/chat/completions", user)
        _, _, streamed = await live.post("/v1/chat/completions", {**user, "stream": True})
        _, _, continued = await live.post("/v1/chat/completions", PREFILL)
        user_continued = {**user, "add_generation_prompt": False}
        _, _, own = await live.post("/v1/chat/completions", user_continued)
    assert body_of(whole)["choices"][0]["message"] == {"role": "bot", "content": "Hi"}
    deltas = [e["choices"][0]["delta"] for e in sse_payloads(streamed)[:-1]]
    assert deltas == [{"role": "bot", "content": ""}, {"content": "H"}, {"content": "i"}]
    message = {"role": "assistant", "content": "SureHi"}
    assert body_of(continued)["choices"][0]["message"] == message
    # (vLLM's: the answer continues the user's message, so it is the user's, echo included)
    assert body_of(own)["choices"][0]["message"] == {"role": "user", "content": "Hi thereHi"}
    with pytest.raises(ValueError, match="^response_role=' ': must be a role's name"):
        ServerConfig(response_role=" ")
