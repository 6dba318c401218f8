"""AsyncClient's retries (the OpenAI SDK's rules), its life across event loops and without
close(), a base URL ending in /v1, and errors that name the client's own doing. Servers are
scripted aiohttp apps (attempts are counted, never timed) and the HTTP app on a scripted stage."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import socket
import threading
import warnings

import aiohttp
import orjson
import pytest
from aiohttp import web
from multidict import CIMultiDict
from test_client_sse import serve
from test_http_harness import running, stage_for, tiny_checkpoint

import rltserve.client_retry as client_retry
from rltserve.client import (
    APIConnectionError,
    APIError,
    APITimeoutError,
    AsyncClient,
    BadRequestError,
    NotFoundError,
    RateLimitError,
    ServiceUnavailableError,
)
from rltserve.client_errors import error_from, retry_after_of

CHUNK = {"id": "c", "choices": [{"index": 0, "text": "a", "finish_reason": None}]}
EVENT = b"data: " + orjson.dumps(CHUNK) + b"\n\n"


@pytest.fixture
def no_backoff(monkeypatch):
    """Backoff without a Retry-After shrunk to nothing (the waits are not under test here)."""
    monkeypatch.setattr(client_retry, "INITIAL_RETRY_DELAY", 0.0)


@contextlib.asynccontextmanager
async def scripted_server(*answers: tuple):
    """POST /v1/completions answers the i-th request with ``answers[i]`` (the last answer from
    then on): ``("status", code, headers)``, ``("ok",)`` (JSON, or a whole stream when the
    request streams), ``("cut",)`` (a JSON body that breaks off), ``("break",)`` (a stream that
    breaks off after one chunk), ``("hang",)`` (no answer until the test ends). Yields the URL
    and the list of prompts received, one per request."""
    received: list = []
    release = asyncio.Event()

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        received.append(body["prompt"])
        kind, *rest = answers[min(len(received), len(answers)) - 1]
        if kind == "status":
            code, headers = rest
            error = {"error": {"message": f"got {code}", "type": "x", "param": None, "code": code}}
            return web.json_response(error, status=code, headers=headers)
        if kind == "hang":
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(release.wait(), 30)
            return web.json_response({})
        if kind == "cut":
            response = web.StreamResponse(headers={"Content-Length": "1000"})
            await response.prepare(request)
            await response.write(b'{"id": "c"')
            request.transport.close()
            return response
        if not body.get("stream"):
            return web.json_response({"attempt": len(received)})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(EVENT)
        if kind == "break":
            request.transport.close()  # (the server dies mid-stream)
            return response
        await response.write(EVENT + b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    async with serve(app) as url:
        try:
            yield url, received
        finally:
            release.set()


def unavailable(retry_after: str = "0.001") -> tuple:
    return ("status", 503, {"Retry-After": retry_after})


async def texts(client: AsyncClient, prompt: str) -> list[str]:
    return [c["choices"][0]["text"] async for c in client.stream(prompt)]


# ---------------------------------------------------------------------------- the rules


def test_retry_rules_are_the_openai_sdks(monkeypatch):
    def status(code: int, retry_after: float | None = None) -> APIError:
        return error_from(code, {"error": {"message": "m"}}, retry_after)

    codes = (400, 401, 403, 404, 408, 409, 413, 418, 422, 429, 500, 502, 503, 504)
    assert [c for c in codes if client_retry.retryable(status(c))] == [
        408, 409, 429, 500, 502, 503, 504,
    ]  # fmt: skip
    assert not client_retry.retryable(status(503, 121.0))  # (asks for more than 120 s)
    assert client_retry.retryable(status(503, 120.0))
    # a transport failure (connecting, reading, timing out) is retried ...
    for cls, cause in (
        (APIConnectionError, aiohttp.ClientConnectionError("x")),
        (APITimeoutError, asyncio.TimeoutError()),
    ):
        error = cls(None, "x")
        error.__cause__ = cause
        assert client_retry.retryable(error)
    # ... but not a server's broken promise (invalid JSON, an error event, no [DONE])
    error = APIConnectionError(None, "the server sent invalid JSON")
    error.__cause__ = orjson.JSONDecodeError("x", "", 0)
    assert not client_retry.retryable(error)
    assert not client_retry.retryable(APIConnectionError(None, "no [DONE]"))

    # Waits: the server's Retry-After in (0, 120] s, else 0.5 s doubling up to 8 s, less up
    # to 25 % jitter.
    delay = client_retry.retry_delay
    assert delay(status(503, 1.0), 0) == 1.0 and delay(status(503, 0.25), 5) == 0.25
    for jitter, factor in ((0.0, 1.0), (1.0, 0.75)):
        monkeypatch.setattr(client_retry.random, "random", lambda jitter=jitter: jitter)
        got = [delay(status(503, hint), n) for hint, n in ((None, 0), (0.0, 1), (-3.0, 2))]
        assert got == [0.5 * factor, 1.0 * factor, 2.0 * factor]
        assert delay(status(500), 4) == delay(status(500), 5000) == 8.0 * factor


def test_retry_after_headers_as_the_sdk_reads_them():
    def read(**headers: str) -> float | None:
        return retry_after_of(CIMultiDict({k.replace("_", "-"): v for k, v in headers.items()}))

    assert read(Retry_After="2") == 2.0
    assert read(Retry_After="0.5") == 0.5  # (fractions, as the SDK allows)
    assert read(retry_after_ms="250", Retry_After="9") == 0.25  # milliseconds first
    assert read(retry_after_ms="soon", Retry_After="3") == 3.0
    assert read(Retry_After="Wed, 21 Oct 2026 07:28:00 GMT") is None
    assert read(Retry_After="nan") is None and read() is None


def test_max_retries_is_validated():
    assert AsyncClient("http://127.0.0.1:1").max_retries == 2  # (the SDK's default)
    assert AsyncClient("http://127.0.0.1:1", max_retries=0).max_retries == 0
    for bad in (-1, 1.5, True, None, "2"):
        with pytest.raises(ValueError, match=r"max_retries=.*: must be an int >= 0"):
            AsyncClient("http://127.0.0.1:1", max_retries=bad)


# ---------------------------------------------------------------------------- retries


async def test_failures_worth_retrying_are_retried_until_they_pass(no_backoff):
    cases = [  # (answers, max_retries, attempts made)
        ((unavailable(), unavailable(), ("ok",)), 2, 3),
        ((("status", 429, {"retry-after-ms": "1"}), ("ok",)), 2, 2),
        ((("status", 500, {}), ("status", 408, {}), ("status", 409, {}), ("ok",)), 3, 4),
        ((("cut",), ("ok",)), 2, 2),  # (a body that broke off: the SDK retries it too)
    ]
    for answers, max_retries, attempts in cases:
        async with scripted_server(*answers) as (url, received):
            async with AsyncClient(url, max_retries=max_retries) as client:
                assert await client.complete("x") == {"attempt": attempts}, answers
            assert received == ["x"] * attempts
    # streams are retried while they open
    answers = (unavailable(), unavailable(), ("ok",))
    async with scripted_server(*answers) as (url, received), AsyncClient(url) as client:
        assert await texts(client, "s") == ["a", "a"]
        assert len(received) == 3
        async with client.stream("t") as stream:  # (opened by async with: the same)
            assert [c["choices"][0]["text"] async for c in stream] == ["a", "a"]
        assert len(received) == 4


async def test_what_is_not_retried(no_backoff):
    # too many failures: the last one is raised after 1 + max_retries attempts
    for max_retries in (0, 2):
        async with scripted_server(unavailable()) as (url, received):
            async with AsyncClient(url, max_retries=max_retries) as client:
                with pytest.raises(ServiceUnavailableError) as err:
                    await client.complete("x")
                assert err.value.retry_after == 0.001
                with pytest.raises(ServiceUnavailableError):
                    await texts(client, "s")
            assert received == ["x"] * (1 + max_retries) + ["s"] * (1 + max_retries)
    # a client error, or a server that asks for more than two minutes
    answers = [
        (("status", 400, {}), BadRequestError),
        (("status", 404, {}), NotFoundError),
        (("status", 503, {"Retry-After": "121"}), ServiceUnavailableError),
        (("status", 429, {"Retry-After": "3600"}), RateLimitError),
    ]
    for answer, cls in answers:
        async with scripted_server(answer, answer, ("ok",)) as (url, received):
            async with AsyncClient(url) as client:
                with pytest.raises(cls):
                    await client.complete("x")
                with pytest.raises(cls):
                    await texts(client, "s")
            assert received == ["x", "s"], answer
    # a stream that broke after a chunk: the caller has seen tokens, so it is not sent again
    async with scripted_server(("break",), ("ok",)) as (url, received):
        async with AsyncClient(url) as client:
            got = []
            with pytest.raises(APIConnectionError) as err:
                async for chunk in client.stream("s"):
                    got.append(chunk["choices"][0]["text"])
        assert got == ["a"] and received == ["s"]
        assert str(err.value) == (
            "stream broke: the server closed the connection mid-stream "
            "(TransferEncodingError: Not enough data to satisfy transfer length header.)"
        )  # (aiohttp's parser calls it a "400": no status the server sent)
    # a body that broke off, once retries are spent, says so in the same words
    async with scripted_server(("cut",)) as (url, received):
        async with AsyncClient(url, max_retries=0) as client:
            with pytest.raises(APIConnectionError) as err:
                await client.complete("x")
        assert received == ["x"]
        assert str(err.value) == (
            "the response broke off: the server closed the connection mid-response "
            "(ContentLengthError: Not enough data to satisfy content length header "
            "(received 10 of 1000 bytes).)"
        )


async def test_a_callers_session_that_raises_for_status_gets_typed_errors_unretried():
    """aiohttp's raise_for_status=True would make a 400 a ClientResponseError, which the
    retry rules take for a connection failure: the client maps statuses itself."""
    async with scripted_server(("status", 400, {}), ("ok",)) as (url, received):
        async with aiohttp.ClientSession(raise_for_status=True) as session:
            client = AsyncClient(url, session=session)
            with pytest.raises(BadRequestError) as err:
                await client.complete("x")
            assert (err.value.status, err.value.message) == (400, "got 400")
            assert await client.complete("y") == {"attempt": 2}
        assert received == ["x", "y"]


async def test_a_timeout_bounds_each_attempt_as_in_the_sdk(no_backoff):
    async with scripted_server(("hang",)) as (url, received):
        # (0.5 s: each attempt must reach the server within it on a loaded machine)
        async with AsyncClient(url, timeout=0.5, max_retries=1) as client:
            with pytest.raises(APITimeoutError):
                await client.complete("x")
        assert received == ["x", "x"]


async def test_a_refused_connection_is_retried_until_the_server_is_up(monkeypatch):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
    port = listener.getsockname()[1]
    refused: list[APIError] = []
    listening = asyncio.Event()

    def retry_at_once(error: APIError, retries_taken: int) -> float:
        refused.append(error)
        listener.listen(8)  # (the retry's connection waits in the backlog for the server)
        listening.set()
        return 0.0

    monkeypatch.setattr(client_retry, "retry_delay", retry_at_once)
    received: list = []

    async def completions(request: web.Request) -> web.Response:
        received.append((await request.json())["prompt"])
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        async with AsyncClient(f"http://127.0.0.1:{port}") as client:
            call = asyncio.create_task(client.complete("x"))
            await asyncio.wait_for(listening.wait(), 10)
            await web.SockSite(runner, listener).start()
            assert await asyncio.wait_for(call, 10) == {"ok": True}
        assert [type(e) for e in refused] == [APIConnectionError] and received == ["x"]
        assert str(refused[0]).startswith(f"cannot reach http://127.0.0.1:{port}: ")
    finally:
        await runner.cleanup()
        listener.close()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory)


async def test_rltserve_loading_503s_are_waited_out_with_their_retry_after(ckpt, monkeypatch):
    release = threading.Event()
    stage = stage_for(ckpt)

    def slow_factory(config):
        release.wait(10)
        return stage

    waits: list[tuple] = []
    server_delay = client_retry.retry_delay

    def record(error: APIError, retries_taken: int) -> float:
        waits.append((type(error), error.message, server_delay(error, retries_taken)))
        release.set()  # (the model loads once the client has been told to wait)
        return 0.01

    monkeypatch.setattr(client_retry, "retry_delay", record)
    async with (
        running(ckpt, client_factory=slow_factory, wait=False) as live,
        AsyncClient(live.url + "/v1", max_retries=100) as client,
    ):
        result = await asyncio.wait_for(client.complete([5], max_tokens=2), 20)
    assert result["usage"]["completion_tokens"] == 2
    # the server's Retry-After (1 s by default) is the wait the client would take
    assert waits and set(waits) == {(ServiceUnavailableError, "Loading model", 1.0)}


# ---------------------------------------------------------------------------- life


async def test_a_base_url_ending_in_v1_names_the_server():
    async with scripted_server(("ok",)) as (url, received):
        for base in (url + "/v1", url + "/v1/", url + "/"):
            async with AsyncClient(base) as client:
                assert client.base_url == url
                assert await client.complete("x") == {"attempt": len(received)}
        assert received == ["x"] * 3


async def test_closing_the_client_mid_call_is_named_as_such():
    async with scripted_server(("hang",)) as (url, received):
        client = AsyncClient(url)
        call = asyncio.create_task(client.complete("x"))
        while not received:
            await asyncio.sleep(0.01)
        await client.close()
        with pytest.raises(APIConnectionError) as err:
            await asyncio.wait_for(call, 10)
        assert str(err.value) == "the client was closed during the call"
        assert received == ["x"]  # (not retried)


async def test_closing_the_client_during_a_retry_wait_is_named_as_such():
    async with scripted_server(("status", 503, {"retry-after-ms": "300"})) as (url, received):
        client = AsyncClient(url)
        call = asyncio.create_task(client.complete("x"))
        while not received:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)  # (into the wait before the retry)
        await client.close()
        with pytest.raises(APIConnectionError, match="^the client was closed during the call$"):
            await asyncio.wait_for(call, 10)
        assert received == ["x"]


@contextlib.contextmanager
def server_thread():
    """An app on a loopback port served by its own thread and loop, so that the test's
    event loops may come and go; yields the URL and the prompts received."""
    received: list = []

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        received.append(body["prompt"])
        if not body.get("stream"):
            return web.json_response({"n": len(received)})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for _ in range(100):
            await response.write(EVENT)
            await asyncio.sleep(0.01)
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}", received
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


@contextlib.contextmanager
def no_unclosed_warnings(caplog):
    """Fails if aiohttp says "Unclosed client session" or "Unclosed connector" (a warning, or
    the report it logs through the event loop's exception handler)."""
    with (
        caplog.at_level(logging.ERROR, logger="asyncio"),
        warnings.catch_warnings(record=True) as caught,
    ):
        warnings.simplefilter("always")
        yield
        gc.collect()
    said = [str(w.message) for w in caught] + [r.getMessage() for r in caplog.records]
    assert [s for s in said if "Unclosed client session" in s or "Unclosed connector" in s] == []


def test_a_client_serves_one_asyncio_run_after_another(caplog):
    with server_thread() as (url, received), no_unclosed_warnings(caplog):
        client = AsyncClient(url)  # (module-level in a script or a notebook)
        for n in (1, 2, 3):
            assert asyncio.run(client.complete("x")) == {"n": n}
        assert asyncio.run(texts_of_one(client)) == ["a"]
        asyncio.run(client.close())  # (on a loop the session was not made on)
        with pytest.raises(RuntimeError, match="closed"):
            asyncio.run(client.complete("x"))
    assert received == ["x", "x", "x", "s"]


async def texts_of_one(client: AsyncClient) -> list[str]:
    async for chunk in client.stream("s"):
        return [chunk["choices"][0]["text"]]  # (leaves the stream early, without async with)
    return []


def test_a_client_never_closed_is_collected_quietly(caplog):
    with server_thread() as (url, received), no_unclosed_warnings(caplog):

        async def in_the_loop() -> None:  # collected while its loop runs
            client = AsyncClient(url)
            assert await client.complete("x") == {"n": 1}
            del client
            gc.collect()

        asyncio.run(in_the_loop())

        async def left_over() -> AsyncClient:  # collected after its loop has closed
            client = AsyncClient(url)
            assert await texts_of_one(client) == ["a"]
            return client

        client = asyncio.run(left_over())
        del client
        gc.collect()
    assert received == ["x", "s"]


def test_a_client_collected_in_a_reference_cycle_lets_go_before_any_finaliser_runs(caplog):
    """A client held only by a reference cycle (a traceback's frames hold it, as after a
    refused call) is collected in one pass with its session and connector, whose finalisers
    run in the collector's order: its connector is closed before any of them runs, else the
    connector's own (first, here) would say "Unclosed connector"."""
    seen: list[bool] = []

    class Witness:  # another finaliser of the same garbage, older than the client
        def __del__(self) -> None:
            seen.append(self.connector.closed)

    with server_thread() as (url, received), no_unclosed_warnings(caplog):
        witness = Witness()
        client = AsyncClient(url)
        # A loop closed without asyncio.run()'s shutdown of its async generators, which
        # would close the session: its connection stays pooled.
        loop = asyncio.new_event_loop()
        assert loop.run_until_complete(client.complete("x")) == {"n": 1}
        loop.close()
        witness.connector = client._session.connector
        witness.cycle = [witness, client]
        del witness, client
        gc.collect()
    assert seen == [True] and received == ["x"]


async def test_a_client_in_use_on_a_loop_of_another_thread_refuses_this_one():
    async with scripted_server(("ok",)) as (url, _):
        client = AsyncClient(url)
        assert await client.complete("x") == {"attempt": 1}
        with pytest.raises(RuntimeError, match="another thread"):
            await asyncio.to_thread(asyncio.run, client.complete("x"))
        # (nor may another thread close its connections under it)
        with pytest.raises(RuntimeError, match="another thread; close it there"):
            await asyncio.to_thread(asyncio.run, client.close())
        assert await client.complete("x") == {"attempt": 2}
        await client.close()
