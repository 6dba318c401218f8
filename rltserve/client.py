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
import numbers
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import aiohttp
import orjson

__all__ = [
    "APIConnectionError",
    "APIError",
    "AsyncClient",
    "AuthenticationError",
    "BadRequestError",
    "ChunkStream",
    "InternalServerError",
    "NotFoundError",
    "RateLimitError",
    "RequestTooLargeError",
    "SSEDecoder",
    "ServiceUnavailableError",
    "UnsupportedMediaTypeError",
]


class APIError(Exception):
    """An error response (or an error event inside a stream)."""

    status: int | None = None

    def __init__(
        self,
        status: int | None,
        message: str,
        type: str | None = None,  # noqa: A002 - the OpenAI field name
        param: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(f"{status}: {message}" if status is not None else message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.retry_after = retry_after


class BadRequestError(APIError):
    """400: the request was invalid; ``param`` names the field."""


class AuthenticationError(APIError):
    """401: missing or wrong API key."""


class NotFoundError(APIError):
    """404: unknown model or route."""


class RequestTooLargeError(APIError):
    """413: the request body exceeds the server's limit."""


class UnsupportedMediaTypeError(APIError):
    """415: the body was not sent as JSON."""


class RateLimitError(APIError):
    """429: too many requests."""


class InternalServerError(APIError):
    """500: the server failed."""


class ServiceUnavailableError(APIError):
    """503: loading, overloaded or shutting down; ``retry_after`` is the server's hint."""


class APIConnectionError(APIError):
    """The server could not be reached, or the connection broke mid-response."""


_ERRORS: dict[int, type[APIError]] = {
    400: BadRequestError,
    401: AuthenticationError,
    404: NotFoundError,
    413: RequestTooLargeError,
    415: UnsupportedMediaTypeError,
    429: RateLimitError,
    500: InternalServerError,
    503: ServiceUnavailableError,
}


def error_from(status: int, body: object, retry_after: str | None = None) -> APIError:
    """The typed error for an error response body (OpenAI or llama.cpp shape)."""
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict):
        error = {"message": str(body) if body else f"HTTP {status}"}
    cls = _ERRORS.get(status, APIError)
    try:
        retry = float(retry_after) if retry_after is not None else None
    except ValueError:
        retry = None
    return cls(status, str(error.get("message")), error.get("type"), error.get("param"), retry)


MAX_EVENT_BYTES = 16 * 2**20  # an SSE event (or line) larger than this is a broken stream


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

    def feed(self, chunk: bytes) -> list[bytes]:
        """The payloads of the events that ``chunk`` completes (possibly none)."""
        events: list[bytes] = []
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
            if isinstance(obj, dict) and "error" in obj and "choices" not in obj:
                code = obj["error"].get("code") if isinstance(obj["error"], dict) else None
                raise error_from(code if isinstance(code, int) else 500, obj)
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
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
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
        except aiohttp.ClientError as exc:
            raise APIConnectionError(None, f"stream broke: {exc}") from exc
        finally:
            if owned:
                await self.close()


class AsyncClient:
    """Client of one server. ``base_url`` is e.g. ``http://127.0.0.1:8000`` (no ``/v1``).
    Extra keyword arguments of the request methods go into the JSON body as they are (None
    values are left out). ``timeout`` is the longest wait for the server to connect or to send
    anything (None: no limit); ``max_connections=0`` means unlimited; a streamed event larger
    than ``max_event_bytes`` ends the stream with ``APIConnectionError``."""

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
        self.base_url = base_url.rstrip("/")
        self.max_event_bytes = max_event_bytes
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._owns_session = session is None
        self._session = session
        # An idle-read limit, not a total: a long stream is fine while tokens keep coming.
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=timeout, sock_read=timeout)
        self._max_connections = max_connections

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._owns_session and self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=self._max_connections)
            self._session = aiohttp.ClientSession(connector=connector, timeout=self._timeout)
        return self._session

    # ------------------------------------------------------------------ transport

    async def _request(self, method: str, path: str, body: dict | None = None):
        data = None
        if body is not None:
            try:  # (NumPy arrays and numbers as JSON)
                data = orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)
            except TypeError as exc:
                raise ValueError(f"request body: cannot be sent as JSON: {exc}") from None
        headers = dict(self._headers)
        if data is not None:
            headers["Content-Type"] = "application/json"
        try:
            response = await self.session.request(
                method, self.base_url + path, data=data, headers=headers
            )
        except aiohttp.ClientError as exc:
            raise APIConnectionError(None, f"cannot reach {self.base_url}: {exc}") from exc
        if response.status >= 400:
            async with response:
                raw = await response.read()
            try:
                parsed: object = orjson.loads(raw)
            except orjson.JSONDecodeError:
                parsed = raw.decode(errors="replace")
            raise error_from(response.status, parsed, response.headers.get("Retry-After"))
        return response

    async def _post(self, path: str, body: dict) -> aiohttp.ClientResponse:
        return await self._request("POST", path, body)

    async def _json(self, method: str, path: str, body: dict | None = None) -> Any:
        response = await self._request(method, path, body)
        try:
            async with response:
                raw = await response.read()
        except aiohttp.ClientError as exc:
            raise APIConnectionError(None, f"the response broke off: {exc}") from exc
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise APIConnectionError(None, f"the server sent invalid JSON: {exc}") from exc

    # ------------------------------------------------------------------ API

    async def complete(self, prompt: str | Sequence[int] | Sequence, **params: Any) -> dict:
        """POST /v1/completions; returns the completion object."""
        return await self._json("POST", "/v1/completions", _body(prompt=prompt, **params))

    def stream(self, prompt: str | Sequence[int] | Sequence, **params: Any) -> ChunkStream:
        """Streaming /v1/completions: ``async for chunk in client.stream("Hi")``."""
        return ChunkStream(self, "/v1/completions", _body(prompt=prompt, stream=True, **params))

    async def chat(self, messages: Sequence[dict], **params: Any) -> dict:
        """POST /v1/chat/completions; returns the chat.completion object."""
        return await self._json("POST", "/v1/chat/completions", _body(messages=messages, **params))

    def chat_stream(self, messages: Sequence[dict], **params: Any) -> ChunkStream:
        """Streaming chat: chunks whose choices carry ``delta``s (the role first)."""
        body = _body(messages=messages, stream=True, **params)
        return ChunkStream(self, "/v1/chat/completions", body)

    async def models(self) -> list[dict]:
        return (await self._json("GET", "/v1/models"))["data"]

    async def health(self) -> bool:
        """True when the server is up and its engine ready (False while loading or down)."""
        try:
            await self._json("GET", "/health")
        except (ServiceUnavailableError, APIConnectionError):
            return False
        return True

    async def wait_ready(self, timeout: float = 300.0, interval: float = 0.1) -> None:
        deadline = time.monotonic() + timeout
        while not await self.health():
            if time.monotonic() > deadline:
                raise APIConnectionError(None, f"{self.base_url} not ready after {timeout} s")
            await asyncio.sleep(interval)

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
        response = await self._request("GET", "/metrics")
        async with response:
            return await response.text()


def _body(**fields: Any) -> dict:
    body = {k: list(v) if isinstance(v, tuple) else v for k, v in fields.items() if v is not None}
    bias = body.get("logit_bias")
    if isinstance(bias, dict):  # token ids as keys, as Python holds them: OpenAI's strings
        body["logit_bias"] = {
            str(int(k)) if isinstance(k, numbers.Integral) else k: v for k, v in bias.items()
        }
    return body
