"""Middlewares: OpenAI-style error bodies for every failure, API-key auth on every route but
the probes (``PUBLIC_PATHS``, and ``/metrics`` unless ``metrics_auth``), header passthrough and
the HTTP request counter.

Order (outermost first): ``activity`` counts the requests in flight for the idle heap trim
(``heap_trim``); ``errors`` renders ``HTTPError``, ``SchemaError``, aiohttp's own
``HTTPException``s (404 route, 405 method, 413 body) and any unexpected exception (500, logged)
as JSON; then ``auth``, which guards every route but the probes. Error bodies never carry a
traceback or a request's own header values. Requests that do not parse never reach a
middleware: ``protocol.py`` renders those.
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import HttpVersion11, web

from rltserve.http.api_keys import matches
from rltserve.http.body import abandon, declared_too_large, discard
from rltserve.http.errors import HTTPError, error_response
from rltserve.http.root_path import ROOT_PATH
from rltserve.http.state import STATE
from rltserve.http.validation import SchemaError

log = logging.getLogger("rltserve.http")
CLIENT_CLOSED = 499  # nginx's status for a request whose client closed the connection
# Read-only routes that answer without the API key, as vLLM leaves them open: probes (load
# balancers, Kubernetes, SageMaker's /ping, load-aware routers' /load) and the API description
# carry no key. Every other route needs it, the admin ones (/sleep, /wake_up,
# /reset_prefix_cache, /v1/update_weights) included. (A path's rules are its methods' alike:
# HEAD as GET.)
PUBLIC_PATHS = frozenset({"/health", "/ping", "/version", "/openapi.json", "/load"})
METRICS_PATHS = frozenset({"/metrics", "/metrics/"})


def _route_name(request: web.Request) -> str:
    route = request.match_info.route
    resource = route.resource if route is not None else None
    return resource.canonical if resource is not None else "unmatched"


@web.middleware
async def activity(request: web.Request, handler) -> web.StreamResponse:
    """Counts the request in flight until its handler returns (a stream's once it has ended)
    or is cancelled: the heap is trimmed once none is (``heap_trim.IdleTrim``)."""
    idle_trim = request.app[STATE].idle_trim
    idle_trim.begin()
    try:
        return await handler(request)
    finally:
        idle_trim.end()


@web.middleware
async def errors(request: web.Request, handler) -> web.StreamResponse:
    state = request.app[STATE]
    started = asyncio.get_running_loop().time()
    try:
        response = await handler(request)
    except HTTPError as exc:
        response = error_response(exc)
    except SchemaError as exc:
        response = error_response(HTTPError(400, exc.message, param=exc.param))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        # (the path as the client sent it: under --root-path, with its prefix)
        path = request.get(ROOT_PATH, "") + request.path
        message = exc.text if exc.status != 404 else f"no route {request.method} {path}"
        headers = None
        if exc.status == 405:  # (RFC 9110: a 405 names the methods the route takes)
            message = f"method {request.method} not allowed on {path}"
            headers = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        response = error_response(HTTPError(exc.status, message or exc.reason, headers=headers))
    except ConnectionError:
        # The client went away (mid-body, mid-stream): nobody reads this; not a server error.
        response = web.Response(status=CLIENT_CLOSED)
    except asyncio.CancelledError:
        # A client that closes the connection cancels its handler (which aborts its requests):
        # no response is made, so aiohttp logs and counts nothing; say it here, as a 499.
        transport = request.transport
        if transport is None or transport.is_closing():
            seconds = asyncio.get_running_loop().time() - started
            state.metrics.on_http(_route_name(request), request.method, CLIENT_CLOSED, seconds)
            _log_access(request, web.Response(status=CLIENT_CLOSED), started)
        raise
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        response = error_response(HTTPError(500, "internal server error"))
    if "Content-Encoding" in request.headers and not request.content.is_eof():
        # A compressed body its route never read (POST /ping with a gzip bomb): aiohttp would
        # read and inflate the rest, for up to 10 s, to reuse the connection.
        discard(request)
        if not response.prepared:
            response.force_close()
    if not response.prepared:
        for name, value in state.passthrough_headers(request).items():
            response.headers.setdefault(name, value)
    # (a stream's handler returns once it has ended)
    seconds = asyncio.get_running_loop().time() - started
    state.metrics.on_http(_route_name(request), request.method, response.status, seconds)
    return response


def _log_access(request: web.Request, response: web.Response, started: float) -> None:
    """The access line of a response aiohttp never sees, through the server's own access
    logger: the same format as every other line (and none where access lines are off)."""
    logger = getattr(request.protocol, "access_logger", None)
    if logger is not None and logger.enabled:
        logger.log(request, response, asyncio.get_running_loop().time() - started)


def needs_key(path: str, metrics_auth: bool) -> bool:
    """Every route needs the key except the probes (``PUBLIC_PATHS``) and, unless
    ``metrics_auth``, ``/metrics`` (scrapers rarely carry keys)."""
    return path not in PUBLIC_PATHS and (metrics_auth or path not in METRICS_PATHS)


def auth_failure(request: web.Request) -> HTTPError | None:
    """The 401 of a request without the key its route needs, else None."""
    config = request.app[STATE].config
    keys = config.api_keys
    if not keys or not needs_key(request.path, config.metrics_auth):
        return None
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if not header:
        return _unauthorized("Missing API key: send 'Authorization: Bearer <key>'")
    if scheme.lower() != "bearer" or not matches(token.strip(), keys):
        return _unauthorized("Invalid API Key")
    return None


@web.middleware
async def auth(request: web.Request, handler) -> web.StreamResponse:
    failure = auth_failure(request)
    if failure is not None:
        raise failure
    return await handler(request)


async def expect_continue(request: web.Request) -> web.StreamResponse | None:
    """Every route's ``Expect`` handler. aiohttp runs it before any middleware, and its own
    sends ``100 Continue`` to anyone: a client without the key, or with a body its
    ``Content-Length`` already puts over ``max_body_bytes``, would upload the body only to be
    refused. Here such a client (and an unknown expectation) gets its error at once, on a
    connection then closed since its body is never read."""
    state = request.app[STATE]
    failure = auth_failure(request)
    expect = request.headers.get("Expect", "")
    if failure is None and expect.lower() != "100-continue":
        failure = HTTPError(417, f"Expect: {expect!r}: only '100-continue' is supported")
    if failure is None:
        failure = declared_too_large(request)
    if failure is not None:
        abandon(request)  # (else aiohttp would wait up to 10 s for the body, to drain it)
        response = error_response(failure)
        response.force_close()
        response.headers.update(state.passthrough_headers(request))
        state.metrics.on_http(_route_name(request), request.method, response.status)
        return response
    if request.version >= HttpVersion11:  # (an HTTP/1.0 client expects no interim answer)
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # (the response proper has not started)
    return None


def _unauthorized(message: str) -> HTTPError:
    return HTTPError(401, message, headers={"WWW-Authenticate": "Bearer"})
