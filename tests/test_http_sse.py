"""Exact bytes of streams and bodies, with a scripted stage (model-independent tokens) and the
real ouro-tiny tokenizer: completion and chat streams, usage, n > 1, echo, stop strings across
token boundaries, the looped-model extensions, and a graceful shutdown mid-stream."""

from __future__ import annotations

import asyncio

import pytest
from test_http_harness import (
    Script,
    ScriptedStage,
    running,
    scripted_factory,
    scripted_info,
    sse_payloads,
    tiny_checkpoint,
)

from rltserve.http.sse import DONE, encode_error, encode_event
from rltserve.models.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def hi_tokens(ckpt) -> list[int]:
    """Token ids of " Hi!": four byte-level tokens whatever the merges."""
    tok = load_tokenizer(ckpt)
    ids = tok.encode(" Hi!")
    assert [tok.decode([i]) for i in ids] == [" ", "H", "i", "!"]
    return ids


def stage_for(ckpt, tokens, **script) -> ScriptedStage:
    return ScriptedStage(scripted_info(ckpt), Script(tokens, **script))


def test_sse_framing_bytes():
    assert encode_event({"a": 1, "b": [None, "x"]}) == b'data: {"a":1,"b":[null,"x"]}\n\n'
    assert DONE == b"data: [DONE]\n\n"
    assert encode_error(503, "busy") == (
        b'data: {"error":{"message":"busy","type":"unavailable_error","param":null,"code":503}}\n\n'
    )


async def test_completion_stream_exact_bytes(ckpt, hi_tokens):
    stage = stage_for(ckpt, hi_tokens)
    body = {
        "model": "tiny",
        "prompt": [5, 6, 7],
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        status, headers, raw = await live.post("/v1/completions", body)
    assert status == 200
    assert headers["Content-Type"] == "text/event-stream"
    head = b'data: {"id":"cmpl-test","object":"text_completion","created":1730000000,'
    assert raw == (
        head + b'"model":"tiny","choices":[{"index":0,"text":" ","logprobs":null,'
        b'"finish_reason":null}],"usage":null}\n\n'
        + head + b'"model":"tiny","choices":[{"index":0,"text":"H","logprobs":null,'
        b'"finish_reason":null}],"usage":null}\n\n'
        + head + b'"model":"tiny","choices":[{"index":0,"text":"i","logprobs":null,'
        b'"finish_reason":null}],"usage":null}\n\n'
        + head + b'"model":"tiny","choices":[{"index":0,"text":"!","logprobs":null,'
        b'"finish_reason":"length","stop_reason":null}],"usage":null}\n\n'
        + head + b'"model":"tiny","choices":[],'
        b'"usage":{"prompt_tokens":3,"completion_tokens":4,"total_tokens":7}}\n\n'
        b"data: [DONE]\n\n"
    )  # fmt: skip


async def test_chat_stream_exact_bytes(ckpt, hi_tokens):
    # "H", "i", then <|im_end|> (id 2): the EOS ends the choice with an empty delta.
    stage = stage_for(ckpt, [hi_tokens[1], hi_tokens[2], 2])
    body = {"messages": [{"role": "user", "content": "hello"}], "stream": True}
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        status, _, raw = await live.post("/v1/chat/completions", body)
    assert status == 200
    head = b'data: {"id":"chatcmpl-test","object":"chat.completion.chunk","created":1730000000,'
    assert raw == (
        head + b'"model":"tiny","choices":[{"index":0,"delta":{"role":"assistant","content":""},'
        b'"logprobs":null,"finish_reason":null}]}\n\n'
        + head + b'"model":"tiny","choices":[{"index":0,"delta":{"content":"H"},'
        b'"logprobs":null,"finish_reason":null}]}\n\n'
        + head + b'"model":"tiny","choices":[{"index":0,"delta":{"content":"i"},'
        b'"logprobs":null,"finish_reason":null}]}\n\n'
        + head + b'"model":"tiny","choices":[{"index":0,"delta":{},'
        b'"logprobs":null,"finish_reason":"stop","stop_reason":null}]}\n\n'
        b"data: [DONE]\n\n"
    )  # fmt: skip


async def test_non_streaming_bodies_exact_bytes(ckpt, hi_tokens):
    stage = stage_for(ckpt, hi_tokens[1:3] + [0])  # "H", "i", <|endoftext|>
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        completion = {"prompt": hi_tokens[1:3], "max_tokens": 2, "echo": True}
        status, headers, raw = await live.post("/v1/completions", completion)
        assert status == 200 and headers["Content-Type"] == "application/json"
        assert raw == (
            b'{"id":"cmpl-test","object":"text_completion","created":1730000000,'
            b'"model":"tiny","choices":[{"index":0,"text":"HiHi","logprobs":null,'
            b'"finish_reason":"length","stop_reason":null}],'
            b'"usage":{"prompt_tokens":2,"completion_tokens":2,"total_tokens":4}}'
        )
        chat = {"messages": [{"role": "user", "content": "x"}]}
        status, _, raw = await live.post("/v1/chat/completions", chat)
        _, _, tokenized = await live.post("/tokenize", chat)
    assert status == 200
    n = len(sse_payloads(b"data: " + tokenized + b"\n\n")[0]["tokens"])
    assert raw == (
        b'{"id":"chatcmpl-test","object":"chat.completion","created":1730000000,"model":"tiny",'
        b'"choices":[{"index":0,"message":{"role":"assistant","content":"Hi"},"logprobs":null,'
        b'"finish_reason":"stop","stop_reason":null}],'
        b'"usage":{"prompt_tokens":%d,"completion_tokens":3,"total_tokens":%d}}' % (n, n + 3)
    )


async def test_n_choices_interleave_and_count(ckpt, hi_tokens):
    stage = stage_for(ckpt, hi_tokens, interval_s=0.002)
    body = {
        "prompt": [[5, 6], [7, 8, 9]],
        "n": 2,
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        status, _, raw = await live.post("/v1/completions", body)
        body["stream"] = False
        body.pop("stream_options")
        _, _, whole = await live.post("/v1/completions", body)
    events = sse_payloads(raw)
    assert status == 200 and events[-1] == "[DONE]"
    texts: dict[int, str] = {}
    finishes: dict[int, list] = {}
    for chunk in events[:-2]:
        (choice,) = chunk["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
        finishes.setdefault(choice["index"], []).append(choice["finish_reason"])
    assert texts == {i: " Hi!" for i in range(4)}
    assert all(f == [None, None, None, "length"] for f in finishes.values())
    # every prompt counted once, every choice's tokens counted
    assert events[-2]["usage"] == {"prompt_tokens": 5, "completion_tokens": 16, "total_tokens": 21}
    choices = sse_payloads(b"data: " + whole + b"\n\n")[0]["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert {c["text"] for c in choices} == {" Hi!"}


@pytest.mark.parametrize("stream", [False, True])
async def test_stop_string_across_tokens_aborts_the_stage(ckpt, hi_tokens, stream):
    stage = stage_for(ckpt, hi_tokens)
    body = {"prompt": [5], "max_tokens": 16, "stop": ["i!"], "stream": stream}
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        status, _, raw = await live.post("/v1/completions", body)
        assert stage.aborted == stage.added  # the engine stops generating too
    assert status == 200
    if stream:
        chunks = [c["choices"][0] for c in sse_payloads(raw)[:-1]]
        text = "".join(c["text"] for c in chunks)
        finish = [c["finish_reason"] for c in chunks]
        assert finish[-1] == "stop" and finish[:-1] == [None] * (len(finish) - 1)
        assert chunks[-1]["stop_reason"] == "i!"  # (vLLM's: what stopped it)
    else:
        (choice,) = sse_payloads(b"data: " + raw + b"\n\n")[0]["choices"]
        text, finish = choice["text"], choice["finish_reason"]
        assert finish == "stop" and choice["stop_reason"] == "i!"
    assert text == " H"  # "i!" spans the "i" and "!" tokens and is left out


async def test_loop_extensions_are_opt_in(ckpt, hi_tokens):
    stage = stage_for(ckpt, hi_tokens)
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        plain = {"prompt": [5], "max_tokens": 4}
        _, _, raw = await live.post("/v1/completions", plain)
        (choice,) = sse_payloads(b"data: " + raw + b"\n\n")[0]["choices"]
        assert list(choice) == ["index", "text", "logprobs", "finish_reason", "stop_reason"]
        extended = {**plain, "return_exit_depths": True, "return_token_ids": True}
        _, _, raw = await live.post("/v1/completions", extended)
        (choice,) = sse_payloads(b"data: " + raw + b"\n\n")[0]["choices"]
        assert choice["exit_depths"] == [1, 2, 3, 4]
        assert choice["token_ids"] == hi_tokens
        _, _, raw = await live.post("/v1/completions", {**extended, "stream": True})
    chunks = [c["choices"][0] for c in sse_payloads(raw)[:-1]]
    assert [c["exit_depths"] for c in chunks] == [[1], [2], [3], [4]]
    assert [c["token_ids"][0] for c in chunks] == hi_tokens


async def test_logprobs_shapes(ckpt, hi_tokens):
    stage = stage_for(ckpt, hi_tokens)
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        body = {"prompt": [5], "max_tokens": 2, "logprobs": 1}
        _, _, raw = await live.post("/v1/completions", body)
        (choice,) = sse_payloads(b"data: " + raw + b"\n\n")[0]["choices"]
        assert choice["logprobs"] == {
            "tokens": [" ", "H"],
            "token_logprobs": [-0.5, -0.5],
            "top_logprobs": [{" ": -0.5}, {"H": -0.5}],
            "text_offset": [0, 1],
        }
        chat = {
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 1,
            "logprobs": True,
            "top_logprobs": 1,
        }
        _, _, raw = await live.post("/v1/chat/completions", chat)
    (choice,) = sse_payloads(b"data: " + raw + b"\n\n")[0]["choices"]
    assert choice["logprobs"] == {
        "content": [
            {
                "token": " ",
                "logprob": -0.5,
                "bytes": [32],
                "top_logprobs": [{"token": " ", "logprob": -0.5, "bytes": [32]}],
            }
        ]
    }


async def test_a_second_signal_cuts_the_drain_short(ckpt, hi_tokens):
    stage = stage_for(ckpt, hi_tokens, interval_s=0.01)
    body = {"prompt": [5], "max_tokens": 63, "stream": True}
    async with running(ckpt, client_factory=scripted_factory(stage), drain_timeout_s=600) as live:
        async with live.stream("/v1/completions", body) as r:
            await r.content.readuntil(b"\n\n")
            closing = asyncio.create_task(live.server.close())
            while not live.state.closing:
                await asyncio.sleep(0.01)
            live.state.cut_drain()  # what a second SIGINT/SIGTERM calls
            rest = await asyncio.wait_for(r.content.read(), 30)  # (not the 600 s drain)
        await asyncio.wait_for(closing, 30)
    assert sse_payloads(rest)[-2]["error"]["message"] == "the server is shutting down"
    assert set(stage.aborted) == set(stage.added)


async def test_graceful_shutdown_ends_streams_and_closes_the_stage(ckpt, hi_tokens):
    stage = stage_for(ckpt, hi_tokens, interval_s=0.01)
    body = {"prompt": [5], "max_tokens": 63, "stream": True}
    factory = scripted_factory(stage)
    async with running(ckpt, client_factory=factory, drain_timeout_s=0.2) as live:
        async with live.stream("/v1/completions", body) as r:
            first = await r.content.readuntil(b"\n\n")
            closing = asyncio.create_task(live.server.close())
            rest = await r.content.read()
        await closing
    events = sse_payloads(first + rest)
    assert events[-2] == {
        "error": {
            "message": "the server is shutting down",
            "type": "unavailable_error",
            "param": None,
            "code": 503,
        }
    }
    assert events[-1] == "[DONE]"
    assert set(stage.aborted) == set(stage.added) and not stage.alive
    assert live.state.closing
