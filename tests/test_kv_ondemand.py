"""On-demand KV blocks, admission, victim choice and priority, on the torch-free scheduler with
hand-built step results (milliseconds), plus the engine's KV usage and config validation."""

from __future__ import annotations

import weakref

import pytest
from engine_util import make_core, oracle_run, run_core
from fixed_exits import FixedExits, make_request, make_scheduler, working

from rltserve.config import CacheConfig, EngineConfig, SchedulerConfig
from rltserve.core.kv_cache import KVManager, KVPolicy
from rltserve.core.plan import StepPlan, StepResult
from rltserve.core.request import RequestStatus
from rltserve.core.scheduler import Scheduler
from rltserve.core.swap import SwapSpace
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
    for _ in working(s, limit):
        plan = _step(s)
        if plan is not None:
            plans.append(plan)
    _step(s)  # hands the last releases over
    s.kv.check_no_leaks()
    assert s.kv.pool.num_used == 0
    return plans


def test_blocks_follow_written_positions():
    s = make_scheduler()
    s.add_request(make_request("a", 10, 20))
    planes = LOOPS
    for _ in working(s):
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


def test_a_later_request_that_fits_does_not_overtake_one_that_does_not():
    s = make_scheduler(16, max_num_seqs=8, prefill_chunk_size=32)
    s.add_request(make_request("r0", 8, 8))
    _step(s)  # r0 holds 4 blocks: "big" (14 for its prompt) must wait, "small" (2) would fit
    s.add_request(make_request("big", 26, 4))
    s.add_request(make_request("small", 3, 2))
    admitted = [setup.request_id for plan in _drain(s) for setup in plan.new_requests]
    assert admitted == ["big", "small"]


def test_unpreemptable_request_still_fails_at_admission():
    s = make_scheduler(8)
    with pytest.raises(ValueError) as err:
        s.add_request(make_request("big", 20, 12))  # 31 positions x 2 planes
    assert str(err.value) == (
        "the request needs 16 KV blocks (31 tokens of prompt and output on 2 KV planes, for 2 "
        "loops) but the pool has 8; lower max_tokens or max_loops, or raise num_blocks"
    )


def test_pressure_preempts_latest_arrival_and_everything_finishes():
    s = make_scheduler(12, max_num_seqs=8)  # 6 blocks per plane: one 24-position request at most
    for i in range(3):
        s.add_request(make_request(f"r{i}", 4, 20))
    outputs = {f"r{i}": 0 for i in range(3)}
    for _ in working(s):
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


def test_the_oldest_running_request_waits_instead_of_preempting_itself():
    # Short of a block while every later arrival holds blocks in the step being built, a
    # request waits for them (they end or yield): it preempts itself only when it is the worst
    # running. Here r1, running alone beside later r2 and r3 (r0 ended), is never the victim.
    s = make_scheduler(26, max_num_seqs=8)
    for rid, prompt_len, max_tokens in (("r0", 3, 12), ("r1", 8, 14), ("r2", 8, 10), ("r3", 6, 13)):
        s.add_request(make_request(rid, prompt_len, max_tokens))
    victims = []
    for _ in working(s):
        oldest = min(s.running, key=s.order_key).request_id if s.running else None
        plan = _step(s)
        if plan is not None:
            assert oldest not in plan.preempted, (plan.step_id, oldest)
            victims += plan.preempted
    assert victims == ["r3", "r2"]
    _step(s)
    s.kv.check_no_leaks()


def test_victim_is_lowest_priority_then_latest():
    s = make_scheduler(12, max_num_seqs=8, scheduling_policy="priority")
    s.add_request(make_request("a", 4, 20, priority=0))
    s.add_request(make_request("b", 4, 20, priority=-1))
    s.add_request(make_request("c", 4, 20, priority=0))
    victims = []
    for _ in working(s):
        plan = _step(s)
        if plan is not None:
            victims += plan.preempted
    assert victims and "b" not in victims
    assert victims[0] == "c"  # same priority as a, later arrival


def _swap_run(capacity_blocks: int, abort_a_swapped: bool = False) -> tuple[int, int, int]:
    """Three requests under pressure in swap mode, with ``capacity_blocks`` of swap space of
    3 bytes a block: (swap-outs, fallbacks to recompute, preemptions). After every step the
    swap stats count what the plans swapped out and not yet in (or aborted)."""
    s = make_scheduler(12, swap=True, max_num_seqs=8)
    s.preemptor.swap = SwapSpace(capacity_blocks, 3)
    for i in range(3):
        s.add_request(make_request(f"r{i}", 4, 12))
    held: dict[str, int] = {}  # swapped-out request -> its blocks
    swaps = 0
    for _ in working(s):
        plan = s.schedule()
        for rid, blocks in plan.swap_out:
            held[rid] = len(blocks)
            swaps += 1
        for rid, _ in plan.swap_in:
            del held[rid]
        s.apply(plan, _result(s, plan))
        if abort_a_swapped and held:  # it ends while swapped out: its swap space is freed
            s.abort(held.popitem()[0])
            abort_a_swapped = False
        assert s.preemptor.num_swapped == len(held)
        assert s.preemptor.swapped_bytes == 3 * sum(held.values())
    assert not abort_a_swapped and s.preemptor.swap.used_blocks == 0
    _drain(s)
    return swaps, s.preemptor.swap_fallbacks, s.preemptor.num_preemptions


def test_swap_space_holds_what_fits_and_counts_the_fallbacks():
    # Victims of 4 then 6 blocks (and 6 again): 4 blocks fit exactly, the rest recompute.
    assert _swap_run(100)[:2] == (2, 0)
    assert _swap_run(4) == (1, 2, 3)
    assert _swap_run(3) == (0, 3, 3)
    _swap_run(100, abort_a_swapped=True)


def test_swap_space_refuses_a_negative_capacity_or_an_empty_block():
    for capacity_blocks, block_bytes in ((-1, 4), (4, 0)):
        with pytest.raises(ValueError, match="must be >= 0, >= 1"):
            SwapSpace(capacity_blocks, block_bytes)
    assert not SwapSpace(0, 1).can_hold(1) and SwapSpace(0, 1).can_hold(0)


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


def test_a_better_priority_arrival_preempts_the_worst_running_request():
    s = make_scheduler(64, max_num_seqs=2, scheduling_policy="priority")
    s.add_request(make_request("mid", 4, 10, priority=3))
    s.add_request(make_request("low", 4, 10, priority=5))
    for _ in range(3):
        _step(s)
    s.add_request(make_request("high", 4, 2, priority=0))
    plan = _step(s)
    assert plan.preempted == ["low"]  # not "mid", which is better than "low"
    assert sorted(r.request_id for r in s.running) == ["high", "mid"]
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


@pytest.mark.parametrize("kv_reservation", ["full", "ondemand"])
def test_carried_tokens_copy_their_exits_into_each_new_block(ckpts, ouro_ref, kv_reservation):
    # last_exited: an early exit copies its K/V into the deeper planes' block holding its
    # position. Under full reservation the tables never change, so a carried token entering a
    # new KV block under the same tables must still copy into that block, not the previous
    # one (whose deeper planes later tokens read). Outputs cross several 4-token blocks.
    prompts = [[5, 6, 7], [11, 12, 13, 14, 15], [9] * 6, [21, 22]]
    params = [
        SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True, exit_threshold=t)
        for t in (0.3, 0.5, 0.7, 0.9)
    ]
    core = make_core(ckpts["ouro"], block_size=4, kv_reservation=kv_reservation)
    run = run_core(core, prompts, params)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        want = oracle_run(ouro_ref, prompt, p, kv_policy="last_exited")
        assert run.tokens[f"r{i}"] == want.tokens, f"request {i}"
        assert run.depths[f"r{i}"] == want.exit_depths, f"request {i}"
    assert min(d for depths in run.depths.values() for d in depths) < core.spec.num_loops


def test_the_watermark_does_not_keep_out_a_request_when_nothing_runs():
    # 16 blocks, 2 planes: a 16-token first chunk takes 8 blocks; the watermark keeps 12 free.
    # With nothing running there is no one to grow into them: the request is admitted.
    s = make_scheduler(16, watermark=0.75, prefill_chunk_size=16)
    s.add_request(make_request("a", 16, 2))
    plan = _step(s)
    assert plan is not None and [w.request_id for w in plan.items] == ["a"]
    _drain(s)
