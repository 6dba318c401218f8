"""AsyncClient against servers that are not rltserve's, as proxies, crashed backends and other
OpenAI-compatible servers answer: never ready, plain-text and broken-off bodies, streams without
[DONE] or cut mid-event, BOMs, vLLM's error objects, statuses mapped to the OpenAI SDK's
classes. The client against a live rltserve server: ``test_client.py``."""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
import numpy as np
import orjson
import pytest
from aiohttp import web
from test_client_sse import serve

from rltserve.client import (
    APIConnectionError,
    APITimeoutError,
    AsyncClient,
    AuthenticationError,
    BadRequestError,
    InternalServerError,
    NotFoundError,
    RateLimitError,
    RequestTooLargeError,
    ServiceUnavailableError,
    UnsupportedMediaTypeError,
)


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
    async with misbehaving_server() as url, AsyncClient(url, timeout=10, max_retries=0) as client:
        with pytest.raises(APIConnectionError, match="not ready after 0.3 s"):
            await asyncio.wait_for(client.wait_ready(timeout=0.3, interval=0.05), 10)
        with pytest.raises(InternalServerError) as err:
            await asyncio.wait_for(client.complete("text-error"), 10)
        assert err.value.status == 500 and err.value.message == "upstream exploded"
        # the OpenAI SDK's body is then the text; no code, no X-Request-Id
        assert (err.value.body, err.value.code, err.value.request_id) == (
            "upstream exploded", None, None,
        )  # fmt: skip
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


@contextlib.asynccontextmanager
async def odd_server():
    """A server as other OpenAI-compatible servers and proxies answer: /health 200 with no
    body, a route that never answers, 5xx statuses and error bodies that break off, streams
    that open with a byte order mark or carry vLLM's top-level error object."""

    release = asyncio.Event()  # (the route that never answers lets go when the test ends)

    async def health(request):
        return web.Response(status=200)

    async def slow(request):
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(release.wait(), 30)
        return web.json_response({})

    async def completions(request):
        mode = (await request.json())["prompt"]
        if mode == "502":
            return web.Response(status=502, text="bad gateway", content_type="text/plain")
        if mode == "cut-error":
            response = web.StreamResponse(status=500, headers={"Content-Length": "1000"})
            await response.prepare(request)
            await response.write(b'{"error": {"mes')
            request.transport.close()
            return response
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        chunk = {"id": "c", "choices": [{"index": 0, "text": "a", "finish_reason": None}]}
        if mode == "bom":
            await response.write(b"\xef\xbb")  # (the mark split across writes)
            await asyncio.sleep(0.05)
            await response.write(b"\xbfdata: " + orjson.dumps(chunk) + b"\n\ndata: [DONE]\n\n")
        elif mode == "vllm-error":
            error = {"object": "error", "message": "boom", "type": "BadRequestError", "code": 400}
            await response.write(b"data: " + orjson.dumps(error) + b"\n\n")
        elif mode == "string-code":
            error = {"error": {"message": "stage died", "code": "503"}}
            await response.write(b"data: " + orjson.dumps(error) + b"\n\n")
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", slow)
    app.router.add_post("/v1/completions", completions)
    async with serve(app) as url:
        try:
            yield url
        finally:
            release.set()


async def _chunks(client, prompt):
    return [chunk async for chunk in client.stream(prompt)]


async def test_client_edges_as_other_servers_and_callers_make_them():
    async with odd_server() as url, AsyncClient(url, timeout=5, max_retries=0) as client:
        assert await client.health()  # 200 without a body
        await asyncio.wait_for(client.wait_ready(timeout=1), 5)
        with pytest.raises(InternalServerError) as err:
            await client.complete("502")
        assert err.value.status == 502 and err.value.message == "bad gateway"
        with pytest.raises(APIConnectionError, match="broke off"):
            await asyncio.wait_for(client.complete("cut-error"), 10)
        assert [c["choices"][0]["text"] for c in await _chunks(client, "bom")] == ["a"]
        with pytest.raises(BadRequestError, match="boom"):
            await _chunks(client, "vllm-error")
        with pytest.raises(ServiceUnavailableError, match="stage died"):
            await _chunks(client, "string-code")
        # JSON has no NaN or infinity: orjson would send null (the server's default instead).
        with pytest.raises(ValueError, match="temperature=nan"):
            await client.complete("x", temperature=float("nan"))
        with pytest.raises(ValueError, match=r"logit_bias\.5=inf"):
            await client.complete("x", logit_bias={5: float("inf")})
        with pytest.raises(ValueError, match="use stream"):
            await client.complete("x", stream=True)
        with pytest.raises(ValueError, match="use complete"):
            client.stream("x", stream=False)
    async with odd_server() as url:  # (/v1/models never answers)
        with pytest.raises(APITimeoutError):
            async with AsyncClient(url, timeout=0.3, max_retries=0) as quick:
                await quick.models()
        async with aiohttp.ClientSession() as session:  # (the timeout applies to it too)
            with pytest.raises(APITimeoutError):
                await AsyncClient(url, timeout=0.3, session=session, max_retries=0).models()
    for bad in ({"timeout": 0}, {"timeout": "5"}, {"max_connections": -1}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            AsyncClient("http://127.0.0.1:1", **bad)


def test_arguments_that_could_never_work_are_refused_when_the_client_is_made():
    """Not at the first call, after its retries: a base URL without a scheme or host (the
    check ``bench serve --url`` makes), and an event bound that is no int >= 1."""
    why = "must be an http(s) URL with a host, e.g. http://127.0.0.1:8000"
    for url in ("localhost:8000", "127.0.0.1:8000/v1", "ftp://127.0.0.1:8000", "http://"):
        with pytest.raises(ValueError) as err:
            AsyncClient(url)
        assert str(err.value) == f"base_url={url!r}: {why}"
    with pytest.raises(ValueError, match=r"^base_url='http://h:x': must be an http\(s\) URL"):
        AsyncClient("http://h:x")
    for bad in (0, -5, 1.5, "1MB", None, True):
        with pytest.raises(ValueError) as err:
            AsyncClient("http://127.0.0.1:1", max_event_bytes=bad)
        assert str(err.value) == f"max_event_bytes={bad!r}: must be an int >= 1"
    assert AsyncClient("https://h/v1", max_event_bytes=1).max_event_bytes == 1


async def test_health_is_false_while_a_gateway_answers_for_a_starting_server():
    """A proxy answers 502, 503 or 504 while the server behind it starts: not ready, as the
    server's own 503; wait_ready waits through them. Another 5xx is an error."""
    answers = [502, 503, 504, 502, 504, 200, 500]
    probes: list[int] = []

    async def health(request):
        status = answers[len(probes)]
        probes.append(status)
        return web.Response(status=status, text="<html>gateway</html>", content_type="text/html")

    app = web.Application()
    app.router.add_get("/health", health)
    async with serve(app) as url, AsyncClient(url, max_retries=0) as client:
        assert [await client.health() for _ in range(3)] == [False, False, False]
        await asyncio.wait_for(client.wait_ready(timeout=10, interval=0.01), 10)
        assert probes == [502, 503, 504, 502, 504, 200]
        with pytest.raises(InternalServerError) as err:
            await client.health()
        assert err.value.status == 500


async def test_wait_ready_bounds_a_probe_the_server_never_answers():
    release = asyncio.Event()  # (let go when the test ends: the server's shutdown waits)

    async def hung(request):
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(release.wait(), 30)
        return web.Response(status=200)

    app = web.Application()
    app.router.add_get("/health", hung)
    async with serve(app) as url, AsyncClient(url, timeout=20) as client:
        start = asyncio.get_running_loop().time()
        try:
            with pytest.raises(APIConnectionError, match="not ready after 0.3 s"):
                await asyncio.wait_for(client.wait_ready(timeout=0.3), 10)
            assert asyncio.get_running_loop().time() - start < 5  # (not the client's 20 s)
        finally:
            release.set()


@contextlib.asynccontextmanager
async def echo_server():
    """A server that shows what the client sent (body, Content-Type, Authorization) and answers
    with the status, headers and streams a test asks for in the prompt."""
    release = asyncio.Event()  # (a stalled stream is let go when the test ends)
    second = asyncio.Event()
    load = {"now": 0, "peak": 0}  # requests in the handler at once

    async def completions(request):
        raw = await request.read()
        body = orjson.loads(raw)
        mode = body.get("prompt")
        if isinstance(mode, str) and mode.startswith("status-"):
            status = int(mode.split("-")[1])
            headers = {"X-Request-Id": f"req-{status}"}
            if status == 503:
                headers["Retry-After"] = "Wed, 21 Oct 2026 07:28:00 GMT"
            error = {"message": f"got {status}", "type": "x", "param": None, "code": f"c{status}"}
            return web.json_response({"error": error}, status=status, headers=headers)
        if mode == "hold":  # waits for a second request (at most 0.5 s) before it answers
            load["now"] += 1
            load["peak"] = max(load["peak"], load["now"])
            if load["now"] == 2:
                second.set()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(second.wait(), 0.5)
            load["now"] -= 1
            return web.json_response({})
        if mode in ("empty-data", "stall"):
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            chunk = {"id": "c", "choices": [{"index": 0, "text": "a", "finish_reason": None}]}
            if mode == "empty-data":  # an event with an empty data line, as keep-alives are
                await response.write(b"data:\n\n" + b"data: " + orjson.dumps(chunk) + b"\n\n")
                await response.write(b"data: [DONE]\n\n")
            else:
                await response.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(release.wait(), 10)
            await response.write_eof()
            return response
        return web.json_response(
            {
                "body": body,
                "content_type": request.headers.get("Content-Type"),
                "authorization": request.headers.get("Authorization"),
                "path": request.path,
                "request_id": request.headers.get("X-Request-Id"),
                "query": dict(request.query),
            }
        )

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    async with serve(app) as url:
        try:
            yield url, load
        finally:
            release.set()


async def test_client_sends_json_as_other_servers_need_it_and_maps_statuses():
    async with echo_server() as (url, load):
        async with AsyncClient(url + "/") as client:  # (a trailing slash is dropped)
            sent = await client.complete([5, 6], temperature=None, max_tokens=2, stream=False)
            assert (await client.complete([5], stream=0))["body"] == {"prompt": [5]}
        assert sent == {
            # None values are left out, and so is stream (the method decides it)
            "body": {"prompt": [5, 6], "max_tokens": 2},
            "content_type": "application/json",  # (FastAPI servers need it)
            "authorization": None,  # no key: no header
            "path": "/v1/completions",
            "request_id": None,
            "query": {},
        }
        async with AsyncClient(url, api_key="k", max_retries=0) as client:
            assert (await client.complete([5]))["authorization"] == "Bearer k"
            for status, cls in (
                (401, AuthenticationError),
                (404, NotFoundError),
                (413, RequestTooLargeError),
                (415, UnsupportedMediaTypeError),
                (429, RateLimitError),
                (503, ServiceUnavailableError),
            ):
                with pytest.raises(cls) as err:
                    await client.complete(f"status-{status}")
                assert type(err.value) is cls
                assert (err.value.status, err.value.message) == (status, f"got {status}")
                assert str(err.value) == f"{status}: got {status}"
                # the OpenAI SDK's code, body (the error object) and request_id
                assert (err.value.code, err.value.request_id) == (f"c{status}", f"req-{status}")
                assert err.value.body == {
                    "message": f"got {status}", "type": "x", "param": None, "code": f"c{status}",
                }  # fmt: skip
            # a Retry-After given as an HTTP date is no number of seconds: None, not a crash
            with pytest.raises(ServiceUnavailableError) as err:
                await client.complete("status-503")
            assert err.value.retry_after is None
            # JSON has no NaN: one inside a list is refused too, not sent as null
            with pytest.raises(ValueError, match=r"stop_token_ids\[1\]=nan"):
                await client.complete("x", stop_token_ids=[1, float("nan")])
            # nor inside a NumPy array (sent as a list)
            with pytest.raises(ValueError, match=r"extra\[0\]\[1\]=nan"):
                await client.complete("x", extra=np.array([[1.0, np.nan]]))
            sent = await client.complete([5], extra=np.array([[1.0, 2.0]]))
            assert sent["body"]["extra"] == [[1.0, 2.0]]
        async with AsyncClient(url, max_connections=1) as client:  # one request at a time
            await asyncio.gather(client.complete("hold"), client.complete("hold"))
        assert load["peak"] == 1


async def test_the_openai_sdks_per_request_keywords():
    """extra_body joins the body (over the call's own fields), extra_headers go over the
    client's (None leaves one out), extra_query makes the query string, and timeout is the
    call's own; none of them is sent as a body field."""
    async with echo_server() as (url, _), AsyncClient(url, api_key="k", timeout=20) as client:
        sent = await client.complete(
            [5],
            top_k=5,
            seed=1,
            extra_body={"top_k": 1, "vllm_only": [1, 2]},
            extra_headers={"X-Request-Id": "trace-42", "Authorization": None},
            extra_query={"api-version": "1", "n": 2},
            timeout=5,
        )
        assert sent == {
            "body": {"prompt": [5], "top_k": 1, "seed": 1, "vllm_only": [1, 2]},
            "content_type": "application/json",
            "authorization": None,
            "path": "/v1/completions",
            "request_id": "trace-42",
            "query": {"api-version": "1", "n": "2"},
        }
        # a stream's timeout is the call's too: it stalls after 0.3 s, not the client's 20
        got = []
        with pytest.raises(APITimeoutError, match=r"^stream stalled: nothing for 0.3 s$"):
            async for chunk in client.stream("stall", timeout=0.3):
                got.append(chunk["choices"][0]["text"])
        assert got == ["a"]
        bad = [
            ({"extra_body": [1]}, r"^extra_body=\[1\]: must be a dict$"),
            ({"extra_headers": {"X-N": 1}}, r"^extra_headers\['X-N'\]=1: must be a str or None"),
            ({"extra_query": {"q": None}}, r"^extra_query\['q'\]=None: must be a str or int"),
            ({"timeout": 0}, r"^timeout=0: must be a positive number of seconds or None$"),
            ({"extra_body": {"stream": True}}, r"^stream=True: complete\(\) does not"),
            ({"extra_body": {"t": float("nan")}}, r"^t=nan: must be a finite number$"),
        ]
        for kwargs, message in bad:
            with pytest.raises(ValueError, match=message):
                await client.complete("x", **kwargs)


async def test_client_stream_skips_empty_events_and_times_out_a_stalled_stream():
    async with echo_server() as (url, _), AsyncClient(url, timeout=0.3) as client:
        chunks = await asyncio.wait_for(_chunks(client, "empty-data"), 10)
        assert [c["choices"][0]["text"] for c in chunks] == ["a"]
        got = []
        with pytest.raises(APITimeoutError, match="stream stalled") as err:
            async for chunk in client.stream("stall"):
                got.append(chunk)
        assert len(got) == 1
        assert isinstance(err.value, APIConnectionError)  # (what callers catch)


def test_error_event_codes_map_to_statuses():
    from rltserve.client_errors import status_of

    assert [status_of(c) for c in (400, "503", 599, 600, 399, "x", None)] == [
        400, 503, 599, 500, 500, 500, 500,
    ]  # fmt: skip


def test_errors_by_status_have_the_openai_sdks_classes():
    from rltserve import client_errors as ce

    cases = {
        400: ce.BadRequestError, 401: ce.AuthenticationError, 403: ce.PermissionDeniedError,
        404: ce.NotFoundError, 409: ce.ConflictError, 413: ce.RequestTooLargeError,
        415: ce.UnsupportedMediaTypeError, 422: ce.UnprocessableEntityError,
        429: ce.RateLimitError, 418: ce.APIStatusError, 500: ce.InternalServerError,
        502: ce.InternalServerError, 503: ce.ServiceUnavailableError,
    }  # fmt: skip
    for status, cls in cases.items():
        error = ce.error_from(status, {"error": {"message": "m", "param": "p"}})
        assert type(error) is cls, status
        assert isinstance(error, ce.APIStatusError) and isinstance(error, ce.APIError)
        assert (error.status_code, error.message, error.param) == (status, "m", "p")
    assert not issubclass(ce.APIConnectionError, ce.APIStatusError)  # (no response at all)


async def test_a_closed_client_takes_no_more_requests():
    async with echo_server() as (url, _):
        client = AsyncClient(url)
        assert (await client.complete("hi"))["body"]["prompt"] == "hi"
        await client.close()
        with pytest.raises(RuntimeError, match="AsyncClient: closed; make a new client"):
            await client.complete("hi")
        async with AsyncClient(url) as used:
            assert (await used.complete("hi"))["body"]["prompt"] == "hi"
        with pytest.raises(RuntimeError, match="closed"):
            await used.health()


async def test_default_headers_go_with_every_request():
    """The SDK's ``default_headers``: on every request (under a call's extra_headers)."""
    headers = {"X-Request-Id": "every", "Authorization": "Bearer d"}
    async with echo_server() as (url, _), AsyncClient(url, default_headers=headers) as client:
        sent = await client.complete([5])
        assert (sent["request_id"], sent["authorization"]) == ("every", "Bearer d")
        sent = await client.complete([5], extra_headers={"X-Request-Id": "mine"})
        assert sent["request_id"] == "mine"
