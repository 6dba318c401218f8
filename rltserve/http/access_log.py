"""The server's access log (``aiohttp.access``): Apache's Combined Log Format, less the paths
``ServerConfig.disable_access_log_for_endpoints`` names.

Every line has one format, ``%h %l %u %t "%r" %>s %b "%{Referer}i" "%{User-Agent}i"`` (ident
and user are always ``-``), so that grok's ``%{COMBINEDAPACHELOG}`` parses them all: ``%b`` is
the body's bytes as Apache counts them (``-`` for none; a HEAD response's none), where aiohttp's
own ``%b`` counts the status line and headers too (and a stream's chunk framing). aiohttp writes
a line once the response has ended, with the time the request started; the middleware writes
the 499 of a client that closed its connection through the same logger
(``middleware._log_access``).
"""

from __future__ import annotations

import logging

from aiohttp import hdrs, web
from aiohttp.abc import AbstractAccessLogger
from aiohttp.web_log import AccessLogger
from aiohttp.web_request import BaseRequest
from aiohttp.web_response import Response, StreamResponse

from rltserve.http.root_path import ROOT_PATH

# The body bytes a stream's writer has written (``sse.SSEWriter``), on its response: aiohttp
# counts only what went on the wire, headers and chunk framing included. (A typed key where
# aiohttp has them, 3.12 on: it warns of plain string keys.)
_KEY = getattr(web, "ResponseKey", None)
BODY_BYTES = _KEY("rltserve.body_bytes", int) if _KEY is not None else "rltserve.body_bytes"


def body_bytes(request: BaseRequest | None, response: StreamResponse) -> int:
    """The bytes of ``response``'s body as sent (0 for a HEAD request's, whose body is not)."""
    if request is not None and request.method == hdrs.METH_HEAD:
        return 0
    if BODY_BYTES in response:
        return response[BODY_BYTES]
    if isinstance(response, Response) and response.prepared:
        # (Content-Length: every Response the server makes has one, set as it is prepared)
        return response.content_length or 0
    return 0


class CombinedAccessLogger(AbstractAccessLogger):
    """Apache Combined lines; the values also go in the record's ``extra`` under aiohttp's
    names (``remote_address``, ``response_size``...), for structured (JSON) log formats."""

    @property
    def enabled(self) -> bool:
        return self.logger.isEnabledFor(logging.INFO)

    def log(self, request: BaseRequest, response: StreamResponse, time: float) -> None:
        if not self.enabled:
            return
        try:
            remote = (request.remote if request is not None else None) or "-"
            if request is None:
                line, referer, agent = "-", "-", "-"
            else:
                version = f"HTTP/{request.version.major}.{request.version.minor}"
                # (a path under --root-path as sent, though served without the prefix)
                path = request.raw_path if ROOT_PATH in request else request.path_qs
                line = f"{request.method} {path} {version}"
                referer = request.headers.get(hdrs.REFERER, "-")
                agent = request.headers.get(hdrs.USER_AGENT, "-")
            size = body_bytes(request, response)
            started = AccessLogger._format_t(request, response, time)
            self.logger.info(
                '%s - - %s "%s" %d %s "%s" "%s"',
                remote,
                started,
                line,
                response.status,
                size or "-",
                referer,
                agent,
                extra={
                    "remote_address": remote,
                    "request_start_time": started,
                    "first_request_line": line,
                    "response_status": response.status,
                    "response_size": size,
                    "request_header": {"Referer": referer, "User-Agent": agent},
                },
            )
        except Exception:
            self.logger.exception("Error in logging")


def access_logger_class(quiet_paths: frozenset[str]) -> type[AbstractAccessLogger]:
    """``CombinedAccessLogger``, silent for requests to ``quiet_paths`` (matched exactly,
    without the query string, as vLLM matches them); aiohttp builds one per connection from
    the class, hence a class per set of paths."""
    if not quiet_paths:
        return CombinedAccessLogger

    class QuietPathsAccessLogger(CombinedAccessLogger):
        def log(self, request: BaseRequest, response: StreamResponse, time: float) -> None:
            if request is None or request.path not in quiet_paths:
                super().log(request, response, time)

    return QuietPathsAccessLogger
