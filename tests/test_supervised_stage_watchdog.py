"""``SupervisedStage``'s watchdog (rltserve/http/supervisor.py) on fake stages and a
hand-advanced clock: it measures only open requests without progress, names the stage that
holds a disaggregated engine back and kills only a hung prefill stage."""

from __future__ import annotations

from test_supervised_stage import _Clock, _FakeStage, _supervised, _token


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
