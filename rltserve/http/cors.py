"""Cross-origin requests from browsers (CORS), as vLLM's server allows them by default.

A web page on another origin that calls the API first sends a preflight (``OPTIONS`` with
``Origin`` and ``Access-Control-Request-Method``); ``preflight`` answers every one before the
API key is checked (browsers never send credentials with a preflight), as Starlette's
``CORSMiddleware`` does for vLLM: 204 with what the policy allows, or a 400 naming what it
refuses (``Disallowed CORS origin``; the browser then refuses the call) rather than the 401 or
405 that its route would give a request nobody authenticated. ``allow_origin`` (the app's
``on_response_prepare``) marks every response to an allowed ``Origin``, streams included, so
the page may read it. The policy (``cors_policy.CorsPolicy``) is ``--allowed-origins``,
``--allowed-methods``, ``--allowed-headers`` and ``--allow-credentials``.
"""

from __future__ import annotations

from aiohttp import web

from rltserve.http.cors_policy import ANY, SAFELISTED_HEADERS
from rltserve.http.errors import HTTPError, error_response
from rltserve.http.state import STATE

MAX_AGE_S = 600  # how long a browser may reuse a preflight's answer


@web.middleware
async def preflight(request: web.Request, handler) -> web.StreamResponse:
    wanted = request.headers.get("Access-Control-Request-Method")
    origin = request.headers.get("Origin")
    if request.method != "OPTIONS" or wanted is None or origin is None:
        return await handler(request)
    policy = request.app[STATE].config.cors
    asked = request.headers.get("Access-Control-Request-Headers")
    failures = policy.refused(origin, wanted, asked)
    if failures:
        message = f"Disallowed CORS {', '.join(failures)}"
        return error_response(HTTPError(400, message))
    headers = {
        "Access-Control-Allow-Methods": wanted,  # (allowed: refused() said so)
        "Access-Control-Max-Age": str(MAX_AGE_S),
    }
    if ANY in policy.headers:  # (any header: the ones asked for, as Starlette mirrors them)
        if asked:
            headers["Access-Control-Allow-Headers"] = asked
    else:
        allowed = sorted(policy.headers | SAFELISTED_HEADERS)
        headers["Access-Control-Allow-Headers"] = ", ".join(allowed)
    return web.Response(status=204, headers=headers)


async def allow_origin(request: web.Request, response: web.StreamResponse) -> None:
    origin = request.headers.get("Origin")
    if origin is None:
        return
    policy = request.app[STATE].config.cors
    if (allowed := policy.allow_origin(origin)) is not None:
        response.headers["Access-Control-Allow-Origin"] = allowed
        if allowed != ANY:
            response.headers.add("Vary", "Origin")
        if policy.credentials:
            response.headers["Access-Control-Allow-Credentials"] = "true"
