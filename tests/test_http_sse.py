"""Exact bytes of streams and bodies, with a scripted stage (model-independent tokens) and the
real ouro-tiny tokenizer: completion and chat streams, n > 1, echo, stop strings across token
boundaries, the looped-model extensions, and a graceful shutdown mid-stream. Logprobs:
``test_http_logprobs.py``; running usage and failures mid-stream: ``test_http_sse_usage.py``."""

from __future__ import annotations

import asyncio

import pytest
from test_http_harness import (
    body_of,
    hi_token_ids,
    running,
    scripted_factory,
    sse_payloads,
    stage_for,
    tiny_checkpoint,
)

from rltserve.http.sse import DONE, encode_error, encode_event
from rltserve.models.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def hi_tokens(ckpt) -> list[int]:
    return hi_token_ids(ckpt)


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
        b'"finish_reason":"length","stop_reason":null}],"usage":null,'
        b'"metadata":{"weight_version":"0"}}\n\n'
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
        b'"logprobs":null,"finish_reason":"stop","stop_reason":null}],'
        b'"metadata":{"weight_version":"0"}}\n\n'
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
            b'"usage":{"prompt_tokens":2,"completion_tokens":2,"total_tokens":4},'
            b'"metadata":{"weight_version":"0"}}'
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
        b'"usage":{"prompt_tokens":%d,"completion_tokens":3,"total_tokens":%d},'
        b'"metadata":{"weight_version":"0"}}' % (n, n + 3)
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
        assert choice["prompt_token_ids"] == [5]  # vLLM's, with return_token_ids
        _, _, raw = await live.post("/v1/completions", {**extended, "stream": True})
    chunks = [c["choices"][0] for c in sse_payloads(raw)[:-1]]
    assert [c["exit_depths"] for c in chunks] == [[1], [2], [3], [4]]
    assert [c["token_ids"][0] for c in chunks] == hi_tokens
    assert [c.get("prompt_token_ids") for c in chunks] == [[5], None, None, None]


async def test_chat_return_token_ids_lists_the_prompt_once_at_the_top(ckpt, hi_tokens):
    stage = stage_for(ckpt, hi_tokens)
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "n": 2}
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        _, _, plain = await live.post("/v1/chat/completions", chat)
        assert "prompt_token_ids" not in body_of(plain)
        ids = {**chat, "return_token_ids": True}
        _, _, raw = await live.post("/v1/chat/completions", ids)
        _, _, streamed = await live.post("/v1/chat/completions", {**ids, "stream": True})
    body = body_of(raw)
    prompt_ids = stage.added_prompts[-1]
    assert body["prompt_token_ids"] == prompt_ids
    assert len(prompt_ids) == body["usage"]["prompt_tokens"]
    assert [c["token_ids"] for c in body["choices"]] == [hi_tokens[:2]] * 2
    assert "prompt_token_ids" not in body["choices"][0]
    chunks = sse_payloads(streamed)[:-1]
    assert [c.get("prompt_token_ids") for c in chunks] == [prompt_ids] + [None] * (len(chunks) - 1)


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


async def test_echo_alone_ends_by_length_whatever_the_engine_sampled(ckpt, hi_tokens):
    """echo with max_tokens=0: the engine samples one token, which is dropped. When that token
    is a stop token, the choice still ends by "length" with no stop_reason and no completion
    tokens, whole or streamed (running usage included)."""
    stop = hi_tokens[1]  # "H"
    stage = stage_for(ckpt, [stop])
    body = {"prompt": hi_tokens[1:3], "max_tokens": 0, "echo": True, "stop_token_ids": [stop]}
    options = {"include_usage": True, "continuous_usage_stats": True}
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        status, _, raw = await live.post("/v1/completions", body)
        assert status == 200
        stream = {**body, "stream": True, "stream_options": options}
        status, _, streamed = await live.post("/v1/completions", stream)
    assert status == 200
    choice = b'{"index":0,"text":"Hi","logprobs":null,"finish_reason":"length","stop_reason":null}'
    usage = b'"usage":{"prompt_tokens":2,"completion_tokens":0,"total_tokens":2}}'
    head = b'{"id":"cmpl-test","object":"text_completion","created":1730000000,"model":"tiny",'
    metadata = b',"metadata":{"weight_version":"0"}}'
    assert raw == head + b'"choices":[' + choice + b"]," + usage[:-1] + metadata
    assert streamed == (
        b"data: " + head + b'"choices":[' + choice + b"]," + usage[:-1] + metadata + b"\n\n"
        + b"data: " + head + b'"choices":[],' + usage + b"\n\n"
        + b"data: [DONE]\n\n"
    )  # fmt: skip


async def test_text_offsets_and_extensions_across_chunks(ckpt):
    """``text_offset`` counts characters of the text so far, across a stream's chunks too
    (tokens of four characters here); ``exit_depths`` then ``token_ids`` follow a choice's
    ``stop_reason``."""
    tok = load_tokenizer(ckpt)
    ids = tok.encode(" the and", add_special_tokens=False)
    assert [tok.decode([i]) for i in ids] == [" the", " and"]
    stage = stage_for(ckpt, ids)
    body = {"prompt": [5], "max_tokens": 2, "logprobs": 1, "return_exit_depths": True,
            "return_token_ids": True}  # fmt: skip
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        _, _, raw = await live.post("/v1/completions", body)
        _, _, streamed = await live.post("/v1/completions", {**body, "stream": True})
    (choice,) = body_of(raw)["choices"]
    assert list(choice) == ["index", "text", "logprobs", "finish_reason", "stop_reason",
                            "exit_depths", "prompt_token_ids", "token_ids"]  # fmt: skip
    assert choice["logprobs"] == {
        "tokens": [" the", " and"],
        "token_logprobs": [-0.5, -0.5],
        "top_logprobs": [{" the": -0.5}, {" and": -0.5}],
        "text_offset": [0, 4],
    }
    chunks = [c["choices"][0] for c in sse_payloads(streamed)[:-1]]
    assert [c["logprobs"]["text_offset"] for c in chunks] == [[0], [4]]
    assert list(chunks[-1]) == [k for k in choice if k != "prompt_token_ids"]  # (first chunk's)


async def test_choice_index_is_prompt_times_n_plus_sample(ckpt, hi_tokens):
    """Choice ``index`` is ``prompt_index * n + sample_index`` (OpenAI's numbering): with echo
    each choice's text starts with the prompt it sampled."""
    stage = stage_for(ckpt, hi_tokens)
    body = {"prompt": [[hi_tokens[1]], [hi_tokens[3]]], "n": 2, "max_tokens": 1, "echo": True}
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        status, _, raw = await live.post("/v1/completions", body)
    assert status == 200
    texts = [(c["index"], c["text"]) for c in body_of(raw)["choices"]]
    assert texts == [(0, "H "), (1, "H "), (2, "! "), (3, "! ")]


async def test_done_goes_out_with_the_end_of_the_body(ckpt, hi_tokens, monkeypatch):
    # In one write: a client that stops reading at [DONE] has the body's end too, so its
    # connection goes back to its pool instead of being dropped.
    from aiohttp.http_writer import StreamWriter

    writes: list[bytes] = []
    write, writelines = StreamWriter._write, StreamWriter._writelines

    def record(self, data):
        writes.append(bytes(data))
        write(self, data)

    def record_lines(self, chunks):
        writes.append(b"".join(chunks))
        writelines(self, chunks)

    monkeypatch.setattr(StreamWriter, "_write", record)
    monkeypatch.setattr(StreamWriter, "_writelines", record_lines)
    stage = stage_for(ckpt, hi_tokens)
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2, "stream": True}
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        status, _, raw = await live.post("/v1/completions", body)
    assert status == 200 and raw.endswith(DONE)
    last = writes[-1]
    assert DONE in last and last.endswith(b"\r\n0\r\n\r\n")
