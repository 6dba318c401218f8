"""ModelRunner delivery: results stay on the device until delivered, in launch order; deferred
delivery happens inside the next launch (after its loop is queued) or when the step thread is
idle; steps that can roll back are delivered at once; a failed step fails only itself."""

from __future__ import annotations

import pytest
from engine_util import make_core, oracle_run

from rltserve.sampling import SamplingParams


def _two_requests(core, **params):
    p = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, **params)
    core.add_request("a", [1, 2, 3], p)
    core.add_request("b", [4, 5], p)


def test_deferred_result_is_delivered_inside_the_next_launch(ouro_rv1):
    core = make_core(ouro_rv1, async_scheduling=True, exit_mode="delayed")
    core.runner.defer_results = True
    _two_requests(core, exit_threshold=0.5)
    first_plan = core.plan()
    first = core.runner.launch(first_plan)
    assert not first.future.done()  # still "on the device"
    second = core.runner.launch(core.plan())
    assert first.future.done() and not second.future.done()
    core.apply(first_plan, first.result())
    assert second.result().error is None  # result() delivers on demand
    assert not core.runner._undelivered


def test_poll_delivers_when_idle_and_execute_delivers_at_once(ouro_rv1):
    core = make_core(ouro_rv1)
    core.runner.defer_results = True
    _two_requests(core)
    handle = core.runner.launch(core.plan())
    assert core.runner.poll() is False  # the CPU is never busy after a launch
    assert handle.future.done()
    core.runner.defer_results = False
    plan = core.plan()
    assert core.runner.execute(plan).step_id == plan.step_id


def test_step_checking_a_draft_is_delivered_at_once(ouro_rv1):
    core = make_core(ouro_rv1, speculative_tokens=1, draft_loops=2, async_scheduling=True)
    core.runner.defer_results = True
    core.add_request("a", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    eager = 0
    handles = []
    while core.has_work():
        plan = core.plan()
        handle = core.runner.launch(plan)
        eager += handle.future.done()
        handles.append(handle)
        core.apply(plan, handle.result())
    assert core.runner.drafts_checked > 0
    assert eager >= core.runner.drafts_checked  # every checking step delivered itself


def test_failed_launch_delivers_earlier_steps_first(ouro_rv1, monkeypatch):
    core = make_core(ouro_rv1)
    core.runner.defer_results = True
    _two_requests(core)
    plan1 = core.plan()
    first = core.runner.launch(plan1)
    loop = core.model.loop
    monkeypatch.setattr(core.model, "loop", lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
    plan2 = core.plan()
    second = core.runner.launch(plan2)
    monkeypatch.setattr(core.model, "loop", loop)
    assert first.future.done() and first.result().error is None
    assert "boom" in second.result().error
    core.apply(plan1, first.result())
    updates = core.apply(plan2, second.result())
    assert {u.request_id for u in updates} == {"a", "b"}
    assert all(u.error and "boom" in u.error for u in updates)
    core.plan()  # releases reach the runner
    core.kv.check_no_leaks()


@pytest.mark.parametrize("deferred", [False, True])
def test_submit_on_the_step_thread_completes_every_future(ouro_rv1, deferred):
    core = make_core(ouro_rv1, async_scheduling=True, exit_mode="delayed")
    core.runner.defer_results = deferred
    _two_requests(core, exit_threshold=0.5)
    tokens = {"a": [], "b": []}
    in_flight = []
    while core.has_work() or in_flight:
        while len(in_flight) < 2 and (plan := core.plan()) is not None:
            in_flight.append((plan, core.runner.submit(plan)))
        plan, future = in_flight.pop(0)
        for update in core.apply(plan, future.result(timeout=30)):
            tokens[update.request_id].extend(update.new_token_ids)
    assert [len(t) for t in tokens.values()] == [4, 4]
    core.shutdown()


def test_failed_step_does_not_fail_the_next_planned_step(ouro_rv1, ouro_ref, monkeypatch):
    core = make_core(ouro_rv1, max_num_seqs=1)
    p = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    core.add_request("a", [1, 2, 3], p)
    core.add_request("b", [4, 5], p)
    plan1 = core.plan()
    loop = core.model.loop
    monkeypatch.setattr(core.model, "loop", lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
    result1 = core.runner.execute(plan1)
    monkeypatch.setattr(core.model, "loop", loop)
    plan2 = core.plan()  # planned before the failure is applied: "a" continues, no room for "b"
    result2 = core.runner.execute(plan2)
    assert "boom" in result1.error and result2.error is None
    assert [u.request_id for u in core.apply(plan1, result1)] == ["a"]
    core.apply(plan2, result2)
    tokens = []
    while core.has_work():
        for u in core.step():
            assert u.error is None
            tokens.extend(u.new_token_ids)
    # "b" ran to completion after "a" failed, with the oracle's tokens.
    assert tokens == oracle_run(ouro_ref, [4, 5], p, kv_policy="last_exited").tokens
    core.execute(core.plan())  # releases reach the runner
    assert not core.runner.live and not core.runner._dropped
    core.kv.check_no_leaks()


def test_device_error_while_idle_fails_the_step_and_keeps_the_thread(ouro_rv1, monkeypatch):
    core = make_core(ouro_rv1, async_scheduling=True, exit_mode="delayed")
    core.runner.defer_results = True
    _two_requests(core)

    def broken(self):
        raise RuntimeError("device lost")

    monkeypatch.setattr("rltserve.core.staging.StepOutputs.ready", broken)
    monkeypatch.setattr("rltserve.core.staging.StepOutputs.read", broken)
    plan = core.plan()
    future = core.runner.submit(plan)
    assert "device lost" in future.result(timeout=30).error
    assert core.runner._executor.call(lambda: "alive") == "alive"
    core.shutdown()


def test_busy_time_counts_each_delivery_once(ouro_rv1):
    import time

    core = make_core(ouro_rv1, async_scheduling=True, exit_mode="delayed")
    core.runner.defer_results = True
    _two_requests(core, exit_threshold=0.5)
    start = time.perf_counter()
    handles = []
    while core.has_work() or handles:
        plan = core.plan()
        if plan is not None:
            handles.append((plan, core.runner.launch(plan)))
        if len(handles) > 1 or (plan is None and handles):
            done, handle = handles.pop(0)
            core.apply(done, handle.result())
    wall = time.perf_counter() - start
    assert 0 < core.runner.busy_seconds <= wall
