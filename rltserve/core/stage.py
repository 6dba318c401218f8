"""Stage worker and its clients.

A stage owns a model replica, its KV pool, a scheduler, a runner and the asyncio engine loop.
``StageClient`` spawns the stage as a separate process and talks to it over a pipe; the
``InProcessStageClient`` runs the same loop on a thread of the calling process (unit tests, and
callers that do not want a second process). Both deliver every request update to the ``sink``
given with the request, on the client's reader thread.

Messages are plain tuples: to the stage ("add", rid, prompt_ids, params), ("abort", rid),
("shutdown",); from the stage ("ready", EngineInfo), ("updates", [RequestUpdate, ...]),
("fatal", message). Updates carry an EngineStats snapshot: ("updates", [RequestUpdate], stats).
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import threading
import traceback
from abc import ABC, abstractmethod
from collections.abc import Callable
from multiprocessing.connection import Connection

from rltserve.config import EngineConfig
from rltserve.core.engine import EngineCore, EngineInfo, EngineStats, run_engine_loop
from rltserve.core.request import FinishReason
from rltserve.core.scheduler import RequestUpdate
from rltserve.sampling import SamplingParams

Sink = Callable[[RequestUpdate], None]


class StageError(RuntimeError):
    """The stage failed to start or died."""


def _new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:  # pragma: no cover - uvloop is a dependency on POSIX
        return asyncio.new_event_loop()


def _serve(config: EngineConfig, recv: Callable[[], tuple], send: Callable[[tuple], None]) -> None:
    """Builds the engine and runs its loop until shutdown; commands arrive through ``recv``."""
    try:
        core = EngineCore(config)
    except Exception as exc:
        send(("fatal", f"{type(exc).__name__}: {exc}"))
        return
    send(("ready", core.info))
    loop = _new_event_loop()
    inbox: asyncio.Queue = asyncio.Queue()

    def pump() -> None:
        while True:
            try:
                command = recv()
            except (EOFError, OSError):
                command = ("shutdown",)
            with contextlib.suppress(RuntimeError):  # the loop already closed
                loop.call_soon_threadsafe(inbox.put_nowait, command)
            if command[0] == "shutdown":
                return

    threading.Thread(target=pump, name="rltserve-stage-inbox", daemon=True).start()
    try:
        loop.run_until_complete(
            run_engine_loop(core, inbox, lambda u, st: send(("updates", u, st)))
        )
    except Exception:
        send(("fatal", traceback.format_exc()))
    finally:
        core.shutdown()
        loop.close()


def _worker_main(config: EngineConfig, conn: Connection) -> None:
    _serve(config, conn.recv, conn.send)
    conn.close()


class _ClientBase(ABC):
    """Routes updates to per-request sinks; fails every open request when the stage dies."""

    def __init__(self) -> None:
        self._sinks: dict[str, Sink] = {}
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._fatal: str | None = None
        self.info: EngineInfo | None = None
        self.stats: EngineStats | None = None  # the latest engine counters the stage sent
        self._closed = False

    def _dispatch(self, message: tuple) -> None:
        kind = message[0]
        if kind == "ready":
            self.info = message[1]
            self._ready.set()
        elif kind == "updates":
            self.stats = message[2]
            for update in message[1]:
                with self._lock:
                    sink = self._sinks.get(update.request_id)
                    if update.finish_reason is not None:
                        self._sinks.pop(update.request_id, None)
                if sink is not None:
                    sink(update)
        elif kind == "fatal":
            self._die(message[1])

    def _die(self, reason: str) -> None:
        # The first reason is the cause: the pipe closing after a "fatal" message must not
        # replace it before wait_ready reads it.
        if self._fatal is None:
            self._fatal = reason
        self._ready.set()
        with self._lock:
            sinks, self._sinks = self._sinks, {}
        for rid, sink in sinks.items():
            sink(
                RequestUpdate(rid, finish_reason=FinishReason.ERROR, error=f"stage died: {reason}")
            )

    def wait_ready(self, timeout: float | None = None) -> EngineInfo:
        if not self._ready.wait(timeout):
            raise StageError("stage did not become ready in time")
        if self.info is None or self._fatal is not None:
            raise StageError(f"stage failed: {self._fatal}")
        return self.info

    @property
    def alive(self) -> bool:
        return self._fatal is None and not self._closed

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, sink: Sink
    ) -> None:
        if not self.alive:
            raise StageError(f"stage is not running: {self._fatal or 'closed'}")
        with self._lock:
            if request_id in self._sinks:
                raise ValueError(f"request_id={request_id!r}: already in use")
            self._sinks[request_id] = sink
        self._send(("add", request_id, list(prompt_token_ids), params))

    def abort(self, request_id: str) -> None:
        if self.alive:
            self._send(("abort", request_id))

    @abstractmethod
    def _send(self, message: tuple) -> None:
        """Delivers one command to the stage."""


class StageClient(_ClientBase):
    """Spawns the stage worker process and talks to it over a pipe."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__()
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._send_lock = threading.Lock()
        self._proc = ctx.Process(target=_worker_main, args=(config, child), daemon=True)
        self._proc.start()
        child.close()
        self._reader = threading.Thread(
            target=self._read, name="rltserve-stage-reader", daemon=True
        )
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                if not self._closed:
                    code = self._proc.exitcode if not self._proc.is_alive() else None
                    self._die(f"worker process exited (code {code})")
                return
            self._dispatch(message)

    def _send(self, message: tuple) -> None:
        try:
            with self._send_lock:
                self._conn.send(message)
        except (BrokenPipeError, OSError) as exc:
            self._die(f"pipe closed: {exc}")
            raise StageError("stage is not running") from exc

    def close(self, timeout: float = 10.0) -> None:
        if self._closed:
            return
        with contextlib.suppress(StageError):
            if self._fatal is None:
                self._send(("shutdown",))
        self._closed = True
        self._proc.join(timeout)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(timeout)
        self._conn.close()

    def kill(self) -> None:
        """Kills the worker (tests use this to check that requests fail instead of hanging)."""
        self._proc.kill()


class InProcessStageClient(_ClientBase):
    """The same stage loop on a thread of this process; same interface as StageClient."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__()
        import queue

        self._commands: queue.Queue = queue.Queue()
        self._thread = threading.Thread(
            target=_serve, args=(config, self._commands.get, self._dispatch), daemon=True
        )
        self._thread.start()

    def _send(self, message: tuple) -> None:
        self._commands.put(message)

    def close(self, timeout: float = 10.0) -> None:
        if self._closed:
            return
        self._send(("shutdown",))
        self._closed = True
        self._thread.join(timeout)
