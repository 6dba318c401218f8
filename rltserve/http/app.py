"""The aiohttp application factory.

``create_app`` wires routes, middlewares and the engine lifecycle: the stage starts in the
background when the app starts (``cleanup_ctx``), in-flight requests drain on shutdown
(``on_shutdown``, which aiohttp runs before it waits for handlers), and the stage closes at
cleanup. Run the app with ``server.start_server`` (or any ``AppRunner`` created with
``handler_cancellation=True``, which is what turns a client disconnect into an engine abort).

Tests inject ``client_factory=InProcessStageClient`` (no second process) and fixed ``ids`` and
``clock`` to compare streams byte for byte.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator

from aiohttp import web

from rltserve.config import EngineConfig
from rltserve.core.pd import stage_client
from rltserve.http.body import warn_ignored_fields
from rltserve.http.config import ServerConfig
from rltserve.http.cors import allow_origin, preflight
from rltserve.http.handlers import add_routes
from rltserve.http.middleware import activity, auth, errors
from rltserve.http.state import STATE, ClientFactory, Clock, IdFactory, ServingState, random_id

__all__ = ["STATE", "create_app", "resolve_model"]


def resolve_model(engine_config: EngineConfig) -> EngineConfig:
    """Fills in the built-in demo checkpoint when no model directory was given."""
    if engine_config.model.model is not None:
        return engine_config
    from rltserve.models.demo import demo_model_path

    model = dataclasses.replace(engine_config.model, model=str(demo_model_path()))
    return dataclasses.replace(engine_config, model=model)


def create_app(
    server_config: ServerConfig,
    engine_config: EngineConfig,
    *,
    client_factory: ClientFactory = stage_client,
    ids: IdFactory = random_id,
    clock: Clock = time.time,
) -> web.Application:
    """The OpenAI-compatible app for one engine. ``client_factory(engine_config)`` builds the
    stage client (default: a spawned ``StageClient`` process, or two for ``disaggregate``:
    ``pd.stage_client``)."""
    engine_config = resolve_model(engine_config)
    middlewares = [activity, errors, preflight, auth]
    app = web.Application(middlewares=middlewares, client_max_size=server_config.max_body_bytes)
    state = ServingState(server_config, engine_config, client_factory, ids=ids, clock=clock)
    app[STATE] = state
    add_routes(app)
    app.on_response_prepare.append(allow_origin)
    app.on_response_prepare.append(warn_ignored_fields)
    app.cleanup_ctx.append(_engine_lifecycle)
    app.on_shutdown.append(_drain)
    return app


async def _engine_lifecycle(app: web.Application) -> AsyncIterator[None]:
    state = app[STATE]
    loading = asyncio.create_task(state.start(), name="rltserve-engine-start")
    yield
    state.closing = True  # a load still in progress gives up at its next poll
    await loading
    await state.stop()


async def _drain(app: web.Application) -> None:
    await app[STATE].drain()
