"""AsyncClient against a live server (scripted stage): every method, typed errors, stream errors
and early stream exit aborting the request. Against other servers and proxies:
``test_client_servers.py``."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import aiohttp
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


async def test_the_openai_sdks_request_options_reach_the_server(ckpt):
    """extra_body's fields (vLLM's docs pass its own parameters so) reach the engine, over the
    call's (not sent as a field named extra_body, which the server would ignore);
    extra_headers' X-Request-Id names the request."""
    stage = stage_for(ckpt)
    async with (
        running(ckpt, client_factory=scripted_factory(stage)) as live,
        AsyncClient(live.url + "/v1") as client,
    ):
        result = await client.complete(
            [5, 6],
            max_tokens=4,
            top_k=5,
            extra_body={"top_k": 1, "seed": 3},
            extra_headers={"X-Request-Id": "trace-42"},
        )
        chunks = [c async for c in client.stream([5], max_tokens=2, extra_body={"top_k": 2})]
    assert result["id"] == "cmpl-trace-42" and result["choices"][0]["text"] == " Hi!"
    assert "".join(c["choices"][0]["text"] for c in chunks) == " H"
    assert [(p.top_k, p.seed, p.max_tokens) for p in stage.added_params] == [
        (1, 3, 4), (2, None, 2),
    ]  # fmt: skip


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
    async with AsyncClient("http://127.0.0.1:9", timeout=2, max_retries=0) as client:
        assert not await client.health()
        with pytest.raises(APIConnectionError):
            await client.models()


async def test_overload_and_stream_errors(ckpt):
    hold = threading.Event()
    stage = stage_for(ckpt, hold=hold, interval_s=0.01)  # a stream outlives the kill
    factory = scripted_factory(stage)
    async with running(ckpt, client_factory=factory, max_concurrent=1, max_queued=0) as live:
        client = AsyncClient(live.url, max_retries=0)  # (the 503 itself is under test)
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


async def test_closing_the_client_ends_its_open_streams(ckpt):
    stage = stage_for(ckpt, interval_s=0.01)
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        client = AsyncClient(live.url)
        started = asyncio.Event()

        async def read():
            async for _ in client.stream([5], max_tokens=63):
                started.set()

        reader = asyncio.create_task(read())
        await asyncio.wait_for(started.wait(), 10)
        await client.close()  # (another task still reads: it must not wait forever)
        with pytest.raises(APIConnectionError, match="^the client was closed while reading$"):
            await asyncio.wait_for(reader, 10)
        await wait_for(lambda: stage.aborted == stage.added)


async def test_closing_a_stream_another_task_reads_ends_that_read(ckpt):
    stage = stage_for(ckpt, interval_s=0.01)
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        async with AsyncClient(live.url) as client:
            stream, started = client.stream([5], max_tokens=63), asyncio.Event()

            async def read():
                async with stream:
                    async for _ in stream:
                        started.set()

            reader = asyncio.create_task(read())
            await asyncio.wait_for(started.wait(), 10)
            await stream.close()
            with pytest.raises(APIConnectionError, match="^the stream was closed while reading$"):
                await asyncio.wait_for(reader, 10)
            await wait_for(lambda: stage.aborted == stage.added)
        # The decoder's own error keeps its words (not "stream broke")
        async with AsyncClient(live.url, max_event_bytes=8) as client:
            message = "^an SSE event exceeds 8 bytes; is this an SSE stream\\?$"
            with pytest.raises(APIConnectionError, match=message):
                async for _ in client.stream([5], max_tokens=2):
                    pass


async def test_what_a_request_carries_and_what_the_client_leaves_alone():
    """No Authorization header without a key; ``extra_query`` in the URL; a caller's session
    stays open; ``max_connections=0`` is unlimited; a NaN is refused before sending."""
    seen = []

    async def completions(request: web.Request) -> web.Response:
        seen.append((request.headers.get("Authorization"), dict(request.query)))
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    async with serve(app) as url:
        async with aiohttp.ClientSession() as session:
            client = AsyncClient(url, session=session)
            await client.complete("x", extra_query={"api-version": "1"})
            await client.close()
            assert not session.closed
        async with AsyncClient(url, api_key="k", max_connections=0) as client:
            await client.complete("x")
            with pytest.raises(ValueError, match=r"^temperature=nan: must be a finite number$"):
                await client.complete("x", temperature=float("nan"))
    assert seen == [(None, {"api-version": "1"}), ("Bearer k", {})]


async def test_wait_ready_gives_up_at_its_timeout_whatever_the_interval():
    with socket.socket() as sock:  # (a port nothing listens on once closed)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    async with AsyncClient(f"http://127.0.0.1:{port}") as client:
        start = time.monotonic()
        with pytest.raises(APIConnectionError, match="not ready after 0.3 s"):
            await client.wait_ready(timeout=0.3, interval=30)
        assert time.monotonic() - start < 1.0


def test_errors_survive_pickling_and_copying():
    import copy
    import pickle

    body = {"message": "loading", "type": "unavailable_error", "code": 503}
    error = ServiceUnavailableError(503, "loading", "unavailable_error", None, 1.0, 503, body, "r1")
    for clone in (pickle.loads(pickle.dumps(error)), copy.copy(error)):
        assert type(clone) is ServiceUnavailableError and str(clone) == str(error)
        assert (clone.status, clone.message, clone.type, clone.retry_after) == (
            503, "loading", "unavailable_error", 1.0,
        )  # fmt: skip
        assert (clone.code, clone.body, clone.request_id) == (503, body, "r1")
    assert isinstance(error, InternalServerError)  # (every 5xx, as the OpenAI SDK has it)
