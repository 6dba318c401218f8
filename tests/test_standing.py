"""Standing decode tokens (``standing.py``): with synchronous scheduling, a carried token that
ends is advanced in place to its request's next position. On the torch-free scheduler with
hand-built results (``FixedExits``, milliseconds), then the engine against the oracle."""

from __future__ import annotations

import pytest
from engine_util import make_core, oracle_run, random_workload, run_core
from fixed_exits import FixedExits, make_request, make_scheduler, working

from rltserve.core.request import Request
from rltserve.core.scheduler import Scheduler


def _drive(s: Scheduler, on_plan=None, on_applied=None) -> dict[str, int]:
    """Steps ``s`` to the end with ``FixedExits`` results; returns the tokens per request."""
    runner = FixedExits()
    outputs: dict[str, int] = {rid: 0 for rid in s.requests}
    for _ in range(1000):
        if not s.has_work():
            break
        plan = s.schedule()
        if plan is None:
            continue
        if on_plan is not None:
            on_plan(plan)
        for update in s.apply(plan, runner.result(plan)):
            rid = update.request_id
            outputs[rid] = outputs.get(rid, 0) + len(update.new_token_ids)
        if on_applied is not None:
            on_applied()
    plan = s.schedule()  # hands the last releases over
    if plan is not None:
        runner.result(plan)
    s.kv.check_no_leaks()
    assert s.kv.pool.num_used == 0 and not s._carried
    return outputs


@pytest.mark.parametrize("reservation", ["ondemand", "full"])
def test_an_ended_token_continues_in_place_within_its_block(reservation):
    """Prompt positions 0-2, outputs from positions 2..11: the first decode token (3) is a plan
    item, each block start (4, 8) a planner continuation with its new tables, and every other
    position the same ``InFlight`` advanced by the applier. (With the whole context reserved,
    a block start has its blocks already, and is still the planner's: its copy-on-exit blocks
    are new.)"""
    s = make_scheduler(reservation=reservation)
    s.add_request(make_request("a", 3, 10))
    request = s.requests["a"]
    seen: list[tuple] = []  # (position, its InFlight, advanced in place)
    moved, carried_items = [], []

    def on_plan(plan):
        moved.extend(entry[0] for entry in plan.moved)
        carried_items.extend(w.start for w in plan.items if w.carry is not None)
        for _, _, key in plan.continued:
            item = s._carried[key][1]
            seen.append((item.start, item, False))

    def on_applied():
        if s.standing.fresh_ids:
            item = request.items[0]
            seen.append((item.start, item, True))

    assert _drive(s, on_plan, on_applied) == {"a": 10}
    assert carried_items == [3]
    assert len(moved) == 2
    in_place = [pos for pos, _, fresh in seen if fresh]
    assert in_place == [5, 6, 7, 9, 10, 11]
    continued = [pos for pos, _, fresh in seen if not fresh]
    assert continued == [4, 5, 6, 7, 8, 9, 10, 11]  # every decode token after the first
    items = {pos: item for pos, item, _ in seen}  # (kept alive: no identity is reused)
    assert all(items[pos] is items[4] for pos in (5, 6, 7))  # one object per block
    assert all(items[pos] is items[8] for pos in (9, 10, 11)) and items[8] is not items[4]


def test_continued_tokens_keep_the_order_their_predecessors_ended_in():
    """Tokens advanced in place and the planner's (block starts) together: the next plan lists
    them in the order the runner reported their predecessors' ends (its row order), which a
    decode batch keeps from token to token (the runner's fast paths rely on it)."""
    s = make_scheduler(max_num_seqs=8)
    for i, n in enumerate([3, 1, 6, 2, 5, 4]):
        s.add_request(make_request(f"r{i}", n, 11))
    runner = FixedExits()
    ended_order: list[str] = []
    checked = mixed = 0
    for _ in working(s):
        plan = s.schedule()
        if plan is None:
            continue
        if plan.continued and ended_order:
            order = [rid for rid, _, _ in plan.continued]
            assert order == [rid for rid in ended_order if rid in order]
            checked += 1
            mixed += bool(plan.moved) and len(plan.moved) < len(plan.continued)
        result = runner.result(plan)
        events = result.carried
        ended_order = [r for r, e in zip(events.request_ids, events.ended) if e]
        s.apply(plan, result)
    assert checked >= 8 and mixed >= 5


def _plans(
    s: Scheduler, standing: bool, late: Request | None = None
) -> tuple[list[tuple], dict[str, int]]:
    """Every plan's decisions (items, continued requests, preemptions, releases) in an
    order-free form, and the outputs, with or without standing tokens (``late``: a request
    added after the sixth step)."""
    if not standing:
        s.standing = None
    decisions = []

    def on_plan(plan):
        items = sorted((w.request_id, w.start, w.depth) for w in plan.items)
        continued = sorted(rid for rid, _, _ in plan.continued)
        decisions.append((items, continued, plan.preempted, sorted(plan.released)))

    def on_applied():
        if late is not None and len(decisions) == 6:
            s.add_request(late)

    outputs = _drive(s, on_plan, on_applied)
    return decisions, outputs


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("budget", [3, 4, 6])
def test_fresh_tokens_take_their_rows_in_the_planners_order(policy, budget):
    """A budget too short for every starter: fresh tokens take their rows among the
    starters in the planner's order (priority, arrival), not before them, so a better
    request's prompt chunk is not held back by worse requests' decode tokens; those left
    without a row wait, as the planner's continuations would. The same plans as when the
    planner continues every token."""

    def build() -> tuple[Scheduler, Request]:
        s = make_scheduler(
            max_num_seqs=8,
            scheduling_policy=policy,
            max_num_batched_tokens=budget,
            prefill_chunk_size=budget,
        )
        s.add_request(make_request("r0", 2, 25, priority=1))
        s.add_request(make_request("r1", 3, 25, priority=1))
        return s, make_request("late", 30, 3, priority=0)

    s, late = build()
    base, base_out = _plans(s, standing=False, late=late)
    s, late = build()
    seated, undone = [], []
    seat, undo = s.standing.seat, s.standing.undo

    def recording_seat(starters, rows):
        out = seat(starters, rows)
        seated.append(bool(out[1]))
        return out

    def recording_undo(requests):
        undone.extend(r.request_id for r in requests)
        undo(requests)

    s.standing.seat, s.standing.undo = recording_seat, recording_undo
    new, new_out = _plans(s, standing=True, late=late)
    assert new_out == base_out == {"r0": 25, "r1": 25, "late": 3}
    assert new == base
    assert any(seated) and not all(seated)  # (both paths taken)
    # Under priority the better late request's chunks come first: fresh tokens wait.
    assert bool(undone) == (policy == "priority")


@pytest.mark.parametrize("swap", [False, True], ids=["recompute", "swap"])
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_standing_tokens_change_no_decision(swap, policy):
    """Under preemption (a pool for one and a half requests), with priorities: the same plans
    and outputs as when the planner continues every token; fresh tokens' requests are among
    the victims (a fresh token is not in the step being built)."""

    def build() -> Scheduler:
        s = make_scheduler(18, swap=swap, max_num_seqs=8, scheduling_policy=policy)
        for i, (n, k, prio) in enumerate([(4, 20, 1), (3, 17, 0), (6, 14, 2), (2, 19, 1)]):
            s.add_request(make_request(f"r{i}", n, k, priority=prio))
        return s

    base, base_out = _plans(build(), standing=False)
    s = build()
    fresh_victims = []
    preempt = s.preemptor.preempt

    def recording_preempt(victim):
        fresh_victims.append(victim.request_id in s.standing.fresh_ids)
        preempt(victim)

    s.preemptor.preempt = recording_preempt
    new, new_out = _plans(s, standing=True)
    assert new_out == base_out == {"r0": 20, "r1": 17, "r2": 14, "r3": 19}
    assert new == base
    assert any(fresh_victims), "no fresh token's request was preempted"


def test_a_fresh_tokens_request_aborted_before_the_plan_is_left_out():
    s = make_scheduler()
    for i in range(3):
        s.add_request(make_request(f"r{i}", 2, 12))
    aborted: list[str] = []
    checked = []

    def on_applied():
        if not aborted and s.standing.fresh_ids:
            aborted.append(min(s.standing.fresh_ids))
            s.abort(aborted[0])

    def on_plan(plan):
        if aborted and not checked:
            assert aborted[0] in plan.released
            assert aborted[0] not in {rid for rid, _, _ in plan.continued}
            checked.append(len(plan.continued))

    outputs = _drive(s, on_plan, on_applied)
    assert checked == [2]  # the other two continued
    assert [outputs[rid] for rid in ("r0", "r1", "r2") if rid != aborted[0]] == [12, 12]
    assert 0 < outputs[aborted[0]] < 12


@pytest.mark.parametrize(
    "config",
    [
        {"async_scheduling": True, "exit_mode": "delayed"},
        {"scheduling": "no_refill"},
        {"carry_decode": False},
    ],
    ids=["async", "no_refill", "not-carried"],
)
def test_standing_is_off_where_plans_run_ahead_or_cohorts_wait(config):
    assert make_scheduler(**config).standing is None
    assert make_scheduler().standing is not None


@pytest.mark.parametrize("kv_policy", ["last_exited", "full", "shared"])
def test_aborting_fresh_tokens_keeps_the_others_exact(ckpts, ouro_ref, kv_policy):
    """Engine, gate exits, 2-position blocks: requests aborted between a result and the next
    plan while a token of theirs stands advanced in place leave the others equal to the
    oracle, and the engine holds nothing of them."""
    prompts, params, arrivals = random_workload(
        8, 3, (0.4, 0.7, 1.0), max_prompt=9, max_tokens=(6, 12), max_arrival=4
    )
    core = make_core(ckpts["ouro"], kv_policy=kv_policy, block_size=2)
    sched = core.scheduler
    apply = core.apply
    aborted: list[str] = []

    def aborting_apply(plan, result):
        updates = apply(plan, result)
        fresh = sorted(sched.standing.fresh_ids)
        if fresh and len(aborted) < 3 and plan.step_id % 3 == 0:
            aborted.append(fresh[0])
            assert core.abort(fresh[0]) is not None
        return updates

    core.apply = aborting_apply
    run = run_core(core, prompts, params, arrivals=arrivals)
    assert len(aborted) == 3
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        if f"r{i}" in aborted:
            continue
        want = oracle_run(ouro_ref, prompt, p, kv_policy=kv_policy)
        assert run.tokens[f"r{i}"] == want.tokens, f"request {i}"
        assert run.depths[f"r{i}"] == want.exit_depths, f"request {i}"
    assert not sched._carried and not core.runner.carried.items
    core.shutdown()


def test_no_refill_starts_nothing_while_any_request_of_the_cohort_loops():
    """``no_refill`` (the static baseline): a new item starts only once every item of the
    cohort has planned its last loop, whichever running request is still looping (here the
    first, which loops 4 times beside a 2-loop request listed after it). Every loop planned
    (``carry_decode=False``), so the plans show each item's depth."""
    s = make_scheduler(scheduling="no_refill", carry_decode=False, max_num_seqs=4)
    s.add_request(make_request("deep", 2, 3, loops=4))
    s.add_request(make_request("shallow", 2, 3, loops=2))
    looping: dict[str, tuple[int, int]] = {}  # request id -> (last loop planned, its loops)

    def on_plan(plan):
        if any(w.depth == 1 for w in plan.items):
            assert all(d >= n for d, n in looping.values()), (plan.step_id, looping)
            looping.clear()
        for w in plan.items:
            looping[w.request_id] = (w.depth, w.ends_at)

    assert _drive(s, on_plan) == {"deep": 3, "shallow": 3}


@pytest.mark.parametrize("standing", [True, False], ids=["standing", "planner"])
def test_steps_never_take_more_rows_than_the_budget_with_mixed_loop_counts(standing):
    """Requests of different loop counts start items in different steps, so a prompt chunk
    cut to the rows left can leave none for a later starter's decode token: that one waits.
    Every step's rows (planned items and carried tokens, ``FixedExits``' ``num_rows``) stay
    within ``max_num_batched_tokens``."""
    s = make_scheduler(max_num_batched_tokens=7, prefill_chunk_size=6, max_num_seqs=8)
    if not standing:
        s.standing = None
    for i, (n, k, loops) in enumerate([(4, 3, 1), (5, 1, 3), (2, 2, 3), (8, 4, 3), (2, 3, 1)]):
        s.add_request(make_request(f"r{i}", n, k, loops=loops))
    runner = FixedExits()
    rows = []
    for _ in working(s):
        plan = s.schedule()
        if plan is None:
            continue
        result = runner.result(plan)
        rows.append(result.num_rows)
        s.apply(plan, result)
    assert max(rows) == 7  # (the budget is used up, never more)
