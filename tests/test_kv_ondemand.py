"""On-demand KV blocks, admission, victim choice and priority, on the torch-free scheduler with
hand-built step results (milliseconds), plus the engine's KV usage and config validation."""

from __future__ import annotations

import weakref

import pytest
from engine_util import make_core, run_core
from fixed_exits import FixedExits, make_request, make_scheduler

from rltserve.config import CacheConfig, EngineConfig, SchedulerConfig
from rltserve.core.kv_cache import KVManager, KVPolicy
from rltserve.core.plan import StepPlan, StepResult
from rltserve.core.request import RequestStatus
from rltserve.core.scheduler import Scheduler
from rltserve.sampling import SamplingParams

LOOPS = 2


RUNNERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _result(s: Scheduler, plan: StepPlan) -> StepResult:
    """Every output position exits where its fixed spec says, sampling token 7 (carried
    tokens included: ``FixedExits`` runs them on as the runner does)."""
    return RUNNERS.setdefault(s, FixedExits()).result(plan)


def _step(s: Scheduler) -> StepPlan | None:
    plan = s.schedule()
    if plan is not None:
        s.apply(plan, _result(s, plan))
    return plan


def _drain(s: Scheduler, limit: int = 1000) -> list[StepPlan]:
    plans = []
    while s.has_work():
        plan = _step(s)
        if plan is not None:
            plans.append(plan)
        assert len(plans) < limit
    _step(s)  # hands the last releases over
    s.kv.check_no_leaks()
    assert s.kv.pool.num_used == 0
    return plans


def test_blocks_follow_written_positions():
    s = make_scheduler()
    s.add_request(make_request("a", 10, 20))
    planes = LOOPS
    while s.has_work():
        plan = _step(s)
        if s.has_work():
            scheduled = s.requests["a"].num_scheduled
            # What is written plus what the planned step writes, on every plane, no more.
            assert s.kv.pool.num_used == planes * -(-scheduled // 4)
            assert s.kv.covered("a") == scheduled
        assert plan is not None
    _step(s)
    assert s.kv.pool.num_used == 0


def test_extend_covers_within_a_block_and_only_asks_past_it():
    kv = KVManager(16, 4, KVPolicy("last_exited"), has_boundary=False)
    kv.allocate("a", 5, LOOPS)  # 2 blocks a plane
    used = kv.pool.num_used
    assert kv.extend("a", 7) == 0 and kv.covered("a") == 7  # still in the second block
    assert kv.extend("a", 6) == 0 and kv.covered("a") == 7  # never shrinks
    assert kv.extend("a", 9) == LOOPS  # a third block on every plane: asked, not taken
    assert kv.covered("a") == 7 and kv.pool.num_used == used
    assert kv.extend("a", 9) == kv.blocks_to_grow("a", 9)
    kv.grow("a", 9)
    assert kv.covered("a") == 9 and kv.pool.num_used == used + LOOPS


def test_full_reservation_reserves_the_whole_context():
    s = make_scheduler(reservation="full")
    s.add_request(make_request("a", 10, 20))
    _step(s)
    assert s.kv.pool.num_used == LOOPS * -(-29 // 4)  # prompt + max_tokens - 1 positions
    _drain(s)


def test_admission_checks_first_chunk_plus_watermark():
    # 16 blocks, 2 planes: a 4-token first chunk takes 2 blocks; a watermark of 0.5 keeps 8 free.
    s = make_scheduler(16, watermark=0.5, max_num_seqs=8)
    for i in range(5):
        s.add_request(make_request(f"r{i}", 4, 20))
    _step(s)
    # The first request ignores the watermark (nothing runs); later ones need 2 + 8 free.
    assert s.num_running == 4
    assert s.kv.num_free_blocks == 8
    _drain(s)


def test_unpreemptable_request_still_fails_at_admission():
    s = make_scheduler(8)
    with pytest.raises(ValueError, match="needs 16 KV blocks"):
        s.add_request(make_request("big", 20, 12))  # 31 positions x 2 planes


def test_pressure_preempts_latest_arrival_and_everything_finishes():
    s = make_scheduler(12, max_num_seqs=8)  # 6 blocks per plane: one 24-position request at most
    for i in range(3):
        s.add_request(make_request(f"r{i}", 4, 20))
    outputs = {f"r{i}": 0 for i in range(3)}
    while s.has_work():
        plan = s.schedule()
        if plan is None:
            continue
        for rid in plan.preempted:
            assert rid != "r0"  # the earliest arrival is never the victim
        for u in s.apply(plan, _result(s, plan)):
            outputs[u.request_id] += len(u.new_token_ids)
    assert s.preemptor.num_preemptions > 0
    assert outputs == {f"r{i}": 20 for i in range(3)}
    _step(s)
    s.kv.check_no_leaks()


def test_victim_is_lowest_priority_then_latest():
    s = make_scheduler(12, max_num_seqs=8, scheduling_policy="priority")
    s.add_request(make_request("a", 4, 20, priority=0))
    s.add_request(make_request("b", 4, 20, priority=-1))
    s.add_request(make_request("c", 4, 20, priority=0))
    victims = []
    while s.has_work():
        plan = _step(s)
        if plan is not None:
            victims += plan.preempted
    assert victims and "b" not in victims
    assert victims[0] == "c"  # same priority as a, later arrival


def test_fcfs_admits_by_arrival_priority_policy_by_priority():
    for policy, order in (("fcfs", ["a", "b", "c"]), ("priority", ["c", "a", "b"])):
        s = make_scheduler(64, max_num_seqs=1, scheduling_policy=policy)
        s.add_request(make_request("a", 4, 2, priority=3))
        s.add_request(make_request("b", 4, 2, priority=5))
        s.add_request(make_request("c", 4, 2, priority=1))
        admitted = []
        for plan in _drain(s):
            admitted += [setup.request_id for setup in plan.new_requests]
        assert admitted == order, policy


def test_better_priority_preempts_running_when_seats_are_full():
    s = make_scheduler(64, max_num_seqs=1, scheduling_policy="priority")
    s.add_request(make_request("low", 4, 10, priority=5))
    for _ in range(4):
        _step(s)
    s.add_request(make_request("same", 4, 2, priority=5))
    _step(s)
    assert [r.request_id for r in s.running] == ["low"]  # equal priority does not preempt
    s.add_request(make_request("high", 4, 2, priority=0))
    plan = _step(s)
    assert plan.preempted == ["low"]
    assert [r.request_id for r in s.running] == ["high"]
    assert s.requests["low"].status is RequestStatus.WAITING
    _drain(s)


def test_fcfs_never_preempts_for_priority():
    s = make_scheduler(64, max_num_seqs=1)
    s.add_request(make_request("low", 4, 10, priority=5))
    _step(s)
    s.add_request(make_request("high", 4, 2, priority=0))
    plans = _drain(s)
    assert not any(p.preempted for p in plans)


@pytest.mark.parametrize(
    "cls,field,value",
    [
        (CacheConfig, "kv_reservation", "lazy"),
        (CacheConfig, "kv_watermark", 1.5),
        (CacheConfig, "swap_space_gb", -1),
        (SchedulerConfig, "preemption_mode", "drop"),
        (SchedulerConfig, "scheduling_policy", "lifo"),
    ],
)
def test_bad_config_names_the_field(cls, field, value):
    with pytest.raises(ValueError, match=f"{field}={value!r}"):
        cls(**{field: value})


@pytest.mark.parametrize("value", ["1", 1.5, None])
def test_bad_priority_names_the_field(value):
    with pytest.raises(ValueError, match="priority"):
        SamplingParams(temperature=0.0, priority=value)


def test_engine_kv_usage_counts_blocks_in_use(ckpts):
    core = make_core(ckpts["ouro"], num_blocks=4096, block_size=16)
    full = make_core(ckpts["ouro"], num_blocks=4096, block_size=16, kv_reservation="full")
    p = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)
    for c in (core, full):
        c.add_request("r", [1, 2, 3], p)
        c.step()
    assert core.stats().kv_usage == 4 / 4096  # one block on each of the 4 planes
    r = full.scheduler.requests["r"]
    assert full.stats().kv_usage == full.kv.blocks_needed(r.kv_tokens, 4) / 4096 > 16 / 4096
    for c in (core, full):
        c.abort("r")
        c.step()
        assert c.stats().kv_usage == 0.0
        c.kv.check_no_leaks()


def test_engine_config_defaults():
    config = EngineConfig()
    assert config.cache.kv_reservation == "ondemand"
    assert config.scheduler.preemption_mode == "recompute"
    assert config.scheduler.scheduling_policy == "fcfs"


def test_ondemand_matches_full_reservation(ckpts):
    prompts = [[5, 6, 7], list(range(1, 40)), [9] * 17]
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, exit_threshold=0.5)
        for n in (9, 5, 12)
    ]
    a = run_core(make_core(ckpts["ouro"], block_size=4), prompts, params)
    b = run_core(make_core(ckpts["ouro"], block_size=4, kv_reservation="full"), prompts, params)
    assert a.tokens == b.tokens and a.depths == b.depths


def test_the_watermark_does_not_keep_out_a_request_when_nothing_runs():
    # 16 blocks, 2 planes: a 16-token first chunk takes 8 blocks; the watermark keeps 12 free.
    # With nothing running there is no one to grow into them: the request is admitted.
    s = make_scheduler(16, watermark=0.75, prefill_chunk_size=16)
    s.add_request(make_request("a", 16, 2))
    plan = _step(s)
    assert plan is not None and [w.request_id for w in plan.items] == ["a"]
    _drain(s)
