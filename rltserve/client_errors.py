"""The errors ``AsyncClient`` raises: one class per HTTP status family, as the OpenAI SDK
names them, each carrying the server's ``message``, ``type``, ``param``, ``code``, the error
``body``, the response's ``X-Request-Id`` and its ``Retry-After``."""

from __future__ import annotations

import math
from collections.abc import Mapping


class APIError(Exception):
    """An error response (or an error event inside a stream). As the OpenAI SDK's: ``code`` is
    the error object's ``code``, ``body`` the error object (the body's ``error``, else the
    whole body as parsed, or its text), ``request_id`` the response's ``X-Request-Id``."""

    status: int | None = None

    def __init__(
        self,
        status: int | None,
        message: str,
        type: str | None = None,  # noqa: A002 - the OpenAI field name
        param: str | None = None,
        retry_after: float | None = None,
        code: object = None,
        body: object = None,
        request_id: str | None = None,
    ) -> None:
        super().__init__(f"{status}: {message}" if status is not None else message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.retry_after = retry_after
        self.code = code
        self.body = body
        self.request_id = request_id

    def __reduce__(self):  # (pickled and copied whole: Ray and multiprocessing carry errors)
        fields = (self.status, self.message, self.type, self.param, self.retry_after)
        return type(self), (*fields, self.code, self.body, self.request_id)


class APIStatusError(APIError):
    """An error response with an HTTP status (the base of the classes by status, as in the
    OpenAI SDK; a status without its own class is this one)."""

    @property
    def status_code(self) -> int | None:  # (the OpenAI SDK's name)
        return self.status


class BadRequestError(APIStatusError):
    """400: the request was invalid; ``param`` names the field."""


class AuthenticationError(APIStatusError):
    """401: missing or wrong API key."""


class PermissionDeniedError(APIStatusError):
    """403: refused (a proxy in front of the server, for instance)."""


class NotFoundError(APIStatusError):
    """404: unknown model or route."""


class ConflictError(APIStatusError):
    """409: the request conflicts with the server's state (a weight update still waiting)."""


class RequestTooLargeError(APIStatusError):
    """413: the request body exceeds the server's limit."""


class UnsupportedMediaTypeError(APIStatusError):
    """415: the body was not sent as JSON."""


class UnprocessableEntityError(APIStatusError):
    """422: the body was understood but refused (a proxy or another server's validation)."""


class RateLimitError(APIStatusError):
    """429: too many requests."""


class InternalServerError(APIStatusError):
    """500 or another 5xx: the server (or a proxy before it) failed."""


class ServiceUnavailableError(InternalServerError):
    """503: loading, overloaded or shutting down; ``retry_after`` is the server's hint."""


class APIConnectionError(APIError):
    """The server could not be reached, or the connection broke mid-response."""


class APITimeoutError(APIConnectionError):
    """The server sent nothing for ``timeout`` seconds (connecting or reading)."""


_ERRORS: dict[int, type[APIError]] = {
    400: BadRequestError,
    401: AuthenticationError,
    403: PermissionDeniedError,
    404: NotFoundError,
    409: ConflictError,
    413: RequestTooLargeError,
    415: UnsupportedMediaTypeError,
    422: UnprocessableEntityError,
    429: RateLimitError,
    500: InternalServerError,
    503: ServiceUnavailableError,
}


def retry_after_of(headers: Mapping[str, str]) -> float | None:
    """The wait in seconds a response asks for before another try: ``retry-after-ms`` first,
    then ``Retry-After`` (seconds, fractions allowed), as the OpenAI SDK reads them; None
    without either (an HTTP-date Retry-After counts as none)."""
    for name, scale in (("retry-after-ms", 1000.0), ("retry-after", 1.0)):
        try:
            seconds = float(headers[name]) / scale
        except (KeyError, ValueError):
            continue
        if not math.isnan(seconds):
            return seconds
    return None


def error_from(
    status: int,
    body: object,
    retry_after: str | float | None = None,
    request_id: str | None = None,
) -> APIError:
    """The typed error for an error response body (OpenAI or llama.cpp shape)."""
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict):
        error = {"message": str(body) if body else f"HTTP {status}"}
    sdk_body = body.get("error", body) if isinstance(body, dict) else body  # (the SDK's body)
    cls = _ERRORS.get(status) or (InternalServerError if status >= 500 else APIStatusError)
    try:
        retry = float(retry_after) if retry_after is not None else None
    except ValueError:
        retry = None
    fields = (error.get("type"), error.get("param"), retry, error.get("code"), sdk_body)
    return cls(status, str(error.get("message")), *fields, request_id)


def status_of(code: object) -> int:
    """An error event's ``code`` as an HTTP status (500 unless it is one)."""
    try:
        status = int(code)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return 500
    return status if 400 <= status <= 599 else 500
