"""Administrative routes: ``POST /v1/update_weights`` loads new weights into the serving model.

Body (``UpdateWeightsRequest``): ``{"model_path": DIR, "abort": false, "timeout": 300}``.
``model_path`` is a checkpoint directory (or a ``.safetensors`` file) on the server's host with
the served model's tensor names and shapes, any subset of them. The update runs between steps
once no request runs (requests that arrive meanwhile wait for it); ``abort`` aborts the running
requests instead of waiting for them. With an API key configured the route needs it, like every
``/v1`` route. The body is read like every other route's (``body.read_body``), except that
unknown fields are always an error: a misspelled option must not be dropped silently here.

Answers ``{"weight_version": N}``; a rejected update is a 400 naming ``model_path`` (nothing
applied, the old weights keep serving), one that timed out waiting for running requests a 409.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from aiohttp import web

from rltserve.http.body import read_body
from rltserve.http.errors import HTTPError, bad_request, json_response
from rltserve.http.state import STATE
from rltserve.http.validation import SchemaError
from rltserve.updates import UpdateTimeout

MAX_TIMEOUT_S = 3600


@dataclass(frozen=True)
class UpdateWeightsRequest:
    """The body of ``POST /v1/update_weights``."""

    model_path: str  # a checkpoint directory or .safetensors file on the server's host
    abort: bool = False  # abort running requests instead of waiting for them
    timeout: float = 300.0  # seconds to wait for running requests, in [0, MAX_TIMEOUT_S]

    def validate(self) -> None:
        if not self.model_path:
            raise SchemaError("model_path", "model_path: required (a checkpoint directory)")
        if not 0 <= self.timeout <= MAX_TIMEOUT_S:
            raise SchemaError(
                "timeout", f"timeout={self.timeout:g}: must be in [0, {MAX_TIMEOUT_S}] seconds"
            )


async def update_weights(request: web.Request) -> web.Response:
    state = request.app[STATE]
    req: UpdateWeightsRequest = await read_body(request, UpdateWeightsRequest, strict=True)
    client = state.require_frontend().client
    try:
        version = await asyncio.to_thread(
            client.update_weights, [req.model_path], req.abort, float(req.timeout)
        )
    except UpdateTimeout as exc:
        raise HTTPError(409, str(exc), param="timeout") from exc
    except ValueError as exc:
        raise bad_request(str(exc), "model_path") from exc
    return json_response({"weight_version": version})
