"""The waiting queue of a batch of thousands of prompts (``LLM.generate`` on a dataset) costs
the scheduler no work per waiting request per step: admission does not sort it on every step
(``Admission.enqueue`` keeps it in order), and a request that ends while running is not looked
for in it. Either was quadratic in the batch. Order still holds: requests preempted under
pressure, or arriving with a better priority, are admitted in (priority, arrival) order."""

from __future__ import annotations

import pytest
from fixed_exits import FixedExits, make_request, make_scheduler, working


class _Watched(list):
    """``waiting``, counting its sorts and membership scans."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.sorts = self.scans = 0

    def sort(self, *args, **kwargs) -> None:
        self.sorts += 1
        super().sort(*args, **kwargs)

    def __contains__(self, item) -> bool:
        self.scans += 1
        return super().__contains__(item)


def _drive(s, limit: int = 5000) -> list[str]:
    """Runs ``s`` to the end; returns the request ids in the order they were admitted."""
    runner, admitted = FixedExits(), []
    for _ in working(s, limit):
        before = {r.request_id for r in s.running}
        plan = s.schedule()
        admitted += [r.request_id for r in s.running if r.request_id not in before]
        s.apply(plan, runner.result(plan))
    assert s.kv.usage == 0.0 and not s.requests
    return admitted


@pytest.mark.parametrize(("policy", "time_slice"), [("fcfs", 0), ("priority", 0), ("fcfs", 2)])
def test_many_waiting_requests_are_neither_sorted_nor_scanned_per_step(policy, time_slice):
    """(Priority preemption and time slicing look at the queue's head every step too.)"""
    s = make_scheduler(
        256, max_num_seqs=2, scheduling_policy=policy, preemption_time_slice=time_slice
    )
    s.waiting = _Watched()
    order_keys = 0
    key = s.order_key

    def counted(request):
        nonlocal order_keys
        order_keys += 1
        return key(request)

    s.order_key = counted
    n = 200
    for i in range(n):
        s.add_request(make_request(f"r{i}", 4, 3))
    admitted = _drive(s)
    assert admitted == [f"r{i}" for i in range(n)]
    # Two seats for 200 requests: about 100 rounds of several steps each, every one with up to
    # 198 waiting. A sort per step (or a scan per finished request) costs tens of thousands.
    assert s.waiting.sorts == 0 and s.waiting.scans == 0
    assert order_keys <= 4 * n


def _admissions(policy: str, time_slice: int, always_sort: bool) -> list[list[str]]:
    """Per step, the requests admitted, of a workload under KV pressure (preemptions, time
    slicing) with arrivals of mixed priorities during the run."""
    s = make_scheduler(
        14, max_num_seqs=8, scheduling_policy=policy, preemption_time_slice=time_slice
    )
    runner, log = FixedExits(), []
    arrivals = {0: [0, 1, 2, 3], 2: [4, 5], 5: [6], 9: [7, 8]}
    for step in range(2000):
        for i in arrivals.get(step, ()):
            s.add_request(make_request(f"r{i}", 4 + i % 3, 10, priority=-(i % 3)))
        if step > max(arrivals) and not s.has_work():
            break
        if always_sort:  # (what admission did before: sort on every step)
            s.admission.unsorted = True
        before = {r.request_id for r in s.running}
        plan = s.schedule()
        log.append([r.request_id for r in s.running if r.request_id not in before])
        if plan is not None:
            s.apply(plan, runner.result(plan))
    assert s.kv.usage == 0.0 and not s.requests
    return log


@pytest.mark.parametrize("time_slice", [0, 2])
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_admission_order_is_that_of_a_sort_on_every_step(policy, time_slice):
    """Late arrivals of a better priority and requests preempted (or rotated out by time
    slicing) back into the queue are admitted exactly as when the queue is sorted on every
    step."""
    s = make_scheduler(14, max_num_seqs=8, scheduling_policy=policy)
    assert not s.admission.unsorted
    kept = _admissions(policy, time_slice, always_sort=False)
    assert kept == _admissions(policy, time_slice, always_sort=True)
    assert sum(map(len, kept)) > 9  # (re-admissions: the pool's pressure took effect)


def test_a_waiting_request_whose_finish_raised_leaves_the_queue_when_finished_again():
    """A fault inside ``finish`` (before it took the request out of the queue) is followed by
    the engine's recovery aborting the request again: that must take it out of ``waiting``,
    not leave a request the scheduler no longer knows there for admission to run."""
    s = make_scheduler(64)
    s.add_request(make_request("a", 4, 3))
    drop_carried = s.drop_carried

    def fault(request) -> None:
        s.drop_carried = drop_carried
        raise RuntimeError("fault inside finish")

    s.drop_carried = fault
    with pytest.raises(RuntimeError):
        s.abort("a")
    s.abort("a")  # (``Engine.apply``'s recovery)
    assert not s.requests and not s.waiting and not s.has_work()
