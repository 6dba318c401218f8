"""Priority preemption and aborts under KV pressure: better-priority arrivals preempt worse
running requests (for KV and for seats) and every output still equals the oracle; a request
aborted in any state preemption leaves it in (waiting to recompute, swapped out, recomputing
generated tokens) ends there, the others continue exactly, and nothing is left behind."""

from __future__ import annotations

import pytest
from engine_util import oracle_run
from test_preemption import MODES, ROOMY, SWAP_GB, TIGHT, _oracle, _run, _workload

from rltserve.core.request import RequestStatus, Resume


def _preempted_state(request) -> str | None:
    """Where a preempted request stands: waiting to recompute, waiting with KV in swap space,
    or resumed and recomputing generated tokens (recompute, or the positions after its swapped
    KV)."""
    if not request.num_preemptions:
        return None
    if request.status is RequestStatus.WAITING:
        return "swapped" if request.resume is Resume.SWAP else "waiting"
    replaying = request.resume is Resume.RECOMPUTE
    return "replaying" if replaying and request.replay_until > request.num_prompt_tokens else None


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("lag", [0, 1])
def test_aborts_of_preempted_requests(ckpts, ouro_ref, mode, lag):
    """One request aborted in each state a preempted request passes through (one abort a
    step, with a step of results still in flight under ``lag=1``): the others' outputs equal
    the oracle, the aborted ones' are its prefixes, and nothing is left behind."""
    prompts, params, arrivals = _workload(8, seed=8)
    aborted: dict[str, str] = {}  # state -> request id

    def abort_one(core):
        for request in list(core.scheduler.requests.values()):
            state = _preempted_state(request)
            if state is not None and state not in aborted:
                aborted[state] = request.request_id
                return [request.request_id]
        return []

    kw = {"exit_mode": "delayed", "async_scheduling": True} if lag else {}
    if mode == "swap":
        kw["swap_space_gb"] = SWAP_GB  # swaps some; the others wait to recompute
    tight, stats = _run(
        ckpts["ouro"],
        prompts,
        params,
        arrivals,
        lag=lag,
        abort_when=abort_one,
        preemption_mode=mode,
        **kw,
        **TIGHT,
    )
    want_states = {"waiting", "replaying"} | ({"swapped"} if mode == "swap" else set())
    assert want_states <= set(aborted), aborted
    assert {rid for rid, why in tight.finish.items() if why == "abort"} == set(aborted.values())
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        exit_mode = "delayed" if lag else "gate"
        want = oracle_run(ouro_ref, prompt, p, kv_policy="last_exited", exit_mode=exit_mode)
        rid = f"r{i}"
        got, depths = tight.tokens[rid], tight.depths[rid]
        assert got == want.tokens[: len(got)] and depths == want.exit_depths[: len(depths)]
        if rid not in aborted.values():
            assert got == want.tokens, rid


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("full", ["kv", "seats"])
def test_priority_preemption_equals_oracle(ckpts, ouro_ref, mode, full):
    """``scheduling_policy="priority"``: requests of a better priority arriving while worse
    ones hold the KV (or every seat) preempt them before a step is built; every output,
    the preempted ones' included, equals the oracle, and the better ones finish first."""
    prompts, params, _ = _workload(8, seed=13, thresholds=(1.0, 0.5))
    params = [p.replace(priority=1 if i < 4 else 0) for i, p in enumerate(params)]
    arrivals = [0] * 4 + [6] * 4
    by_priority = []

    def count(core):
        preemptor = core.scheduler.preemptor
        admit = preemptor.admit_by_priority

        def counted():
            before = preemptor.num_preemptions
            admit()
            by_priority.append(preemptor.num_preemptions - before)

        preemptor.admit_by_priority = counted

    kw = {"scheduling_policy": "priority", "preemption_mode": mode, "on_core": count}
    room = {**ROOMY, "max_num_seqs": 2} if full == "seats" else TIGHT
    run, stats = _run(ckpts["ouro"], prompts, params, arrivals, **kw, **room)
    assert sum(by_priority) >= 1
    _oracle(ouro_ref, run, prompts, params, "last_exited")
    order = list(run.finish)  # (in the order requests finished)
    assert set(order[:4]) == {"r4", "r5", "r6", "r7"}


def test_priority_preempts_nothing_when_the_worse_requests_cannot_make_room():
    """A better request whose first chunk needs more blocks than the free ones and those every
    worse request holds together preempts none of them: each victim would only wait behind it
    while the pool idled. Once they hold enough it preempts them."""
    from fixed_exits import FixedExits, make_request, make_scheduler

    s = make_scheduler(24, scheduling_policy="priority", prefill_chunk_size=16, max_num_seqs=8)
    s.add_request(make_request("r0", 16, 30, priority=0))
    runner = FixedExits()
    preemptor, by_priority = s.preemptor, []
    admit = preemptor.admit_by_priority

    def counted():
        before = preemptor.num_preemptions
        admit()
        by_priority.append(preemptor.num_preemptions - before)

    preemptor.admit_by_priority = counted

    def step():
        plan = s.schedule()
        s.apply(plan, runner.result(plan))
        return plan

    while s.kv.num_free_blocks > 6:
        step()
    s.add_request(make_request("r1", 4, 40, priority=5))
    step()
    assert s.kv.num_free_blocks == 4  # r0 holds 18 blocks, r1 2
    s.add_request(make_request("best", 16, 5, priority=2))  # its first chunk: 8 blocks
    plan = step()
    assert plan.preempted == [] and {r.request_id for r in s.running} == {"r0", "r1"}
    assert by_priority[-1] == 0
    while "best" not in {r.request_id for r in s.running}:
        step()
        if by_priority[-1]:  # (only once r1 holds what best lacks: best is in at once)
            assert "best" in {r.request_id for r in s.running}
    while s.has_work():
        step()
    assert s.kv.usage == 0.0


def test_priority_preempts_when_only_the_watermark_kept_the_better_request_out():
    """The watermark is kept free only while requests run: a better request whose first chunk
    fits the pool once every (worse) running request is gone preempts them, rather than
    waiting behind them for all their outputs."""
    from fixed_exits import FixedExits, make_request, make_scheduler

    s = make_scheduler(20, watermark=0.2, scheduling_policy="priority", prefill_chunk_size=64)
    s.add_request(make_request("worse", 4, 20, priority=5))
    runner = FixedExits()

    def step():
        plan = s.schedule()
        s.apply(plan, runner.result(plan))
        return plan

    for _ in range(3):
        step()
    s.add_request(make_request("best", 36, 5, priority=0))  # 18 blocks, 4 of watermark
    plan = step()
    assert plan.preempted == ["worse"] and [r.request_id for r in s.running] == ["best"]
    while s.has_work():
        step()
    assert s.kv.usage == 0.0
