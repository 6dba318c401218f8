"""Running the app on a socket: ``start_server`` (tests and embedding) and ``run_server`` (the
``rltserve serve`` process: uvloop, signals, exit code).

The runner is created with ``handler_cancellation=True``: aiohttp then cancels a handler whose
client disconnected, and the cancellation aborts the request in the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass

from aiohttp import web

from rltserve.config import EngineConfig
from rltserve.http.access_log import access_logger_class
from rltserve.http.app import create_app
from rltserve.http.config import ServerConfig
from rltserve.http.listener import open_site, remove_socket, socket_file
from rltserve.http.protocol import JSONErrorRunner
from rltserve.http.state import STATE, ClientFactory

log = logging.getLogger("rltserve.http")
_SHUTDOWN_MARGIN_S = 5.0  # beyond drain_timeout_s, for aborted handlers to write their ending


@dataclass
class RunningServer:
    """An app listening on a socket. ``url`` has the bound port (useful with port 0), or is
    ``unix:PATH`` on a Unix socket."""

    app: web.Application
    runner: web.AppRunner
    url: str
    config: ServerConfig
    socket_file: tuple[int, int] | None = None  # (a Unix socket's, ``listener.socket_file``)
    closed: bool = False

    async def close(self) -> None:
        """Graceful stop: no new connections, drain or abort in-flight requests, close the
        engine, remove a Unix socket. Idempotent."""
        if not self.closed:
            self.closed = True
            await self.runner.cleanup()
            remove_socket(self.config, self.socket_file)


async def start_server(app: web.Application, config: ServerConfig) -> RunningServer:
    if config.disable_uvicorn_access_log:
        access: dict = {"access_log": None}
    else:
        access = {"access_log_class": access_logger_class(config.quiet_paths)}
    runner = JSONErrorRunner(
        app,
        root_path=config.root_path,
        handler_cancellation=True,
        shutdown_timeout=config.drain_timeout_s + _SHUTDOWN_MARGIN_S,
        # aiohttp arms this timer when a connection opens, so it also closes a connection that
        # trickles its headers in (slow loris), not only idle keep-alive ones.
        keepalive_timeout=config.idle_timeout_s,
        max_line_size=config.max_header_bytes,
        max_field_size=config.max_header_bytes,
        max_headers=config.max_header_count,
        **access,
    )
    await runner.setup()
    try:
        url = await open_site(runner, config)
    except BaseException:
        await runner.cleanup()
        raise
    return RunningServer(app, runner, url, config, socket_file(config))


@contextlib.asynccontextmanager
async def serving(app: web.Application, config: ServerConfig) -> AsyncIterator[RunningServer]:
    server = await start_server(app, config)
    try:
        yield server
    finally:
        await server.close()


async def serve_until_signalled(
    server_config: ServerConfig,
    engine_config: EngineConfig,
    client_factory: ClientFactory | None = None,
) -> int:
    factory = {} if client_factory is None else {"client_factory": client_factory}
    app = create_app(server_config, engine_config, **factory)
    server = await start_server(app, server_config)
    log.info("listening on %s (model loading)", server.url)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    state = app[STATE]
    ready = asyncio.create_task(state.ready.wait())
    stopped = asyncio.create_task(stop.wait())
    await asyncio.wait({ready, stopped}, return_when=asyncio.FIRST_COMPLETED)
    if state.load_error is not None:
        await server.close()
        if isinstance(state.load_exception, ValueError):
            # A setting the model or its KV pool cannot take (or a checkpoint that does not
            # load): the command reports it as `generate` does, exit code 2 (1).
            raise state.load_exception
        log.error("giving up: the engine failed to start")
        return 1
    code = 0
    if not stop.is_set():
        under = f" (and under {server_config.root_path})" if server_config.root_path else ""
        log.info("serving %s on %s%s", state.model_name, server.url, under)
        failed = asyncio.create_task(state.gave_up())
        await asyncio.wait({stopped, failed}, return_when=asyncio.FIRST_COMPLETED)
        if failed.done() and not stop.is_set():  # (a failure as the stop comes is its effect)
            log.error("giving up: the stage failed and could not be restarted")
            code = 1
        failed.cancel()
    log.info("shutting down (again to abort the requests in flight now)")
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, state.cut_drain)
    ready.cancel()
    stopped.cancel()
    await server.close()
    return code


def run_server(
    server_config: ServerConfig,
    engine_config: EngineConfig,
    client_factory: ClientFactory | None = None,
) -> int:
    """Serves until SIGINT/SIGTERM (exit code 0), or until the stage failed and its restarts
    ran out (exit code 1, so that systemd or Kubernetes restarts the process).
    ``client_factory`` builds the stage client (default: one stage worker process)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on POSIX
        return asyncio.run(serve_until_signalled(server_config, engine_config, client_factory))
    return uvloop.run(serve_until_signalled(server_config, engine_config, client_factory))
