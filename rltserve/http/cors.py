"""Cross-origin requests from browsers (CORS), as vLLM's server allows them by default.

A web page on another origin that calls the API first sends a preflight (``OPTIONS`` with
``Origin`` and ``Access-Control-Request-Method``); ``preflight`` answers it before the API key
is checked (browsers never send credentials with a preflight) with the method and headers asked
for. ``allow_origin`` (the app's ``on_response_prepare``) marks every response to an allowed
``Origin``, streams included, so the page may read it. ``--allowed-origins``: a comma-separated
list of origins or vLLM's JSON list, ``*`` for any (the default, as vLLM's), empty for none.
No credentials mode: clients authenticate with the ``Authorization`` header, which a preflight
lets through.
"""

from __future__ import annotations

from aiohttp import web

from rltserve.http.state import STATE

MAX_AGE_S = 600  # how long a browser may reuse a preflight's answer


def _allowed(request: web.Request) -> str | None:
    """The ``Access-Control-Allow-Origin`` value for the request's origin; None: not allowed
    (or not a cross-origin request)."""
    origin = request.headers.get("Origin")
    if origin is None:
        return None
    origins = request.app[STATE].config.origins
    if "*" in origins:
        return "*"
    return origin if origin in origins else None


@web.middleware
async def preflight(request: web.Request, handler) -> web.StreamResponse:
    wanted = request.headers.get("Access-Control-Request-Method")
    if request.method != "OPTIONS" or wanted is None or _allowed(request) is None:
        return await handler(request)
    headers = {
        "Access-Control-Allow-Methods": wanted,
        "Access-Control-Max-Age": str(MAX_AGE_S),
    }
    if asked := request.headers.get("Access-Control-Request-Headers"):
        headers["Access-Control-Allow-Headers"] = asked
    return web.Response(status=204, headers=headers)


async def allow_origin(request: web.Request, response: web.StreamResponse) -> None:
    if (origin := _allowed(request)) is not None:
        response.headers["Access-Control-Allow-Origin"] = origin
        if origin != "*":
            response.headers.add("Vary", "Origin")
