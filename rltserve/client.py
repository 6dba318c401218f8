"""AsyncClient: an asyncio client for ``rltserve serve`` (and other OpenAI-compatible servers).

Responses are the server's JSON objects as dicts; error responses raise typed ``APIError``s.
Streams are async iterators of chunk dicts; leaving a stream early (``break``, an exception, or
closing its ``async with``) closes the connection, which makes the server abort the request.
Failed calls are retried as the OpenAI SDK retries them (``max_retries``). A client may serve
one ``asyncio.run()`` after another (a module-level client in a script or notebook): each new
event loop gets a fresh connection pool, closed as ``asyncio.run()`` ends that loop.

Embedding it in an aiohttp app (one client per app, closed with the app)::

    from aiohttp import web
    from rltserve.client import AsyncClient

    LLM_CLIENT = web.AppKey("llm_client", AsyncClient)

    async def llm_client(app: web.Application):
        async with AsyncClient("http://127.0.0.1:8000", api_key="secret") as client:
            await client.wait_ready()
            app[LLM_CLIENT] = client
            yield

    async def answer(request: web.Request) -> web.StreamResponse:
        client = request.app[LLM_CLIENT]
        response = web.StreamResponse()
        await response.prepare(request)
        async with client.chat_stream(
            [{"role": "user", "content": request.query["q"]}], max_tokens=64, temperature=0
        ) as chunks:
            async for chunk in chunks:
                for choice in chunk["choices"]:
                    await response.write(choice["delta"].get("content", "").encode())
        return response

    app = web.Application()
    app.cleanup_ctx.append(llm_client)
    app.router.add_get("/answer", answer)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

import aiohttp
import orjson

from rltserve import client_retry
from rltserve.client_errors import (
    APIConnectionError,
    APIError,
    APIStatusError,
    APITimeoutError,
    AuthenticationError,
    BadRequestError,
    ConflictError,
    InternalServerError,
    NotFoundError,
    PermissionDeniedError,
    RateLimitError,
    RequestTooLargeError,
    ServiceUnavailableError,
    UnprocessableEntityError,
    UnsupportedMediaTypeError,
    error_from,
    retry_after_of,
)
from rltserve.client_pool import open_session
from rltserve.client_request import (
    RequestOptions,
    check_stream,
    check_timeout,
    check_url,
    non_finite,
    request_of,
    server_root,
)
from rltserve.client_retry import DEFAULT_MAX_RETRIES
from rltserve.client_sse import MAX_EVENT_BYTES, SSEDecoder, broken, iter_sse

__all__ = [
    "APIConnectionError",
    "APIError",
    "APIStatusError",
    "APITimeoutError",
    "AsyncClient",
    "AuthenticationError",
    "BadRequestError",
    "ChunkStream",
    "ConflictError",
    "InternalServerError",
    "NotFoundError",
    "PermissionDeniedError",
    "RateLimitError",
    "RequestTooLargeError",
    "SSEDecoder",
    "ServiceUnavailableError",
    "UnprocessableEntityError",
    "UnsupportedMediaTypeError",
]


_log = logging.getLogger(__name__)
_T = TypeVar("_T")
_Body = dict | None  # a request's JSON body, and its options (None: the client's)
_Opts = RequestOptions | None
# A gateway's answers on /health while the server behind it (re)starts: not ready yet.
_NOT_READY_STATUSES = (502, 503, 504)


class ChunkStream:
    """An open streaming response. Iterate it for chunk dicts; use ``async with`` (or let the
    iteration finish) to release the connection."""

    def __init__(self, client: AsyncClient, path: str, body: dict, options: RequestOptions) -> None:
        self._client = client
        self._path = path
        self._body = body
        self._options = options
        self._response: aiohttp.ClientResponse | None = None
        self._events: AsyncIterator[dict] | None = None
        self._closed = False

    async def __aenter__(self) -> ChunkStream:
        # Retried only while opening: once a chunk is out, the caller has seen tokens.
        client = self._client
        self._response = await client._with_retries(
            lambda: client._request("POST", self._path, self._body, self._options)
        )
        self._events = iter_sse(self._response, self._client.max_event_bytes)
        self._client._streams.add(self)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        self._closed = True
        self._client._streams.discard(self)
        if self._response is not None:
            self._response.close()  # drops the connection: the server aborts the request

    def __aiter__(self) -> AsyncIterator[dict]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[dict]:
        owned = self._response is None
        if owned:
            await self.__aenter__()
        assert self._events is not None
        try:
            async for chunk in self._events:
                yield chunk
        except asyncio.TimeoutError as exc:  # (aiohttp's read timeout is one)
            raise APITimeoutError(
                None, f"stream stalled: nothing for {self._options.timeout} s"
            ) from exc
        except (aiohttp.ClientError, APIConnectionError) as exc:
            if self._client._closed or self._closed:  # (the break is this side's doing)
                closer = "client" if self._client._closed else "stream"
                raise APIConnectionError(None, f"the {closer} was closed while reading") from exc
            if isinstance(exc, APIConnectionError):
                raise
            raise APIConnectionError(None, f"stream broke: {broken(exc, 'mid-stream')}") from exc
        finally:
            if owned:
                await self.close()


class AsyncClient:
    """Client of one server. ``base_url`` is e.g. ``http://127.0.0.1:8000`` (an http(s) URL
    with a host, else ValueError); one ending in ``/v1``, as the OpenAI SDK takes it, names the
    same server. Extra keyword arguments of the request methods go into the JSON body as they
    are (None values are left out; a NaN or infinite number is a ValueError), except the OpenAI
    SDK's per-request ones: ``extra_body`` (a dict merged into the body, over the other
    fields), ``extra_headers`` (sent over the client's; e.g. ``X-Request-Id``),
    ``extra_query`` (query parameters) and ``timeout`` (this call's, over the client's);
    ``default_headers`` go with every request, probes included (the SDK's).
    ``timeout`` is the longest wait for the server to connect or to send anything (None: no
    limit; it applies to a ``session`` passed in too, whose ``raise_for_status`` the client
    overrides: it maps statuses itself); ``max_connections=0`` means unlimited (it sizes the
    client's own session only); a streamed event larger than ``max_event_bytes`` (an int >= 1)
    ends the stream with ``APIConnectionError``. Closing
    the client closes its open streams (their readers get ``APIConnectionError``); a closed
    client takes no more requests (RuntimeError, as the OpenAI SDK's client refuses them).

    A call that fails is retried up to ``max_retries`` times (0: never), by the OpenAI SDK's
    rules: connection failures and timeouts, 408, 409, 429 and 5xx (the server's 503s while
    loading, at capacity, restarting or shutting down), after the server's ``Retry-After`` (or
    ``retry-after-ms``) when it asks for more than 0 and at most 120 s, else after 0.5 s
    doubling up to 8 s, less up to 25 % jitter; a longer Retry-After is not retried. Any other
    error is raised at once. The default 2 retries after rltserve's ``Retry-After: 1`` wait out
    about 2 s of 503s: a moment at capacity, not a model still loading or a stage restarting
    (seconds or minutes): ``await wait_ready()`` after starting a server, and raise
    ``max_retries`` to ride out restarts. A stream is retried only while it opens, never once a
    chunk has been yielded. ``timeout`` bounds each attempt, as the SDK's does, not the whole
    call (bound that with ``asyncio.timeout``; on 3.10 ``asyncio.wait_for``). ``health`` and
    ``wait_ready`` (probes) are not retried.

    Each event loop gets the client's own session afresh: a client used under one
    ``asyncio.run()`` after another works (one loop at a time; a loop still running in another
    thread is refused with RuntimeError); the connections opened under one ``asyncio.run()``
    close as it ends (a loop closed otherwise leaves them to the collector). A client never
    closed lets go of its connections quietly when garbage-collected; ``close()`` or
    ``async with`` closes it cleanly."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        *,
        timeout: float | None = 600.0,
        max_connections: int = 100,
        session: aiohttp.ClientSession | None = None,
        max_event_bytes: int = MAX_EVENT_BYTES,
        max_retries: int = DEFAULT_MAX_RETRIES,
        default_headers: Mapping[str, str] | None = None,
    ) -> None:
        check_url(base_url, "base_url")  # (not at the first call, after its retries)
        check_timeout(timeout)
        if not isinstance(max_connections, int) or max_connections < 0:
            raise ValueError(f"max_connections={max_connections!r}: must be an int >= 0")
        if not isinstance(max_retries, int) or isinstance(max_retries, bool) or max_retries < 0:
            raise ValueError(f"max_retries={max_retries!r}: must be an int >= 0 (0: no retries)")
        if (
            not isinstance(max_event_bytes, int)
            or isinstance(max_event_bytes, bool)
            or max_event_bytes < 1
        ):
            raise ValueError(f"max_event_bytes={max_event_bytes!r}: must be an int >= 1")
        self.base_url = server_root(base_url)
        self.max_retries = max_retries
        self.max_event_bytes = max_event_bytes
        self.timeout = timeout
        self._streams: weakref.WeakSet[ChunkStream] = weakref.WeakSet()
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._headers.update(default_headers or {})  # (the SDK's: on every request)
        self._owns_session = session is None
        self._session = session
        self._let_go: weakref.finalize | None = None  # closes the own session's connector
        self._closer: AsyncGenerator[None] | None = None  # closes it as asyncio.run() ends
        self._lock = threading.Lock()  # (two threads' first calls would both make a session)
        self._max_connections = max_connections
        self._loop: asyncio.AbstractEventLoop | None = None  # the one the own session runs on
        self._closed = False

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._owns_session and self._loop is not asyncio.get_running_loop():
            self._refuse_other_thread("close it there")
            self._closed = True
            self._release_session()  # (made on a loop that has ended: nothing to await here)
            return
        self._closed = True
        for stream in list(self._streams):  # (a reader would otherwise wait forever)
            await stream.close()
        if self._owns_session and self._session is not None:
            await self._session.close()
            if self._closer is not None:  # (its work done: the loop forgets it)
                await self._closer.aclose()
            self._release_session()

    def _release_session(self) -> None:
        """Closes the own session without awaiting (its loop may have ended or not be
        running), as ``_let_go`` would when the client is collected."""
        if self._let_go is not None:  # (first: a session dropped while open would warn)
            self._let_go()
            self._let_go = None
        self._session, self._loop, self._closer = None, None, None
        self._streams.clear()  # (their connections close with the connector)

    def _refuse_other_thread(self, advice: str) -> None:
        """Its session's loop runs in another thread: its connections are that thread's."""
        if self._loop is not None and self._loop.is_running():
            raise RuntimeError(
                f"AsyncClient: in use on an event loop running in another thread; {advice}"
            )

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._closed:  # (a fresh session here would never be closed)
            raise RuntimeError("AsyncClient: closed; make a new client to send more requests")
        if self._owns_session:
            loop = asyncio.get_running_loop()
            with self._lock:
                if self._session is not None and self._loop is not loop:
                    self._refuse_other_thread("make one client per thread")
                    self._release_session()  # (an earlier asyncio.run(): its loop has ended)
                elif self._session is not None and self._session.closed:
                    self._release_session()  # (its loop shut down its async generators)
                if self._session is None:
                    self._open_session(loop)
        assert self._session is not None
        return self._session

    def _open_session(self, loop: asyncio.AbstractEventLoop) -> None:
        self._session, self._let_go, self._closer = open_session(self, self._max_connections)
        self._loop = loop

    # ------------------------------------------------------------------ transport

    async def _request(
        self, method: str, path: str, body: _Body = None, options: _Opts = None
    ) -> aiohttp.ClientResponse:
        options = options or RequestOptions(self.timeout)
        data = None
        if body is not None:
            if (where := non_finite(body)) is not None:  # (orjson would send null)
                raise ValueError(f"{where}: must be a finite number")
            try:  # (NumPy arrays and numbers as JSON)
                data = orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)
            except TypeError as exc:
                raise ValueError(f"request body: cannot be sent as JSON: {exc}") from None
        headers = dict(self._headers)
        if data is not None:
            headers["Content-Type"] = "application/json"
        headers.update(options.headers)
        seconds = options.timeout
        try:
            response = await self.session.request(
                method,
                self.base_url + path,
                params=options.query or None,
                data=data,
                headers={k: v for k, v in headers.items() if v is not None},
                # An idle-read limit, not a total: a long stream is fine while tokens come.
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=seconds, sock_read=seconds),
                raise_for_status=False,  # (a caller's session may say True: statuses are ours)
            )
        except asyncio.TimeoutError as exc:
            raise APITimeoutError(None, f"{self.base_url}: no answer in {seconds} s") from exc
        except aiohttp.ClientError as exc:
            if self._closed:  # (close() dropped the connection: not the server's doing)
                raise APIConnectionError(None, "the client was closed during the call") from exc
            raise APIConnectionError(None, f"cannot reach {self.base_url}: {exc}") from exc
        if response.status >= 400:
            raw = await self._read(response, seconds)
            try:
                parsed: object = orjson.loads(raw)
            except orjson.JSONDecodeError:
                parsed = raw.decode(errors="replace")
            retry_after = retry_after_of(response.headers)
            request_id = response.headers.get("X-Request-Id")
            raise error_from(response.status, parsed, retry_after, request_id)
        return response

    async def _read(self, response: aiohttp.ClientResponse, seconds: float | None) -> bytes:
        try:
            async with response:
                return await response.read()
        except asyncio.TimeoutError as exc:
            raise APITimeoutError(None, f"the response stalled for {seconds} s") from exc
        except aiohttp.ClientError as exc:
            if self._closed:
                raise APIConnectionError(None, "the client was closed during the call") from exc
            raise APIConnectionError(
                None, f"the response broke off: {broken(exc, 'mid-response')}"
            ) from exc

    async def _with_retries(self, attempt: Callable[[], Awaitable[_T]]) -> _T:
        """``attempt()``, again after each failure ``client_retry.retryable`` allows,
        ``max_retries`` at most."""
        retries_taken = 0
        while True:
            try:
                return await attempt()
            except APIError as error:
                if (
                    retries_taken >= self.max_retries
                    or self._closed
                    or not client_retry.retryable(error)
                ):
                    raise
                delay = client_retry.retry_delay(error, retries_taken)
                _log.info(
                    "retrying in %.2f s (retry %d of %d): %s",
                    delay, retries_taken + 1, self.max_retries, error,
                )  # fmt: skip
                await asyncio.sleep(delay)
                if self._closed:
                    raise APIConnectionError(
                        None, "the client was closed during the call"
                    ) from error
            retries_taken += 1

    async def _fetch(
        self, method: str, path: str, body: _Body = None, options: _Opts = None
    ) -> bytes:
        """One whole response body, retried as a unit (a body that breaks off is too)."""
        options = options or RequestOptions(self.timeout)

        async def attempt() -> bytes:
            response = await self._request(method, path, body, options)
            return await self._read(response, options.timeout)

        return await self._with_retries(attempt)

    async def _json(self, method: str, path: str, body: _Body = None, options: _Opts = None) -> Any:
        raw = await self._fetch(method, path, body, options)
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise APIConnectionError(None, f"the server sent invalid JSON: {exc}") from exc

    # ------------------------------------------------------------------ API

    async def complete(self, prompt: str | Sequence[int] | Sequence, **params: Any) -> dict:
        """POST /v1/completions; returns the completion object."""
        body, options = request_of(params, self.timeout, prompt=prompt)
        check_stream(body, False, "complete", "stream")
        return await self._json("POST", "/v1/completions", body, options)

    def stream(self, prompt: str | Sequence[int] | Sequence, **params: Any) -> ChunkStream:
        """Streaming /v1/completions: ``async for chunk in client.stream("Hi")``."""
        body, options = request_of(params, self.timeout, prompt=prompt)
        check_stream(body, True, "stream", "complete")
        return ChunkStream(self, "/v1/completions", {**body, "stream": True}, options)

    async def chat(self, messages: Sequence[dict], **params: Any) -> dict:
        """POST /v1/chat/completions; returns the chat.completion object."""
        body, options = request_of(params, self.timeout, messages=messages)
        check_stream(body, False, "chat", "chat_stream")
        return await self._json("POST", "/v1/chat/completions", body, options)

    def chat_stream(self, messages: Sequence[dict], **params: Any) -> ChunkStream:
        """Streaming chat: chunks whose choices carry ``delta``s (the role first)."""
        body, options = request_of(params, self.timeout, messages=messages)
        check_stream(body, True, "chat_stream", "chat")
        return ChunkStream(self, "/v1/chat/completions", {**body, "stream": True}, options)

    async def models(self) -> list[dict]:
        return (await self._json("GET", "/v1/models"))["data"]

    async def health(self) -> bool:
        """True when the server is up and its engine ready (False while loading or down, or
        while a gateway before it answers 502 or 504); the status decides (vLLM and SGLang
        answer 200 with an empty body)."""
        try:
            await self._read(await self._request("GET", "/health"), self.timeout)
        except InternalServerError as exc:
            if exc.status in _NOT_READY_STATUSES:
                return False
            raise
        except APIConnectionError:
            return False
        return True

    async def wait_ready(self, timeout: float = 300.0, interval: float = 0.1) -> None:
        """Polls ``/health`` until it says ready; ``APIConnectionError`` after ``timeout``
        seconds (a probe the server leaves unanswered counts against it)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left > 0:
                with contextlib.suppress(asyncio.TimeoutError):
                    if await asyncio.wait_for(self.health(), left):
                        return
            if time.monotonic() >= deadline:
                raise APIConnectionError(None, f"{self.base_url} not ready after {timeout} s")
            await asyncio.sleep(min(interval, max(0.0, deadline - time.monotonic())))

    async def tokenize(
        self, prompt: str | None = None, *, messages: Sequence[dict] | None = None, **params: Any
    ) -> list[int]:
        body, options = request_of(params, self.timeout, prompt=prompt, messages=messages)
        return (await self._json("POST", "/tokenize", body, options))["tokens"]

    async def detokenize(self, tokens: Sequence[int]) -> str:
        return (await self._json("POST", "/detokenize", {"tokens": list(tokens)}))["prompt"]

    async def version(self) -> str:
        return (await self._json("GET", "/version"))["version"]

    async def metrics(self) -> str:
        return (await self._fetch("GET", "/metrics")).decode()
