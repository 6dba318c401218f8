"""StepThread: jobs run in order on one thread, exceptions reach the caller, the idle hook runs
while nothing is queued and is polled while it reports pending work; an engine dropped without
``shutdown`` does not leave its thread behind."""

from __future__ import annotations

import gc
import sys
import threading
import time

import pytest
from engine_util import make_core

from rltserve.core.executor import ExecutionFuture, StepThread
from rltserve.core.plan import StepResult


def test_jobs_run_in_order_on_one_thread():
    thread = StepThread()
    try:
        seen: list[tuple[int, str]] = []
        futures = [
            thread.submit(lambda i=i: seen.append((i, threading.current_thread().name)))
            for i in range(20)
        ]
        for f in futures:
            f.result(timeout=10)
        assert [i for i, _ in seen] == list(range(20))
        assert {name for _, name in seen} == {"rltserve-step"}
        assert thread.call(lambda: 7) == 7
    finally:
        thread.shutdown()


def test_exceptions_reach_the_caller_and_the_thread_survives():
    thread = StepThread()
    try:
        with pytest.raises(ZeroDivisionError):
            thread.call(lambda: 1 / 0)
        assert thread.call(lambda: "alive") == "alive"
        # (BaseExceptions too: an uncaught one would end the thread and leave its caller waiting)
        exiting = thread.submit(sys.exit, 3)
        assert isinstance(exiting.exception(timeout=30), SystemExit)
        assert thread.call(lambda: "alive") == "alive"
    finally:
        thread.shutdown()


def test_stop_called_on_the_thread_itself_does_not_wait_for_itself():
    """(An engine's finalizer may run on its own step thread.)"""
    thread = StepThread()
    assert thread.call(thread.stop, 5.0) is None
    thread._thread.join(30)
    assert not thread.alive


def test_idle_hook_is_polled_while_it_reports_pending_work():
    thread = StepThread()
    calls = {"n": 0}
    done = threading.Event()

    def hook() -> bool:
        calls["n"] += 1
        if calls["n"] >= 5:
            done.set()
            return False  # nothing pending any more: the thread sleeps until the next job
        return True

    try:
        thread.set_idle(hook)
        thread.call(lambda: None)  # the hook is consulted once the queue runs dry
        assert done.wait(10)
        time.sleep(0.05)
        assert calls["n"] == 5  # not polled once it reported no pending work
        thread.call(lambda: None)
        time.sleep(0.05)
        assert calls["n"] >= 6  # idle again after the job
    finally:
        thread.set_idle(None)
        thread.shutdown()


def test_completed_future():
    result = StepResult(3, [])
    future = ExecutionFuture.completed(result)
    assert future.done() and future.result() is result


def test_an_engine_dropped_without_shutdown_stops_its_step_thread(ckpts):
    """Its thread (and, through the idle hook, its runner and model) goes with the engine."""

    def step_threads() -> int:
        return sum(t.name == "rltserve-step" for t in threading.enumerate())

    gc.collect()  # (engines other tests dropped go first: their threads would count here)
    before = step_threads()
    core = make_core(ckpts["ouro"], async_scheduling=True, exit_mode="delayed")
    assert step_threads() == before + 1
    del core
    gc.collect()
    assert step_threads() == before  # the finalizer waited for it
