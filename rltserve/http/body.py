"""Reading a request body into its request dataclass, the same way on every route.

``read_body`` checks the Content-Type (JSON or absent: 415), the size (``max_body_bytes``: 413)
and how long the body takes to arrive (``body_timeout_s``: 408), that it decodes (a
``Content-Encoding`` its bytes do not match: 400), then parses it with
``validation.parse_object`` and runs the dataclass's ``validate`` (400 naming the field).

The size bounds the body as decoded: a gzip or deflate body is inflated by aiohttp's parser one
bounded piece at a time as it is read (``read_within``), so a compression bomb costs at most
``max_body_bytes`` and the stream's buffer (under 1 MiB) before its 413, never its whole
inflated size, and never holds the event loop for more than a piece. A body refused
before it was read to its end (415, 413, 408, 400) is never parsed or inflated further, and
its connection closes after the answer (``Connection: close``) rather than being reused.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from aiohttp import StreamReader, web
from aiohttp.streams import EmptyStreamReader
from aiohttp.web_protocol import RequestPayloadError

from rltserve.http.errors import HTTPError, bad_request
from rltserve.http.state import STATE
from rltserve.http.validation import loads, parse_object

_JSON_TYPES = ("application/json",)
_INLINE_BODY_BYTES = 64 * 1024  # larger bodies are parsed on the tokenizer pool
_CLOSE = {"Connection": "close"}  # (on the answer to a body left unread)
# A request's unknown body fields (their paths) and the id the log names it by.
IGNORED_FIELDS = web.RequestKey("rltserve.ignored_fields", tuple)


class BodyTooLarge(Exception):
    """A body, as decoded, of more than the limit ``read_within`` was given."""


async def read_body(
    request: web.Request, cls: type, strict: bool | None = None, request_id: str | None = None
) -> Any:
    """The request body parsed into ``cls`` (415 / 413 / 408 / 400 on bad bodies). Unknown
    fields are errors with ``strict``, else logged and ignored; None: the server's
    ``strict_fields``. ``request_id``: what the log names the request (default: its
    ``X-Request-Id``, if any)."""
    if "Content-Type" in request.headers:
        ctype = request.content_type
        if ctype not in _JSON_TYPES and not ctype.endswith("+json"):
            discard(request)
            message = f"Content-Type must be application/json, not {ctype!r}"
            raise HTTPError(415, message, headers=_CLOSE)
    state = request.app[STATE]
    limit = state.config.max_body_bytes
    if (error := declared_too_large(request)) is not None:
        discard(request)
        error.headers.update(_CLOSE)
        raise error
    timeout = state.config.body_timeout_s
    try:
        raw = await asyncio.wait_for(read_within(request.content, limit), timeout)
    except BodyTooLarge as exc:
        discard(request)
        raise HTTPError(413, f"request body exceeds {limit} bytes", headers=_CLOSE) from exc
    except asyncio.TimeoutError as exc:
        abandon(request)
        message = f"request body not received within {timeout:g} s"
        raise HTTPError(408, message, headers=_CLOSE) from exc
    except RequestPayloadError as exc:  # (a Content-Encoding its bytes do not decode, ...)
        # The rest of such a body cannot be read either (aiohttp draining it for keep-alive
        # would fail again and log it as an unhandled exception).
        abandon(request)
        reason = getattr(exc.__cause__, "message", None) or str(exc)
        raise HTTPError(400, f"body: cannot be read: {reason}", headers=_CLOSE) from exc
    if strict is None:
        strict = state.config.strict_fields
    if len(raw) > _INLINE_BODY_BYTES:  # checking a million token ids takes a while
        loop = asyncio.get_running_loop()
        parsed, unknown = await loop.run_in_executor(state.executor, _parse, raw, cls, strict)
    else:
        parsed, unknown = _parse(raw, cls, strict)
    if unknown:
        # Warned of once the request is answered without an error (``warn_ignored_fields``): a
        # request refused for another reason ignored nothing.
        request[IGNORED_FIELDS] = (unknown, request_id or state.request_id(request))
    return parsed


async def warn_ignored_fields(request: web.Request, response: web.StreamResponse) -> None:
    """The app's ``on_response_prepare``: the unknown fields a request's body had, logged
    (``ServingState.ignore_field``) when its response is no error."""
    ignored = request.get(IGNORED_FIELDS)
    if ignored is None or response.status >= 400:
        return
    names, request_id = ignored
    for name in names:
        request.app[STATE].ignore_field(name, request_id)


def declared_too_large(request: web.Request) -> HTTPError | None:
    """The 413 of a body whose ``Content-Length`` is over ``max_body_bytes``, else None."""
    length, limit = request.content_length, request.app[STATE].config.max_body_bytes
    if length is None or length <= limit:
        return None
    return HTTPError(413, f"request body of {length} bytes exceeds {limit}")


async def read_within(content: StreamReader, limit: int) -> bytes:
    """The whole body, or BodyTooLarge as soon as more than ``limit`` bytes of it arrived.

    Not ``request.read()``: that raises the stream's buffer to the whole limit, so that each
    step of a compressed body's decoding inflates megabytes on the event loop, and the stream
    buffers twice that. Read this way the buffer keeps aiohttp's size: a step inflates one
    piece of it (256 KiB), and the decoding pauses while two are waiting to be read."""
    if isinstance(content, EmptyStreamReader):  # (no body, and no buffer)
        return b""
    piece = content.get_read_buffer_limits()[0]  # (larger reads would raise the limits)
    body = bytearray()
    while chunk := await content.read(min(limit + 1 - len(body), piece)):
        body += chunk
        if len(body) > limit:
            raise BodyTooLarge(limit)
    return bytes(body)


def discard(request: web.Request) -> None:
    """Drops the rest of a refused body that may still be arriving (a 413, a 415): nothing more
    of it is parsed or inflated, and its connection closes after the answer. aiohttp would
    otherwise read, and inflate, the rest to reuse the connection; this way it only drops the
    bytes while it lingers (until the client closes, at most 10 s), so that a client still
    sending reads its answer rather than a reset."""
    request.protocol.close()  # (aiohttp then feeds its parser nothing more)


def abandon(request: web.Request) -> None:
    """As ``discard``, for a body that is not coming (stalled, broken, or awaiting ``100
    Continue``): the connection closes right after the answer, without lingering."""
    request.content.feed_eof()  # (ended: nothing left for aiohttp to wait for)
    request.protocol.close()


def _parse(raw: bytes, cls: type, strict: bool) -> tuple[Any, list[str]]:
    """The validated request and the unknown fields it had (none when ``strict``: they raise)."""
    try:
        data = loads(raw)
    except orjson.JSONDecodeError as exc:
        raise bad_request(_not_json(raw, exc)) from exc
    unknown: list[str] = []
    parsed = parse_object(cls, data, on_unknown=None if strict else unknown.append)
    parsed.validate()
    return parsed, unknown


def _not_json(raw: bytes, exc: orjson.JSONDecodeError) -> str:
    """Why a body is not JSON. orjson calls bytes that are not UTF-8 "str is not valid UTF-8:
    surrogates not allowed", wherever they are: the first such byte is named instead."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as bad:
        return f"body: not valid UTF-8 (byte 0x{raw[bad.start]:02x} at offset {bad.start})"
    return f"body: invalid JSON: {exc}"
