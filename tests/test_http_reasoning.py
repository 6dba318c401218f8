"""Chat answers with a thinking span, as exact bytes on a scripted stage with the real
ouro-tiny tokenizer: ``reasoning`` and ``reasoning_content`` in messages and stream deltas, the
tail a stream holds back, ``usage.completion_tokens_details.reasoning_tokens``, an answer that
opens its own span, one cut off while thinking, and a tokenizer whose ``</think>`` is
special."""

from __future__ import annotations

import pytest
from test_http_harness import (
    RewritingStage,
    Script,
    ScriptedStage,
    running,
    scripted_factory,
    scripted_info,
    special_think_end_checkpoint,
    sse_payloads,
    tiny_checkpoint,
)

from rltserve.models.tokenizer import load_tokenizer
from rltserve.updates import RequestUpdate


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory)


def stage_for(ckpt, tokens, **script) -> ScriptedStage:
    return ScriptedStage(scripted_info(ckpt), Script(tokens, **script))


def body_of(raw: bytes) -> dict:
    return sse_payloads(b"data: " + raw + b"\n\n")[0]


async def test_chat_reasoning_stream_flushes_the_tail_it_held_back(ckpt):
    # "H", then "<" (it could open "</think>", so it is held back): the last delta carries it.
    stage = stage_for(ckpt, [44, 32])
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "chat_template_kwargs": {"enable_thinking": True}}  # fmt: skip
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        status, _, raw = await live.post("/v1/chat/completions", body)
        assert status == 200, raw
        assert body_of(raw)["choices"][0]["message"] == {
            "role": "assistant", "content": None, "reasoning": "H<", "reasoning_content": "H<",
        }  # fmt: skip
        status, _, raw = await live.post("/v1/chat/completions", {**body, "stream": True})
    assert status == 200
    events = sse_payloads(raw)
    assert events[-1] == "[DONE]"
    assert [e["choices"][0]["delta"] for e in events[:-1]] == [
        {"role": "assistant", "content": ""},
        {"reasoning": "H", "reasoning_content": "H"},
        {"reasoning": "<", "reasoning_content": "<"},
    ]


THINK, END = 3, 4  # ouro-tiny's <think> and </think> (plain added tokens)


H_ID, I_ID, EOS_ID = 44, 77, 2  # "H", "i", <|im_end|>


def chat_bytes(message: bytes, usage: bytes, finish: bytes = b'"stop"') -> bytes:
    return (
        b'{"id":"chatcmpl-test","object":"chat.completion","created":1730000000,"model":"tiny",'
        b'"choices":[{"index":0,"message":' + message + b',"logprobs":null,'
        b'"finish_reason":' + finish + b',"stop_reason":null}],"usage":' + usage
        + b',"metadata":{"weight_version":"0"}}'
    )  # fmt: skip


def chat_stream_bytes(deltas: list[bytes], usage: bytes) -> bytes:
    """A chat stream with include_usage: a role chunk, one chunk per delta (the last ends the
    choice by "stop", with the weight version), the usage chunk and [DONE]."""
    head = b'data: {"id":"chatcmpl-test","object":"chat.completion.chunk","created":1730000000,'
    head += b'"model":"tiny","choices":['
    role = b'{"role":"assistant","content":""}'
    out = []
    for i, delta in enumerate([role, *deltas]):
        last = i == len(deltas)
        finish = b'"stop","stop_reason":null' if last else b"null"
        metadata = b',"metadata":{"weight_version":"0"}' if last else b""
        out.append(
            head + b'{"index":0,"delta":' + delta + b',"logprobs":null,"finish_reason":'
            + finish + b'}],"usage":null' + metadata + b"}\n\n"
        )  # fmt: skip
    out.append(head + b'],"usage":' + usage + b"}\n\n")
    return b"".join(out) + b"data: [DONE]\n\n"


async def test_chat_reasoning_bytes_and_reasoning_tokens(ckpt):
    """A prompt that opens the thinking span (enable_thinking): "H" is reasoning, "</think>"
    ends it, "i" is content. ``reasoning`` and ``reasoning_content`` carry the same text; usage
    counts the span's tokens, the tag included (2), whole and streamed."""
    tok = load_tokenizer(ckpt)
    assert [tok.decode([t]) for t in (THINK, END)] == ["<think>", "</think>"]
    stage = stage_for(ckpt, [H_ID, END, I_ID, EOS_ID])
    body = {"messages": [{"role": "user", "content": "hi"}],
            "chat_template_kwargs": {"enable_thinking": True}}  # fmt: skip
    stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        _, _, tokenized = await live.post("/tokenize", body)
        status, _, raw = await live.post("/v1/chat/completions", body)
        assert status == 200, raw
        _, _, streamed = await live.post("/v1/chat/completions", stream)
    n = len(body_of(tokenized)["tokens"])
    usage = (
        b'{"prompt_tokens":%d,"completion_tokens":4,"total_tokens":%d,'
        b'"completion_tokens_details":{"reasoning_tokens":2}}' % (n, n + 4)
    )
    message = b'{"role":"assistant","content":"i","reasoning":"H","reasoning_content":"H"}'
    assert raw == chat_bytes(message, usage)
    assert streamed == chat_stream_bytes(
        [b'{"reasoning":"H","reasoning_content":"H"}', b'{"content":"i"}', b"{}"], usage
    )


async def test_an_answer_that_opens_its_own_thinking_span_is_split(ckpt):
    """No thinking span in the prompt, but the answer's first token is ``<think>``: split as
    vLLM's deepseek_r1 / qwen3 parsers do (the tags in neither part; the span's 3 tokens
    counted; the tags make no chunk). ``include_reasoning`` false leaves the reasoning out (and
    its chunks), the count stays. An answer with ``<think>`` later (not its first token) is
    plain content, with no reasoning count."""
    stage = stage_for(ckpt, [THINK, H_ID, END, I_ID, EOS_ID])
    body = {"messages": [{"role": "user", "content": "hi"}]}
    stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        _, _, tokenized = await live.post("/tokenize", body)
        _, _, raw = await live.post("/v1/chat/completions", body)
        _, _, streamed = await live.post("/v1/chat/completions", stream)
        hidden = {"include_reasoning": False}
        _, _, raw_hidden = await live.post("/v1/chat/completions", {**body, **hidden})
        _, _, streamed_hidden = await live.post("/v1/chat/completions", {**stream, **hidden})
    n = len(body_of(tokenized)["tokens"])
    usage = (
        b'{"prompt_tokens":%d,"completion_tokens":5,"total_tokens":%d,'
        b'"completion_tokens_details":{"reasoning_tokens":3}}' % (n, n + 5)
    )
    message = b'{"role":"assistant","content":"i","reasoning":"H","reasoning_content":"H"}'
    assert raw == chat_bytes(message, usage)
    reasoning = b'{"reasoning":"H","reasoning_content":"H"}'
    deltas = [reasoning, b'{"content":"i"}', b"{}"]  # (no chunk of the tags: they show nothing)
    assert streamed == chat_stream_bytes(deltas, usage)
    assert raw_hidden == chat_bytes(b'{"role":"assistant","content":"i"}', usage)
    assert streamed_hidden == chat_stream_bytes([b'{"content":"i"}', b"{}"], usage)
    later = stage_for(ckpt, [H_ID, THINK, I_ID, EOS_ID])
    async with running(ckpt, client_factory=scripted_factory(later)) as live:
        _, _, raw = await live.post("/v1/chat/completions", body)
        _, _, streamed = await live.post("/v1/chat/completions", stream)
    usage = b'{"prompt_tokens":%d,"completion_tokens":4,"total_tokens":%d}' % (n, n + 4)
    assert raw == chat_bytes(b'{"role":"assistant","content":"H<think>i"}', usage)
    assert streamed == chat_stream_bytes(
        [b'{"content":"H"}', b'{"content":"<think>"}', b'{"content":"i"}', b"{}"], usage
    )


async def test_an_answer_still_thinking_at_its_limit_is_all_reasoning(ckpt):
    """An answer that opened its span and ran out of tokens inside it: all reasoning (its
    content null, as vLLM's parsers give it), every token counted."""
    stage = stage_for(ckpt, [THINK, H_ID, I_ID])
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        _, _, raw = await live.post("/v1/chat/completions", body)
    result = body_of(raw)
    assert result["choices"][0]["message"] == {
        "role": "assistant", "content": None, "reasoning": "Hi", "reasoning_content": "Hi",
    }  # fmt: skip
    assert result["choices"][0]["finish_reason"] == "length"
    assert result["usage"]["completion_tokens_details"] == {"reasoning_tokens": 3}


async def test_an_own_span_is_split_only_where_the_text_keeps_its_end(ckpt, tmp_path):
    """A tokenizer whose ``</think>`` is a special token: skip_special_tokens (the default)
    drops it from the text, so an answer that opens its own span stays whole content (a split
    would call all of it reasoning); with skip_special_tokens false it is split."""
    special = special_think_end_checkpoint(ckpt, tmp_path / "special")
    stage = stage_for(special, [THINK, H_ID, END, I_ID, EOS_ID])
    body = {"messages": [{"role": "user", "content": "hi"}]}
    async with running(special, client_factory=scripted_factory(stage)) as live:
        _, _, raw = await live.post("/v1/chat/completions", body)
        _, _, kept = await live.post("/v1/chat/completions", {**body, "skip_special_tokens": False})
    result = body_of(raw)
    assert result["choices"][0]["message"] == {"role": "assistant", "content": "<think>Hi"}
    assert "completion_tokens_details" not in result["usage"]
    assert body_of(kept)["choices"][0]["message"] == {
        "role": "assistant", "content": "i", "reasoning": "H", "reasoning_content": "H",
    }  # fmt: skip


async def test_an_answer_with_no_content_after_its_span_has_null_content(ckpt):
    """vLLM's parsers return ``content or None``: an answer that ends right after ``</think>``
    (EOS) or on a stop string inside its span has null content (streamed deltas as before:
    no content chunk); an answer with no span keeps its empty text as ""."""
    think = {"messages": [{"role": "user", "content": "hi"}],
             "chat_template_kwargs": {"enable_thinking": True}}  # fmt: skip
    ended = stage_for(ckpt, [H_ID, END, EOS_ID])
    async with running(ckpt, client_factory=scripted_factory(ended)) as live:
        _, _, raw = await live.post("/v1/chat/completions", think)
        _, _, streamed = await live.post("/v1/chat/completions", {**think, "stream": True})
        _, _, stopped = await live.post("/v1/chat/completions", {**think, "stop": ["</think>"]})
        plain = {"messages": think["messages"], "stop": ["H"]}
        _, _, empty = await live.post("/v1/chat/completions", plain)
    message = {"role": "assistant", "content": None, "reasoning": "H", "reasoning_content": "H"}
    assert body_of(raw)["choices"][0]["message"] == message
    assert [e["choices"][0]["delta"] for e in sse_payloads(streamed)[:-1]] == [
        {"role": "assistant", "content": ""},
        {"reasoning": "H", "reasoning_content": "H"},
        {},
    ]
    choice = body_of(stopped)["choices"][0]
    assert (choice["message"], choice["stop_reason"]) == (message, "</think>")
    choice = body_of(empty)["choices"][0]
    assert (choice["message"], choice["finish_reason"]) == ({"role": "assistant", "content": ""},
                                                            "stop")  # fmt: skip


async def test_a_forced_think_end_makes_no_chunk_with_logprobs(ckpt):
    """Bounded thinking's forced ``</think>`` (no logprob: nothing sampled) shows nothing and
    lists no logprob entry: no chunk for it with ``logprobs`` as without (vLLM sends no empty
    delta); the other chunks, the finish and the usage are as ever."""

    def forced_end(update: RequestUpdate) -> RequestUpdate:
        update.new_logprobs = [
            None if t == END else lp for t, lp in zip(update.new_token_ids, update.new_logprobs)
        ]
        return update

    stage = RewritingStage(scripted_info(ckpt), Script([H_ID, END, I_ID, EOS_ID]), forced_end)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True,
            "thinking_token_budget": 2, "logprobs": True, "stream_options": {"include_usage": True},
            "chat_template_kwargs": {"enable_thinking": True}}  # fmt: skip
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        rendered = {key: body[key] for key in ("messages", "chat_template_kwargs")}
        _, _, tokenized = await live.post("/tokenize", rendered)
        status, _, streamed = await live.post("/v1/chat/completions", body)
    assert status == 200, streamed
    n = len(body_of(tokenized)["tokens"])
    head = b'data: {"id":"chatcmpl-test","object":"chat.completion.chunk","created":1730000000,'
    head += b'"model":"tiny","choices":[{"index":0,"delta":'

    def logprob(token: bytes) -> bytes:
        listed = b",".join(b"%d" % byte for byte in token)
        return (
            b'{"content":[{"token":"' + token + b'","logprob":-0.5,"bytes":[' + listed
            + b'],"top_logprobs":[]}]}'
        )  # fmt: skip

    usage = (
        b'{"prompt_tokens":%d,"completion_tokens":4,"total_tokens":%d,'
        b'"completion_tokens_details":{"reasoning_tokens":2}}' % (n, n + 4)
    )
    assert streamed == (
        head + b'{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],'
        b'"usage":null}\n\n'
        + head + b'{"reasoning":"H","reasoning_content":"H"},"logprobs":' + logprob(b"H")
        + b',"finish_reason":null}],"usage":null}\n\n'
        + head + b'{"content":"i"},"logprobs":' + logprob(b"i")
        + b',"finish_reason":null}],"usage":null}\n\n'
        + head + b'{},"logprobs":' + logprob(b"<|im_end|>")
        + b',"finish_reason":"stop","stop_reason":null}],"usage":null,'
        b'"metadata":{"weight_version":"0"}}\n\n'
        + head[: head.index(b"[") + 1] + b'],"usage":' + usage + b"}\n\n"
        + b"data: [DONE]\n\n"
    )  # fmt: skip
