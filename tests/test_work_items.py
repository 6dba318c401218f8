"""``ItemMaker``, torch-free: which item a request runs next (prompt chunks, decode tokens, the
end of its outputs) and the ``WorkItem`` of one loop (table of the loop's plane, the request's
shared exit specs, last_exited copy targets, prompt ids only on entry)."""

from __future__ import annotations

from dataclasses import astuple

from rltserve.config import SchedulerConfig
from rltserve.core.exit import exit_known, exit_spec
from rltserve.core.kv_cache import KVManager, KVPolicy
from rltserve.core.plan import WorkItem
from rltserve.core.preemption import replay_item
from rltserve.core.request import InFlight, Request
from rltserve.core.work_items import ItemMaker
from rltserve.sampling import SamplingParams


def _maker(policy: str = "last_exited") -> ItemMaker:
    kv = KVManager(64, 4, KVPolicy.parse(policy), has_boundary=False)
    return ItemMaker(SchedulerConfig(prefill_chunk_size=4), kv, has_boundary=False)


def _request(exit_mode: str = "fixed", max_tokens: int = 3) -> Request:
    request = Request(
        request_id="a",
        prompt_token_ids=[5, 6, 7, 8, 9, 10],
        params=SamplingParams(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=True, exit_threshold=0.5
        ),
        num_loops=3,
        max_loops=3,
        eos_token_ids=frozenset(),
        max_total_tokens=100,
        seed=0,
    )
    request.exit_mode = exit_mode
    return request


def test_prompt_chunks_then_decode_tokens_then_none():
    maker, request = _maker(), _request(max_tokens=2)
    first = maker.next_item(request, budget=100)
    assert (first.start, first.num_tokens, first.has_output) == (0, 4, False)
    assert maker.next_item(request, budget=3).num_tokens == 3  # the budget bounds a chunk
    request.num_scheduled = 4
    last = maker.next_item(request, budget=100)
    assert (last.start, last.num_tokens, last.has_output, last.ends_at) == (4, 2, True, 3)
    request.num_scheduled = 6  # the first output's position is planned: its decode token
    token = maker.next_item(request, budget=100)
    assert (token.start, token.num_tokens, token.output_index, token.stop_at_exit) == (
        6,
        1,
        1,
        True,
    )
    request.num_scheduled = 7  # output 2 would be the third: max_tokens=2 is reached
    assert maker.next_item(request, budget=100) is None


def test_whole_chunks_fit_beside_the_other_requests_decode_rows():
    assert SchedulerConfig().whole_chunk_size == 512  # (the defaults: prefill_chunk_size)
    sched = SchedulerConfig(prefill_chunk_size=8, max_num_batched_tokens=10, max_num_seqs=4)
    assert sched.whole_chunk_size == 7  # 10 - 3 decode rows
    sched = SchedulerConfig(prefill_chunk_size=4, max_num_batched_tokens=4, max_num_seqs=64)
    assert sched.whole_chunk_size == 1


def test_shared_and_ring_prompt_chunks_are_never_cut_by_the_budget():
    # (A later chunk reads an earlier one's last versions: where chunks start decides the KV.)
    for policy in ("shared", "ring:2"):
        maker, request = _maker(policy), _request()
        assert maker.next_item(request, budget=3) is None  # waits for a step with room
        assert maker.next_item(request, budget=4).num_tokens == 4
        request.num_scheduled = 4
        assert maker.next_item(request, budget=1) is None
        assert maker.next_item(request, budget=2).num_tokens == 2  # (the prompt's last two)


def test_work_item_tables_prompt_ids_and_copy_targets():
    maker, request = _maker(), _request()
    maker.kv.allocate("a", 8, 3)
    request.num_scheduled = 6
    token = maker.next_item(request, budget=100)
    works = [maker.work_item(request, token, d) for d in (1, 2, 3)]
    for d, work in enumerate(works, start=1):
        assert work.block_table == maker.kv.table_for_depth("a", d)
        assert work.token_ids is None  # a decode token's input stays on the runner
        assert work.exit_copy_blocks == maker.kv.exit_copy_blocks("a", 6, d, 3)
    assert works[0].exit_copy_blocks and works[2].exit_copy_blocks == []
    request.num_scheduled = 0
    chunk = maker.next_item(request, budget=100)
    assert maker.work_item(request, chunk, 1).token_ids == [5, 6, 7, 8]
    assert maker.work_item(request, chunk, 2).token_ids is None
    assert maker.work_item(request, chunk, 2).exit is None  # no output position


def test_exit_specs_are_shared_per_request_and_fixed_ones_say_when():
    maker, request = _maker("full"), _request("gate")
    maker.kv.allocate("a", 8, 3)
    request.num_scheduled = 6
    token = maker.next_item(request, budget=100)
    specs = [maker.work_item(request, token, d).exit for d in (1, 2, 3)]
    assert specs[0] is specs[1] is specs[2]
    assert (specs[0].mode, specs[0].threshold, specs[0].max_loops) == ("gate", 0.5, 3)
    assert maker.work_item(request, token, 1).exit_copy_blocks == []  # full copies nothing
    fixed = _request("fixed")
    fixed.num_scheduled = 6
    token = maker.next_item(fixed, budget=100)
    now = [maker.work_item(fixed, token, d).exit.exit_now for d in (1, 2, 3)]
    assert now == [False, False, True]  # exits at the cap: max_loops


def test_work_item_fields_land_where_they_belong():
    # work_item builds WorkItems positionally (speed): every field must still be the right one.
    maker, request = _maker(), _request("delayed")
    maker.kv.allocate("a", 8, 3)
    request.num_scheduled, request.epoch = 6, 2
    token = maker.next_item(request, budget=100)
    token.draft_at = 2
    assert maker.work_item(request, token, 2) == WorkItem(
        request_id="a",
        start=6,
        num_tokens=1,
        depth=2,
        ends_at=3,
        stop_at_exit=True,
        block_table=maker.kv.table_for_depth("a", 2),
        token_ids=None,
        boundary_table=None,
        exit=exit_spec(request, token, 2),
        exit_copy_blocks=maker.kv.exit_copy_blocks("a", 6, 2, 3),
        draft=True,
        epoch=2,
    )


def test_decode_item_fields_land_where_they_belong():
    # next_item builds decode items positionally (speed): every field must be the right one.
    maker, request = _maker(), _request("delayed", max_tokens=3)
    request.num_scheduled, request.epoch, request.num_preemptions = 6, 1, 2
    request.pipelined = True
    maker.config = SchedulerConfig(prefill_chunk_size=4, speculative_tokens=1, draft_loops=2)
    assert astuple(maker.next_item(request, budget=100)) == astuple(
        InFlight(
            start=6,
            num_tokens=1,
            ends_at=3,
            stop_at_exit=True,
            has_output=True,
            output_index=1,
            draft_at=2,
            epoch=1,
            life=2,
        )
    )


def test_a_delayed_decision_wakes_a_carried_token_at_its_exit_loop():
    """``InFlight.exits_after``: the next loop is the exit; a carried token's ``wake`` (the
    step planning next looks at it) moves to that loop's step, never later."""
    item = InFlight(start=6, num_tokens=1, ends_at=4, stop_at_exit=True, has_output=True)
    item.exits_after(1)
    assert (item.delayed_exit_at, item.wake) == (2, 0)  # planned loop by loop: never asleep
    carried = InFlight(start=6, num_tokens=1, ends_at=4, stop_at_exit=True, has_output=True)
    carried.carry_key, carried.carry_step, carried.exit_by = 3, 10, 4
    carried.wake = 14  # its cap: loop 4 runs in step 13, so step 14 knows the exit
    carried.exits_after(2)  # loop 2 (step 11) decided: loop 3, in step 12, exits
    assert (carried.delayed_exit_at, carried.wake) == (3, 13)
    carried.wake = 12
    carried.exits_after(2)
    assert carried.wake == 12


def _coda_maker(policy: str) -> ItemMaker:
    kv = KVManager(64, 4, KVPolicy.parse(policy), has_boundary=True)
    return ItemMaker(SchedulerConfig(prefill_chunk_size=4), kv, has_boundary=True)


def test_an_early_first_output_with_coda_attention_samples_at_the_prompt_last_loop():
    # Huginn, first output traced at loop 1 of 3: the final prompt chunk keeps its last row's
    # state after loop 1 and exits (samples) at loop 3; later outputs exit at their own loops.
    maker, request = _coda_maker("last_exited"), _request()
    request.params = request.params.replace(exit_threshold=1.0, trace_depths=(1, 2, 3))
    request.first_coda_at = 1
    maker.kv.allocate("a", 8, 3)
    request.num_scheduled = 4
    last = maker.next_item(request, budget=100)
    assert (last.start, last.has_output, last.coda_state_at) == (4, True, 1)
    now = [maker.work_item(request, last, d).exit.exit_now for d in (1, 2, 3)]
    assert now == [False, False, True]
    assert [maker.work_item(request, last, d).coda_state_at for d in (1, 3)] == [1, 1]
    assert [exit_known(request, last, d) for d in (1, 2, 3)] == [False, False, True]
    request.num_scheduled = 0
    assert maker.next_item(request, budget=100).coda_state_at == 0  # not the last chunk
    request.num_scheduled = 6
    token = maker.next_item(request, budget=100)
    assert token.coda_state_at == 0
    now = [maker.work_item(request, token, d).exit.exit_now for d in (1, 2, 3)]
    assert now == [False, True, True]  # output 1 exits at its traced loop 2


def test_full_replay_with_coda_attention_recomputes_an_early_exit_alone():
    request = _request(max_tokens=6)
    request.output_token_ids = [1, 2, 3, 4, 5]
    request.exit_depths = [3, 3, 3, 1, 3]  # outputs 1, 2 (positions 6, 7) at full depth
    request.replay_until = 10
    full = KVPolicy.parse("full")
    both = replay_item(request, 6, 4, full, coda_attention=True)
    assert (both.num_tokens, both.ends_at, both.coda_state_at) == (2, 3, 0)
    alone = replay_item(request, 8, 2, full, coda_attention=True)  # output 3 exited at 1
    assert (alone.num_tokens, alone.ends_at, alone.coda_state_at) == (1, 3, 1)
    plain = replay_item(request, 6, 4, full, coda_attention=False)
    assert (plain.num_tokens, plain.coda_state_at) == (4, 0)
    # last_exited: each token to its exit depth, where its coda runs anyway.
    last = replay_item(request, 8, 2, KVPolicy.parse("last_exited"), coda_attention=True)
    assert (last.num_tokens, last.ends_at, last.coda_state_at) == (1, 1, 0)


def test_trace_depths_past_the_cap_exit_at_the_cap():
    """A traced depth deeper than the request's ``max_loops`` (validation bounds it by
    ``min_loops`` only) exits at the cap: the spec says so at loop ``max_loops``, and a carried
    token's known exit (``exit_known_by``) is the cap, not past its last loop."""
    maker, request = _maker(), _request()
    request.params = SamplingParams(
        temperature=0.0, max_tokens=3, ignore_eos=True, trace_depths=(2, 9, 9)
    )
    maker.kv.allocate("a", 8, 3)
    request.num_scheduled = 6
    token = maker.next_item(request, budget=100)  # output 1, traced at depth 9 > cap 3
    assert token.output_index == 1
    assert [exit_spec(request, token, d).exit_now for d in (1, 2, 3)] == [False, False, True]
    assert maker.exit_known_by(request, token) == 3
