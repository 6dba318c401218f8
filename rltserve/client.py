"""AsyncClient: an asyncio client for ``rltserve serve`` (and other OpenAI-compatible servers).

Responses are the server's JSON objects as dicts; error responses raise typed ``APIError``s.
Streams are async iterators of chunk dicts; leaving a stream early (``break``, an exception, or
closing its ``async with``) closes the connection, which makes the server abort the request.

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
import math
import numbers
import time
import weakref
from collections.abc import AsyncIterator, Sequence
from typing import Any

import aiohttp
import orjson

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
    status_of,
)

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


MAX_EVENT_BYTES = 16 * 2**20  # an SSE event (or line) larger than this is a broken stream
_BOM = b"\xef\xbb\xbf"


class SSEDecoder:
    """Incremental server-sent-events parser: bytes in, the ``data`` of each complete event out.

    Lines end in ``\r\n``, ``\n`` or ``\r`` (all three are valid SSE; sse-starlette frames
    with ``\r\n``). A ``\r`` at the end of a chunk may be the first half of a ``\r\n`` split
    across reads, so it is held until the next byte arrives. Comments, ``event:``, ``id:`` and
    ``retry:`` lines are skipped; several ``data:`` lines join with ``\n``. The bytes held for
    one event (its data plus its unfinished line) never exceed ``max_event_bytes``.
    """

    def __init__(self, max_event_bytes: int = MAX_EVENT_BYTES) -> None:
        self.max_event_bytes = max_event_bytes
        self._line = bytearray()  # the unfinished line
        self._data: list[bytes] = []  # data lines of the unfinished event
        self._size = 0  # bytes in _data
        self._pending_cr = False  # the last byte seen was a \r ending a line
        self._head = b""  # the stream's first bytes while they may be a byte order mark

    def feed(self, chunk: bytes) -> list[bytes]:
        """The payloads of the events that ``chunk`` completes (possibly none)."""
        events: list[bytes] = []
        if self._head is not None:  # (a UTF-8 byte order mark opening the stream is dropped)
            chunk = self._head + chunk
            if len(chunk) < len(_BOM) and _BOM.startswith(chunk):
                self._head = chunk
                return events
            self._head = None
            chunk = chunk.removeprefix(_BOM)
        if not chunk:
            return events
        start = 0
        if self._pending_cr and chunk[:1] == b"\n":
            start = 1  # the \n of a \r\n split across chunks
        self._pending_cr = False
        end = len(chunk)
        while start < end:
            cr, lf = chunk.find(b"\r", start), chunk.find(b"\n", start)
            stops = [i for i in (cr, lf) if i >= 0]
            if not stops:
                self._extend(chunk[start:])
                break
            stop = min(stops)
            self._extend(chunk[start:stop])
            self._end_line(events)
            if chunk[stop : stop + 1] == b"\r":
                if stop + 1 == end:
                    self._pending_cr = True
                elif chunk[stop + 1 : stop + 2] == b"\n":
                    stop += 1
            start = stop + 1
        return events

    def _extend(self, part: bytes) -> None:
        self._line += part
        if self._size + len(self._line) > self.max_event_bytes:
            raise APIConnectionError(
                None, f"an SSE event exceeds {self.max_event_bytes} bytes; is this an SSE stream?"
            )

    def _end_line(self, events: list[bytes]) -> None:
        line = bytes(self._line)
        self._line.clear()
        if not line:  # a blank line dispatches the event
            if self._data:
                events.append(b"\n".join(self._data))
            self._data, self._size = [], 0
            return
        name, colon, value = line.partition(b":")
        if name == b"data":
            value = value[1:] if value.startswith(b" ") else value
            self._data.append(value if colon else b"")
            self._size += len(value) + 1


async def iter_sse(
    response: aiohttp.ClientResponse, max_event_bytes: int = MAX_EVENT_BYTES
) -> AsyncIterator[dict]:
    """The JSON events of an SSE body, up to ``[DONE]``; an error event raises APIError."""
    decoder = SSEDecoder(max_event_bytes)
    async for data in response.content.iter_any():
        for payload in decoder.feed(data):
            if not payload:
                continue  # an empty data line: nothing to parse
            if payload == b"[DONE]":
                return
            try:
                obj = orjson.loads(payload)
            except orjson.JSONDecodeError as exc:
                raise APIConnectionError(None, f"the stream sent invalid JSON: {exc}") from exc
            if isinstance(obj, dict) and "choices" not in obj:
                if "error" in obj:
                    error = obj["error"]
                    raise error_from(
                        status_of(error.get("code") if isinstance(error, dict) else 0), obj
                    )
                if obj.get("object") == "error":  # (vLLM's top-level ErrorResponse)
                    raise error_from(status_of(obj.get("code")), {"error": obj})
            yield obj
    raise APIConnectionError(None, "the stream ended without [DONE]")


class ChunkStream:
    """An open streaming response. Iterate it for chunk dicts; use ``async with`` (or let the
    iteration finish) to release the connection."""

    def __init__(self, client: AsyncClient, path: str, body: dict) -> None:
        self._client = client
        self._path = path
        self._body = body
        self._response: aiohttp.ClientResponse | None = None
        self._events: AsyncIterator[dict] | None = None

    async def __aenter__(self) -> ChunkStream:
        self._response = await self._client._post(self._path, self._body)
        self._events = iter_sse(self._response, self._client.max_event_bytes)
        self._client._streams.add(self)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
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
        except aiohttp.ClientError as exc:
            raise APIConnectionError(None, f"stream broke: {exc}") from exc
        finally:
            if owned:
                await self.close()


def server_root(url: str) -> str:
    """The server's base URL for ``AsyncClient``: a URL ending in ``/v1``, as OpenAI clients
    take it, names the same server."""
    return url.rstrip("/").removesuffix("/v1")


class AsyncClient:
    """Client of one server. ``base_url`` is e.g. ``http://127.0.0.1:8000`` (no ``/v1``).
    Extra keyword arguments of the request methods go into the JSON body as they are (None
    values are left out; a NaN or infinite number is a ValueError). ``timeout`` is the longest
    wait for the server to connect or to send anything (None: no limit; it applies to a
    ``session`` passed in too); ``max_connections=0`` means unlimited (it sizes the client's
    own session only); a streamed event larger than ``max_event_bytes`` ends the stream with
    ``APIConnectionError``. Closing the client closes its open streams (their readers get
    ``APIConnectionError``); a closed client takes no more requests (RuntimeError, as the
    OpenAI SDK's client refuses them)."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        *,
        timeout: float | None = 600.0,
        max_connections: int = 100,
        session: aiohttp.ClientSession | None = None,
        max_event_bytes: int = MAX_EVENT_BYTES,
    ) -> None:
        if timeout is not None and (
            not isinstance(timeout, numbers.Real) or isinstance(timeout, bool) or not timeout > 0
        ):
            raise ValueError(f"timeout={timeout!r}: must be a positive number of seconds or None")
        if not isinstance(max_connections, int) or max_connections < 0:
            raise ValueError(f"max_connections={max_connections!r}: must be an int >= 0")
        self.base_url = base_url.rstrip("/")
        self.max_event_bytes = max_event_bytes
        self.timeout = timeout
        self._streams: weakref.WeakSet[ChunkStream] = weakref.WeakSet()
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._owns_session = session is None
        self._session = session
        # An idle-read limit, not a total: a long stream is fine while tokens keep coming.
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=timeout, sock_read=timeout)
        self._max_connections = max_connections
        self._closed = False

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        self._closed = True
        for stream in list(self._streams):  # (a reader would otherwise wait forever)
            await stream.close()
        if self._owns_session and self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._closed:  # (a fresh session here would never be closed)
            raise RuntimeError("AsyncClient: closed; make a new client to send more requests")
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=self._max_connections)
            self._session = aiohttp.ClientSession(connector=connector, timeout=self._timeout)
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
            raise APIConnectionError(None, f"cannot reach {self.base_url}: {exc}") from exc
        if response.status >= 400:
            raw = await self._read(response)
            try:
                parsed: object = orjson.loads(raw)
            except orjson.JSONDecodeError:
                parsed = raw.decode(errors="replace")
            raise error_from(response.status, parsed, response.headers.get("Retry-After"))
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
            raise APIConnectionError(None, f"the response broke off: {exc}") from exc

    async def _json(self, method: str, path: str, body: dict | None = None) -> Any:
        raw = await self._read(await self._request(method, path, body))
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
        return (await self._read(await self._request("GET", "/metrics"))).decode()


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
