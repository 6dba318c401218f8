"""Administrative routes: ``POST /v1/update_weights`` loads new weights into the serving model.

Body: ``{"model_path": DIR, "abort": false, "timeout": 300}``. ``model_path`` is a checkpoint
directory (or a ``.safetensors`` file) on the server's host with the served model's tensor
names and shapes, any subset of them. The update runs between steps once no request runs
(requests that arrive meanwhile wait for it); ``abort`` aborts the running requests instead of
waiting for them. With an API key configured the route needs it, like every ``/v1`` route.

Answers ``{"weight_version": N}``; a rejected update is a 400 naming ``model_path`` (nothing
applied, the old weights keep serving), one that timed out waiting for running requests a 409.
"""

from __future__ import annotations

import asyncio

import orjson
from aiohttp import web

from rltserve.http.errors import HTTPError, bad_request, json_response
from rltserve.http.state import STATE
from rltserve.updates import UpdateTimeout

_FIELDS = {"model_path": str, "abort": bool, "timeout": (int, float)}


def _parse(raw: bytes) -> tuple[str, bool, float]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"body: invalid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise bad_request("body: must be a JSON object")
    for name, value in body.items():
        kind = _FIELDS.get(name)
        if kind is None:
            raise bad_request(f"{name}: unknown field (accepted: {', '.join(_FIELDS)})", name)
        if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
            raise bad_request(f"{name}: wrong type {type(value).__name__}", name)
    path = body.get("model_path")
    if not path:
        raise bad_request("model_path: required (a checkpoint directory)", "model_path")
    timeout = float(body.get("timeout", 300.0))
    if not 0 <= timeout <= 3600:
        raise bad_request(f"timeout={timeout:g}: must be in [0, 3600] seconds", "timeout")
    return path, bool(body.get("abort", False)), timeout


async def update_weights(request: web.Request) -> web.Response:
    state = request.app[STATE]
    path, abort, timeout = _parse(await request.read())
    client = state.require_frontend().client
    try:
        version = await asyncio.to_thread(client.update_weights, [path], abort, timeout)
    except UpdateTimeout as exc:
        raise HTTPError(409, str(exc), param="timeout") from exc
    except ValueError as exc:
        raise bad_request(str(exc), "model_path") from exc
    return json_response({"weight_version": version})


def add_admin_routes(app: web.Application) -> None:
    app.router.add_post("/v1/update_weights", update_weights)
