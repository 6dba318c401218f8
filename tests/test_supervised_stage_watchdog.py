"""``SupervisedStage``'s watchdog (rltserve/http/supervisor.py) on fake stages and a
hand-advanced clock: it measures only open requests without progress, names the stage that
holds a disaggregated engine back, kills only a hung prefill stage, and kills a stage that
leaves a control call unanswered (its caller told why); a restarted stage that hangs while it
gets its weights or sleep back is killed, bounded, before it serves."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time

import pytest
from test_supervised_stage import (
    _Clock,
    _FakeStage,
    _gave_up_lines,
    _Sleepy,
    _supervised,
    _token,
    _update_file,
)

from rltserve.core.stage import StageError


def test_supervised_stage_watchdog_measures_only_open_requests_without_progress():
    clock = _Clock()
    a = _FakeStage("a")
    sup, _, _ = _supervised(a, clock=clock, watchdog_s=10.0)
    clock.now += 100  # idle for long: not hung, and the first request starts the measure
    assert sup.check() is None
    sup.add_request("r1", [1], None, lambda u: None)
    assert sup.check() is None
    clock.now += 8
    a.sinks["r1"](_token("r1"))  # progress
    clock.now += 7
    assert sup.check() is None
    clock.now += 4  # 11 s without progress
    assert "stage watchdog" in sup.check()
    # watchdog 0: off
    sup, _, _ = _supervised(_FakeStage("b"), clock=clock, watchdog_s=0.0)
    sup.add_request("r1", [1], None, lambda u: None)
    clock.now += 1000
    assert sup.check() is None
    # a self-supervised client (Ray Serve replicas) replaces its own parts
    c = _FakeStage("c")
    c.self_supervised = True
    sup, _, _ = _supervised(c, clock=clock, watchdog_s=10.0)
    sup.add_request("r1", [1], None, lambda u: None)
    clock.now += 1000
    assert sup.check() is None


def test_supervised_stage_watchdog_names_the_hung_stage_and_kills_only_a_prefill_stage():
    clock = _Clock()
    a = _FakeStage("a")  # a disaggregated engine: which stage holds progress back
    a.stalled = "decode"
    a.stalled_stage = lambda: a.stalled
    a.kill_prefill = lambda: setattr(a, "prefill_killed", True)
    sup, _, _ = _supervised(a, clock=clock, watchdog_s=10.0)
    sup.add_request("r1", [1], None, lambda u: None)
    clock.now += 11
    assert sup.check().startswith("decode stage: no engine step finished within 10 s")
    # A hung prefill stage: killed alone (the client moves its prefills on and starts it
    # again); the client is not replaced and the watchdog measures afresh.
    a.stalled = "prefill"
    assert sup.check() is None and a.prefill_killed and not a.killed
    clock.now += 5
    assert sup.check() is None


def test_a_control_left_unanswered_by_a_prefill_stage_kills_only_that_stage():
    """A disaggregated engine whose prefill stage stopped answering a control: the prefill
    stage is killed alone (the control moves on to the decode stage, which serves alone
    meanwhile), not both; a control the decode stage leaves unanswered replaces the engine."""
    clock = _Clock()
    a = _Sleepy("a")
    a.waits_for = "prefill"
    a.control_stage = lambda: a.waits_for
    a.kill_prefill = lambda: setattr(a, "prefill_killed", True)
    sup, _, _ = _supervised(a, clock=clock, watchdog_s=10.0)
    with _unanswered(a, "reset_prefix_cache", sup.reset_prefix_cache):
        clock.now += 11
        assert sup.check() is None and a.prefill_killed and not a.killed
        clock.now += 9  # (measured afresh from the kill)
        assert sup.check() is None
        a.waits_for = "decode"
        clock.now += 2
        assert sup.check() == (
            "decode stage: no answer to reset_prefix_cache within 10 s (stage watchdog); killed it"
        )


@contextlib.contextmanager
def _unanswered(stage, name: str, call):
    """``call()`` on a thread while the fake ``stage``'s control ``name`` waits for an answer
    that comes at the end of the block."""
    called, answer = threading.Event(), threading.Event()

    def control(*args):
        called.set()
        assert answer.wait(30), "never answered"

    setattr(stage, name, control)
    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    try:
        assert called.wait(30)
        yield
    finally:
        answer.set()
        thread.join(30)
    assert not thread.is_alive()


def test_supervised_stage_watchdog_kills_a_stage_that_leaves_a_control_unanswered():
    """An idle stage that stopped reading (SIGSTOP) has no request to go without progress: a
    sleep it never answers would wait for good, and with it every request the server holds back
    meanwhile. A control gets its own timeout (the wait for running requests) plus
    ``watchdog_s`` (to apply it) before the stage counts as hung."""
    clock = _Clock()
    a = _Sleepy("a")
    sup, _, _ = _supervised(a, clock=clock, watchdog_s=10.0)
    with _unanswered(a, "sleep", lambda: sup.sleep(1, 60.0)):
        clock.now += 69  # (within 60 s of waiting for requests plus 10 s to apply)
        assert sup.check() is None
        clock.now += 2
        assert sup.check() == (
            "no answer to sleep within 10 s past its timeout (stage watchdog); killed it"
        )
    clock.now += 1000  # (answered: nothing left to wait for)
    assert sup.check() is None
    with _unanswered(a, "reset_prefix_cache", sup.reset_prefix_cache):  # (waits for nothing)
        clock.now += 11
        assert sup.check().startswith("no answer to reset_prefix_cache within 10 s (stage")
    # watchdog 0: off
    sup, _, _ = _supervised(a, clock=clock, watchdog_s=0.0)
    with _unanswered(a, "wake_up", lambda: sup.wake_up(["weights"])):
        clock.now += 1000
        assert sup.check() is None


class _Hanging(_Sleepy):
    """A stage whose controls ``hung`` never answer (a stopped worker) until it is killed or
    closed, which fails them as a stage client does."""

    def __init__(self, name: str, *hung: str) -> None:
        super().__init__(name)
        self.asked = threading.Event()
        self._ended = threading.Event()
        for control in hung:
            setattr(self, control, self._hang)

    def _hang(self, *args):
        self.asked.set()
        assert self._ended.wait(30), "never killed"
        raise StageError("stage closed before the request finished")

    def kill(self) -> None:
        super().kill()
        self._ended.set()

    def close(self) -> None:
        super().close()
        self._ended.set()


async def test_a_hung_control_answers_with_the_watchdogs_reason():
    """The caller of a control the watchdog ended learns why, not "stage closed"."""
    clock = _Clock()
    a = _Hanging("a", "sleep")
    sup, _, _ = _supervised(a, _Sleepy("b"), clock=clock, watchdog_s=10.0)
    errors: list[str] = []

    def call() -> None:
        try:
            sup.sleep(1, 5.0)
        except StageError as exc:
            errors.append(str(exc))

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    assert a.asked.wait(10)
    clock.now += 16
    reason = sup.check()
    await sup._replace(reason)
    thread.join(10)
    assert errors == [
        "stage died: no answer to sleep within 10 s past its timeout (stage watchdog); killed it"
    ]


async def test_a_restarted_stage_that_hangs_taking_its_weights_back_is_killed(tmp_path, caplog):
    """No other watchdog runs while the supervisor restarts a stage: one that hangs as it gets
    its weight updates or its sleep back is killed within ``watchdog_s`` and the attempt
    fails, so the restarts go on and end (``max_restarts``), never a restart held for good."""
    caplog.set_level(logging.INFO, logger="rltserve.http")
    w1 = _update_file(tmp_path / "w1.safetensors", x=1.0)
    a, hung, good = _Sleepy("a"), _Hanging("hung", "update_weights"), _Sleepy("good")
    sup, _, _ = _supervised(a, hung, good, clock=time.monotonic, watchdog_s=0.3)
    sup.update_weights([w1], False, 5.0)
    await asyncio.wait_for(sup._replace("boom"), 10)
    assert hung.killed and hung.closed and sup.inner is good and sup.alive
    assert good.weights == [[w1]] and sup.weight_version == 1
    assert (
        f"restart attempt 1: restart failed: weight update ['{w1}'] again: no answer to "
        "update_weights within 0.3 s (stage watchdog); killed it"
    ) in caplog.messages
    # One that never gets back to sleep: the attempts run out, the server gives up.
    hung = [_Hanging(str(i), "sleep") for i in range(2)]
    sup, _, _ = _supervised(
        _Sleepy("a"), *hung, clock=time.monotonic, watchdog_s=0.3, max_restarts=2
    )
    sup.sleep(1, 5.0)
    await asyncio.wait_for(sup._replace("boom"), 10)
    assert sup.gave_up and all(stage.killed for stage in hung)
    assert _gave_up_lines(caplog)[-1].endswith(
        "restart failed: putting it back to sleep: no answer to sleep within 0.3 s (stage "
        "watchdog); killed it"
    )


async def test_with_the_watchdog_off_a_restore_is_bounded_by_the_start_timeout(caplog):
    """``watchdog_s`` 0: the bound is ``startup_timeout_s``, and the reason names that flag."""
    caplog.set_level(logging.INFO, logger="rltserve.http")
    hung, good = _Hanging("hung", "sleep"), _Sleepy("good")
    sup, _, _ = _supervised(
        _Sleepy("a"), hung, good, clock=time.monotonic, watchdog_s=0.0, startup_timeout_s=0.3
    )
    sup.sleep(1, 5.0)
    await asyncio.wait_for(sup._replace("boom"), 10)
    assert hung.killed and sup.inner is good
    assert (
        "restart attempt 1: restart failed: putting it back to sleep: no answer to sleep within "
        "0.3 s (--startup-timeout-s); killed it"
    ) in caplog.messages


class _Loading(_Sleepy):
    """A new stage that never gets past its load (alive, never ready)."""

    def wait_ready(self, timeout=None):
        time.sleep(0.01)
        raise StageError("timed out waiting for the stage to load")


async def test_a_restarted_stage_that_never_loads_fails_its_attempt(caplog):
    caplog.set_level(logging.INFO, logger="rltserve.http")
    slow, good = _Loading("slow"), _Sleepy("good")
    sup, _, _ = _supervised(_Sleepy("a"), slow, good, clock=time.monotonic, startup_timeout_s=0.3)
    await asyncio.wait_for(sup._replace("boom"), 10)
    assert slow.closed and sup.inner is good and sup.alive
    assert (
        "restart attempt 1: restart failed: timed out waiting for the stage to load"
        in caplog.messages
    )


@pytest.mark.parametrize("how", ["close", "cancel"])
async def test_a_shutdown_during_a_hung_restore_kills_the_new_stage(how):
    """With the watchdog off the bound is the start's (long): a shutdown meanwhile must not
    wait for it, nor leave the new stage, or the thread calling it, behind."""
    hung = _Hanging("hung", "sleep")
    sup, _, _ = _supervised(_Sleepy("a"), hung, clock=time.monotonic, watchdog_s=0.0)
    sup.sleep(1, 5.0)
    task = asyncio.ensure_future(sup._replace("boom"))
    await asyncio.to_thread(hung.asked.wait, 10)
    sup.close() if how == "close" else task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.wait_for(task, 5)
    assert hung.killed and hung.closed and sup.inner is not hung
    assert "no answer" not in str(sup.error)  # (cut short by the shutdown, not a hang)
