"""Drives an ``EngineCore`` with an injected fault for the engine-fault tests
(``test_engine_faults.py``, ``test_scheduler_faults.py``): the outcome per request, the
requests a step runs, and the checks that nothing is left behind and that the others
continue with the oracle's tokens."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine_util import make_core, oracle_run

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


def assert_survivors(ref, core, out: Outcome, params, failed: set[str]) -> None:
    """Some request outlived the fault, every one that did gave the oracle's tokens, and
    nothing is left behind."""
    survivors = set(PROMPTS) - failed
    assert survivors
    assert_oracle(ref, core, out, params, sorted(survivors))
    assert_clean(core)


def assert_serves_on(ref, core, p: SamplingParams, lag: int) -> None:
    """The engine is not corrupted: a new request gives the oracle's tokens and exit depths,
    and nothing is left behind."""
    again = drive(core, {"a": p}, lag=lag)
    assert_oracle(ref, core, again, {"a": p}, ["a"])
    assert_clean(core)


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

    def poisoned(logits, rows, banned=()):
        hit = [j for j, row in enumerate(rows) if row.params.seed == marker]
        if hit:
            if calls["n"] >= from_call:
                logits = logits.clone()
                logits[hit[0], 3] = float("nan")
            calls["n"] += 1
        return sample_device(logits, rows, banned)

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


def configured(path, name: str, **engine):
    """A core for ``CONFIGS[name]`` (results delivered inside the next launch for
    "deferred"), the params of every request of ``PROMPTS`` (6 tokens at the configuration's
    exit threshold) and the lag to drive it with."""
    config, lag, threshold = CONFIGS[name]
    core = make_core(path, **engine, **config)
    core.runner.defer_results = name == "deferred"
    params = {
        rid: SamplingParams(
            temperature=0.0, max_tokens=6, ignore_eos=True, exit_threshold=threshold
        )
        for rid in PROMPTS
    }
    return core, params, lag
