"""Reading a request body into its request dataclass, the same way on every route.

``read_body`` checks the Content-Type (JSON or absent: 415), the size (``max_body_bytes``: 413)
and how long the body takes to arrive (``body_timeout_s``: 408), that it decodes (a
``Content-Encoding`` its bytes do not match: 400), then parses it with
``validation.parse_object`` and runs the dataclass's ``validate`` (400 naming the field).
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from rltserve.http.errors import HTTPError, bad_request
from rltserve.http.state import STATE
from rltserve.http.validation import loads, parse_object

_JSON_TYPES = ("application/json",)
_INLINE_BODY_BYTES = 64 * 1024  # larger bodies are parsed on the tokenizer pool


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
            raise HTTPError(415, f"Content-Type must be application/json, not {ctype!r}")
    state = request.app[STATE]
    limit = state.config.max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        raise HTTPError(413, f"request body of {request.content_length} bytes exceeds {limit}")
    timeout = state.config.body_timeout_s
    try:
        raw = await asyncio.wait_for(request.read(), timeout)
    except web.HTTPRequestEntityTooLarge as exc:
        raise HTTPError(413, f"request body exceeds {limit} bytes") from exc
    except asyncio.TimeoutError as exc:
        raise HTTPError(408, f"request body not received within {timeout:g} s") from exc
    except RequestPayloadError as exc:  # (a Content-Encoding its bytes do not decode, ...)
        # The rest of such a body cannot be read either: the connection closes after the 400
        # (its payload marked ended) rather than aiohttp draining the body for keep-alive,
        # which fails again and logs it as an unhandled exception.
        request.content.feed_eof()
        request.protocol.close()
        reason = getattr(exc.__cause__, "message", None) or str(exc)
        raise bad_request(f"body: cannot be read: {reason}") from exc
    if strict is None:
        strict = state.config.strict_fields
    if len(raw) > _INLINE_BODY_BYTES:  # checking a million token ids takes a while
        loop = asyncio.get_running_loop()
        parsed, unknown = await loop.run_in_executor(state.executor, _parse, raw, cls, strict)
    else:
        parsed, unknown = _parse(raw, cls, strict)
    if unknown and request_id is None:
        request_id = state.request_id(request)
    for name in unknown:
        state.ignore_field(name, request_id)
    return parsed


def _parse(raw: bytes, cls: type, strict: bool) -> tuple[Any, list[str]]:
    """The validated request and the unknown fields it had (none when ``strict``: they raise)."""
    try:
        data = loads(raw)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"body: invalid JSON: {exc}") from exc
    unknown: list[str] = []
    parsed = parse_object(cls, data, on_unknown=None if strict else unknown.append)
    parsed.validate()
    return parsed, unknown
