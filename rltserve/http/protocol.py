"""OpenAI-style JSON errors for requests aiohttp rejects before any middleware runs.

A request whose line, headers or chunked framing do not parse (bad request line or method,
oversized or invalid headers, malformed chunk sizes, conflicting lengths) never reaches the
app: aiohttp's protocol handler answers it with ``RequestHandler.handle_error``, a plain-text
400 that quotes the offending bytes. aiohttp has no public hook for that response, so
``JSONErrorRunner`` makes its server build ``JSONErrorProtocol`` handlers, whose
``handle_error`` answers with the same JSON body as every other error (``errors.py``). The
message names the kind of error only: the bytes it quotes may be a client's header values.
"""

from __future__ import annotations

import logging
import re
from http import HTTPStatus

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from rltserve.http.errors import HTTPError, error_response
from rltserve.http.root_path import under_root_path

log = logging.getLogger("rltserve.http")

# aiohttp's descriptions quote the offending bytes after one of these ("...: b'x'", "... (20000)
# when reading b'...'", "Bad status line 'x'"); the text before the first one names the error.
# ("Missing 'Host' header" quotes aiohttp's own word, not request bytes: kept whole.)
# A colon inside `backquotes` is aiohttp's own text too.
_QUOTE_START = re.compile(r"""(?::(?![^`]*`)|[\n(]| b['"]|(?<=line) ['"])""")


def parse_error_message(status: int, exc: BaseException | None) -> str:
    """The client-facing text: aiohttp's description up to where it starts quoting request
    bytes (``Invalid header value char``, ``Got more than 8190 bytes when reading``)."""
    if status >= 500:
        return "internal server error" if status == 500 else HTTPStatus(status).phrase.lower()
    detail = str(getattr(exc, "message", "") or "")
    head = _QUOTE_START.split(detail, 1)[0].strip()[:100]
    return f"malformed HTTP request: {head}" if head else "malformed HTTP request"


class JSONErrorProtocol(RequestHandler):
    __slots__ = ()

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        text = parse_error_message(status, exc)
        if status >= 500:
            # aiohttp's version logs the traceback and refuses when a response has started;
            # its plain-text body is replaced.
            super().handle_error(request, status, exc, message)
        else:
            # A client's malformed request: one line, not a traceback quoting its bytes (any
            # client could fill the log); refused as aiohttp's when a response has started.
            peer = request.remote or "a Unix socket's client"  # (a socket's peer has no address)
            log.info("malformed request from %s: %d %s", peer, status, text)
            if request.writer.output_size > 0:
                raise ConnectionError("a response was sent already")
        response = error_response(HTTPError(status, text))
        response.force_close()
        return response


class JSONErrorServer(web.Server):
    __slots__ = ()

    def __call__(self) -> RequestHandler:
        handler = super().__call__()
        handler.__class__ = JSONErrorProtocol  # same slots: only handle_error differs
        return handler

    def pre_shutdown(self) -> None:
        """As aiohttp's, which marks every connection closing, and then closes the idle ones.
        aiohttp leaves an idle keep-alive connection open but deaf to new requests until the
        drain ends: a client reusing it (pooled clients all do) waited the whole drain for
        nothing. Closed now, it fails at once and reconnects, to find the listener closed."""
        super().pre_shutdown()
        for connection in self.connections:
            # (aiohttp's own flag, which its RequestHandler.shutdown reads too)
            if not getattr(connection, "_request_in_progress", True):
                connection.force_close()


class JSONErrorRunner(web.AppRunner):
    """``web.AppRunner`` whose connections answer parse errors with JSON, and serve requests
    under ``root_path`` without it (``root_path.py``: before routing, which no middleware
    precedes)."""

    __slots__ = ("_root_path",)

    def __init__(self, app: web.Application, *, root_path: str | None = None, **kwargs) -> None:
        super().__init__(app, **kwargs)
        self._root_path = root_path

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = JSONErrorServer  # adds no state: only how handlers are made
        if self._root_path is not None:
            server.request_factory = under_root_path(server.request_factory, self._root_path)
        return server
