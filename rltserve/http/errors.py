"""OpenAI-style error bodies: ``{"error": {"message", "type", "param", "code"}}``.

``code`` is the HTTP status (as vLLM and llama.cpp send it); ``param`` names the offending
request field or is null. Handlers raise ``HTTPError``; the error middleware renders it.
"""

from __future__ import annotations

from collections.abc import Mapping

import orjson
from aiohttp import web

from rltserve.caller_values import at_prompt

# The ``type`` sent for each status; statuses not listed use "api_error".
ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    409: "conflict_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "unavailable_error",
}


class HTTPError(Exception):
    """An error response: raised anywhere below a handler, rendered by the error middleware."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = dict(headers or {})

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param)


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {
        "error": {
            "message": message,
            "type": ERROR_TYPES.get(status, "api_error"),
            "param": param,
            "code": status,
        }
    }


def in_batch(error: HTTPError, index: int, count: int) -> HTTPError:
    """``error`` naming prompt ``index`` of a request's ``count`` prompts (as the offline
    ``LLM`` names it): in a batch of 64 the message alone does not find the prompt. One
    prompt: ``error`` as it is."""
    if count <= 1:
        return error
    message = f"{error.message}{at_prompt(index, count)}"
    return HTTPError(error.status, message, param=error.param, headers=error.headers)


def bad_request(message: str, param: str | None = None) -> HTTPError:
    return HTTPError(400, message, param=param)


def unavailable(message: str, retry_after_s: int | None = None) -> HTTPError:
    headers = {"Retry-After": str(retry_after_s)} if retry_after_s is not None else None
    return HTTPError(503, message, headers=headers)


def json_response(obj: object, status: int = 200, headers: Mapping[str, str] | None = None):
    return web.Response(
        body=orjson.dumps(obj), status=status, content_type="application/json", headers=headers
    )


def error_response(error: HTTPError) -> web.Response:
    return json_response(error.body(), error.status, error.headers)
