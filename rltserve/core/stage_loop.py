"""The stage's side of its channel: ``serve`` builds the engine and runs its loop over the
commands a client sends (the messages: ``rltserve.core.stage``), in a worker process
(``stage_worker``) or on a thread of the caller (``InProcessStageClient``)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import traceback
from collections.abc import Callable

from rltserve.config import EngineConfig
from rltserve.updates import to_wire


def _new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:  # pragma: no cover - uvloop is a dependency on POSIX
        return asyncio.new_event_loop()


def serve(
    config: EngineConfig,
    recv: Callable[[], tuple],
    send: Callable[[tuple], None],
    on_idle: Callable[[], None] | None = None,
    role: str | None = None,
) -> None:
    """Builds the engine and runs its loop until shutdown; commands arrive through ``recv``.
    ``on_idle``: as ``run_engine_loop``'s; ``role``: the stage it is (its log lines say so)."""
    # Imported here: torch comes with the engine, and only the process that runs it needs it.
    from rltserve.core.engine import EngineCore
    from rltserve.core.engine_loop import run_engine_loop
    from rltserve.models.loader import CheckpointError

    try:
        core = EngineCore(config, role=role)
    except Exception as exc:
        # (A checkpoint that does not load is a failure: its path was checked before.)
        unloadable = isinstance(exc, CheckpointError)
        refused = isinstance(exc, ValueError) and not unloadable
        send(
            (
                "fatal",
                f"{type(exc).__name__}: {exc}",
                str(exc) if refused else None,
                str(exc) if unloadable else None,
            )
        )
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
            except Exception as exc:
                # A message that pickled in the client but does not unpickle here (an object
                # of a class this process cannot import). Its request would wait for good, and
                # which compiled constraints it registered (``guide_registry``) is unknown: the
                # stage fails, saying why, rather than go on without its commands. (The loop's
                # thread sends it: it writes every message of this process.)
                traceback.print_exc()
                fatal = f"a message from the client could not be read: {type(exc).__name__}: {exc}"
                command = ("shutdown",)
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(send, ("fatal", fatal))
            with contextlib.suppress(RuntimeError):  # the loop already closed
                loop.call_soon_threadsafe(inbox.put_nowait, command)
            if command[0] == "shutdown":
                return

    threading.Thread(target=pump, name="rltserve-stage-inbox", daemon=True).start()
    try:
        loop.run_until_complete(
            run_engine_loop(
                core,
                inbox,
                lambda u, st: send(("updates", to_wire(u), st)),
                # (Every reply carries what is asleep: the client's view follows the engine's,
                # whatever became of the command.)
                lambda token, error, version: send(
                    ("reply", token, error, version, sorted(core.sleeping))
                ),
                on_idle,
            )
        )
    except Exception as exc:
        # The traceback goes to this process's error output (the server's log); clients get
        # only the exception's type and message.
        traceback.print_exc()
        send(("fatal", f"engine loop failed: {type(exc).__name__}: {exc}"))
    finally:
        core.shutdown()
        loop.close()
