"""The prefix cache when requests leave early, torch-free with hand-built step results: group
followers whose leader is preempted, answers cached after a resume from swap or recompute or
after an abort (only their final blocks), and the one waiting request that takes a prefix over
when its computer is aborted or preempted. Hits, eviction and group admission:
``test_prefix_cache.py``."""

from __future__ import annotations

import pytest
from test_prefix_cache import _drain, _first_items, _request, _scheduler, _step

from rltserve.core.scheduler import Scheduler
from rltserve.core.swap import SwapSpace


def test_a_follower_whose_leader_is_preempted_mid_prompt_computes_it_at_once():
    """The leader, preempted (by a better priority) before its prompt is final, is waited for
    no more: its follower is admitted in the same step and computes the prompt itself; the
    leader then hits the follower's blocks, though its cached tokens stay those of its first
    admission (none)."""
    s = _scheduler(max_num_seqs=1, scheduling_policy="priority")
    prompt = list(range(10))
    leader = _request("g0", prompt, group="g", priority=1)
    follower = _request("g1", prompt, group="g")
    s.add_request(leader)
    assert [w.request_id for w in _step(s).items] == ["g0"]  # its prompt's first loop
    s.add_request(follower)
    plan = _step(s)
    assert plan.preempted == ["g0"]
    assert [(w.request_id, w.start) for w in plan.items] == [("g1", 0)]
    plans = _drain(s)
    assert _first_items(plans)["g0"] == (8, 2)  # the follower's two full blocks
    assert (leader.num_cached_tokens, follower.num_cached_tokens) == (0, 0)
    # Counted at first admissions only: a re-admission's hit would inflate the hit rate.
    assert (s.kv.cache.queries, s.kv.cache.hits) == (2 * 10, 0)


def test_a_leader_preempted_after_its_prompt_lends_its_follower_no_block():
    """A follower admitted while its leader, its prompt final, is preempted: it takes the
    cached full blocks and computes the rest of its prompt, copying nothing from the leader
    (whose blocks are gone)."""
    s = _scheduler(max_num_seqs=1, scheduling_policy="priority")
    prompt = list(range(10))  # blocks 0, 1 full; positions 8, 9 in block 2
    s.add_request(_request("g0", prompt, group="g", priority=1))
    _step(s)
    _step(s)  # the leader's prompt is final
    s.add_request(_request("g1", prompt, group="g"))
    plan = _step(s)
    assert plan.preempted == ["g0"] and plan.block_copies == []
    assert [(w.request_id, w.start, w.num_tokens) for w in plan.items] == [("g1", 8, 2)]
    _drain(s)


def _preempted_mid_answer(s):
    """Runs request "a" (prompt 0..5, 8 tokens) to 4 tokens, then adds a better-priority
    request that preempts it; returns a, its prompt and the plans to its end."""
    prompt = list(range(6))
    answer = _request("a", prompt, max_tokens=8, priority=1)
    s.add_request(answer)
    while len(answer.output_token_ids) < 4:
        _step(s)
    s.add_request(_request("h", list(range(50, 55))))
    plans = [_step(s)]
    assert plans[0].preempted == ["a"]
    return answer, prompt, plans + _drain(s)


def test_a_request_resumed_from_swap_caches_its_answer_for_the_next_turn():
    """Swapped out (preempted by a better priority) with KV past its prompt, then swapped
    back in: when it ends, its answer's full-depth blocks are cached after its prompt's, and
    the next turn hits them."""
    s = _scheduler(max_num_seqs=1, swap=SwapSpace(64, 1), scheduling_policy="priority")
    answer, prompt, plans = _preempted_mid_answer(s)
    assert plans[0].swap_out and any(plan.swap_in for plan in plans)
    assert answer.output_token_ids == [7] * 8  # 13 positions written: 3 full blocks
    s.add_request(_request("b", prompt + [7] * 8 + [5]))
    assert {w.request_id: w.start for w in s.schedule().items} == {"b": 12}


def test_a_request_resumed_by_recompute_caches_its_answer_for_the_next_turn():
    """As from swap, but recomputed: its prompt and the answer so far run again as one chunk
    that ends past the prompt; its answer's full-depth blocks still follow its prompt's."""
    s = _scheduler(max_num_seqs=1, scheduling_policy="priority")
    answer, prompt, plans = _preempted_mid_answer(s)
    assert not plans[0].swap_out
    assert answer.output_token_ids == [7] * 8
    assert s.kv.cache.num_entries == 3 + 1  # a's three blocks, h's one
    assert s.kv.cache.queries == 6 + 5  # each prompt once: a's recomputing re-admission is not
    s.add_request(_request("b", prompt + [7] * 8 + [5]))
    assert {w.request_id: w.start for w in s.schedule().items} == {"b": 12}


def _burst(s: Scheduler, prompt: list[int]) -> None:
    """Requests a, b, c with one prompt, added at once: a computes it, b and c wait; runs the
    step whose result makes a's first chunk final (blocks 0..3 cached, the rest a's to
    compute)."""
    for rid in "abc":
        s.add_request(_request(rid, prompt))
    assert [w.request_id for w in _step(s).items] == ["a"]
    assert [w.request_id for w in _step(s).items] == ["a"]  # its chunk's last loop
    assert s.requests["a"].blocks_cached == 4 and set(s.sharing._computing.values()) == {"a"}


@pytest.mark.parametrize("leaves", ["abort", "preempt"])
def test_when_a_prefix_computer_leaves_one_waiting_request_takes_the_prefix_over(leaves):
    """The computer of a burst's shared prefix leaves before computing all of it: its claims
    on the blocks it had not cached go with it (none is left behind), the first waiting
    request (a preempted computer is first again) computes the rest after the cached blocks
    and the others wait for it, so the prefix is still computed once."""
    s = _scheduler()
    prompt = list(range(49))  # 12 blocks before the last token: 3 chunks of 16, then 1 token
    _burst(s, prompt)
    if leaves == "abort":
        s.abort("a")
    else:
        s.preemptor.preempt(s.requests["a"])
    assert s.sharing._computing == {}
    first = _first_items(_drain(s))
    if leaves == "abort":
        assert first == {"b": (16, 16), "c": (48, 1)}
    else:
        assert first == {"a": (16, 16), "b": (48, 1), "c": (48, 1)}
    assert s.sharing._computing == {}


def test_aborted_prefix_computers_leave_no_claims():
    s = _scheduler()
    for r in range(5):
        s.add_request(_request(f"r{r}", list(range(100 * r, 100 * r + 30))))
        _step(s)
        s.abort(f"r{r}")
        _drain(s)
    assert s.sharing._computing == {}


def test_an_aborted_answer_caches_its_final_blocks_for_the_next_turn():
    """An answer cut short (a stop string ends it in the front end with an abort, as does a
    client that leaves) caches its full-depth blocks as a finished one does: the next turn,
    its prompt and the answer so far, computes only what is new."""
    s = _scheduler()
    prompt = list(range(14))
    answer = _request("a", prompt, max_tokens=8)
    s.add_request(answer)
    while len(answer.output_token_ids) < 5:  # 18 positions written: four full blocks
        _step(s)
    s.abort("a")
    _drain(s)
    s.add_request(_request("b", prompt + answer.output_token_ids + [5]))
    assert {w.request_id: w.start for w in s.schedule().items} == {"b": 16}


def test_an_answer_aborted_while_it_recomputes_caches_only_recomputed_blocks():
    """Aborted after its recompute resumed but before the replay's last loop: the positions
    past the prompt's cached block have no final KV yet, so none of their blocks is cached
    (a later hit would read KV that was never written)."""
    s = _scheduler(max_num_seqs=1, scheduling_policy="priority")
    prompt = list(range(6))
    answer = _request("a", prompt, max_tokens=8, priority=1)
    s.add_request(answer)
    while len(answer.output_token_ids) < 4:
        _step(s)
    s.add_request(_request("h", list(range(50, 55)), max_tokens=1))
    assert _step(s).preempted == ["a"]
    while answer not in s.running:
        _step(s)
    assert answer.items and answer.items[0].start == 4  # its replay, after the cached block
    s.abort("a")
    _drain(s)
    assert s.kv.cache.num_entries == 1 + 1  # a's prompt block, h's one
