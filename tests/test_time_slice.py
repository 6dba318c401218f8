"""Time slicing under KV pressure (``preemption_time_slice``, ``Preemptor.rotate``): a request
preempted early takes a turn before the first requests end instead of waiting for them; the
victim has had its slice (beyond what it replayed), is the one furthest ahead under swap and
the one least far under recompute, and queues behind the request it makes room for; token ids
and exit depths stay those of an unpressured run and the dense oracle in both preemption modes,
with async scheduling, delayed exits, wavefront prefill, token pipelining, seeded sampling,
aborts and swap space running out, and the pool and swap space end empty."""

from __future__ import annotations

import pytest
from engine_util import make_core, run_core, tight_blocks
from fixed_exits import FixedExits, make_request, make_scheduler, working
from test_preemption import (
    MODES,
    ROOMY,
    SWAP_GB,
    TIGHT,
    _assert_empty,
    _oracle,
    _run,
    _same,
    _workload,
)

from rltserve.config import SchedulerConfig


def _three_requests(time_slice: int = 0, swap: bool = False):
    """A scheduler with three requests of 4 prompt and 12 output tokens over 12 blocks (two
    fit at the end)."""
    s = make_scheduler(12, swap=swap, preemption_time_slice=time_slice, max_num_seqs=8)
    for i in range(3):
        s.add_request(make_request(f"r{i}", 4, 12))
    return s


def _drive(time_slice: int, swap: bool = False):
    """``_three_requests``: per step, the running ids, the preempted ids and the finished
    ids."""
    s = _three_requests(time_slice, swap)
    runner = FixedExits()
    log = []
    for _ in working(s):
        admitted = {r.request_id: (r.admitted_step, r.admitted_replay) for r in s.running}
        rotations = s.preemptor.num_rotations
        plan = s.schedule()
        for rid in plan.preempted[: s.preemptor.num_rotations - rotations]:
            # A slice is q steps past the positions its admission recomputed.
            step, replay = admitted[rid]
            assert plan.step_id - step >= time_slice + replay, rid
        updates = s.apply(plan, runner.result(plan))
        ended = [u.request_id for u in updates if u.finish_reason is not None]
        log.append(({r.request_id for r in s.running}, list(plan.preempted), ended))
    assert s.kv.usage == 0.0 and not s.requests
    return s, log


def _first(log, pred) -> int:
    return next(i for i, entry in enumerate(log) if pred(entry))


@pytest.mark.parametrize("swap", [False, True])
def test_a_preempted_request_takes_a_turn_before_the_first_ends(swap):
    s, log = _drive(0, swap)
    preempted = _first(log, lambda e: e[1])
    first_end = _first(log, lambda e: e[2])
    assert log[preempted][1] == ["r2"]  # the latest arrival (vLLM's order)
    back = _first(log[preempted + 1 :], lambda e: "r2" in e[0]) + preempted + 1
    assert back > first_end  # without slicing it waits for blocks to free
    assert s.preemptor.num_rotations == 0

    s, log = _drive(3, swap)
    assert _first(log, lambda e: e[1]) == preempted  # the same first preemption ...
    rotation = _first(log[preempted + 1 :], lambda e: e[1]) + preempted + 1
    assert rotation - preempted == 3  # ... then a turn after 3 steps of waiting
    assert log[rotation][1] == ["r0"]  # r0 and r1 tie (same outputs, same step): first in line
    assert "r2" in log[rotation][0]  # admitted in the step that made room for it
    assert rotation < _first(log, lambda e: e[2])
    assert s.preemptor.num_rotations >= 2
    assert sum(len(e[2]) for e in log) == 3


def test_the_victim_queues_behind_the_request_it_makes_room_for():
    s = make_scheduler(12, preemption_time_slice=3, max_num_seqs=8)
    for i in range(3):
        s.add_request(make_request(f"r{i}", 4, 12))
    runner = FixedExits()
    seqs = {}
    while not s.preemptor.num_rotations:
        plan = s.schedule()
        s.apply(plan, runner.result(plan))
        seqs = {rid: r.seq for rid, r in s.requests.items()}
    assert seqs["r0"] > seqs["r2"] > seqs["r1"]  # r0 re-queued as a new arrival


def test_requests_of_equal_priority_take_turns_under_the_priority_policy():
    # Only a running request of better priority than the waiting one is spared its turn.
    s = make_scheduler(12, preemption_time_slice=3, max_num_seqs=8, scheduling_policy="priority")
    for i in range(3):
        s.add_request(make_request(f"r{i}", 4, 12, priority=1))
    runner = FixedExits()
    for _ in working(s):
        plan = s.schedule()
        s.apply(plan, runner.result(plan))
    assert s.preemptor.num_rotations >= 2 and not s.requests


def test_a_request_is_never_readmitted_in_the_step_that_preempted_it():
    # (It would only be preempted again: a swap or replay bought nothing.)
    s = make_scheduler(14, preemption_time_slice=2, max_num_seqs=8)
    for rid, prompt_len, max_tokens in (("r0", 7, 10), ("r1", 9, 9), ("r2", 9, 12), ("r3", 7, 12)):
        s.add_request(make_request(rid, prompt_len, max_tokens))
    runner = FixedExits()
    for _ in working(s):
        plan = s.schedule()
        if plan is None:
            continue
        admitted = {setup.request_id for setup in plan.new_requests}
        assert not admitted & set(plan.preempted), plan.step_id
        s.apply(plan, runner.result(plan))
    assert s.preemptor.num_preemptions >= 10 and not s.requests


def test_time_slice_must_be_a_non_negative_int():
    for bad in (-1, 1.5, "8"):
        with pytest.raises(ValueError, match="preemption_time_slice"):
            SchedulerConfig(preemption_time_slice=bad)


SLICED = {"preemption_time_slice": 2}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "case",
    [
        {},
        {"kv_policy": "full"},
        {"async_scheduling": True, "exit_mode": "delayed", "lag": 1, "deferred": True},
        {"wavefront_prefill": True, "prefill_chunk_size": 5, "max_num_batched_tokens": 24},
        {"speculative_tokens": 2, "draft_loops": 2},
    ],
    ids=["gate", "full", "async-delayed", "wavefront", "pipelined"],
)
def test_time_slicing_equals_unpressured_and_oracle(ckpts, ouro_ref, mode, case):
    prompts, params, arrivals = _workload(6, seed=11, thresholds=(0.5, 1.0, 0.3))
    if "speculative_tokens" in case:
        params = [p.replace(exit_threshold=1.0, min_loops=1) for p in params]
    kw = {"prefill_chunk_size": 8, "max_num_batched_tokens": 32, **case}
    plain, _ = _run(ckpts["ouro"], prompts, params, arrivals, **kw, **ROOMY)  # (lag, deferred)
    cores = []
    sliced, _ = _run(
        ckpts["ouro"],
        prompts,
        params,
        arrivals,
        on_core=cores.append,
        preemption_mode=mode,
        **kw,
        **SLICED,
        **TIGHT,
    )
    assert cores[0].scheduler.preemptor.num_rotations >= 2
    _same(sliced, plain)
    policy = case.get("kv_policy", "last_exited")
    _oracle(ouro_ref, sliced, prompts, params, policy, case.get("exit_mode", "gate"))


@pytest.mark.parametrize("swap", [False, True])
def test_the_victim_is_the_one_furthest_ahead_under_swap_the_least_under_recompute(swap):
    # r0 and r1 arrive first, r2 three steps later, r3 six: the first turn finds r0 and r1 with
    # more outputs than r2 (r3 was the first preempted, for lack of blocks).
    s = make_scheduler(16, swap=swap, preemption_time_slice=3, max_num_seqs=8)
    arrivals = {0: ["r0", "r1"], 3: ["r2"], 6: ["r3"]}
    runner = FixedExits()
    step = 0
    while not s.preemptor.num_rotations:
        for rid in arrivals.pop(step, []):
            s.add_request(make_request(rid, 4, 12))
        outputs = {r.request_id: len(r.output_token_ids) for r in s.running}
        plan = s.schedule()
        s.apply(plan, runner.result(plan))
        step += 1
    assert s.requests["r3"].num_preemptions == 1
    assert outputs == {"r0": 6, "r1": 6, "r2": 5}
    # Swap: the furthest ahead, r0 before r1 (admitted in the same step, first in line);
    # recompute: r2, whose replay is shortest.
    assert plan.preempted == (["r0"] if swap else ["r2"])


@pytest.mark.parametrize("mode", MODES)
def test_time_slicing_with_seeded_sampling_and_aborts(ckpts, mode):
    """Sampled requests continue their generators across turns; requests aborted while
    running or waiting their turn leave nothing behind (``_assert_empty``)."""
    prompts, params, arrivals = _workload(6, seed=12, thresholds=(0.5, 1.0))
    params = [p.replace(temperature=0.9, top_p=0.95, seed=300 + i) for i, p in enumerate(params)]
    plain, _ = _run(ckpts["ouro"], prompts, params, arrivals, **ROOMY)
    kw = {"preemption_mode": mode, **SLICED}
    if mode == "swap":
        kw["swap_space_gb"] = SWAP_GB  # some turns fall back to recompute
    aborts = {1: 12, 4: 20}
    cores = []
    sliced, _ = _run(
        ckpts["ouro"], prompts, params, arrivals, aborts=aborts, on_core=cores.append, **kw, **TIGHT
    )
    assert cores[0].scheduler.preemptor.num_rotations >= 2
    for i in range(len(prompts)):
        got, want = sliced.tokens[f"r{i}"], plain.tokens[f"r{i}"]
        assert got == (want[: len(got)] if i in aborts else want), f"request {i}"


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
def test_time_slicing_on_cuda_equals_oracle(ckpts, ouro_ref, mode):
    """On the device, sync and async with deferred results: turns, swap-outs to host memory
    and resumes give the oracle's tokens and depths."""
    prompts, params, arrivals = _workload(6, seed=11, thresholds=(0.5, 1.0, 0.3))
    kw = {"block_size": 4, "kv_watermark": 0.0, "preemption_mode": mode, **SLICED}
    blocks = tight_blocks(ckpts["ouro"], prompts, params, **kw)
    for deferred in (False, True):
        async_kw = {"async_scheduling": True, "exit_mode": "delayed"} if deferred else {}
        core = make_core(ckpts["ouro"], num_blocks=blocks, device="cuda", **kw, **async_kw)
        run = run_core(
            core, prompts, params, arrivals=arrivals, lag=int(deferred), deferred=deferred
        )
        _assert_empty(core)
        assert core.scheduler.preemptor.num_rotations >= 2
        exit_mode = "delayed" if deferred else "gate"
        _oracle(ouro_ref, run, prompts, params, "last_exited", exit_mode)


def test_a_turn_that_could_not_make_room_preempts_nobody(monkeypatch):
    s = make_scheduler(12, preemption_time_slice=3, max_num_seqs=8)
    for i in range(3):
        s.add_request(make_request(f"r{i}", 4, 12))
    runner = FixedExits()
    head = s.requests["r2"]
    while not head.num_preemptions or s.next_step_id - head.preempted_step < 3:
        plan = s.schedule()
        s.apply(plan, runner.result(plan))
    assert head.status.name == "WAITING" and s.preemptor.num_rotations == 0
    # Its turn is due. Needing more than every running request holds, it takes nobody.
    blocks = s.admission.blocks
    monkeypatch.setattr(s.admission, "blocks", lambda r, item, hit=None: s.kv.pool.num_total + 1)
    s.preemptor.rotate()
    assert s.preemptor.num_rotations == 0 and s.num_running == 2
    monkeypatch.setattr(s.admission, "blocks", blocks)
    s.preemptor.rotate()  # the real need: one victim makes room
    assert s.preemptor.num_rotations == 1 and s.num_running == 1


def test_a_swapped_request_counts_only_what_it_recomputes_as_its_replay():
    """A slice is q steps past the positions its admission *recomputed*: a swap-resumed
    request gets its swapped positions back without running them, so they are no replay
    (else a swapped request would hold its turn for as many more steps as it had written)."""
    s = _three_requests(swap=True)
    runner = FixedExits()
    resumed = []
    for _ in working(s):
        waiting = {r.request_id: (r.swapped_tokens, r.replay_until) for r in s.waiting}
        plan = s.schedule()
        for setup in plan.new_requests:
            swapped, replay_until = waiting.get(setup.request_id, (0, 0))
            if swapped:
                want = max(0, replay_until + 1 - swapped)
                resumed.append((s.requests[setup.request_id].admitted_replay, want))
        s.apply(plan, runner.result(plan))
    assert resumed and all(got == want for got, want in resumed), resumed
