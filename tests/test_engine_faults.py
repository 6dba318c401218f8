"""Engine faults: a step that raises fails exactly the requests it ran, and a row of non-finite
logits fails exactly its request. Everything else continues with the oracle's tokens, every KV
block comes back, and the engine serves new requests unchanged afterwards."""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass, field

import pytest
import torch
from engine_util import make_core, oracle_run

from rltserve.core.request import FinishReason
from rltserve.sampling import SamplingParams

PROMPTS = {"a": [1, 2, 3, 4, 5, 6, 7], "b": [8, 9], "c": [10, 11, 12], "d": [13]}


@dataclass
class Outcome:
    tokens: dict[str, list[int]] = field(default_factory=dict)
    depths: dict[str, list[int]] = field(default_factory=dict)
    finish: dict[str, str] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    faulty: set[str] = field(default_factory=set)  # requests in the step that raised
    omitted: set[str] = field(default_factory=set)  # running then, but not in that step


def drive(
    core, params: dict[str, SamplingParams], *, lag: int, fault=None, breaks=("model", "loop")
) -> Outcome:
    """Runs the requests to completion, planning ``lag`` steps ahead of applied results (as
    async scheduling does). ``fault(plan, core)`` is asked before each launch until it answers
    True once; in that step ``breaks`` (the model's loop unless told) raises."""
    out = Outcome()
    for rid, p in params.items():
        core.add_request(rid, PROMPTS[rid], p)
        out.tokens[rid], out.depths[rid] = [], []
    pending: deque = deque()
    armed = fault is not None
    for _ in range(2_000):
        plan = core.plan()
        if plan is not None:
            if armed and fault(plan, core):
                armed = False
                out.faulty = step_requests(plan, core)
                out.omitted = {r.request_id for r in core.scheduler.running} - out.faulty
                owner = core.model if breaks[0] == "model" else core.runner

                def broken(*args):
                    raise RuntimeError("injected step failure")

                setattr(owner, breaks[1], broken)
                try:
                    handle = core.runner.launch(plan)
                finally:
                    delattr(owner, breaks[1])  # the class's method again
            else:
                handle = core.runner.launch(plan)
            pending.append((plan, handle))
        if len(pending) > lag or (plan is None and pending):
            done, handle = pending.popleft()
            for u in core.apply(done, handle.result()):
                out.tokens[u.request_id] += u.new_token_ids
                out.depths[u.request_id] += u.new_exit_depths
                if u.finish_reason is not None:
                    out.finish[u.request_id] = u.finish_reason.value
                if u.error is not None:
                    out.errors[u.request_id] = u.error
        if not core.has_work() and not pending:
            break
    else:
        raise AssertionError("engine did not finish")
    final = core.plan()  # the releases of the last finished requests reach the runner
    if final is not None:
        core.execute(final)
    return out


def step_requests(plan, core) -> set[str]:
    """The requests a step about to launch runs: its items' and the runner's carried decode
    tokens' (those its plan does not release or preempt), and those it continues."""
    gone = {*plan.released, *plan.preempted}
    carried = {w.request_id for w in core.runner.carried.items} - gone
    continued = {rid for rid, _, _ in plan.continued}
    return {it.request_id for it in plan.items} | carried | continued


def assert_clean(core) -> None:
    assert core.kv.usage == 0
    assert not core.runner.host_swap.num_requests and core.stats().swapped_bytes == 0
    core.kv.check_no_leaks()
    assert not core.runner.live and not core.runner._dropped
    assert not core.scheduler.requests


def oracle(ref, core, rid: str, p: SamplingParams):
    mode = core.config.scheduler.exit_mode
    return oracle_run(ref, PROMPTS[rid], p, kv_policy="last_exited", exit_mode=mode)


def assert_oracle(ref, core, out: Outcome, params, rids) -> None:
    for rid in rids:
        want = oracle(ref, core, rid, params[rid])
        assert out.tokens[rid] == want.tokens, rid
        assert out.depths[rid] == want.exit_depths, rid
        assert out.finish[rid] == "length", rid


def omits_a_running_request(plan, core) -> bool:
    """A step that leaves out a running request (its exit is not known yet) and has run
    before (so the fault hits requests mid-generation)."""
    planned = step_requests(plan, core)
    running = {r.request_id for r in core.scheduler.running}
    return plan.step_id > 3 and bool(planned) and bool(running - planned)


def poison_rows(core, monkeypatch, marker: int, from_call: int) -> None:
    """The logits reaching the sampler become NaN in the rows of requests seeded ``marker``,
    from that request's ``from_call``-th sampled token on (0-based)."""
    sample_device = core.runner.sampler.sample_device
    calls = {"n": 0}

    def poisoned(logits, rows):
        hit = [j for j, row in enumerate(rows) if row.params.seed == marker]
        if hit:
            if calls["n"] >= from_call:
                logits = logits.clone()
                logits[hit[0], 3] = float("nan")
            calls["n"] += 1
        return sample_device(logits, rows)

    monkeypatch.setattr(core.runner.sampler, "sample_device", poisoned)


CONFIGS = {
    "sync": ({}, 0, 1.0),
    "async-delayed": ({"async_scheduling": True, "exit_mode": "delayed"}, 1, 0.5),
    "deferred": ({"async_scheduling": True, "exit_mode": "delayed"}, 1, 0.3),
    "small-budget": (
        {"max_num_batched_tokens": 6, "prefill_chunk_size": 4, "exit_mode": "delayed"},
        1,
        1.0,
    ),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_step_that_raises_fails_only_its_requests(ouro_rv1, ouro_ref, name):
    engine, lag, threshold = CONFIGS[name]
    core = make_core(ouro_rv1, max_num_seqs=3, **engine)
    core.runner.defer_results = name == "deferred"
    params = {
        rid: SamplingParams(max_tokens=6, ignore_eos=True, exit_threshold=threshold)
        for rid in PROMPTS
    }

    def fault(plan, core) -> bool:
        if name == "sync":  # every running request is in every step: fault mid-generation
            return plan.step_id == 6
        return omits_a_running_request(plan, core)

    out = drive(core, params, lag=lag, fault=fault)
    assert out.faulty, "the fault was never injected"
    if name != "sync":
        assert out.omitted, "the faulty step left no running request out"
    failed = {rid for rid, why in out.finish.items() if why == "error"}
    assert failed == out.faulty
    for rid in failed:
        assert out.errors[rid] == "RuntimeError: injected step failure"
    survivors = set(PROMPTS) - failed
    assert survivors  # "d" waited for a slot at least
    assert_oracle(ouro_ref, core, out, params, sorted(survivors))
    assert_clean(core)
    # The engine is not corrupted: a new request gives the oracle's tokens and exit depths.
    again = drive(core, {"a": params["a"]}, lag=lag)
    assert_oracle(ouro_ref, core, again, params, ["a"])
    assert_clean(core)
    core.shutdown()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_nan_logits_fail_only_their_request(ouro_rv1, ouro_ref, monkeypatch, name):
    engine, lag, threshold = CONFIGS[name]
    core = make_core(ouro_rv1, **engine)
    core.runner.defer_results = name == "deferred"
    params = {
        rid: SamplingParams(max_tokens=6, ignore_eos=True, exit_threshold=threshold)
        for rid in PROMPTS
    }
    params["c"] = SamplingParams(max_tokens=6, ignore_eos=True, exit_threshold=threshold, seed=4242)
    poison_rows(core, monkeypatch, marker=4242, from_call=2)
    out = drive(core, params, lag=lag)
    assert out.finish["c"] == "error"
    assert out.errors["c"].startswith("non-finite logits (NaN or infinity) for output token 2 ")
    want = oracle(ouro_ref, core, "c", params["c"])
    assert out.tokens["c"] == want.tokens[:2]  # the tokens before the NaN row stand
    assert_oracle(ouro_ref, core, out, params, ["a", "b", "d"])
    assert_clean(core)
    core.shutdown()


def test_nan_logits_under_token_pipelining(ouro_rv1, ouro_ref, monkeypatch):
    core = make_core(ouro_rv1, speculative_tokens=1, async_scheduling=True)
    params = {rid: SamplingParams(max_tokens=6, ignore_eos=True) for rid in ("a", "b")}
    params["b"] = SamplingParams(max_tokens=6, ignore_eos=True, seed=4242)
    poison_rows(core, monkeypatch, marker=4242, from_call=3)
    out = drive(core, params, lag=1)
    assert out.finish["b"] == "error" and "non-finite logits" in out.errors["b"]
    assert len(out.tokens["b"]) == 3
    assert_oracle(ouro_ref, core, out, params, ["a"])
    assert_clean(core)
    core.shutdown()


def test_sampler_flags_non_finite_rows():
    from rltserve.core.sampler import Sampler, SampleRow

    logits = torch.zeros(4, 8)
    logits[1, 2] = float("nan")
    logits[2, 5] = float("inf")
    logits[3, 0] = float("-inf")  # a masked token is not finite either
    rows = [SampleRow(SamplingParams(temperature=0.0))] * 2
    rows += [SampleRow(SamplingParams(temperature=0.8, top_p=0.5, logprobs=2))] * 2
    out = Sampler().sample(logits, rows)
    assert out.finite == [True, False, False, False]
    assert len(out.token_ids) == 4


def test_failed_step_logs_its_traceback(ouro_rv1, monkeypatch, caplog):
    core = make_core(ouro_rv1)
    core.add_request("a", [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))

    def broken(*args):
        raise RuntimeError("injected step failure")

    monkeypatch.setattr(core.model, "loop", broken)
    with caplog.at_level("ERROR", logger="rltserve.core.runner"):
        updates = core.step()
    assert [(u.request_id, u.finish_reason) for u in updates] == [("a", FinishReason.ERROR)]
    assert "Traceback" not in updates[0].error
    assert "step 1 failed" in caplog.text and "injected step failure" in caplog.text
    assert caplog.records[-1].exc_info is not None


def test_a_failed_swap_out_fails_the_requests_it_preempted(ouro_rv1, ouro_ref):
    params = {rid: SamplingParams(max_tokens=12, ignore_eos=True) for rid in PROMPTS}
    probe = make_core(ouro_rv1, block_size=4)
    need = max(
        probe.kv.blocks_needed(r.kv_tokens, r.num_loops)
        for r in (probe.make_request(rid, PROMPTS[rid], params[rid]) for rid in PROMPTS)
    )
    probe.shutdown()
    core = make_core(
        ouro_rv1,
        preemption_mode="swap",
        block_size=4,
        num_blocks=need + 2,
        kv_watermark=0.0,
        max_num_seqs=3,
    )
    preempted: set[str] = set()

    def fault(plan, core) -> bool:
        preempted.update(rid for rid, _ in plan.swap_out)
        return bool(plan.swap_out)

    out = drive(core, params, lag=0, fault=fault, breaks=("runner", "_slots"))
    assert preempted - out.faulty, "the faulty step preempted nobody"
    failed = {rid for rid, why in out.finish.items() if why == "error"}
    assert failed == out.faulty | preempted
    assert all(out.errors[rid] == "RuntimeError: injected step failure" for rid in failed)
    survivors = set(PROMPTS) - failed
    assert survivors
    assert_oracle(ouro_ref, core, out, params, sorted(survivors))
    assert_clean(core)
    core.shutdown()


@pytest.mark.parametrize("arrival", [2, 4, 6, 8])
@pytest.mark.parametrize("threshold", [1.0, 0.5])
def test_a_launch_failing_before_its_loop_fails_the_carried_tokens(
    ouro_rv1, ouro_ref, monkeypatch, arrival, threshold
):
    """The launch raises while setting up a new request, before any loop is queued: the
    step's carried decode tokens fail with it (the scheduler counted their loop in it), the
    others continue exactly and nothing stalls or leaks."""
    from rltserve.core.live import LiveRequest

    core = make_core(ouro_rv1)
    params = {
        "a": SamplingParams(max_tokens=6, ignore_eos=True, exit_threshold=threshold),
        "b": SamplingParams(max_tokens=3, ignore_eos=True),
        "c": SamplingParams(max_tokens=4, ignore_eos=True, exit_threshold=threshold),
    }
    create = LiveRequest.create
    faulty: set[str] = set()

    def broken(setup, *args, **kwargs):
        if setup.request_id == "b":
            raise RuntimeError("injected set-up failure")
        return create(setup, *args, **kwargs)

    out = Outcome()
    for rid in ("a", "c"):
        core.add_request(rid, PROMPTS[rid], params[rid])
    for step in range(300):
        if step == arrival:
            core.add_request("b", PROMPTS["b"], params["b"])
        plan = core.plan()
        if plan is None:
            assert not core.has_work(), "stalled with requests running"
            break
        if any(setup.request_id == "b" for setup in plan.new_requests):
            faulty = step_requests(plan, core)
            monkeypatch.setattr(LiveRequest, "create", broken)
            result = core.runner.execute(plan)
            monkeypatch.setattr(LiveRequest, "create", create)
        else:
            result = core.runner.execute(plan)
        for u in core.apply(plan, result):
            out.tokens.setdefault(u.request_id, []).extend(u.new_token_ids)
            out.depths.setdefault(u.request_id, []).extend(u.new_exit_depths)
            if u.finish_reason is not None:
                out.finish[u.request_id] = u.finish_reason.value
    final = core.plan()
    if final is not None:
        core.execute(final)
    assert "b" in faulty
    failed = {rid for rid, why in out.finish.items() if why == "error"}
    assert failed == faulty
    for rid in {"a", "c"} - failed:
        want = oracle_run(ouro_ref, PROMPTS[rid], params[rid])
        assert out.tokens[rid] == want.tokens and out.depths[rid] == want.exit_depths, rid
    assert_clean(core)
    core.shutdown()


def test_a_failed_swap_out_still_releases_the_plans_requests(ouro_rv1, ouro_ref):
    """A plan that releases an aborted request (whose decode token the runner carries) and
    whose swap-out fails: the released request's row goes all the same, so it never writes
    into its freed blocks once a new request holds them."""
    core = make_core(ouro_rv1, block_size=4)
    p = SamplingParams(max_tokens=20, ignore_eos=True)
    core.add_request("a", PROMPTS["a"], p)
    core.add_request("b", PROMPTS["b"], p)
    for _ in range(40):
        core.step()
        carried = core.runner.carried
        if any(w.request_id == "a" and d <= 2 for w, d in zip(carried.items, carried.depths)):
            break  # (its depth is the runner's column: the plan's item keeps its first loop's)
    else:
        raise AssertionError("a's decode token was never carried")
    core.abort("a")
    plan = core.plan()
    assert plan.released == ["a"]
    # The same plan swaps out a victim, and that copy fails (a device error).
    victim = core.kv.all_blocks("b", core.kv.covered("b"))
    plan = dataclasses.replace(plan, swap_out=[("b", victim)])

    def broken(*args):
        raise RuntimeError("injected swap-out failure")

    core.runner._slots = broken
    try:
        result = core.runner.execute(plan)
    finally:
        del core.runner._slots
    assert result.error is not None
    core.apply(plan, result)
    assert "a" not in core.runner.live
    assert all(w.request_id != "a" for w in core.runner.carried.items)
    core.add_request("d", [9, 10, 11, 12, 13, 14], p)  # takes the freed blocks
    tokens: list[int] = []
    while core.has_work():
        tokens += [t for u in core.step() if u.request_id == "d" for t in u.new_token_ids]
    assert tokens == oracle_run(ouro_ref, [9, 10, 11, 12, 13, 14], p).tokens
    core.shutdown()


@pytest.mark.parametrize("finished_first", [False, True], ids=["raises", "finishes-raises"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_an_apply_error_fails_only_the_steps_requests(ouro_rv1, ouro_ref, name, finished_first):
    """The scheduler raising while it applies a step's result: that step's requests fail with
    the error (also one it finished before raising), every other request continues exactly,
    nothing leaks."""
    engine, lag, threshold = CONFIGS[name]
    core = make_core(ouro_rv1, max_num_seqs=3, **engine)
    core.runner.defer_results = name == "deferred"
    params = {
        rid: SamplingParams(max_tokens=6, ignore_eos=True, exit_threshold=threshold)
        for rid in PROMPTS
    }
    sched = core.scheduler
    apply = sched.apply
    hit: dict[str, set[str]] = {}

    class BrokenStopIds(frozenset):
        """A request's stop ids, tested for every token applied (a row of ``StepUpdates``'
        columns or not): the step's last test raises, after the step's other tokens were
        applied, and after ending the request when ``finished_first``."""

        def __contains__(self, token):
            hit["tested"] = tested = hit.get("tested", 0) + 1
            if tested < hit["samples"]:
                return frozenset.__contains__(self, token)
            if finished_first and not self.request.is_finished:
                sched.finish(self.request, FinishReason.STOP)
                assert self.request.request_id not in sched.requests
            raise RuntimeError("injected apply failure")

    def faulty_apply(plan, result):
        # Mid-generation, a step that samples while other requests are running or waiting.
        planned = {it.request_id for it in plan.items}
        planned |= set(result.carried.request_ids if result.carried else ())
        others = set(sched.requests) - planned
        samples = any(r is not None and r.exited for r in result.items)
        samples |= bool(result.carried and any(result.carried.exited))
        if hit or plan.step_id < 4 or not samples or not others:
            return apply(plan, result)
        hit.update(step={plan.step_id}, faulty=planned & set(sched.requests))
        hit["samples"] = sum(r is not None and r.exited for r in result.items)
        hit["samples"] += sum(result.carried.exited) if result.carried else 0
        for rid in hit["faulty"]:
            request = sched.requests[rid]
            request.stop_ids = BrokenStopIds(request.stop_ids)
            request.stop_ids.request = request
        return apply(plan, result)

    sched.apply = faulty_apply
    out = drive(core, params, lag=lag)
    assert hit, "the fault was never injected"
    assert hit["tested"] == hit["samples"]  # (every token of the step came to its test)
    failed = {rid for rid, why in out.finish.items() if why == "error"}
    assert failed == hit["faulty"]
    (step,) = hit["step"]
    for rid in failed:
        want = f"engine error while applying step {step}: RuntimeError: injected apply failure"
        assert out.errors[rid] == want
    survivors = set(PROMPTS) - failed
    assert survivors
    assert_oracle(ouro_ref, core, out, params, sorted(survivors))
    assert_clean(core)
    again = drive(core, {"a": params["a"]}, lag=lag)
    assert_oracle(ouro_ref, core, again, params, ["a"])
    assert_clean(core)
    core.shutdown()


def _break_planning(core, at_call: int) -> None:
    """The scheduler's ``at_call``-th schedule() raises (once: the engine replaces it)."""
    schedule, calls = core.scheduler.schedule, [0]

    def broken():
        calls[0] += 1
        if calls[0] == at_call:
            raise RuntimeError("injected planning failure")
        return schedule()

    core.scheduler.schedule = broken


PLANNING_ERROR = "engine error while planning a step: RuntimeError: injected planning failure"


def test_a_planning_error_fails_every_request_and_the_engine_serves_on(ouro_rv1, ouro_ref):
    core = make_core(ouro_rv1, max_num_seqs=3)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    for rid in PROMPTS:
        core.add_request(rid, PROMPTS[rid], params)
    _break_planning(core, at_call=4)
    out = Outcome()
    for _ in range(100):
        for u in core.step():
            out.tokens.setdefault(u.request_id, []).extend(u.new_token_ids)
            if u.finish_reason is not None:
                out.finish[u.request_id], out.errors[u.request_id] = u.finish_reason, u.error
        if not core.has_work():
            break
    assert out.finish == dict.fromkeys(PROMPTS, FinishReason.ERROR)
    assert out.errors == dict.fromkeys(PROMPTS, PLANNING_ERROR)
    for rid, tokens in out.tokens.items():  # what came out before the failure is right
        assert tokens == oracle(ouro_ref, core, rid, params).tokens[: len(tokens)]
    assert core.kv.usage == 0 and not core.scheduler.requests
    again = drive(core, {"a": params}, lag=0)
    assert_oracle(ouro_ref, core, again, {"a": params}, ["a"])
    assert_clean(core)
    core.shutdown()


def test_a_planning_error_in_the_engine_loop_with_two_steps_in_flight(ouro_rv1, ouro_ref):
    import asyncio

    from rltserve.core.engine_loop import run_engine_loop

    core = make_core(ouro_rv1, max_num_seqs=3, async_scheduling=True, exit_mode="delayed")
    params = SamplingParams(max_tokens=6, ignore_eos=True, exit_threshold=0.5)
    _break_planning(core, at_call=5)
    finish: dict[str, tuple] = {}
    tokens: dict[str, list[int]] = {}

    async def main() -> None:
        inbox: asyncio.Queue = asyncio.Queue()
        for rid in PROMPTS:
            inbox.put_nowait(("add", rid, PROMPTS[rid], params))

        def emit(updates, stats) -> None:
            for u in updates:
                tokens.setdefault(u.request_id, []).extend(u.new_token_ids)
                if u.finish_reason is not None:
                    assert u.request_id not in finish, u  # one final update per request
                    finish[u.request_id] = (u.finish_reason, u.error)
                    if set(finish) == set(PROMPTS):  # then a new request
                        inbox.put_nowait(("add", "again", PROMPTS["a"], params))
                    if u.request_id == "again":
                        inbox.put_nowait(("shutdown",))

        await asyncio.wait_for(run_engine_loop(core, inbox, emit), timeout=120)

    asyncio.run(main())
    assert {rid: finish[rid] for rid in PROMPTS} == dict.fromkeys(
        PROMPTS, (FinishReason.ERROR, PLANNING_ERROR)
    )
    want = oracle(ouro_ref, core, "a", params)
    assert finish["again"] == (FinishReason.LENGTH, None)
    assert tokens["again"] == want.tokens
    final = core.plan()  # the release of the last request reaches the runner
    if final is not None:
        core.execute(final)
    assert_clean(core)
    core.shutdown()


def test_every_update_of_an_applied_step_carries_the_weight_version(ouro_rv1):
    """Column rows and whole updates alike, in process and through the wire, on each of
    ``EngineCore.apply``'s ways out: a step applied, a step whose apply raised (its requests
    fail), and one where failing them raised too (every request fails, the engine starts
    over)."""
    from rltserve.updates import StepUpdates, from_wire, to_wire

    core = make_core(ouro_rv1, max_num_seqs=3)
    core.weight_version = 7
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    for rid in PROMPTS:
        core.add_request(rid, PROMPTS[rid], params)

    def step() -> tuple:
        """The next step that reports tokens (those before it applied)."""
        while True:
            plan = core.plan()
            result = core.runner.execute(plan)
            if result.carried and result.carried.request_ids:
                return plan, result
            stamped(core.apply(plan, result))

    def stamped(updates) -> list:
        assert isinstance(updates, StepUpdates)
        got = list(updates)
        assert from_wire(to_wire(updates)) == got
        assert all(u.weight_version == 7 for u in got)
        return got

    rows = 0
    for _ in range(6):
        updates = core.apply(*step())
        rows += len(updates.rows)
        stamped(updates)
    assert rows  # (some tokens went as column rows)
    sched = core.scheduler

    def broken_apply(plan, result):
        raise RuntimeError("injected apply failure")

    plan, result = step()
    sched.apply = broken_apply
    failed = stamped(core.apply(plan, result))
    assert failed and {u.finish_reason for u in failed} == {FinishReason.ERROR}
    assert core.scheduler is sched and sched.requests  # (only the step's requests failed)
    del sched.apply

    def broken_abort(rid):
        raise RuntimeError("injected abort failure")

    plan, result = step()
    rids = set(sched.requests)
    sched.apply, sched.abort = broken_apply, broken_abort
    failed = stamped(core.apply(plan, result))
    assert {u.request_id for u in failed} == rids
    assert {u.finish_reason for u in failed} == {FinishReason.ERROR}
    assert core.scheduler is not sched and not core.scheduler.requests  # (started over)
    core.shutdown()
