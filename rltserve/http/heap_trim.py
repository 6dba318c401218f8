"""The server process's freed heap given back to the kernel once HTTP traffic stops (glibc's
``malloc_trim``), as the stage worker gives back its own (``stage_worker.trim_heap``).

The server's threads allocate from glibc arenas of their own (the event loop; the stage
client's reader, which unpickles every update; the tokenizer pool), and what a burst of requests
frees stays in them, where the top of a heap cannot be cut. Untrimmed, an idle server's RSS
counts that free memory too (3.5 MB of 78 MB after a 12-minute chat soak: docs/benchmarks.md,
"Chat soak"), so idle samples mix what is in use with what the allocator kept. ``IdleTrim``
counts the requests in flight (the ``activity`` middleware) and trims once none has run for
``IDLE_S`` after some did, on a worker thread (a trim that returns tens of MB takes tens of ms,
which the event loop must not wait for)."""

from __future__ import annotations

import asyncio
import ctypes
import logging
import platform
import sys
from collections.abc import Callable
from concurrent.futures import Executor

log = logging.getLogger("rltserve.http")
IDLE_S = 1.0  # quiet seconds before a trim (as long as the stage's engine loop waits)


def heap_trimmer() -> Callable[[], object] | None:
    """``malloc_trim(0)`` of this process's C library; None where it has none (not glibc)."""
    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
    return lambda: trim(0)


class IdleTrim:
    """Trims the heap ``idle_s`` after the last request in flight ended (once per quiet spell;
    a request that starts meanwhile puts it off). ``trim``: None turns it off."""

    def __init__(
        self,
        trim: Callable[[], object] | None,
        executor: Executor | None = None,
        idle_s: float = IDLE_S,
    ) -> None:
        self.trim = trim
        self.executor = executor
        self.idle_s = idle_s
        self.active = 0  # requests in flight
        self.trims = 0  # trims done (tests, and a debug line each)
        self._timer: asyncio.TimerHandle | None = None
        self._closed = False

    def begin(self) -> None:
        self.active += 1
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def end(self) -> None:
        self.active -= 1
        if self.active or self.trim is None or self._closed:
            return
        self._timer = asyncio.get_running_loop().call_later(self.idle_s, self._start)

    def close(self) -> None:
        """No trim after this (server shutdown: the executor is going away)."""
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _start(self) -> None:
        self._timer = None
        if self.active or self._closed:
            return
        loop = asyncio.get_running_loop()
        try:
            job = loop.run_in_executor(self.executor, self._trim)
        except RuntimeError:  # (the executor was shut down)
            return
        job.add_done_callback(_retrieved)

    def _trim(self) -> None:
        self.trim()
        self.trims += 1
        log.debug("idle: heap trimmed (%d so far)", self.trims)


def _retrieved(job: asyncio.Future) -> None:
    if not job.cancelled() and (exc := job.exception()) is not None:
        log.warning("idle heap trim failed: %s", exc)
