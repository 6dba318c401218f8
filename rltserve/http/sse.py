"""Server-sent events: the one place that frames stream bytes.

Every event is ``data: <compact json>\\n\\n``; a stream ends with ``data: [DONE]\\n\\n``; an
error inside a stream (after the 200 went out) is ``data: {"error": {...}}\\n\\n`` followed by
``[DONE]``, as vLLM and SGLang send it. The response is prepared lazily, on the first event, so
that a request the engine rejects before producing anything still gets a proper 4xx status.
A client that stops reading is dropped after a stall timeout, here and (``BoundedResponse``)
on a non-streaming body.
"""

from __future__ import annotations

import asyncio
import logging

import orjson
from aiohttp import HttpVersion11, web

from rltserve.http.access_log import BODY_BYTES
from rltserve.http.errors import error_body

log = logging.getLogger("rltserve.http")

DONE = b"data: [DONE]\n\n"
_UNBLOCKED_BYTES = 16 * 1024  # asyncio's default low-water mark: a transport below it is writable
CONTENT_TYPE = "text/event-stream"


def encode_event(obj: object) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def encode_error(status: int, message: str) -> bytes:
    return encode_event(error_body(status, message))


class StreamStalled(ConnectionResetError):
    """The client did not read for ``stall_timeout_s``: the connection was dropped."""


class SSEWriter:
    """Writes events of one stream. ``started`` tells whether the headers went out.

    What the server holds for a slow reader is bounded: a write waits while the socket's buffers
    are full, and one that waits longer than ``stall_timeout_s`` drops the connection and raises
    ``StreamStalled`` (so the request is aborted and its KV freed)."""

    def __init__(
        self,
        request: web.Request,
        headers: dict[str, str] | None = None,
        stall_timeout_s: float | None = None,
    ) -> None:
        self._request = request
        self._headers = headers or {}
        self._stall_timeout_s = stall_timeout_s
        self._response: web.StreamResponse | None = None

    @property
    def started(self) -> bool:
        return self._response is not None

    @property
    def response(self) -> web.StreamResponse | None:
        return self._response

    async def _ensure_started(self) -> web.StreamResponse:
        if self._response is None:
            response = web.StreamResponse(
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **self._headers}
            )
            response.content_type = CONTENT_TYPE
            if self._request.version < HttpVersion11:
                # HTTP/1.0 has no chunked encoding: the stream ends where its connection does.
                # (aiohttp would keep a keep-alive 1.0 connection open, and its client would
                # wait for an end that never comes, until the idle timeout.)
                response.force_close()
            await response.prepare(self._request)
            response[BODY_BYTES] = 0  # (the access line's %b)
            self._response = response
        return self._response

    async def send(self, *objs: object) -> None:
        """Sends events in one write (the chunks of one engine update go out together)."""
        if objs:
            response = await self._ensure_started()
            await self._write(response, b"".join(encode_event(o) for o in objs))

    async def _write(self, response: web.StreamResponse, data: bytes) -> None:
        await write_bounded(self._request, response, data, self._stall_timeout_s)
        response[BODY_BYTES] += len(data)

    async def finish(self, error: tuple[int, str] | None = None) -> web.StreamResponse:
        """Ends the stream: an optional error event, then ``[DONE]``."""
        response = await self._ensure_started()
        tail = encode_error(*error) + DONE if error is not None else DONE
        transport = self._request.transport
        if transport is not None and transport.get_write_buffer_size() < _UNBLOCKED_BYTES:
            # One write with the body's end (never waiting: the buffer is low): a client that
            # stops reading at [DONE] finds the end there too and keeps the connection pooled.
            await response.write_eof(tail)
            response[BODY_BYTES] += len(tail)
            return response
        await self._write(response, tail)
        await response.write_eof()
        return response


async def write_bounded(
    request: web.BaseRequest,
    response: web.StreamResponse,
    data: bytes | memoryview,
    stall_timeout_s: float | None,
) -> None:
    """``response.write(data)``; a write that waits longer than ``stall_timeout_s`` for the
    client to read drops the connection and raises ``StreamStalled``."""
    transport = request.transport
    if (
        stall_timeout_s is None
        or transport is None
        or (transport.get_write_buffer_size() + len(data) < _UNBLOCKED_BYTES)
    ):
        # Below the transport's low-water mark writing never waits: no timer needed (the
        # common case, kept free of wait_for's extra task per write).
        await response.write(data)
        return
    try:
        await asyncio.wait_for(response.write(data), stall_timeout_s)
    except asyncio.TimeoutError:
        transport = request.transport
        if transport is not None:
            transport.abort()
        raise StreamStalled(f"client read nothing for {stall_timeout_s:g} s; dropped") from None


class BoundedResponse(web.Response):
    """A ``web.Response`` (same headers and bytes) whose body is written a piece at a time,
    each write bounded as a stream's (``write_bounded``): a client that stops reading a large
    body is dropped instead of holding the connection and the body forever."""

    PIECE = 0x10000  # the payload writer's own drain threshold

    def __init__(
        self, request: web.BaseRequest, stall_timeout_s: float | None, **kwargs: object
    ) -> None:
        super().__init__(**kwargs)
        self._bounded_request = request
        self._stall_timeout_s = stall_timeout_s

    async def write_eof(self, data: bytes = b"") -> None:
        body = self.body
        if (
            self._stall_timeout_s is None
            or not isinstance(body, bytes)
            or len(body) < _UNBLOCKED_BYTES
            or self.compression
            or self._bounded_request.method == "HEAD"
        ):
            await super().write_eof(data)
            return
        view = memoryview(body)
        self[BODY_BYTES] = 0  # (the access line's %b: what was sent, as a stream's)
        for start in range(0, len(body), self.PIECE):
            piece = view[start : start + self.PIECE]
            try:
                await write_bounded(self._bounded_request, self, piece, self._stall_timeout_s)
            except StreamStalled as exc:
                # (the handler returned long ago: its status is counted, and aiohttp drops
                # this error quietly, so the log is where the drop shows)
                request = self._bounded_request
                log.warning(
                    "%s %s: %s after %d of %d body bytes",
                    request.method,
                    request.path,
                    exc,
                    self[BODY_BYTES],
                    len(body),
                )
                raise
            self[BODY_BYTES] += len(piece)
        await web.StreamResponse.write_eof(self)
