"""Stage worker and its clients.

A stage owns a model replica, its KV pool, a scheduler, a runner and the asyncio engine loop.
``StageClient`` runs the stage in a worker process (``rltserve.core.stage_worker``) and talks to
it over a socket pair; the ``InProcessStageClient`` runs the same loop on a thread of the calling
process (unit tests, and callers that do not want a second process). Both deliver every request
update to the ``sink`` given with the request, on the client's reader thread.

Messages are plain tuples: to the stage ("add", rid, prompt_ids, params[, group[, transfer]]),
("abort", rid), ("shutdown",); from the stage ("ready", EngineInfo), ("updates", [update fields,
...], stats) (each update as a tuple of plain values: ``updates.to_wire``, with an EngineStats
snapshot), ("fatal", message[, refused[, unloadable]]): ``refused`` is the message of a
ValueError the engine raised at construction (a config it refuses: bad input, not a failure),
``unloadable`` that of a CheckpointError (a checkpoint that does not load).
A weight update ("update_weights", token, paths, abort, timeout_s), ("sleep", token, level,
timeout_s), ("wake_up", token, tags), ("reset_prefix_cache", token) and ("set_weight_version",
token, version) are each answered by ("reply", token, error or None, weight_version, the parts
asleep).

Invariants of a client: every request whose ``add_request`` returned gets exactly one final
update (finished, aborted or failed), whatever the stage does; the first known cause of a stage
failure is the one reported; the client's threads hold it only weakly, so an unreferenced client
is collected and its finalizer stops the stage.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import queue
import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable

from rltserve.config import EngineConfig
from rltserve.core.engine_info import EngineInfo, EngineStats
from rltserve.core.stage_loop import serve
from rltserve.core.worker_process import WorkerProcess
from rltserve.sampling import SamplingParams
from rltserve.updates import FinishReason, RequestUpdate, UpdateTimeout, from_wire

Sink = Callable[[RequestUpdate], None]
log = logging.getLogger(__name__)

_CLOSED = "stage closed before the request finished"
# How long the exit waits for an in-process stage loop that outlived its close (``_stop_loop``):
# a load or a step ends well within it; a wedged loop does not hold the exit forever.
_EXIT_JOIN_S = 300.0


class StageError(RuntimeError):
    """The stage failed to start or died."""


class StageConfigError(StageError, ValueError):
    """The engine refused its config at start (a ValueError building it, e.g. a context the KV
    pool cannot hold): bad input, caught as a ValueError like the config's own checks."""


class StageCheckpointError(StageError, ValueError):
    """The engine's checkpoint does not load (a config.json it does not support, missing or
    corrupt weights; the loader's ``CheckpointError``): a ValueError, as vLLM raises for a model
    config it does not support, but not bad usage (the path was checked before), so the CLI
    still exits 1 for it."""


class _ClientBase(ABC):
    """Routes updates to per-request sinks; fails every open request when the stage dies or the
    client closes."""

    def __init__(self, role: str | None = None) -> None:
        # Which stage of a disaggregated engine this is ("prefill", "decode"): its failures
        # name it, as an operator sees two of them.
        self.role = role
        self._sinks: dict[str, Sink] = {}
        self._lock = threading.Lock()  # guards _sinks, _fatal and _closed together
        self._ready = threading.Event()
        self._fatal: str | None = None
        self._refused: str | None = None  # the engine refused its config: why
        self._unloadable: str | None = None  # the checkpoint did not load: why
        self.info: EngineInfo | None = None
        self.stats: EngineStats | None = None  # the latest engine counters the stage sent
        self._closed = False
        self.weight_version = 0  # the stage's, as of its latest reply
        # What is asleep in the engine (``sleep`` freed, ``wake_up`` not yet restored), as of its
        # latest reply.
        self.sleeping: set[str] = set()
        self._replies: dict[int, list] = {}  # token -> [event, error, version]; under _lock
        self._tokens = itertools.count()

    def _dispatch(self, message: tuple) -> None:
        """Handles one message from the stage. Never raises: a failure here (a sink that
        raises, say) would otherwise end the thread that delivers updates and leave every
        caller waiting, so it fails every open request and marks the client broken instead."""
        try:
            self._handle(message)
        except Exception as exc:
            log.exception("stage client: handling a stage message failed")
            self._die(f"{type(exc).__name__} while handling a stage message: {exc}")
            self._stop_stage()

    def _handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == "ready":
            self.info = message[1]
            self._ready.set()
        elif kind == "updates":
            self.stats = message[2]
            for update in from_wire(message[1]):
                with self._lock:
                    sink = self._sinks.get(update.request_id)
                    if update.finish_reason is not None:
                        self._sinks.pop(update.request_id, None)
                if sink is not None:
                    self._deliver(update, sink)
        elif kind == "reply":
            _, token, error, version, sleeping = message
            with self._lock:
                slot = self._replies.pop(token, None)
                self.weight_version = max(self.weight_version, version)
                self.sleeping = set(sleeping)
            if slot is not None:
                slot[1:] = [error, version]
                slot[0].set()
        elif kind == "fatal":
            if len(message) > 2 and message[2] is not None:
                self._refused = message[2]
            if len(message) > 3 and message[3] is not None:
                self._unloadable = message[3]
            self._die(message[1])

    def _deliver(self, update: RequestUpdate, sink: Sink) -> None:
        """Hands ``update`` to its sink. A sink that raises fails its own request only: the stage
        stops its work and the sink gets one final error update (if that raises too, the caller
        behind it cannot be reached any more)."""
        try:
            sink(update)
        except Exception as exc:
            rid = update.request_id
            log.exception("stage client: the sink of request %s failed", rid)
            with self._lock:
                self._sinks.pop(rid, None)
            if update.finish_reason is None:
                self.abort(rid)
            error = f"{type(exc).__name__} while delivering output: {exc}"
            with contextlib.suppress(Exception):
                sink(RequestUpdate(rid, finish_reason=FinishReason.ERROR, error=error))

    def _die(self, reason: str) -> None:
        """Records the stage's failure (the first cause known wins) and fails open requests."""
        with self._lock:
            if self._fatal is None:
                self._fatal = reason
            reason = self._fatal
        self._ready.set()
        named = f"{self.role} stage: {reason}" if self.role else reason
        self._fail_open(FinishReason.ERROR, f"stage died: {named}")
        self._fail_replies(f"stage died: {named}")

    def _fail_replies(self, error: str) -> None:
        with self._lock:
            slots, self._replies = list(self._replies.values()), {}
        for slot in slots:
            slot[1] = error
            slot[0].set()

    def update_weights(self, paths: list[str], abort: bool, timeout_s: float) -> int:
        """Asks the stage to load the safetensors under ``paths`` into its model once no request
        runs (waiting up to ``timeout_s`` for them, or aborting them with ``abort``). Returns the
        new weight version; raises ValueError with the stage's reason when it refused."""
        return self._call("update_weights", list(paths), abort, timeout_s)

    def sleep(self, level: int, timeout_s: float) -> None:
        """Frees the engine's device memory once no request runs (``EngineCore.sleep``)."""
        self._call("sleep", level, timeout_s)

    def wake_up(self, tags: list[str]) -> None:
        self._call("wake_up", list(tags))

    def reset_prefix_cache(self) -> None:
        self._call("reset_prefix_cache")

    def set_weight_version(self, version: int) -> int:
        """Tells the stage that its weights are those of ``version``
        (``EngineCore.set_weight_version``); returns the stage's weight version."""
        return self._call("set_weight_version", version)

    def _call(self, kind: str, *args: object) -> int:
        """Sends ``(kind, token, *args)`` and waits for the stage's reply; returns the weight
        version. UpdateTimeout or ValueError with the stage's reason when it refused."""
        event = threading.Event()
        slot: list = [event, None, None]
        with self._lock:
            if not self.alive:
                raise StageError(f"stage is not running: {self.error}")
            token = next(self._tokens)
            self._replies[token] = slot
        try:
            self._send((kind, token, *args))
        except StageError:
            with self._lock:
                self._replies.pop(token, None)
            raise
        # The stage answers within a command's timeout_s plus the time to apply it (reading
        # weights, say); a dead or closed stage answers through _fail_replies.
        event.wait()
        _, error, version = slot
        if error is not None:
            if version is None:
                raise StageError(error)
            raise (UpdateTimeout if error.startswith(UpdateTimeout.PREFIX) else ValueError)(error)
        return version

    def _fail_open(self, finish: FinishReason, error: str) -> None:
        with self._lock:
            sinks, self._sinks = self._sinks, {}
        for rid, sink in sinks.items():
            try:
                sink(RequestUpdate(rid, finish_reason=finish, error=error))
            except Exception:  # one sink's failure must not keep the others waiting
                log.exception("stage client: the sink of request %s failed", rid)

    def wait_ready(self, timeout: float | None = None) -> EngineInfo:
        if not self._ready.wait(timeout):
            raise StageError("stage did not become ready in time")
        if self.info is None and self._refused is not None:
            raise StageConfigError(self._refused)
        if self.info is None and self._unloadable is not None:
            raise StageCheckpointError(self._unloadable)
        if self.info is None or self._fatal is not None or self._closed:
            raise StageError(f"stage failed: {self.error}")
        return self.info

    @property
    def alive(self) -> bool:
        return self._fatal is None and not self._closed

    @property
    def error(self) -> str | None:
        """Why the stage is not running: its failure, "closed", or None while it runs."""
        return self._fatal or ("closed" if self._closed else None)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        sink: Sink,
        group: str | None = None,
        transfer: tuple[str, str] | None = None,
    ) -> None:
        """Adds one request; its updates go to ``sink``. ``group``: a key the samples of one
        prompt share (n > 1): add sample j (j = 0..n-1) as its own request, with its own id and
        seed ``seed + j`` when a seed is set, all with the same prompt and group key; the
        stage computes the prompt once for all of them. Outputs equal n independent requests.
        The key only needs to be unique among the client's open requests. ``transfer``: a
        prompt KV file to write or read (``EngineCore.add_request``; ``pd.py``)."""
        with self._lock:  # so that close() either sees this sink or this call sees it closed
            if not self.alive:
                raise StageError(f"stage is not running: {self.error}")
            if request_id in self._sinks:
                raise ValueError(f"request_id={request_id!r}: already in use")
            self._sinks[request_id] = sink
        try:
            message = ("add", request_id, list(prompt_token_ids), params)
            if transfer is not None:
                message = (*message, group, transfer)
            elif group is not None:
                message = (*message, group)
            self._send(message)
        except Exception as exc:  # (StageError; or params that do not pickle: nothing sent)
            with self._lock:
                ours = self._sinks.pop(request_id, None) is not None
            if ours or not isinstance(exc, StageError):
                raise  # (a StageError otherwise: close() or a failure ended the sink already)

    def abort(self, request_id: str) -> None:
        if self.alive:
            with contextlib.suppress(StageError):  # a dead stage fails the request itself
                self._send(("abort", request_id))

    @abstractmethod
    def _send(self, message: tuple) -> None:
        """Delivers one command to the stage; raises StageError when it cannot."""

    @abstractmethod
    def _stop_stage(self) -> None:
        """Asks the stage to stop (best effort, never raises)."""

    def _mark_closed(self) -> bool:
        """Marks the client closed; False if it already was."""
        with self._lock:
            if self._closed:
                return False
            self._closed = True
        self._ready.set()  # a thread in wait_ready() learns at once that the stage is closed
        return True


def _read(ref: weakref.ref, worker: WorkerProcess) -> None:
    """The reader thread: delivers the worker's messages to the client. Holds the client only
    while handling a message, so an unreferenced client can be collected."""
    while True:
        try:
            message = worker.recv()
        except (EOFError, OSError):
            client = ref()
            if client is not None:
                client._worker_gone()
            return
        client = ref()
        if client is None:
            return
        client._dispatch(message)
        del client


class StageClient(_ClientBase):
    """Runs the stage in a worker process and talks to it over a socket pair."""

    def __init__(self, config: EngineConfig, role: str | None = None) -> None:
        super().__init__(role)
        self._worker = WorkerProcess.start(config, role)
        self.pid = self._worker.pid
        self._reader = threading.Thread(
            target=_read, args=(weakref.ref(self), self._worker), name="rltserve-stage-reader"
        )
        self._reader.daemon = True
        self._reader.start()
        # Stops the worker when the client is collected or at interpreter exit.
        self._finalizer = weakref.finalize(self, self._worker.stop, 5.0)

    def _worker_gone(self) -> None:
        if not self._closed:
            self._die(self._worker.exit_reason())

    def _send(self, message: tuple) -> None:
        try:
            self._worker.send(message)
        except OSError as exc:
            raise StageError(f"stage is not running: {self.error or exc}") from exc

    def _stop_stage(self) -> None:
        self._worker.request_stop()

    def close(self, timeout: float = 10.0) -> None:
        """Stops the worker: asks it to shut down (it aborts its requests), kills it if it has
        not exited within ``timeout`` seconds, and ends every request still open."""
        if not self._mark_closed():
            return
        self._finalizer.detach()
        self._worker.stop(timeout)
        if threading.current_thread() is not self._reader:
            self._reader.join(timeout)  # the abort updates the worker sent are delivered
        self._fail_open(FinishReason.ABORT, _CLOSED)
        self._fail_replies(_CLOSED)
        self._worker.close()

    def kill(self) -> None:
        """Kills the worker (tests use this to check that requests fail instead of hanging)."""
        self._worker.kill()


class InProcessStageClient(_ClientBase):
    """The same stage loop on a thread of this process; same interface as StageClient."""

    def __init__(self, config: EngineConfig, role: str | None = None) -> None:
        super().__init__(role)
        self._commands: queue.Queue = queue.Queue()
        ref = weakref.ref(self)

        def deliver(message: tuple) -> None:  # holds the client weakly (see the module doc)
            client = ref()
            if client is not None:
                client._dispatch(message)

        self._thread = threading.Thread(
            target=serve,
            args=(config, self._commands.get, deliver, None, role),
            name="rltserve-stage-loop",
            daemon=True,
        )
        self._thread.start()
        self._finalizer = weakref.finalize(self, _stop_loop, self._commands, self._thread)

    def _send(self, message: tuple) -> None:
        self._commands.put(message)

    def _stop_stage(self) -> None:
        self._commands.put(("shutdown",))

    def close(self, timeout: float = 10.0) -> None:
        if not self._mark_closed():
            return
        self._finalizer.detach()
        _stop_loop(self._commands, self._thread, timeout)
        self._fail_open(FinishReason.ABORT, _CLOSED)
        self._fail_replies(_CLOSED)


def _stop_loop(commands: queue.Queue, thread: threading.Thread, timeout: float = 10.0) -> None:
    """Stops an in-process client's loop and waits for it (``close``, and the finalizer of an
    unreferenced client, also run at interpreter exit: the loop must have ended before the
    interpreter goes on, else its daemon thread, still freeing tensors, is stopped at shutdown
    and the C++ runtime aborts the process). A loop still busy after ``timeout`` (a model still
    loading when Ctrl-C interrupted ``LLM(...)``: it reads the shutdown once loaded) is waited
    for again at exit, up to ``_EXIT_JOIN_S``, for the same reason."""
    commands.put(("shutdown",))
    if threading.current_thread() is not thread:
        thread.join(timeout)
        if not thread.is_alive():
            return
        # (At exit, the main thread marked stopped, an exit hook registered now never runs.)
        if threading.main_thread().is_alive():
            atexit.register(thread.join, _EXIT_JOIN_S)
        else:
            thread.join(_EXIT_JOIN_S)
