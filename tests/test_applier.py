"""Applying results (``applier.py``): a step's updates as ``StepUpdates``, the tokens that
neither start nor end their request's output as column rows, the others as ``RequestUpdate``s.
On the torch-free scheduler with hand-built results (``FixedExits``, milliseconds)."""

from __future__ import annotations

import pickle

from fixed_exits import FixedExits, make_request, make_scheduler, working

from rltserve.core.plan import CarriedEvents
from rltserve.core.request import FinishReason, InFlight
from rltserve.core.scheduler import Scheduler
from rltserve.sampling import SamplingParams
from rltserve.updates import RequestUpdate, StepUpdates, from_wire, to_wire


def _with_params(rid: str, prompt_len: int, **params):
    request = make_request(rid, prompt_len, params.pop("max_tokens"))
    request.params = SamplingParams(
        **{"temperature": 0.0, "max_tokens": request.params.max_tokens, **params}
    )
    request.__post_init__()  # (its stop ids and limits from the new parameters)
    return request


def test_middle_tokens_are_column_rows_and_every_update_reads_as_before():
    """A decode batch's requests: each token between a request's first and last (and not a
    stop id) is a row of the columns; the first (it reports cached tokens), the last (it
    finishes the request), a stop id (under ``min_tokens`` or not) and a bounded-thinking
    request's tokens are ``RequestUpdate``s. Read back (iterated, or through the wire), each
    request gets its tokens once, in order, with its finish reason on the last."""
    s = make_scheduler(max_num_seqs=8)
    s.add_request(make_request("plain", 3, 6))
    s.add_request(_with_params("stops", 2, max_tokens=9, stop_token_ids=[7], min_tokens=3))
    thinking = dict(max_thinking_tokens=3, thinking_end_token_ids=(5,))
    s.add_request(_with_params("thinks", 5, max_tokens=8, **thinking))
    requests = dict(s.requests)
    runner = FixedExits(token=7)
    got: dict[str, list[RequestUpdate]] = {rid: [] for rid in requests}
    rows_per_request = {rid: 0 for rid in requests}
    for _ in working(s):
        plan = s.schedule()
        if plan is None:
            continue
        step = s.apply(plan, runner.result(plan))
        assert isinstance(step, StepUpdates)
        assert not set(step.rows) & set(step.updates)  # (no request in both)
        for rid in step.rows:
            rows_per_request[rid] += 1
        updates = list(step)
        assert [u.request_id for u in updates] == list(step.rows) + list(step.updates)
        wire = pickle.loads(pickle.dumps(to_wire(step), pickle.HIGHEST_PROTOCOL))
        assert from_wire(wire) == updates
        for u in updates:
            got[u.request_id].append(u)
    plain, stops, thinks = (requests[rid] for rid in ("plain", "stops", "thinks"))
    assert len(plain.output_token_ids) == 6 and len(stops.output_token_ids) == 3
    assert rows_per_request == {"plain": 4, "stops": 0, "thinks": 0}
    for rid, request in requests.items():
        updates = got[rid]
        assert [t for u in updates for t in u.new_token_ids] == request.output_token_ids
        assert [d for u in updates for d in u.new_exit_depths] == request.exit_depths
        assert [u.finish_reason for u in updates[:-1]] == [None] * (len(updates) - 1)
        assert updates[0].num_cached_tokens == 0
        assert all(u.num_cached_tokens is None for u in updates[1:])
    assert got["plain"][-1].finish_reason is FinishReason.LENGTH
    assert got["stops"][-1].finish_reason is FinishReason.STOP
    # Bounded thinking: the forced end token went with the token that spent the budget.
    assert thinks.output_token_ids[3] == 5 and got["thinks"][2].new_token_ids == [7, 5]


def _two_tokens_of_one_request() -> tuple[Scheduler, list]:
    """A running request with one output token, and two carried tokens of it in flight (keys
    1 and 2), as the runner may report them in one step; another request with one token in
    flight (key 3)."""
    s = make_scheduler()
    owners = []
    for rid in ("a", "b"):
        request = make_request(rid, 2, 10)
        s.requests[rid] = request
        request.output_token_ids.append(4)
        request.exit_depths.append(2)
        owners.append(request)
    a, b = owners
    for key, request in ((1, a), (2, a), (3, b)):
        item = InFlight(start=2 + key, num_tokens=1, ends_at=2, stop_at_exit=True, has_output=1)
        item.carry_key = key
        request.items.append(item)
        s._carried[key] = (request, item)
    return s, [a, b]


def _events(finite: list[bool]) -> CarriedEvents:
    n = len(finite)
    return CarriedEvents(
        [1, 2, 3][:n],
        ["a", "a", "b"][:n],
        [2] * n,
        [False] * n,
        [True] * n,
        [False] * n,
        [8, 9, 6][:n],
        [-0.5, -1.5, -2.0][:n],
        [None] * n,
        finite,
    )


def test_a_second_token_of_a_request_in_one_step_takes_its_row_out():
    """The older token takes a row; the newer one finds it there and moves it into one
    ``RequestUpdate`` holding both tokens in order; the columns keep the other request's row
    alone (the empty row does not cross the wire)."""
    s, (a, b) = _two_tokens_of_one_request()
    step = StepUpdates()
    s.applier._apply_carried(_events([True, True, True]), step)
    assert step.rows == {"b": 1} and step.request_ids == [None, "b"]
    assert list(step.updates) == ["a"]
    assert step.updates["a"] == RequestUpdate("a", [8, 9], [2, 2], [-0.5, -1.5], [None, None])
    assert step.columns() == (["b"], [6], [2], [-2.0], [None], [None])
    assert list(step) == [RequestUpdate("b", [6], [2], [-2.0], [None]), step.updates["a"]]
    wire = to_wire(step)
    assert wire[0] == (["b"], [6], [2], [-2.0], [None], [None], 0) and len(wire) == 2
    assert from_wire(wire) == list(step)
    assert a.output_token_ids == [4, 8, 9] and b.output_token_ids == [4, 6]


def test_a_non_finite_second_token_ends_its_request_with_the_first_kept():
    s, (a, _) = _two_tokens_of_one_request()
    step = StepUpdates()
    s.applier._apply_carried(_events([True, False]), step)
    (update,) = list(step)
    assert update.new_token_ids == [8] and update.finish_reason is FinishReason.ERROR
    assert "non-finite logits" in update.error
    assert not step.rows and a.is_finished


def test_step_updates_read_back_with_the_weight_version():
    step = StepUpdates()
    step.rows["r"] = 0
    step.request_ids.append("r")
    for column, value in zip(
        (step.token_ids, step.exit_depths, step.logprobs, step.top_logprobs, step.ranks),
        (3, 4, -0.25, [(3, -0.25)], 1),
    ):
        column.append(value)
    step.updates["q"] = RequestUpdate("q", finish_reason=FinishReason.ABORT, weight_version=2)
    step.weight_version = 2
    want = [RequestUpdate("r", [3], [4], [-0.25], [[(3, -0.25)]], weight_version=2, new_ranks=[1])]
    want.append(step.updates["q"])
    assert len(step) == 2 and list(step) == want
    assert from_wire(pickle.loads(pickle.dumps(to_wire(step)))) == want
    assert to_wire(StepUpdates()) == [] and list(StepUpdates()) == []
