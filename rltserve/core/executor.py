"""The step thread: one thread that runs every torch call of a replica, and the futures of steps.

All heavy torch work of a replica stays on one thread (torch split across two threads of one
process measured ~15% slower on CPU), so with async scheduling the model is loaded, the runner
built and every step launched on the ``StepThread``, in submission order, while the engine's
event loop plans the next step.

A launched step's result may still be on the device (CUDA): the runner delivers it later,
either inside the next step (after that step's work is queued, so the device never idles) or
from the thread's *idle hook* when no job is waiting. ``ExecutionFuture`` completes when the
result reaches the host, not when the launch returns.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from rltserve.core.plan import StepResult

logger = logging.getLogger(__name__)

# How long the idle thread waits for a new job before polling the device again. Short: a step
# on a GPU takes about a millisecond, and its result should reach the engine promptly.
IDLE_POLL_S = 0.0002


class ExecutionFuture:
    """A submitted step. ``result()`` blocks until the step's StepResult is on the host."""

    def __init__(self, future: Future[StepResult]) -> None:
        self._future = future

    @classmethod
    def completed(cls, result: StepResult) -> ExecutionFuture:
        """A step that already ran (synchronous execution)."""
        future: Future[StepResult] = Future()
        future.set_result(result)
        return cls(future)

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> StepResult:
        return self._future.result(timeout)

    def wait(self) -> asyncio.Future[StepResult]:
        """Awaitable form for an asyncio loop."""
        return asyncio.wrap_future(self._future)


IdleHook = Callable[[], bool]


class StepThread:
    """Runs submitted callables one at a time, in order, on one dedicated thread.

    ``set_idle(hook)``: whenever no job is queued the thread calls ``hook()``; it returns True
    while work it owns is still running on the device, and the thread then calls it again after
    ``IDLE_POLL_S`` unless a job arrives first. Without pending device work the thread sleeps
    until the next job.
    """

    def __init__(self, name: str = "rltserve-step") -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._idle: IdleHook | None = None
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def set_idle(self, hook: IdleHook | None) -> None:
        self._idle = hook

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
        future: Future = Future()
        self._jobs.put((future, fn, args, kwargs))
        return future

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Runs ``fn`` on the thread and returns its result (or raises its exception)."""
        if threading.current_thread() is self._thread:
            return fn(*args, **kwargs)
        return self.submit(fn, *args, **kwargs).result()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, wait_s: float = 0.0) -> None:
        """Lets the thread end after the jobs already queued, waiting up to ``wait_s`` for it
        unless called on it (safe from any thread, a finalizer's included)."""
        self._jobs.put(None)
        if wait_s > 0 and threading.current_thread() is not self._thread:
            self._thread.join(wait_s)

    def shutdown(self) -> None:
        """Runs the jobs already queued, then stops the thread."""
        if self._thread.is_alive():
            self.stop()
            self._thread.join()

    def _next_job(self) -> tuple | None:
        while True:
            try:
                return self._jobs.get_nowait()
            except queue.Empty:
                pass
            waiting = False
            if self._idle is not None:
                try:
                    waiting = self._idle()
                except Exception:  # the hook's owner reports its own failures; keep serving
                    logger.exception("step thread idle hook failed")
            try:
                return self._jobs.get(timeout=IDLE_POLL_S) if waiting else self._jobs.get()
            except queue.Empty:
                continue

    def _main(self) -> None:
        while True:
            job = self._next_job()
            if job is None:
                return
            future, fn, args, kwargs = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as exc:  # delivered to whoever waits on the future
                future.set_exception(exc)
