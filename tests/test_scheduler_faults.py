"""Faults of the scheduler: an error while it applies a step's result fails that step's requests
only, an error while it plans fails every request and the engine serves on (also in the engine
loop with two steps in flight); every update of an applied step carries the weight version.
Everything else continues with the oracle's tokens and nothing leaks."""

from __future__ import annotations

import pytest
from engine_util import make_core
from fault_util import (
    CONFIGS,
    PROMPTS,
    Outcome,
    assert_clean,
    assert_serves_on,
    assert_survivors,
    configured,
    drive,
    oracle,
)

from rltserve.core.request import FinishReason
from rltserve.sampling import SamplingParams


@pytest.mark.parametrize("finished_first", [False, True], ids=["raises", "finishes-raises"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_an_apply_error_fails_only_the_steps_requests(ouro_rv1, ouro_ref, name, finished_first):
    """The scheduler raising while it applies a step's result: that step's requests fail with
    the error (also one it finished before raising), every other request continues exactly,
    nothing leaks."""
    core, params, lag = configured(ouro_rv1, name, max_num_seqs=3)
    sched = core.scheduler
    apply = sched.apply
    hit: dict[str, set[str]] = {}

    class BrokenStopIds(frozenset):
        """A request's stop ids, tested for every token applied (a row of ``StepUpdates``'
        columns or not): the step's last test raises, after the step's other tokens were
        applied, and after ending the request when ``finished_first``."""

        def __contains__(self, token):
            hit["tested"] = tested = hit.get("tested", 0) + 1
            if tested < hit["samples"]:
                return frozenset.__contains__(self, token)
            if finished_first and not self.request.is_finished:
                sched.finish(self.request, FinishReason.STOP)
                assert self.request.request_id not in sched.requests
            raise RuntimeError("injected apply failure")

    def faulty_apply(plan, result):
        # Mid-generation, a step that samples while other requests are running or waiting.
        planned = {it.request_id for it in plan.items}
        planned |= set(result.carried.request_ids if result.carried else ())
        others = set(sched.requests) - planned
        samples = any(r is not None and r.exited for r in result.items)
        samples |= bool(result.carried and any(result.carried.exited))
        if hit or plan.step_id < 4 or not samples or not others:
            return apply(plan, result)
        hit.update(step={plan.step_id}, faulty=planned & set(sched.requests))
        hit["samples"] = sum(r is not None and r.exited for r in result.items)
        hit["samples"] += sum(result.carried.exited) if result.carried else 0
        for rid in hit["faulty"]:
            request = sched.requests[rid]
            request.stop_ids = BrokenStopIds(request.stop_ids)
            request.stop_ids.request = request
        return apply(plan, result)

    sched.apply = faulty_apply
    out = drive(core, params, lag=lag)
    assert hit, "the fault was never injected"
    assert hit["tested"] == hit["samples"]  # (every token of the step came to its test)
    failed = {rid for rid, why in out.finish.items() if why == "error"}
    assert failed == hit["faulty"]
    (step,) = hit["step"]
    for rid in failed:
        want = f"engine error while applying step {step}: RuntimeError: injected apply failure"
        assert out.errors[rid] == want
    assert_survivors(ouro_ref, core, out, params, failed)
    assert_serves_on(ouro_ref, core, params["a"], lag)
    core.shutdown()


def _break_planning(core, at_call: int) -> None:
    """The scheduler's ``at_call``-th schedule() raises (once: the engine replaces it)."""
    schedule, calls = core.scheduler.schedule, [0]

    def broken():
        calls[0] += 1
        if calls[0] == at_call:
            raise RuntimeError("injected planning failure")
        return schedule()

    core.scheduler.schedule = broken


PLANNING_ERROR = "engine error while planning a step: RuntimeError: injected planning failure"


def test_a_planning_error_fails_every_request_and_the_engine_serves_on(ouro_rv1, ouro_ref):
    core = make_core(ouro_rv1, max_num_seqs=3)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for rid in PROMPTS:
        core.add_request(rid, PROMPTS[rid], params)
    _break_planning(core, at_call=4)
    out = Outcome()
    for _ in range(100):
        for u in core.step():
            out.tokens.setdefault(u.request_id, []).extend(u.new_token_ids)
            if u.finish_reason is not None:
                out.finish[u.request_id], out.errors[u.request_id] = u.finish_reason, u.error
        if not core.has_work():
            break
    assert out.finish == dict.fromkeys(PROMPTS, FinishReason.ERROR)
    assert out.errors == dict.fromkeys(PROMPTS, PLANNING_ERROR)
    for rid, tokens in out.tokens.items():  # what came out before the failure is right
        assert tokens == oracle(ouro_ref, core, rid, params).tokens[: len(tokens)]
    assert core.kv.usage == 0 and not core.scheduler.requests
    assert_serves_on(ouro_ref, core, params, lag=0)
    core.shutdown()


def test_a_planning_error_in_the_engine_loop_with_two_steps_in_flight(ouro_rv1, ouro_ref):
    import asyncio

    from rltserve.core.engine_loop import run_engine_loop

    core = make_core(ouro_rv1, max_num_seqs=3, async_scheduling=True, exit_mode="delayed")
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, exit_threshold=0.5)
    _break_planning(core, at_call=5)
    finish: dict[str, tuple] = {}
    tokens: dict[str, list[int]] = {}

    async def main() -> None:
        inbox: asyncio.Queue = asyncio.Queue()
        for rid in PROMPTS:
            inbox.put_nowait(("add", rid, PROMPTS[rid], params))

        def emit(updates, stats) -> None:
            for u in updates:
                tokens.setdefault(u.request_id, []).extend(u.new_token_ids)
                if u.finish_reason is not None:
                    assert u.request_id not in finish, u  # one final update per request
                    finish[u.request_id] = (u.finish_reason, u.error)
                    if set(finish) == set(PROMPTS):  # then a new request
                        inbox.put_nowait(("add", "again", PROMPTS["a"], params))
                    if u.request_id == "again":
                        inbox.put_nowait(("shutdown",))

        await asyncio.wait_for(run_engine_loop(core, inbox, emit), timeout=120)

    asyncio.run(main())
    assert {rid: finish[rid] for rid in PROMPTS} == dict.fromkeys(
        PROMPTS, (FinishReason.ERROR, PLANNING_ERROR)
    )
    want = oracle(ouro_ref, core, "a", params)
    assert finish["again"] == (FinishReason.LENGTH, None)
    assert tokens["again"] == want.tokens
    final = core.plan()  # the release of the last request reaches the runner
    if final is not None:
        core.execute(final)
    assert_clean(core)
    core.shutdown()


def test_every_update_of_an_applied_step_carries_the_weight_version(ouro_rv1):
    """Column rows and whole updates alike, in process and through the wire, on each of
    ``EngineCore.apply``'s ways out: a step applied, a step whose apply raised (its requests
    fail), and one where failing them raised too (every request fails, the engine starts
    over)."""
    from rltserve.updates import StepUpdates, from_wire, to_wire

    core = make_core(ouro_rv1, max_num_seqs=3)
    core.weight_version = 7
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for rid in PROMPTS:
        core.add_request(rid, PROMPTS[rid], params)

    def step() -> tuple:
        """The next step that reports tokens (those before it applied)."""
        while True:
            plan = core.plan()
            result = core.runner.execute(plan)
            if result.carried and result.carried.request_ids:
                return plan, result
            stamped(core.apply(plan, result))

    def stamped(updates) -> list:
        assert isinstance(updates, StepUpdates)
        got = list(updates)
        assert from_wire(to_wire(updates)) == got
        assert all(u.weight_version == 7 for u in got)
        return got

    rows = 0
    for _ in range(6):
        updates = core.apply(*step())
        rows += len(updates.rows)
        stamped(updates)
    assert rows  # (some tokens went as column rows)
    sched = core.scheduler

    def broken_apply(plan, result):
        raise RuntimeError("injected apply failure")

    plan, result = step()
    sched.apply = broken_apply
    failed = stamped(core.apply(plan, result))
    assert failed and {u.finish_reason for u in failed} == {FinishReason.ERROR}
    assert core.scheduler is sched and sched.requests  # (only the step's requests failed)
    del sched.apply

    def broken_abort(rid):
        raise RuntimeError("injected abort failure")

    plan, result = step()
    rids = set(sched.requests)
    sched.apply, sched.abort = broken_apply, broken_abort
    failed = stamped(core.apply(plan, result))
    assert {u.request_id for u in failed} == rids
    assert {u.finish_reason for u in failed} == {FinishReason.ERROR}
    assert core.scheduler is not sched and not core.scheduler.requests  # (started over)
    core.shutdown()
