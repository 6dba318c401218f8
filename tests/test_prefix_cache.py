"""The prefix cache and the KV manager's sharing, torch-free (milliseconds): chained hashes,
hits shared on every plane by reference count, LRU eviction before allocation fails, no
leaks, invalidation; and the scheduler's admission after a cached prefix and group followers
waiting for their leader, with hand-built step results. Preempted and aborted prefix
computers: ``test_prefix_cache_preemption.py``."""

from __future__ import annotations

import weakref

import pytest
from fixed_exits import FixedExits

from rltserve.config import SchedulerConfig
from rltserve.core.kv_cache import BOUNDARY, KVManager, KVPolicy, NoFreeBlocks
from rltserve.core.plan import StepPlan, StepResult
from rltserve.core.prefix_cache import block_hashes, make_salt
from rltserve.core.request import Request
from rltserve.core.scheduler import Scheduler
from rltserve.sampling import SamplingParams

SALT = make_salt("model", 0, "float32")


def test_block_hashes_are_chained_and_salted():
    a = block_hashes(SALT, list(range(10)), 4)
    assert len(a) == 2  # the partial third block has none
    b = block_hashes(SALT, [0, 1, 2, 3, 4, 5, 6, 99, 8], 4)
    assert a[0] == b[0] and a[1] != b[1]
    c = block_hashes(SALT, [9, 1, 2, 3, 4, 5, 6, 7], 4)
    assert a[0] != c[0] and a[1] != c[1]  # a change in block 0 changes every later hash
    assert block_hashes(make_salt("model", 1, "float32"), list(range(8)), 4)[0] != a[0]
    assert block_hashes(SALT, list(range(8)), 4) == a  # deterministic


def _kv(num_blocks=24, retain=True, boundary=True) -> KVManager:
    return KVManager(num_blocks, 4, KVPolicy("last_exited"), boundary, retain_cached=retain)


def _cache_prompt(kv: KVManager, rid: str, tokens: list[int], loops: int = 2) -> list[bytes]:
    hashes = block_hashes(SALT, tokens, 4)
    kv.allocate(rid, len(tokens), loops)
    kv.cache_blocks(rid, 0, hashes)
    return hashes


def test_hit_shares_every_plane_and_cached_blocks_count_as_free():
    kv = _kv()
    hashes = _cache_prompt(kv, "a", list(range(9)))  # 3 blocks x 3 planes, 2 cached
    assert kv.cache.num_blocks == 6 and kv.num_free_blocks == 24 - 9
    kv.free("a")
    kv.check_no_leaks()
    assert kv.cache.num_evictable_blocks == 6 and kv.num_free_blocks == 24 and kv.usage == 0.0
    hit = kv.cache.lookup(hashes, 2)
    kv.allocate("b", 10, 2, hit)
    for i, plane in enumerate(kv.planes_of(2)):
        assert kv.block_table("b", plane)[:2] == [e.blocks[i] for e in hit]
        assert all(kv.pool.ref_count(b) == 2 for b in kv.block_table("b", plane)[:2])
    assert BOUNDARY in kv.planes_of(2)
    assert kv.cache.num_evictable_blocks == 0 and kv.num_free_blocks == 24 - 9
    kv.check_no_leaks()
    kv.free("b")
    kv.check_no_leaks()
    assert kv.num_free_blocks == 24


def test_eviction_is_least_recently_released_first_and_only_when_short():
    kv = _kv(num_blocks=12, boundary=False)  # 2 planes
    old = _cache_prompt(kv, "old", list(range(8)))
    new = _cache_prompt(kv, "new", list(range(100, 108)))
    kv.free("old")
    kv.free("new")
    kv.allocate("x", 8, 2)  # 4 blocks: from the free list, nothing evicted
    assert kv.cache.evictions == 0
    kv.allocate("y", 4, 2)  # 2 blocks: the free list is empty, the oldest entry goes
    assert kv.cache.evictions == 1
    assert len(kv.cache.lookup(old, 2)) == 0 and len(kv.cache.lookup(new, 2)) == 2
    kv.check_no_leaks()
    with pytest.raises(NoFreeBlocks):
        kv.allocate("z", 16, 2)  # more than free + evictable: nothing evicted
    assert kv.cache.evictions == 1
    kv.check_no_leaks()


def test_failed_allocation_returns_the_hit():
    kv = _kv(num_blocks=9, boundary=False)
    hashes = _cache_prompt(kv, "a", list(range(8)))
    kv.free("a")
    hit = kv.cache.lookup(hashes, 2)
    with pytest.raises(NoFreeBlocks):
        kv.allocate("b", 40, 2, hit)
    assert not kv.has_request("b") and kv.cache.num_evictable_blocks == 4
    kv.check_no_leaks()
    assert kv.num_free_blocks == 9


def test_without_retention_entries_go_with_their_last_holder():
    kv = _kv(retain=False)
    hashes = _cache_prompt(kv, "a", list(range(8)))
    kv.allocate("b", 9, 2, kv.cache.lookup(hashes, 2))
    kv.free("a")
    assert kv.cache.num_entries == 2  # b still holds them
    kv.free("b")
    assert kv.cache.num_entries == 0 and kv.pool.num_free == 24
    kv.check_no_leaks()


def test_clear_makes_held_blocks_private_and_frees_the_rest():
    kv = _kv()
    held = _cache_prompt(kv, "a", list(range(8)))
    _cache_prompt(kv, "b", list(range(50, 58)))
    kv.free("b")
    kv.cache.clear()
    assert kv.cache.num_entries == 0 and kv.cache.lookup(held, 2) == []
    kv.check_no_leaks()
    kv.free("a")
    kv.check_no_leaks()
    assert kv.pool.num_free == 24


def test_a_key_cached_twice_keeps_the_first_blocks():
    kv = _kv()
    _cache_prompt(kv, "a", list(range(8)))
    _cache_prompt(kv, "b", list(range(8)))  # same tokens computed again: b's stay private
    assert kv.cache.num_entries == 2 and kv.cache.num_blocks == 6
    kv.free("a")
    kv.free("b")
    kv.check_no_leaks()
    assert kv.num_free_blocks == 24


def test_an_entry_cached_again_after_invalidation_is_released_once():
    """A request holding an entry across ``clear`` keeps its blocks private; when the same key
    is cached again by another request and released, the first request's release of its old
    key leaves the new entry counted once."""
    kv = _kv()
    _cache_prompt(kv, "a", list(range(8)))
    kv.cache.clear()
    _cache_prompt(kv, "b", list(range(8)))  # the same keys, b's blocks
    kv.free("b")
    kv.free("a")
    kv.check_no_leaks()
    assert kv.cache.num_evictable_blocks == 6 and kv.num_free_blocks == 24


# ---------------------------------------------------------------- the scheduler side


def _scheduler(num_blocks=64, max_num_seqs=64, retain=True, swap=None, **config) -> Scheduler:
    kv = KVManager(num_blocks, 4, KVPolicy("last_exited"), has_boundary=False, retain_cached=retain)
    config = SchedulerConfig(prefill_chunk_size=16, max_num_seqs=max_num_seqs, **config)
    return Scheduler(
        config, kv, has_gate=False, has_boundary=False, reservation="ondemand", swap=swap
    )


def _request(
    rid: str, prompt: list[int], group: str | None = None, max_tokens: int = 3, priority: int = 0
) -> Request:
    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, priority=priority
    )
    request = Request(
        request_id=rid,
        prompt_token_ids=prompt,
        params=params,
        num_loops=2,
        max_loops=2,
        eos_token_ids=frozenset(),
        max_total_tokens=1000,
        seed=0,
        group=group,
    )
    request.cache_salt = SALT
    request.block_hashes = block_hashes(SALT, prompt, 4)
    return request


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


def _drain(s: Scheduler) -> list[StepPlan]:
    plans = []
    while s.has_work():
        plan = _step(s)
        plans += [plan] if plan else []
        assert len(plans) < 100
    _step(s)
    s.kv.check_no_leaks()
    assert s.kv.usage == 0.0
    return plans


def test_admission_starts_after_the_cached_prefix():
    s = _scheduler()
    s.add_request(_request("a", list(range(14))))
    _drain(s)
    s.add_request(_request("b", list(range(14))))  # 13 positions before the last: 3 blocks
    s.add_request(_request("c", list(range(6)) + [99] * 4))  # diverges mid-block 1: 1 block
    first = {w.request_id: w.start for w in s.schedule().items}
    assert first == {"b": 12, "c": 4}
    assert (s.requests["b"].num_cached_tokens, s.requests["c"].num_cached_tokens) == (12, 4)
    assert s.kv.cache.queries == 14 + 14 + 10 and s.kv.cache.hits == 16


def test_waiting_followers_keep_their_seats_from_later_requests():
    """With caching off and 3 seats, a group of 3 and a later request: the later request must
    not take the followers' seats while the leader computes, or they would miss its prompt."""
    s = _scheduler(max_num_seqs=3, retain=False)
    prompt = list(range(10))
    for j in range(3):
        s.add_request(_request(f"g{j}", prompt, group="g"))
    s.add_request(_request("late", list(range(50, 60))))
    assert [w.request_id for w in _step(s).items] == ["g0"]  # the seats of g1, g2 are kept
    _step(s)
    third = _step(s)
    assert {w.request_id for w in third.items} == {"g0", "g1", "g2"}
    assert all(w.start == 9 for w in third.items if w.request_id != "g0")
    _drain(s)
    assert s.kv.cache.hits == 2 * 9


def test_group_followers_wait_for_the_leader_then_copy_its_last_block():
    s = _scheduler()
    prompt = list(range(10))  # blocks 0, 1 full; positions 8, 9 in block 2
    for j in range(3):
        s.add_request(_request(f"g{j}", prompt, group="g"))
    first = _step(s)
    assert [w.request_id for w in first.items] == ["g0"]  # the followers wait
    second = _step(s)  # the leader's last prompt loop
    assert [w.request_id for w in second.items] == ["g0"]
    third = _step(s)
    starts = {w.request_id: (w.start, w.num_tokens) for w in third.items}
    assert starts["g1"] == starts["g2"] == (9, 1)  # only the last prompt token
    leader_block = s.kv.block_table("g0", 0)[2]
    assert (leader_block, s.kv.block_table("g1", 0)[2]) in third.block_copies
    assert len(third.block_copies) == 2 * 2  # two followers, two planes
    assert s.kv.block_table("g1", 1)[:2] == s.kv.block_table("g0", 1)[:2]
    _drain(s)
    assert s.kv.cache.hits == 2 * 9


def test_adopted_entries_are_written_first_then_cached_and_evictable():
    kv = _kv(num_blocks=24)  # 3 planes at 2 loops
    keys = block_hashes(SALT, list(range(12)), 4)  # 3 entries
    written = []
    assert kv.adopt_cached(keys, 2, [], written.append) == 3
    assert len(written) == 1 and len(written[0]) == 9  # one write, entry by entry
    assert len(kv.cache.lookup(keys, 3)) == 3
    assert kv.cache.num_evictable_blocks == 9 and kv.num_free_blocks == 24
    kv.check_no_leaks()
    kv.allocate("r", 13, 2, kv.cache.lookup(keys, 3))  # a hit, as admission takes it
    assert kv.block_table("r", 0)[:3] == [e.blocks[0] for e in kv.cache.lookup(keys, 3)]
    kv.free("r")
    kv.check_no_leaks()


def test_adoption_takes_what_fits_keeps_the_held_prefix_and_stops_at_a_cached_key():
    kv = _kv(num_blocks=12)  # 3 planes: room for 4 entries
    keys = block_hashes(SALT, list(range(24)), 4)  # 6 entries
    assert kv.adopt_cached(keys[:2], 2, [], lambda ids: None) == 2
    held = kv.cache.lookup(keys, 2)
    assert kv.adopt_cached(keys[2:], 2, held, lambda ids: None) == 2  # 2 fit, held not evicted
    assert len(kv.cache.lookup(keys, 6)) == 4 and kv.cache.evictions == 0
    kv.check_no_leaks()
    kv.cache.clear()
    assert kv.adopt_cached(keys[:1], 2, [], lambda ids: None) == 1
    assert kv.adopt_cached([keys[1], keys[0], keys[2]], 2, [], lambda ids: None) == 1
    assert len(kv.cache.lookup(keys, 6)) == 2  # keys[2] after the cached keys[0]: not taken
    kv.check_no_leaks()


def test_a_failed_write_caches_nothing_and_returns_the_blocks():
    kv = _kv(num_blocks=12)
    keys = block_hashes(SALT, list(range(8)), 4)

    def fail(ids):
        raise RuntimeError("device error")

    with pytest.raises(RuntimeError):
        kv.adopt_cached(keys, 2, [], fail)
    assert kv.cache.num_blocks == 0 and kv.pool.num_free == 12
    kv.check_no_leaks()


def test_finished_answers_are_cached_where_they_ran_the_whole_depth():
    """Stop or length: the answer's full blocks after the prompt's (14 + 3 outputs: 16 written
    positions, four blocks); an abort two outputs in (15 written positions), an answer below
    the request's depth (``max_loops`` 1 of 2 loops) or caching off: the prompt's only."""
    for kind, expected in (("done", 4), ("abort", 3), ("shallow", 3), ("off", 0)):
        s = _scheduler(retain=kind != "off")
        request = _request("a", list(range(14)))
        if kind == "shallow":
            request.max_loops = 1
        s.add_request(request)
        if kind == "abort":
            while len(request.output_token_ids) < 2:
                _step(s)
            s.abort("a")
        _drain(s)
        assert len(s.kv.cache._entries) == expected, kind
        if kind == "done":  # the next turn's prompt: this one, its answer and more
            s.add_request(_request("b", list(range(14)) + [7, 7, 7, 5, 6]))
            first = {w.request_id: w.start for w in s.schedule().items}
            assert first == {"b": 16} and s.requests["b"].num_cached_tokens == 16


def test_a_follower_that_ends_does_not_take_the_groups_leader_with_it():
    """A follower aborted while the leader computes: the other follower still waits for the
    leader and copies its partly filled last block (computing only the last prompt token)."""
    s = _scheduler()
    prompt = list(range(10))  # blocks 0, 1 full; positions 8, 9 in block 2
    for j in range(3):
        s.add_request(_request(f"g{j}", prompt, group="g"))
    assert [w.request_id for w in _step(s).items] == ["g0"]
    s.abort("g2")  # a waiting follower ends
    assert [w.request_id for w in _step(s).items] == ["g0"]  # the leader's last prompt loop
    starts = {w.request_id: (w.start, w.num_tokens) for w in _step(s).items}
    assert starts["g1"] == (9, 1)  # still the leader's follower
    _drain(s)
    assert s.kv.cache.hits == 9


def test_a_request_that_ends_before_its_prompt_is_final_caches_nothing():
    """One output that exits at loop 1 of 2 ends the request before the prompt's last loop is
    applied: none of its prompt blocks is final, so none may be cached (by ``on_finished``
    either), and the same prompt afterwards hits nothing."""
    s = _scheduler()
    prompt = list(range(14))
    request = Request(
        request_id="a",
        prompt_token_ids=prompt,
        params=SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
        num_loops=2,
        max_loops=1,  # the output exits at loop 1
        eos_token_ids=frozenset(),
        max_total_tokens=1000,
        seed=0,
    )
    request.cache_salt = SALT
    request.block_hashes = block_hashes(SALT, prompt, 4)
    s.add_request(request)
    _drain(s)
    assert s.kv.cache.num_entries == 0
    s.add_request(_request("b", prompt))
    assert {w.request_id: w.start for w in s.schedule().items} == {"b": 0}


def _first_items(plans: list[StepPlan]) -> dict[str, tuple[int, int]]:
    """(start, num_tokens) of each request's first planned item."""
    first: dict[str, tuple[int, int]] = {}
    for plan in plans:
        for w in plan.items:
            first.setdefault(w.request_id, (w.start, w.num_tokens))
    return first


def test_a_hit_on_evictable_blocks_waits_until_its_fresh_blocks_fit():
    """The evictable blocks a hit takes stop being free: with the free list held by a running
    request, a request hitting them waits (its allocation would fail) and is admitted with
    its hit once that request ends."""
    s = _scheduler(num_blocks=12)  # 2 planes: 6 blocks per plane
    prompt = list(range(13))
    s.add_request(_request("a", prompt))
    _drain(s)  # 3 prompt blocks cached: 6 evictable blocks, 6 free
    s.add_request(_request("c", list(range(50, 59))))
    plans = [_step(s)]
    assert [w.request_id for w in plans[0].items] == ["c"]  # c holds the 6 free blocks
    s.add_request(_request("b", prompt))  # 3 blocks hit, 1 fresh per plane: none is left
    plans.append(_step(s))
    assert "b" not in {w.request_id for w in plans[-1].items}
    plans += _drain(s)
    assert _first_items(plans)["b"] == (12, 1)


def test_group_members_with_different_prompts_copy_no_block():
    """Requests of one group whose prompts share their full blocks but differ in the last,
    partly filled one: the later one hits the full blocks and computes its own last block
    (the leader's copy would hold the leader's tokens)."""
    s = _scheduler()
    s.add_request(_request("g0", list(range(10)), group="g"))
    s.add_request(_request("g1", [*range(8), 50, 9], group="g"))  # differs at position 8
    plans = _drain(s)
    assert _first_items(plans)["g1"] == (8, 2)
    assert all(plan.block_copies == [] for plan in plans)
    assert s.kv.cache.hits == 8


def test_a_group_member_added_after_its_leader_ended_leads_the_group():
    """Once a group's leader ends, the next request added with its key leads the group: the
    one after it waits for it and copies its partly filled last prompt block."""
    s = _scheduler()
    prompt = list(range(10))
    s.add_request(_request("g0", prompt, group="g"))
    _drain(s)
    s.add_request(_request("g1", prompt, group="g"))
    s.add_request(_request("g2", prompt, group="g"))
    plans = _drain(s)
    assert _first_items(plans) == {"g1": (8, 2), "g2": (9, 1)}
    assert any(plan.block_copies for plan in plans)


def test_a_prompt_scoring_group_member_neither_waits_for_nor_copies_from_its_leader():
    """A member that scores its prompt computes every position: it is admitted with its leader
    instead of waiting for the leader's prompt, and takes no block from it."""
    s = _scheduler()
    prompt = list(range(10))
    s.add_request(_request("g0", prompt, group="g"))
    scoring = _request("g1", prompt, group="g")
    scoring.prompt_logprobs = [None] * (len(prompt) - 1)
    s.add_request(scoring)
    first = _step(s)
    assert {w.request_id for w in first.items} == {"g0", "g1"}
    plans = [first, *_drain(s)]
    assert _first_items(plans)["g1"] == (0, 10)
    assert all(plan.block_copies == [] for plan in plans)


def test_a_follower_whose_last_prompt_token_starts_a_block_copies_nothing():
    """Prompt of 9 tokens, blocks of 4: the last token is the first of block 2, so the leader
    has no partly filled prompt block to lend; the follower hits blocks 0 and 1 only."""
    s = _scheduler()
    prompt = list(range(9))
    for j in range(2):
        s.add_request(_request(f"g{j}", prompt, group="g"))
    plans = _drain(s)
    assert _first_items(plans)["g1"] == (8, 1)
    assert all(plan.block_copies == [] for plan in plans)
    assert s.kv.cache.hits == 8


def test_prompt_blocks_are_cached_once_every_position_before_them_is_final():
    """Prompt items may complete out of order within a step: positions 4..8 final first cache
    nothing; once 0..4 are, both blocks are (and 8..12, the last, a third)."""
    s = _scheduler()
    request = _request("a", list(range(14)))
    s.add_request(request)
    assert s.schedule() is not None  # admitted: its blocks are allocated
    s.sharing.on_prompt_done(request, 4, 8)
    assert (request.prompt_final, request.blocks_cached, s.kv.cache.num_entries) == (0, 0, 0)
    s.sharing.on_prompt_done(request, 0, 4)
    assert (request.prompt_final, request.blocks_cached, s.kv.cache.num_entries) == (8, 2, 2)
    assert list(s.sharing._computing.values()) == ["a"]  # (block 2: a computes it)
    s.sharing.on_prompt_done(request, 8, 14)
    assert (request.prompt_final, request.blocks_cached, s.kv.cache.num_entries) == (14, 3, 3)
    assert s.sharing._computing == {}  # (nothing left to wait for)
