"""vLLM's queued interval, engine side: a request's first update with a token says how long it
waited in the engine, from reaching it to its first scheduling (``RequestUpdate.queued_s``, a
duration the front end adds to its own admission wait). Waiting for a seat or for KV blocks
counts; a preempted request's re-admission does not start it again. On the torch-free
scheduler with hand-built results and a clock that advances one second per step."""

from __future__ import annotations

from fixed_exits import FixedExits, make_request, make_scheduler, working

from rltserve.core.scheduler import Scheduler


def _first_updates(s: Scheduler, requests: list[tuple[str, int, int]]) -> dict:
    """Runs ``requests`` (id, prompt length, max tokens; all arriving at 0.0) to the end:
    per request, (its update's ``queued_s``, the clock when its first token came)."""
    now = [0.0]
    s.clock = lambda: now[0]
    for rid, prompt_len, max_tokens in requests:
        request = make_request(rid, prompt_len, max_tokens)
        request.arrival_time = 0.0
        s.add_request(request)
    runner, first = FixedExits(), {}
    for _ in working(s):
        plan = s.schedule()
        if plan is not None:
            for update in s.apply(plan, runner.result(plan)):
                if update.new_token_ids and update.request_id not in first:
                    first[update.request_id] = (update.queued_s, now[0])
                else:
                    assert update.queued_s is None  # (the first token's update alone)
        now[0] += 1.0
    return first


def test_a_request_waiting_for_a_seat_reports_its_wait():
    """One seat: b is first scheduled once a has finished, c once b has; a never waited."""
    s = make_scheduler(max_num_seqs=1)
    first = _first_updates(s, [("a", 6, 6), ("b", 6, 6), ("c", 2, 2)])
    assert first == {"a": (0.0, 3.0), "b": (14.0, 17.0), "c": (28.0, 29.0)}


def test_a_preempted_request_keeps_its_first_scheduling():
    """Seven blocks: all three are scheduled at once, then b is preempted before its first
    token (KV pressure) and re-admitted later; its wait is still the first one's (none), as
    vLLM's queued interval ends at the first scheduling."""
    s = make_scheduler(7, max_num_seqs=4)
    first = _first_updates(s, [("a", 6, 6), ("b", 6, 6), ("c", 2, 2)])
    # (c, then b once: b waits for the room it was growing to instead of coming back at once
    # and preempting itself again)
    assert s.preemptor.num_preemptions == 2
    assert first == {"c": (0.0, 1.0), "a": (0.0, 3.0), "b": (0.0, 17.0)}
