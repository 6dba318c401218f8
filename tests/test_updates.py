"""``RequestUpdate`` crosses to the front end's process every step, with ``EngineStats``: their
pickled forms and the update's wire form (``to_wire``: a tuple of plain values) keep every
field."""

from __future__ import annotations

import dataclasses
import pickle

from rltserve.core.engine_info import EngineStats
from rltserve.updates import FinishReason, RequestUpdate, from_wire, to_wire


def test_request_update_pickles_every_field():
    values = {
        "request_id": "r1",
        "new_token_ids": [5, 6],
        "new_exit_depths": [3, 4],
        "new_logprobs": [-0.5, None],
        "new_top_logprobs": [[(5, -0.5)], None],
        "finish_reason": FinishReason.LENGTH,
        "error": "boom",
        "rejected": True,
        "weight_version": 7,
        "num_cached_tokens": 16,
        "prompt_logprobs": [(-1.5, [(3, -0.25)], 4)],
        "new_ranks": [1, None],
        "queued_s": 2.5,
        "forced_logprobs": [(0, -2.0, [(5, -0.5)], 3)],
    }
    # Every field is set to a value other than its default: a field added without being
    # pickled fails here.
    assert {f.name for f in dataclasses.fields(RequestUpdate)} == set(values)
    update = RequestUpdate(**values)
    for protocol in (2, pickle.HIGHEST_PROTOCOL):
        back = pickle.loads(pickle.dumps(update, protocol=protocol))
        assert back == update and back is not update
        assert dataclasses.asdict(back) == values
        # As the stage sends a step's updates: tuples of plain values.
        wire = pickle.loads(pickle.dumps(to_wire([update, RequestUpdate("r2")]), protocol))
        assert all(type(row) is tuple for row in wire)
        got = from_wire(wire)
        assert got == [update, RequestUpdate("r2")] and dataclasses.asdict(got[0]) == values
    plain = pickle.loads(pickle.dumps(RequestUpdate("r2")))
    assert plain == RequestUpdate("r2")


def test_engine_stats_pickle_every_field():
    """``EngineStats`` goes with every step's updates, pickled positionally."""
    names = [f.name for f in dataclasses.fields(EngineStats)]
    # Every field a distinct value (none its default): a field dropped or reordered fails.
    stats = EngineStats(**{name: k + 1 for k, name in enumerate(names)})
    for protocol in (2, pickle.HIGHEST_PROTOCOL):
        back = pickle.loads(pickle.dumps(stats, protocol=protocol))
        assert back == stats and back is not stats
        assert dataclasses.asdict(back) == {name: k + 1 for k, name in enumerate(names)}


def test_a_one_token_update_goes_as_plain_values():
    """A decode step's update (one token, nothing else) crosses without its one-element lists;
    one that also ends the request, or reports cached tokens, goes whole."""
    one = RequestUpdate(
        "r1", [7], [3], [-0.25], [[(7, -0.25), (9, -1.5)]], weight_version=4, new_ranks=[1]
    )
    ending = RequestUpdate("r2", [8], [2], [None], [None], finish_reason=FinishReason.STOP)
    first = RequestUpdate("r3", [9], [4], [None], [None], num_cached_tokens=16)
    waited = RequestUpdate("r4", [9], [4], [None], [None], queued_s=0.75)  # (engine wait)
    scored = RequestUpdate("r5", [9], [4], [None], [None], forced_logprobs=[(1, -1.0, [], 2)])
    for protocol in (2, pickle.HIGHEST_PROTOCOL):
        wire = pickle.loads(pickle.dumps(to_wire([one, ending, first, waited, scored]), protocol))
        assert wire[0] == ("r1", 7, 3, -0.25, [(7, -0.25), (9, -1.5)], 1, 4)
        assert [len(row) for row in wire[1:]] == [14, 14, 14, 14]
        assert from_wire(wire) == [one, ending, first, waited, scored]


def test_ranks_stay_parallel_to_the_tokens_around_forced_ones():
    """A forced token has no rank: none is kept until a token has one, then every token has an
    entry (None for the forced ones), in token order."""
    update = RequestUpdate("r")
    for token, rank in ((1, None), (2, 5), (3, None), (4, None), (5, 0), (6, None)):
        update.new_token_ids.append(token)
        update.add_rank(rank)
    assert update.new_ranks == [None, 5, None, None, 0, None]
    forced = RequestUpdate("f")
    for token in (6, 7):
        forced.new_token_ids.append(token)
        forced.add_rank(None)
    assert forced.new_ranks == []


def test_a_one_token_update_with_prompt_logprobs_goes_whole():
    scored = RequestUpdate("r", [9], [4], [None], [None], prompt_logprobs=[(-1.0, [], 2)])
    wire = to_wire([scored])
    assert len(wire[0]) == 14 and from_wire(wire) == [scored]
