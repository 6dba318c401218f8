"""The parent's handle on a stage worker process: launch, channel, error output, stop.

The worker runs ``rltserve.core.stage_worker.main`` in a fresh interpreter (never the caller's
main module, nor modules from the caller's current directory) with one end of a socket pair
inherited as its channel. Its error output is relayed to this process's ``sys.stderr`` line by
line (the server's log, where an operator reads all of it). Of that output only the line of
the exception that ended the worker ("ModuleNotFoundError: ..." after its traceback) goes into
``exit_reason``, which clients see: any other line (a startup warning long before a kill) would
be unrelated log text there.

Messages to the worker are pickled by the caller and written by a sender thread, so ``send``
never blocks: a worker that stops reading (stopped, frozen) would otherwise block whoever sends,
the server's event loop among them, and with it the watchdog that would kill that worker. A
compiled constraint crosses once (``guide_registry``): messages are pickled, and queued, one at a
time, so the worker unpickles them in the order the channel's record of what it holds assumed.

Invariant: this handle holds no reference to any client, so a client that owns it can be
collected while the reader, relay and sender threads run.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import site
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from pathlib import Path
from typing import IO

import rltserve
from rltserve.config import EngineConfig
from rltserve.core.guide_registry import GuidePickler

WORKER_MODULE = "rltserve.core.stage_worker"
_TRACEBACK = "Traceback (most recent call last):"
# ``python -m`` would put the current directory first on sys.path, where a stray ``rltserve/``
# (another checkout) or a file named like a dependency would shadow the code this process runs;
# the worker puts this process's package root there instead.
_BOOTSTRAP = (
    "import sys; sys.path[0] = {root!r}; from {module} import main; raise SystemExit(main())"
)


def _package_root() -> str:
    return str(Path(rltserve.__file__).resolve().parent.parent)


def _worker_env() -> dict[str, str]:
    """The environment of the worker: this one, with the directory this ``rltserve`` was
    imported from on PYTHONPATH (unless it is a site directory already on the path), so the
    worker runs the same code even when the caller put it on ``sys.path`` by hand."""
    env = dict(os.environ)
    root = _package_root()
    dirs = [*getattr(site, "getsitepackages", list)(), site.getusersitepackages()]
    sites = {str(Path(p).resolve()) for p in dirs}
    if root not in sites:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


# The dictConfig file this process's logging came from (``rltserve serve --log-config-file``),
# which its workers load too: their records then go through the same handlers and formats. An
# environment variable, as vLLM's VLLM_LOGGING_CONFIG_PATH: the process's own setting, seen by
# whatever starts workers in it ("" or unset: none).
LOG_CONFIG_ENV = "RLTSERVE_LOG_CONFIG_FILE"


def set_log_config_file(path: str | None) -> None:
    """Workers started from now on set up logging from ``path`` (None: as ``_log_args`` says
    without one)."""
    if path is None:
        os.environ.pop(LOG_CONFIG_ENV, None)
    else:
        os.environ[LOG_CONFIG_ENV] = os.path.abspath(path)


def handed_logging() -> str | int | None:
    """The logging this process hands to the engines it starts (workers, Ray replicas): its
    logging configuration file when it has one (``set_log_config_file``), else its level,
    formatted as the server's, when it set up logging (the server does; a script usually does
    not: then neither do they)."""
    if path := os.environ.get(LOG_CONFIG_ENV):
        return path
    root = logging.getLogger()
    return root.getEffectiveLevel() if root.handlers else None  # (a number: custom names too)


def _log_args() -> list[str]:
    """The worker's logging flags: ``handed_logging``'s."""
    setup = handed_logging()
    if setup is None:
        return []
    if isinstance(setup, str):
        return ["--log-config-file", setup]
    return ["--log-level", str(setup)]


class LastException:
    """The line naming the exception of the latest traceback in an error output (``Type:
    message``, the first unindented line after ``Traceback (most recent call last):``; its
    frames are indented). An uncaught exception prints it last before its process exits."""

    def __init__(self) -> None:
        self.line: str | None = None
        self._in_traceback = False

    def feed(self, line: str) -> None:
        if line.startswith(_TRACEBACK):
            self._in_traceback = True
        elif self._in_traceback and line.strip() and not line[0].isspace():
            self.line = line.rstrip()
            self._in_traceback = False


def _relay(stream: IO[bytes], last: LastException) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", "replace")
        last.feed(line)
        with contextlib.suppress(Exception):  # a closed or odd sys.stderr must not stop the relay
            sys.stderr.write(line)
            sys.stderr.flush()
    stream.close()


class _Outbox:
    """The messages on their way to the worker, in order, written by one thread; ``failed``: the
    error that broke the channel (nothing more is written then)."""

    def __init__(self, conn: Connection) -> None:
        self.failed: Exception | None = None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        thread = threading.Thread(target=self._write, args=(conn,), name="rltserve-stage-sender")
        thread.daemon = True
        thread.start()

    def put(self, data: memoryview | None) -> None:
        self._queue.put(data)

    def _write(self, conn: Connection) -> None:
        while (data := self._queue.get()) is not None:
            try:
                conn.send_bytes(data)
            except Exception as exc:  # (OSError; TypeError once close() dropped the handle)
                self.failed = exc
                return


class WorkerProcess:
    def __init__(self, proc: subprocess.Popen, conn: Connection) -> None:
        self._proc = proc
        self._conn = conn
        self._outbox = _Outbox(conn)
        self._pickler = GuidePickler()
        self._pickling = threading.Lock()  # (pickle and queue in one order: see the module doc)
        self._last_exception = LastException()
        self._relay = threading.Thread(
            target=_relay, args=(proc.stderr, self._last_exception), name="rltserve-stage-stderr"
        )
        self._relay.daemon = True
        self._relay.start()
        self.pid = proc.pid

    @classmethod
    def start(cls, config: EngineConfig, role: str | None = None) -> WorkerProcess:
        """Launches a worker and hands it ``config``; raises ``StageError`` naming the cause
        when it cannot be started. ``role`` goes on its command line (``--role prefill``), so
        that ``ps`` (and the log lines that name their stage) tell a disaggregated engine's two
        workers apart."""
        from rltserve.core.stage import StageError

        command = f"{sys.executable or 'python'} -c <{WORKER_MODULE}.main>"
        if not sys.executable:
            raise StageError(
                f"cannot start the stage worker ({command}): this interpreter does not know its "
                "own executable (sys.executable is empty); pass in_process=True instead"
            )
        ours, theirs = socket.socketpair()
        try:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    _BOOTSTRAP.format(root=_package_root(), module=WORKER_MODULE),
                    "--fd",
                    str(theirs.fileno()),
                    "--parent-pid",
                    str(os.getpid()),
                    *_log_args(),
                    *(["--role", role] if role else []),
                ],  # fmt: skip
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                env=_worker_env(),
            )
        except (OSError, ValueError) as exc:  # ValueError: pass_fds where it is unsupported
            ours.close()
            raise StageError(f"cannot start the stage worker ({command}): {exc}") from exc
        finally:
            theirs.close()
        worker = cls(proc, Connection(ours.detach()))
        with contextlib.suppress(OSError):  # it died at once; the reader reports why
            worker.send(config)
        return worker

    def send(self, message: object) -> None:
        """Queues ``message`` for the worker; never blocks. A message that cannot be pickled
        raises here, as one naming the caller's ``__main__`` does (the worker could not read
        it: ``GuidePickler``); OSError once the channel broke (the worker is gone)."""
        if (failed := self._outbox.failed) is not None:
            raise OSError(f"the stage channel is broken: {failed}")
        with self._pickling:
            self._outbox.put(self._pickler.dumps(message))

    def recv(self) -> tuple:
        return self._conn.recv()

    def request_stop(self) -> None:
        """Queues ("shutdown",), after what was sent before (a worker that does not read,
        stopped or stuck in a step, is killed by ``stop``)."""
        with contextlib.suppress(OSError):
            self.send(("shutdown",))

    def stop(self, timeout: float) -> None:
        """Asks the worker to shut down and waits up to ``timeout`` seconds; then kills it."""
        if self._proc.poll() is None:
            self.request_stop()
            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                self._proc.wait()
        self._outbox.put(None)  # (the worker is gone: its sender thread ends)

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            self._proc.kill()

    def close(self) -> None:
        self._outbox.put(None)
        self._conn.close()

    def exit_reason(self) -> str:
        """Why the channel closed: the worker's exit code or signal and, when it exited with an
        error code (an uncaught exception: an import error, say), that exception's line. A
        signal (a kill, a crash) comes with no line: whatever traceback preceded it was handled
        and logged, so it is not the cause."""
        try:
            code = self._proc.wait(5.0)
        except subprocess.TimeoutExpired:
            code = None
        self._relay.join(2.0)
        if code is not None and code < 0:
            return f"worker process killed by signal {-code}"
        reason = f"worker process exited (code {code})"
        if code and self._last_exception.line is not None:
            reason += f": {self._last_exception.line}"
        return reason
