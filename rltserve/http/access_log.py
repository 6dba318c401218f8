"""The server's access log: aiohttp's combined-format lines (``aiohttp.access``), less the
paths ``ServerConfig.disable_access_log_for_endpoints`` names.

Every line has one format, ``%a %t "%r" %s %b "%{Referer}i" "%{User-Agent}i"``, so that one
grok/regex pattern parses them all; the middleware writes the 499 of a client that closed its
connection through the same logger (``middleware._log_access``).
"""

from __future__ import annotations

from aiohttp.abc import AbstractAccessLogger
from aiohttp.web_log import AccessLogger
from aiohttp.web_request import BaseRequest
from aiohttp.web_response import StreamResponse


def access_logger_class(quiet_paths: frozenset[str]) -> type[AbstractAccessLogger]:
    """aiohttp's ``AccessLogger``, silent for requests to ``quiet_paths`` (matched exactly,
    without the query string, as vLLM matches them); aiohttp builds one per connection from
    the class, hence a class per set of paths."""
    if not quiet_paths:
        return AccessLogger

    class QuietPathsAccessLogger(AccessLogger):
        def log(self, request: BaseRequest, response: StreamResponse, time: float) -> None:
            if request is None or request.path not in quiet_paths:
                super().log(request, response, time)

    return QuietPathsAccessLogger
