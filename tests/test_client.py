"""AsyncClient against a live server (scripted stage): every method, typed errors, stream errors
and early stream exit aborting the request."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import numpy as np
import orjson
import pytest
from aiohttp import web
from test_client_sse import serve
from test_http_harness import (
    Script,
    ScriptedStage,
    running,
    scripted_factory,
    scripted_info,
    tiny_checkpoint,
    wait_for,
)

import rltserve
from rltserve.client import (
    APIConnectionError,
    APIError,
    AsyncClient,
    AuthenticationError,
    BadRequestError,
    InternalServerError,
    NotFoundError,
    RequestTooLargeError,
    ServiceUnavailableError,
)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory)


def stage_for(ckpt, **script) -> ScriptedStage:
    return ScriptedStage(scripted_info(ckpt), Script([225, 44, 77, 5], **script))


async def test_every_method(ckpt):
    factory = scripted_factory(stage_for(ckpt))
    async with running(ckpt, client_factory=factory, api_key="k") as live:
        client = AsyncClient(live.url, api_key="k")
        async with client:
            await client.wait_ready(timeout=5)
            assert await client.health()
            assert [m["id"] for m in await client.models()] == ["tiny"]
            assert await client.version() == rltserve.__version__
            result = await client.complete([5, 6], max_tokens=4)
            assert result["choices"][0]["text"] == " Hi!"
            chunks = [c async for c in client.stream([5, 6], max_tokens=4)]
            assert "".join(c["choices"][0]["text"] for c in chunks) == " Hi!"
            messages = [{"role": "user", "content": "x"}]
            chat = await client.chat(messages, max_tokens=3)
            assert chat["choices"][0]["message"]["content"] == " Hi"
            usage = {"include_usage": True}
            async with client.chat_stream(messages, max_tokens=3, stream_options=usage) as stream:
                chunks = [c async for c in stream]
            assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
            assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
            ids = await client.tokenize("Hi!")
            assert await client.detokenize(ids) == "Hi!"
            assert len(await client.tokenize(messages=messages)) > len(ids)
            assert "rltserve:generation_tokens_total" in await client.metrics()


async def test_typed_errors(ckpt):
    factory = scripted_factory(stage_for(ckpt))
    async with running(ckpt, client_factory=factory, api_key="k", max_body_bytes=4096) as live:
        client = AsyncClient(live.url, api_key="k")
        async with client:
            with pytest.raises(BadRequestError) as err:
                await client.complete("x", temperature=9)
            assert err.value.status == 400 and err.value.param == "temperature"
            assert err.value.type == "invalid_request_error"
            with pytest.raises(NotFoundError):
                await client.complete("x", model="nope")
            with pytest.raises(RequestTooLargeError):
                await client.complete("x" * 5000)
            with pytest.raises(BadRequestError):  # raised when the stream opens
                async with client.stream("x", n=0):
                    pass
        client = AsyncClient(live.url, api_key="wrong")
        async with client:
            with pytest.raises(AuthenticationError) as err:
                await client.models()
            assert err.value.message == "Invalid API Key"
            assert await client.health()  # open without a key
    async with AsyncClient("http://127.0.0.1:9", timeout=2) as client:
        assert not await client.health()
        with pytest.raises(APIConnectionError):
            await client.models()


async def test_overload_and_stream_errors(ckpt):
    hold = threading.Event()
    stage = stage_for(ckpt, hold=hold, interval_s=0.01)  # a stream outlives the kill
    factory = scripted_factory(stage)
    async with running(ckpt, client_factory=factory, max_concurrent=1, max_queued=0) as live:
        client = AsyncClient(live.url)
        async with client:
            # Stream headers go out with the first event, so the held request waits in a task.
            blocker = asyncio.create_task(client.complete([5], max_tokens=2))
            await wait_for(lambda: len(stage.added) == 1)
            with pytest.raises(ServiceUnavailableError) as err:
                await client.complete([5])
            assert err.value.retry_after == 1.0
            hold.set()
            assert (await blocker)["usage"]["completion_tokens"] == 2
            async with client.stream([5], max_tokens=63) as stream:
                chunks = aiter(stream)
                await anext(chunks)
                stage.kill()
                with pytest.raises(ServiceUnavailableError) as err:
                    async for _ in chunks:
                        pass
            assert "stage died" in err.value.message and isinstance(err.value, APIError)


async def test_leaving_a_stream_early_aborts_the_request(ckpt):
    stage = stage_for(ckpt, interval_s=0.005)
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        client = AsyncClient(live.url)
        async with client:
            async with client.stream([5], max_tokens=63) as stream:
                async for _ in stream:
                    break
            await wait_for(lambda: stage.aborted == stage.added)
            await wait_for(lambda: live.state.gate.in_use == 0)
            result = await client.complete([5], max_tokens=1)
            assert result["usage"]["completion_tokens"] == 1


@contextlib.asynccontextmanager
async def misbehaving_server():
    """A server that is never ready, ends streams without [DONE], breaks connections
    mid-stream and answers errors with plain text, as a proxy or a crashed backend may."""

    async def health(request):
        return web.json_response({"error": {"message": "Loading model", "code": 503}}, status=503)

    async def completions(request):
        body = await request.json()
        mode = body["prompt"]
        if mode == "text-error":
            return web.Response(status=500, text="upstream exploded", content_type="text/plain")
        if mode == "not-json":
            return web.Response(status=200, text="<html>proxy page</html>")
        if isinstance(mode, list):  # the body as the server got it
            return web.json_response(body)
        if mode == "cut":  # a body that breaks off
            response = web.StreamResponse(headers={"Content-Length": "1000"})
            await response.prepare(request)
            await response.write(b'{"id": "c"')
            request.transport.close()
            return response
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        chunk = {"id": "c", "choices": [{"index": 0, "text": "a", "finish_reason": None}]}
        await response.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
        if mode == "broken":
            await response.write(b'data: {"id": "c", "cho')  # half an event, then gone
            request.transport.close()
            return response
        await response.write_eof()  # "no-done": a clean end, but without [DONE]
        return response

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/v1/completions", completions)
    async with serve(app) as url:
        yield url


async def test_client_error_paths_end_clearly():
    async with misbehaving_server() as url, AsyncClient(url, timeout=10) as client:
        with pytest.raises(APIConnectionError, match="not ready after 0.3 s"):
            await asyncio.wait_for(client.wait_ready(timeout=0.3, interval=0.05), 10)
        with pytest.raises(InternalServerError) as err:
            await asyncio.wait_for(client.complete("text-error"), 10)
        assert err.value.status == 500 and err.value.message == "upstream exploded"
        with pytest.raises(APIConnectionError, match="invalid JSON"):
            await asyncio.wait_for(client.complete("not-json"), 10)
        with pytest.raises(APIConnectionError, match="broke off"):
            await asyncio.wait_for(client.complete("cut"), 10)
        # Python values as callers hold them: int keys (OpenAI's SDK sends them as strings),
        # NumPy arrays and integers.
        sent = await client.complete(np.array([5, 6]), logit_bias={np.int64(5): 100, 7: -1})
        assert sent == {"prompt": [5, 6], "logit_bias": {"5": 100, "7": -1}}
        for mode, message in (("no-done", "without \\[DONE\\]"), ("broken", None)):
            got = []

            async def consume(mode=mode, got=got):
                async for chunk in client.stream(mode):
                    got.append(chunk["choices"][0]["text"])

            with pytest.raises(APIConnectionError, match=message):
                await asyncio.wait_for(consume(), 10)
            assert got == ["a"], mode  # what arrived before the end was delivered
