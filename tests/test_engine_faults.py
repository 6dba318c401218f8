"""Engine faults in a step: a step that raises fails exactly the requests it ran (also when
its swap-out or its launch fails before the loop), and a row of non-finite logits fails exactly
its request. Everything else continues with the oracle's tokens, every KV block comes back, and
the engine serves new requests unchanged afterwards. Faults of the scheduler itself:
``test_scheduler_faults.py``."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
from engine_util import make_core, oracle_run
from fault_util import (
    CONFIGS,
    PROMPTS,
    Outcome,
    assert_clean,
    assert_oracle,
    assert_serves_on,
    assert_survivors,
    configured,
    drive,
    omits_a_running_request,
    oracle,
    poison_rows,
    step_requests,
)

from rltserve.core.request import FinishReason
from rltserve.sampling import SamplingParams


@contextlib.contextmanager
def failing_swap_out(core):
    """The runner's swap-out copies fail (a device error) while the body runs."""

    def broken(*args):
        raise RuntimeError("injected swap-out failure")

    core.runner._slots = broken
    try:
        yield
    finally:
        del core.runner._slots


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_step_that_raises_fails_only_its_requests(ouro_rv1, ouro_ref, name):
    core, params, lag = configured(ouro_rv1, name, max_num_seqs=3)

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
    assert_survivors(ouro_ref, core, out, params, failed)  # ("d" waited for a slot at least)
    assert_serves_on(ouro_ref, core, params["a"], lag)
    core.shutdown()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_nan_logits_fail_only_their_request(ouro_rv1, ouro_ref, monkeypatch, name):
    core, params, lag = configured(ouro_rv1, name)
    params["c"] = params["c"].replace(seed=4242)
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
    params = {
        rid: SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True) for rid in ("a", "b")
    }
    params["b"] = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, seed=4242)
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
    core.add_request("a", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))

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
    params = {
        rid: SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True) for rid in PROMPTS
    }
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
    assert_survivors(ouro_ref, core, out, params, failed)
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
        "a": SamplingParams(
            temperature=0.0, max_tokens=6, ignore_eos=True, exit_threshold=threshold
        ),
        "b": SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
        "c": SamplingParams(
            temperature=0.0, max_tokens=4, ignore_eos=True, exit_threshold=threshold
        ),
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
    p = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
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
    with failing_swap_out(core):
        result = core.runner.execute(plan)
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


def test_a_swap_in_of_a_request_whose_swap_out_failed_is_skipped(ouro_rv1, ouro_ref):
    """A step swaps a request out and fails (its K/V never reached swap space); the next step,
    planned before that failure was applied, swaps it back in. The runner skips that swap-in
    (the scheduler fails the request with the failed step) instead of failing the whole step:
    a request that only the second step runs goes on with the oracle's tokens."""
    core = make_core(ouro_rv1, block_size=4)
    p = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    core.add_request("a", PROMPTS["a"], p)
    core.add_request("b", PROMPTS["b"], p)
    for _ in range(3):
        core.step()
    victim = core.kv.all_blocks("b", core.kv.covered("b"))
    failing = dataclasses.replace(core.plan(), swap_out=[("b", victim)])
    with failing_swap_out(core):
        handle = core.runner.launch(failing)
    # Planned before the failure is applied: "c" arrives, and "b" comes back from swap space.
    core.add_request("c", PROMPTS["c"], p)
    after = core.plan()
    assert any(it.request_id == "c" for it in after.items)
    after = dataclasses.replace(after, swap_in=[("b", victim)])
    second = core.runner.launch(after)
    assert handle.result().error is not None
    assert "b" in handle.result().lost
    assert second.result().error is None
    out = Outcome()
    for plan, h in ((failing, handle), (after, second)):
        for u in core.apply(plan, h.result()):
            out.tokens.setdefault(u.request_id, []).extend(u.new_token_ids)
            if u.finish_reason is not None:
                out.finish[u.request_id] = u.finish_reason.value
    assert out.finish.get("a") == out.finish.get("b") == "error"
    while core.has_work():
        for u in core.step():
            out.tokens.setdefault(u.request_id, []).extend(u.new_token_ids)
            if u.finish_reason is not None:
                out.finish[u.request_id] = u.finish_reason.value
    assert out.finish["c"] == "length"
    assert out.tokens["c"] == oracle_run(ouro_ref, PROMPTS["c"], p).tokens
    final = core.plan()  # (the releases of the finished requests reach the runner)
    if final is not None:
        core.execute(final)
    assert_clean(core)
    core.shutdown()


def test_a_step_planned_before_a_failure_is_applied_runs_no_row_of_its_requests(ouro_rv1):
    """Async scheduling plans the next step before the failed one's result is applied: that
    step runs no row of the failed requests (the runner drops their carried decode tokens at
    its launch: their block tables are released, their KV is about to be freed), and the
    engine goes on once the failure is applied."""
    core = make_core(ouro_rv1)
    p = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)  # (full depth: carried)
    for rid in ("a", "b"):
        core.add_request(rid, PROMPTS[rid], p)
    for _ in range(40):
        core.step()
        if {w.request_id for w in core.runner.carried.items} == {"a", "b"}:
            break
    else:
        raise AssertionError("the decode tokens were never carried")
    failing = core.plan()

    def broken(*args):
        raise RuntimeError("injected step failure")

    core.model.loop = broken
    try:
        handle = core.runner.launch(failing)
    finally:
        del core.model.loop
    after = core.plan()  # (the failure is not applied yet)
    assert after is not None
    second = core.runner.launch(after)
    assert handle.result().error is not None
    assert second.result().error is None
    assert second.result().num_rows == 0  # no failed request's row ran
    assert not core.runner.carried.items
    finish = {}
    for plan, h in ((failing, handle), (after, second)):
        for u in core.apply(plan, h.result()):
            if u.finish_reason is not None:
                finish[u.request_id] = u.finish_reason.value
    assert finish == {"a": "error", "b": "error"}
    while core.has_work():
        core.step()
    final = core.plan()
    if final is not None:
        core.execute(final)
    assert_clean(core)
    core.shutdown()
