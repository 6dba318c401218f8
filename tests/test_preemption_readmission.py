"""Re-admission of a request that preempted itself (``Preemptor.make_room``: the worst running
request, its next item short of blocks): it waits until the pool has room for the positions it
was growing to, not just for its first item. Admitted on its first chunk at once, it would
recompute up to where it stopped and preempt itself again, over and over, until the requests
ahead of it end."""

from __future__ import annotations

import pytest
from fixed_exits import FixedExits, make_request, make_scheduler, working


def _drive(mode: str):
    """r0 (20 prompt tokens, 24 outputs) and r1 (a 40-token prompt) do not fit together in 24
    blocks: r1, the later, runs short and preempts itself. Returns r1's preemptions and
    admissions and the step that ended r0."""
    s = make_scheduler(24, swap=mode == "swap", max_num_seqs=4)
    s.add_request(make_request("r0", 20, 24))
    s.add_request(make_request("r1", 40, 2))
    runner = FixedExits()
    preempted = admitted = 0
    r0_end = None
    for _ in working(s):
        before = {r.request_id for r in s.running}
        plan = s.schedule()
        if plan is None:
            continue
        preempted += plan.preempted.count("r1")
        if "r1" not in before and any(r.request_id == "r1" for r in s.running):
            admitted += 1
        updates = s.apply(plan, runner.result(plan))
        if any(u.request_id == "r0" and u.finish_reason is not None for u in updates):
            r0_end = plan.step_id
    assert s.kv.usage == 0.0 and not s.requests
    return preempted, admitted, r0_end


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_request_that_preempted_itself_is_not_readmitted_to_preempt_again(mode):
    preempted, admitted, r0_end = _drive(mode)
    assert r0_end is not None
    assert preempted == 1  # once, not once per re-admission until r0 ends
    assert admitted == 2
