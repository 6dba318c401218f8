"""``SupervisedStage``'s watchdog (rltserve/http/supervisor.py) on fake stages and a
hand-advanced clock: it measures only open requests without progress, names the stage that
holds a disaggregated engine back, kills only a hung prefill stage, and kills a stage that
leaves a control call unanswered."""

from __future__ import annotations

import contextlib
import threading

from test_supervised_stage import _Clock, _FakeStage, _Sleepy, _supervised, _token


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
