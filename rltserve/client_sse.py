"""Server-sent events as ``AsyncClient`` reads them: an incremental decoder (bytes in, the
``data`` of each complete event out) and the JSON chunks of a streamed response up to
``[DONE]``, an error event raising its ``APIError``."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aiohttp
import orjson
from aiohttp.http_exceptions import HttpProcessingError

from rltserve.client_errors import APIConnectionError, error_from, status_of

MAX_EVENT_BYTES = 16 * 2**20  # an SSE event (or line) larger than this is a broken stream
# How long a stream waits after [DONE] for its body's end, which lets the connection go back to
# the pool (a server ends it at once, though often in a write of its own); a body still open
# then is dropped with its connection when the stream closes.
END_GRACE_S = 1.0
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
                await _read_to_end(response.content)
                return
            try:
                obj = orjson.loads(payload)
            except orjson.JSONDecodeError as exc:
                raise APIConnectionError(None, f"the stream sent invalid JSON: {exc}") from exc
            if isinstance(obj, dict) and "choices" not in obj:
                request_id = response.headers.get("X-Request-Id")
                if "error" in obj:
                    error = obj["error"]
                    code = error.get("code") if isinstance(error, dict) else 0
                    raise error_from(status_of(code), obj, None, request_id)
                if obj.get("object") == "error":  # (vLLM's top-level ErrorResponse)
                    raise error_from(status_of(obj.get("code")), {"error": obj}, None, request_id)
            yield obj
    raise APIConnectionError(None, "the stream ended without [DONE]")


async def _read_to_end(content: aiohttp.StreamReader) -> None:
    """What follows [DONE], discarded, up to the body's end: aiohttp then gives the connection
    back to the pool (closing a response cut short drops it). ``END_GRACE_S`` at most."""

    async def drain() -> None:
        while await content.readany():
            pass

    with contextlib.suppress(asyncio.TimeoutError, aiohttp.ClientError):
        await asyncio.wait_for(drain(), END_GRACE_S)


def broken(exc: aiohttp.ClientError, where: str) -> str:
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
