"""AsyncClient: an asyncio client for ``rltserve serve`` (and other OpenAI-compatible servers).

Responses are the server's JSON objects as dicts; error responses raise typed ``APIError``s.
Streams are async iterators of chunk dicts; leaving a stream early (``break``, an exception, or
closing its ``async with``) closes the connection, which makes the server abort the request.
Failed calls are retried as the OpenAI SDK retries them (``max_retries``). A client may serve
one ``asyncio.run()`` after another (a module-level client in a script or notebook): each new
event loop gets a fresh connection pool.

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
import math
import numbers
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

import aiohttp
import orjson
from aiohttp.http_exceptions import HttpProcessingError

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
from rltserve.client_retry import DEFAULT_MAX_RETRIES
from rltserve.client_sse import MAX_EVENT_BYTES, SSEDecoder, iter_sse

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


class ChunkStream:
    """An open streaming response. Iterate it for chunk dicts; use ``async with`` (or let the
    iteration finish) to release the connection."""

    def __init__(self, client: AsyncClient, path: str, body: dict) -> None:
        self._client = client
        self._path = path
        self._body = body
        self._response: aiohttp.ClientResponse | None = None
        self._events: AsyncIterator[dict] | None = None
        self._closed = False

    async def __aenter__(self) -> ChunkStream:
        # Retried only while opening: once a chunk is out, the caller has seen tokens.
        client = self._client
        self._response = await client._with_retries(lambda: client._post(self._path, self._body))
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
                None, f"stream stalled: nothing for {self._client.timeout} s"
            ) from exc
        except (aiohttp.ClientError, APIConnectionError) as exc:
            if self._client._closed or self._closed:  # (the break is this side's doing)
                closer = "client" if self._client._closed else "stream"
                raise APIConnectionError(None, f"the {closer} was closed while reading") from exc
            if isinstance(exc, APIConnectionError):
                raise
            raise APIConnectionError(None, f"stream broke: {_broken(exc, 'mid-stream')}") from exc
        finally:
            if owned:
                await self.close()


def _broken(exc: aiohttp.ClientError, where: str) -> str:
    """A broken connection in words. aiohttp tells a body cut short as its parser's error, whose
    text opens with "400" (the status aiohttp's server would answer): no status the server
    sent, so the parser's message is kept without it."""
    cause = exc.__cause__
    if not (isinstance(exc, aiohttp.ClientPayloadError) and isinstance(cause, HttpProcessingError)):
        return str(exc)
    detail = f"{type(cause).__name__}: {cause.message}"
    if str(exc).startswith("Response payload is not completed"):  # (the connection ended)
        return f"the server closed the connection {where} ({detail})"
    return f"the response body is malformed ({detail})"


def server_root(url: str) -> str:
    """The server's base URL for ``AsyncClient``: a URL ending in ``/v1``, as OpenAI clients
    take it, names the same server."""
    return url.rstrip("/").removesuffix("/v1")


class AsyncClient:
    """Client of one server. ``base_url`` is e.g. ``http://127.0.0.1:8000``; one ending in
    ``/v1``, as the OpenAI SDK takes it, names the same server. Extra keyword arguments of the
    request methods go into the JSON body as they are (None values are left out; a NaN or
    infinite number is a ValueError). ``timeout`` is the longest wait for the server to
    connect or to send anything (None: no limit; it applies to a ``session`` passed in too);
    ``max_connections=0`` means unlimited (it sizes the client's own session only); a streamed
    event larger than ``max_event_bytes`` ends the stream with ``APIConnectionError``. Closing
    the client closes its open streams (their readers get ``APIConnectionError``); a closed
    client takes no more requests (RuntimeError, as the OpenAI SDK's client refuses them).

    A call that fails is retried up to ``max_retries`` times (0: never), by the OpenAI SDK's
    rules: connection failures and timeouts, 408, 409, 429 and 5xx (the server's 503s while
    loading, at capacity, restarting or shutting down), after the server's ``Retry-After`` (or
    ``retry-after-ms``) when it asks for more than 0 and at most 120 s, else after 0.5 s
    doubling up to 8 s, less up to 25 % jitter; a longer Retry-After is not retried. Any other
    error is raised at once. A stream is retried only while it opens, never once a chunk has
    been yielded. ``timeout`` bounds each attempt, as the SDK's does, not the whole call (bound
    that with ``asyncio.timeout``). ``health`` and ``wait_ready`` (probes) are not retried.

    Each event loop gets the client's own session afresh: a client used under one
    ``asyncio.run()`` after another works (one loop at a time; a loop still running in another
    thread is refused with RuntimeError). A client never closed lets go of its connections
    quietly when garbage-collected; ``close()`` or ``async with`` closes it cleanly."""

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
    ) -> None:
        if timeout is not None and (
            not isinstance(timeout, numbers.Real) or isinstance(timeout, bool) or not timeout > 0
        ):
            raise ValueError(f"timeout={timeout!r}: must be a positive number of seconds or None")
        if not isinstance(max_connections, int) or max_connections < 0:
            raise ValueError(f"max_connections={max_connections!r}: must be an int >= 0")
        if not isinstance(max_retries, int) or isinstance(max_retries, bool) or max_retries < 0:
            raise ValueError(f"max_retries={max_retries!r}: must be an int >= 0 (0: no retries)")
        self.base_url = server_root(base_url)
        self.max_retries = max_retries
        self.max_event_bytes = max_event_bytes
        self.timeout = timeout
        self._streams: weakref.WeakSet[ChunkStream] = weakref.WeakSet()
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._owns_session = session is None
        self._session = session
        # An idle-read limit, not a total: a long stream is fine while tokens keep coming.
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=timeout, sock_read=timeout)
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
            self._session = None

    def __del__(self) -> None:
        # Never closed: let go of the session quietly, as the OpenAI SDK's client does, rather
        # than leave aiohttp to warn "Unclosed client session" at collection or exit.
        if getattr(self, "_owns_session", False) and self._session is not None:
            try:  # noqa: SIM105 - (at exit, the modules it uses may be gone)
                self._release_session()
            except Exception:
                pass

    def _release_session(self) -> None:
        """Closes the own session without awaiting (its loop may have ended or not be running).
        aiohttp has no public synchronous close; the connector's ``_close`` is what its own
        ``__del__`` calls: it closes the pooled connections (on a loop that is closed, it
        marks them closed) and leaves the session closed, so nothing warns later."""
        session, self._session, self._loop = self._session, None, None
        self._streams.clear()  # (their connections close with the connector)
        connector = session.connector if session is not None else None
        if connector is not None and not connector.closed:
            with contextlib.suppress(RuntimeError):  # (a callback on a closed loop: moot)
                connector._close()

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
            if self._session is not None and self._loop is not loop:
                self._refuse_other_thread("make one client per thread")
                self._release_session()  # (an earlier asyncio.run(): its loop has ended)
            if self._session is None:
                connector = aiohttp.TCPConnector(limit=self._max_connections)
                self._session = aiohttp.ClientSession(connector=connector, timeout=self._timeout)
                self._loop = loop
        assert self._session is not None
        return self._session

    # ------------------------------------------------------------------ transport

    async def _request(self, method: str, path: str, body: dict | None = None):
        data = None
        if body is not None:
            if (where := _non_finite(body)) is not None:  # (orjson would send null)
                raise ValueError(f"{where}: must be a finite number")
            try:  # (NumPy arrays and numbers as JSON)
                data = orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)
            except TypeError as exc:
                raise ValueError(f"request body: cannot be sent as JSON: {exc}") from None
        headers = dict(self._headers)
        if data is not None:
            headers["Content-Type"] = "application/json"
        try:
            response = await self.session.request(
                method, self.base_url + path, data=data, headers=headers, timeout=self._timeout
            )
        except asyncio.TimeoutError as exc:
            raise APITimeoutError(None, f"{self.base_url}: no answer in {self.timeout} s") from exc
        except aiohttp.ClientError as exc:
            if self._closed:  # (close() dropped the connection: not the server's doing)
                raise APIConnectionError(None, "the client was closed during the call") from exc
            raise APIConnectionError(None, f"cannot reach {self.base_url}: {exc}") from exc
        if response.status >= 400:
            raw = await self._read(response)
            try:
                parsed: object = orjson.loads(raw)
            except orjson.JSONDecodeError:
                parsed = raw.decode(errors="replace")
            raise error_from(response.status, parsed, retry_after_of(response.headers))
        return response

    async def _post(self, path: str, body: dict) -> aiohttp.ClientResponse:
        return await self._request("POST", path, body)

    async def _read(self, response: aiohttp.ClientResponse) -> bytes:
        try:
            async with response:
                return await response.read()
        except asyncio.TimeoutError as exc:
            raise APITimeoutError(None, f"the response stalled for {self.timeout} s") from exc
        except aiohttp.ClientError as exc:
            if self._closed:
                raise APIConnectionError(None, "the client was closed during the call") from exc
            raise APIConnectionError(
                None, f"the response broke off: {_broken(exc, 'mid-response')}"
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

    async def _fetch(self, method: str, path: str, body: dict | None = None) -> bytes:
        """One whole response body, retried as a unit (a body that breaks off is too)."""

        async def attempt() -> bytes:
            return await self._read(await self._request(method, path, body))

        return await self._with_retries(attempt)

    async def _json(self, method: str, path: str, body: dict | None = None) -> Any:
        raw = await self._fetch(method, path, body)
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise APIConnectionError(None, f"the server sent invalid JSON: {exc}") from exc

    # ------------------------------------------------------------------ API

    async def complete(self, prompt: str | Sequence[int] | Sequence, **params: Any) -> dict:
        """POST /v1/completions; returns the completion object."""
        _check_stream(params, False, "complete", "stream")
        return await self._json("POST", "/v1/completions", _body(prompt=prompt, **params))

    def stream(self, prompt: str | Sequence[int] | Sequence, **params: Any) -> ChunkStream:
        """Streaming /v1/completions: ``async for chunk in client.stream("Hi")``."""
        _check_stream(params, True, "stream", "complete")
        return ChunkStream(self, "/v1/completions", _body(prompt=prompt, stream=True, **params))

    async def chat(self, messages: Sequence[dict], **params: Any) -> dict:
        """POST /v1/chat/completions; returns the chat.completion object."""
        _check_stream(params, False, "chat", "chat_stream")
        return await self._json("POST", "/v1/chat/completions", _body(messages=messages, **params))

    def chat_stream(self, messages: Sequence[dict], **params: Any) -> ChunkStream:
        """Streaming chat: chunks whose choices carry ``delta``s (the role first)."""
        _check_stream(params, True, "chat_stream", "chat")
        body = _body(messages=messages, stream=True, **params)
        return ChunkStream(self, "/v1/chat/completions", body)

    async def models(self) -> list[dict]:
        return (await self._json("GET", "/v1/models"))["data"]

    async def health(self) -> bool:
        """True when the server is up and its engine ready (False while loading or down); the
        status decides (vLLM and SGLang answer 200 with an empty body)."""
        try:
            await self._read(await self._request("GET", "/health"))
        except (ServiceUnavailableError, APIConnectionError):
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
        body = _body(prompt=prompt, messages=messages, **params)
        return (await self._json("POST", "/tokenize", body))["tokens"]

    async def detokenize(self, tokens: Sequence[int]) -> str:
        return (await self._json("POST", "/detokenize", {"tokens": list(tokens)}))["prompt"]

    async def version(self) -> str:
        return (await self._json("GET", "/version"))["version"]

    async def metrics(self) -> str:
        return (await self._fetch("GET", "/metrics")).decode()


def _check_stream(params: dict, streams: bool, method: str, other: str) -> None:
    if "stream" in params and bool(params["stream"]) is not streams:
        raise ValueError(f"stream={params['stream']!r}: {method}() does not; use {other}()")
    params.pop("stream", None)


def _non_finite(value: object, where: str = "") -> str | None:
    """Where in a request body a NaN or infinite number is (JSON has none), or None."""
    if isinstance(value, dict):
        paths = ((f"{where}.{k}" if where else str(k), v) for k, v in value.items())
        return next((w for path, v in paths if (w := _non_finite(v, path))), None)
    if type(value).__name__ == "ndarray":  # (NumPy's, sent as lists: OPT_SERIALIZE_NUMPY)
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        return next(
            (w for i, v in enumerate(value) if (w := _non_finite(v, f"{where}[{i}]"))), None
        )
    if isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral):
        return None if math.isfinite(value) else f"{where}={value!r}"
    return None


def _body(**fields: Any) -> dict:
    body = {k: list(v) if isinstance(v, tuple) else v for k, v in fields.items() if v is not None}
    bias = body.get("logit_bias")
    if isinstance(bias, dict):  # token ids as keys, as Python holds them: OpenAI's strings
        body["logit_bias"] = {
            str(int(k)) if isinstance(k, numbers.Integral) else k: v for k, v in bias.items()
        }
    return body
