"""Carried decode tokens (``plan.Carry``): a decode token is planned once and the runner runs its
later loops by itself. The reference schedule (``carry_decode=False``: every loop planned) and
the carried one give the oracle's token ids and exit depths in every configuration; steps keep
their row budget and carried columns stay in step with their items. ``CarriedRows`` by hand:
``test_carried_rows.py``."""

from __future__ import annotations

import random

import pytest
from engine_util import make_core, oracle_run, run_core
from test_carried_rows import spec_row

from rltserve.sampling import SamplingParams


def _workload(n: int, seed: int, thresholds=(0.3, 0.5, 0.7, 1.0), max_tokens=8):
    rng = random.Random(seed)
    prompts = [[rng.randrange(384) for _ in range(rng.randint(1, 20))] for _ in range(n)]
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=rng.randint(1, max_tokens),
            ignore_eos=True,
            exit_threshold=thresholds[i % len(thresholds)],
            min_loops=rng.choice([1, 1, 2]),
        )
        for i in range(n)
    ]
    return prompts, params


# name: (engine settings, run_core settings, oracle kv policy, oracle exit mode)
CONFIGS = {
    "gate": ({}, {}, "last_exited", "gate"),
    "full-policy": ({"kv_policy": "full"}, {}, "full", "gate"),
    "shared-policy": ({"kv_policy": "shared"}, {}, "shared", "gate"),
    "delayed-async": (
        {"exit_mode": "delayed", "async_scheduling": True},
        {"lag": 1},
        "last_exited",
        "delayed",
    ),
    "delayed-deferred": (
        {"exit_mode": "delayed", "async_scheduling": True},
        {"lag": 1, "deferred": True},
        "last_exited",
        "delayed",
    ),
    "gate-lag": ({}, {"lag": 1}, "last_exited", "gate"),
    "wavefront-full": (
        {"wavefront_prefill": True, "prefill_chunk_size": 4, "kv_policy": "full"},
        {},
        "full",
        "gate",
    ),
    "no-refill": ({"scheduling": "no_refill"}, {}, "last_exited", "gate"),
    "small-budget": (
        {"max_num_batched_tokens": 3, "prefill_chunk_size": 2, "max_num_seqs": 4},
        {},
        "last_exited",
        "gate",
    ),
    "preempt-recompute": (
        {"num_blocks": 40, "block_size": 4, "kv_watermark": 0.0, "max_num_seqs": 6},
        {},
        "last_exited",
        "gate",
    ),
    "preempt-swap": (
        {
            "num_blocks": 40,
            "block_size": 4,
            "kv_watermark": 0.0,
            "max_num_seqs": 6,
            "preemption_mode": "swap",
        },
        {},
        "last_exited",
        "gate",
    ),
}


def _run_recording_plans(core, prompts, params, **drive):
    """``run_core``, and every plan the runner launched, in order."""
    plans = []
    launch = core.runner.launch

    def record(plan, *args):
        plans.append(plan)
        return launch(plan, *args)

    core.runner.launch = record
    return run_core(core, prompts, params, **drive), plans


@pytest.mark.parametrize("carry", [True, False], ids=["carried", "reference"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_schedules_match_the_oracle(ckpts, ouro_ref, name, carry):
    engine, drive, policy, mode = CONFIGS[name]
    prompts, params = _workload(8, seed=len(name))
    core = make_core(ckpts["ouro"], carry_decode=carry, **engine)
    run, plans = _run_recording_plans(core, prompts, params, **drive)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        want = oracle_run(ouro_ref, prompt, p, kv_policy=policy, exit_mode=mode)
        assert run.tokens[f"r{i}"] == want.tokens, f"request {i}"
        assert run.depths[f"r{i}"] == want.exit_depths, f"request {i}"
    budget = core.config.scheduler.max_num_batched_tokens
    assert run.max_rows <= budget  # carried rows count against the step's budget
    decode = [it for plan in plans for it in plan.items if it.exit and it.num_tokens == 1]
    carried = [it for it in decode if it.carry is not None]
    if carry:
        assert carried, "no decode token was carried"
        assert all(it.depth == 1 for it in carried)  # planned once, at the first loop
    else:
        assert not carried
        assert any(it.depth > 1 for it in decode)  # every loop planned
    assert not core.runner.carried.items and not core.scheduler._carried
    assert not core.runner.carried._ended  # (released with their requests)
    continued = [c for plan in plans for c in plan.continued]
    assert bool(continued) == carry, "a carried token's next one starts as a continuation"
    if name.startswith("preempt"):
        assert core.stats().num_preemptions > 0
    core.shutdown()


@pytest.mark.parametrize(
    "name", ["gate", "full-policy", "delayed-deferred", "wavefront-full", "preempt-swap"]
)
def test_carried_columns_and_items_stay_in_step(ckpts, name):
    """After every launch the runner's columns of each carried row are its request's live
    state and its held state (which its live state does not list), and after every applied
    result each token the scheduler carries is one of its request's items (which
    ``Applier._apply_carried`` removes at its end)."""
    engine, drive, _, _ = CONFIGS[name]
    prompts, params = _workload(8, seed=11)
    core = make_core(ckpts["ouro"], **engine)
    runner, sched = core.runner, core.scheduler
    launch, apply = runner._launch, core.apply
    checks = [0, 0]

    def checked_launch(plan, handle):
        eager = launch(plan, handle)
        rows = runner.carried
        # A new carried token whose input is on the runner ran as a carried row.
        fresh = [w for w in plan.items if w.carry is not None and w.token_ids is None]
        assert all(any(w is c for c in handle.carried) for w in fresh)
        assert len(rows.lives) == len(rows.held) == len(rows.items) == len(rows.starts)
        assert len(rows.keys) == len(rows.items)
        assert rows.ends == [w.ends_at for w in rows.items]
        # The spec columns (kept up to date as rows come and go) are those of the specs.
        columns = rows.spec_columns()
        assert columns[:5] == (tuple(zip(*[spec_row(x) for x in rows.specs])) or ((),) * 5)
        assert columns[5] == frozenset(columns[0])
        for w, start, live, held in zip(rows.items, rows.starts, rows.lives, rows.held):
            assert live is runner.live[w.request_id]
            assert held is not None and start not in live.items  # (its state is held alone)
        checks[0] += len(rows.items)
        return eager

    def checked_apply(plan, result):
        updates = apply(plan, result)
        for request, item in sched._carried.values():
            assert any(it is item for it in request.items)
        checks[1] += len(sched._carried)
        return updates

    runner._launch = checked_launch
    core.apply = checked_apply
    run_core(core, prompts, params, **drive)
    assert all(checks)  # tokens were carried (and checked) at both ends
    assert not runner.carried.items and not sched._carried
    core.shutdown()


@pytest.mark.parametrize(
    "model,kv_policy,drive",
    [
        ("ouro", "last_exited", {}),
        ("ouro", "full", {}),
        ("ouro", "last_exited", {"lag": 1, "deferred": True}),
        ("huginn", "full", {}),
        ("huginn", "ring:2", {}),
    ],
)
def test_continuations_into_new_blocks_match_the_oracle(
    ckpts, ouro_ref, huginn_ref, model, kv_policy, drive
):
    """Two-position blocks: every other decode token enters a new KV block and continues
    its predecessor with new tables (``StepPlan.moved``: new copy-on-exit blocks under
    last_exited, a new boundary table for Huginn's coda), never as a plan item."""
    rng = random.Random(21)
    prompts = [[rng.randrange(384) for _ in range(rng.randint(1, 9))] for _ in range(5)]
    huginn = model == "huginn"
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=rng.randint(4, 9),
            ignore_eos=True,
            **(
                {"max_loops": rng.choice([2, 3, 4]), "init_state": "random", "seed": i}
                if huginn
                else {"exit_threshold": rng.choice([0.3, 0.6, 1.0]), "min_loops": 1}
            ),
        )
        for i in range(5)
    ]
    engine = {"kv_policy": kv_policy, "block_size": 2}
    if drive:
        engine.update(exit_mode="delayed", async_scheduling=True)
    core = make_core(ckpts[model], **engine)
    run, plans = _run_recording_plans(core, prompts, params, **drive)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        if huginn:
            want = oracle_run(huginn_ref, prompt, p, kv_policy=kv_policy)
        else:
            mode = "delayed" if drive else "gate"
            want = oracle_run(ouro_ref, prompt, p, kv_policy=kv_policy, exit_mode=mode)
        assert run.tokens[f"r{i}"] == want.tokens, f"request {i}"
        assert run.depths[f"r{i}"] == want.exit_depths, f"request {i}"
    moved = [m for plan in plans for m in plan.moved]
    continued = {key for plan in plans for _, _, key in plan.continued}
    assert len(moved) >= 5 and {m[0] for m in moved} <= continued
    # A decode token at a block's first position starts as a carried item only when it
    # cannot continue (the first after the prompt): fewer than the moved ones.
    fresh = [w for plan in plans for w in plan.items if w.carry is not None and w.start % 2 == 0]
    assert len(fresh) < len(moved)
    assert not core.runner.carried.items and not core.scheduler._carried
    core.shutdown()


def test_continuations_into_new_blocks_below_the_models_depth(ckpts, ouro_ref):
    """Ouro requests capped below the model's loops (``max_loops`` < 4): the prompt runs the
    model's 4 loops, so the request has 4 depth tables, but its decode tokens stop at the cap.
    A continuation entering a new block gets its tables cut to its cap (``StepPlan.moved``),
    as a carried item does: the runner's carried columns hold a row per loop it runs."""
    rng = random.Random(8)
    prompts = [[rng.randrange(384) for _ in range(rng.randint(1, 9))] for _ in range(5)]
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=rng.randint(5, 9),
            ignore_eos=True,
            exit_threshold=rng.choice([0.3, 0.6, 1.0]),
            max_loops=rng.choice([1, 2, 3]),
        )
        for _ in range(5)
    ]
    core = make_core(ckpts["ouro"], block_size=2)
    run, plans = _run_recording_plans(core, prompts, params)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        want = oracle_run(ouro_ref, prompt, p, kv_policy="last_exited")
        assert run.tokens[f"r{i}"] == want.tokens, f"request {i}"
        assert run.depths[f"r{i}"] == want.exit_depths, f"request {i}"
    moved = [m for plan in plans for m in plan.moved]
    assert moved and all(len(tables) < core.spec.num_loops for _, tables, _, _ in moved)
    core.shutdown()


@pytest.mark.parametrize("carry", [True, False], ids=["carried", "reference"])
@pytest.mark.parametrize("kv_policy", ["full", "last_exited", "ring:2"])
def test_huginn_schedules_match_the_oracle(ckpts, huginn_ref, kv_policy, carry):
    """Fixed exits (no gate), coda attention (a boundary plane), random initial state."""
    rng = random.Random(4)
    prompts = [[rng.randrange(384) for _ in range(rng.randint(1, 20))] for _ in range(5)]
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=rng.randint(1, 6),
            ignore_eos=True,
            max_loops=rng.choice([2, 3, 4]),
            init_state="random",
            seed=i,
        )
        for i in range(5)
    ]
    core = make_core(ckpts["huginn"], kv_policy=kv_policy, carry_decode=carry)
    run = run_core(core, prompts, params)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        want = oracle_run(huginn_ref, prompt, p, kv_policy=kv_policy)
        assert run.tokens[f"r{i}"] == want.tokens, f"request {i}"
        assert run.depths[f"r{i}"] == want.exit_depths, f"request {i}"
    core.shutdown()


def test_trace_depths_are_carried_exactly(ckpts, ouro_ref):
    """Fixed exits from a trace: the runner flips the spec to exit_now at the traced loop."""
    prompts, params = _workload(6, seed=9)
    rng = random.Random(1)
    params = [
        p.replace(trace_depths=[rng.randint(p.min_loops, 4) for _ in range(8)]) for p in params
    ]
    core = make_core(ckpts["ouro"], exit_mode="trace")
    run = run_core(core, prompts, params)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        want = oracle_run(ouro_ref, prompt, p, kv_policy="last_exited", exit_mode="trace")
        assert run.tokens[f"r{i}"] == want.tokens
        assert run.depths[f"r{i}"] == want.exit_depths
    core.shutdown()


def test_seeded_sampling_is_the_same_carried_or_not(ckpts):
    """Seeded sampling, with penalties (the runner's sampled history) on every other request."""
    prompts, _ = _workload(6, seed=3)
    params = [
        SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.9, top_p=0.9, seed=i)
        for i in range(6)
    ]
    params = [
        p.replace(repetition_penalty=1.5, presence_penalty=0.8) if i % 2 else p
        for i, p in enumerate(params)
    ]
    runs = []
    for carry in (True, False):
        core = make_core(ckpts["ouro"], carry_decode=carry)
        runs.append(run_core(core, prompts, params))
        core.shutdown()
    assert runs[0].tokens == runs[1].tokens
    assert runs[0].depths == runs[1].depths


@pytest.mark.parametrize("exit_mode", ["delayed", "gate"])
def test_carried_tokens_report_events_as_columns(ckpts, exit_mode):
    """A carried token's results are ``CarriedEvents`` columns, its first loop's included (its
    ``StepResult.items`` entry is None): a delayed decision names the loop that then exits, an
    exit brings the token the request gets, and each token ends exactly once."""
    prompts, params = _workload(6, seed=9)
    params = [p.replace(logprobs=2) if i % 2 else p for i, p in enumerate(params)]
    core = make_core(ckpts["ouro"], exit_mode=exit_mode, max_num_seqs=6)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        core.add_request(f"r{i}", prompt, p)
    tokens: dict[str, list] = {f"r{i}": [] for i in range(len(prompts))}
    from_events: dict[str, list] = {f"r{i}": [] for i in range(len(prompts))}
    decided: dict[int, int] = {}  # key -> the exit loop a delayed decision named
    ended: list[int] = []
    seen_keys: set[int] = set()
    while core.scheduler.has_work():
        plan = core.plan()
        if plan is None:
            continue
        result = core.runner.execute(plan)
        for work, outcome in zip(plan.items, result.items):
            if work.carry is not None:
                seen_keys.add(work.carry.key)
                assert outcome is None  # reported as an event
        seen_keys.update(key for _, _, key in plan.continued)  # (started without an item)
        events = result.carried
        if events:
            columns = [
                events.keys,
                events.request_ids,
                events.depths,
                events.ended,
                events.exited,
                events.exit_next,
                events.token_ids,
                events.logprobs,
                events.top_logprobs,
                events.finite,
            ]
            assert {len(c) for c in columns} == {len(events)}
            for key, rid, depth, end, exited, nxt, token, logprob, top, finite in zip(*columns):
                assert key in seen_keys
                assert not (exited and nxt)
                if nxt:
                    assert exit_mode == "delayed"
                    decided[key] = depth + 1
                assert finite
                if exited:
                    assert token >= 0
                    assert decided.pop(key, depth) == depth
                    from_events[rid].append((token, logprob, top))
                else:
                    assert (token, logprob, top) == (-1, None, None)
                if end:
                    ended.append(key)
        for u in core.apply(plan, result):
            tokens[u.request_id] += zip(u.new_token_ids, u.new_logprobs, u.new_top_logprobs)
    assert from_events == {rid: t[1:] for rid, t in tokens.items()}  # (the prompt's first)
    assert any(lp is not None for t in from_events.values() for _, lp, _ in t)
    assert sorted(ended) == sorted(seen_keys)  # every carried token ended, once
    assert not decided
    core.shutdown()


@pytest.mark.parametrize(
    "engine,drive",
    [
        ({}, {}),
        ({}, {"lag": 1}),
        ({"exit_mode": "delayed", "async_scheduling": True}, {"lag": 1}),
        ({"kv_policy": "full", "exit_mode": "delayed"}, {"lag": 1}),
        (
            {"wavefront_prefill": True, "prefill_chunk_size": 4, "kv_policy": "full"},
            {"lag": 1},
        ),
        ({"exit_mode": "trace"}, {"lag": 1}),
    ],
    ids=["gate", "gate-lag", "delayed-async", "full-delayed-lag", "wavefront-lag", "trace-lag"],
)
def test_carrying_never_takes_more_steps(ckpts, engine, drive):
    """What the scheduler learns from a carried token's events (exits, delayed decisions) and
    from counting its loops (one a step: the cap, a fixed exit, its last loop) lets the next
    token start when the reference schedule starts it, or earlier (gate mode planned a step
    ahead: a carried token need not wait for its result to run its next loop)."""
    prompts, params = _workload(8, seed=5)
    if engine.get("exit_mode") == "trace":
        rng = random.Random(1)
        params = [
            p.replace(trace_depths=[rng.randint(p.min_loops, 4) for _ in range(8)]) for p in params
        ]
    runs = {}
    for carry in (True, False):
        core = make_core(ckpts["ouro"], carry_decode=carry, **engine)
        runs[carry] = run_core(core, prompts, params, **drive)
        core.shutdown()
    assert runs[True].tokens == runs[False].tokens
    assert runs[True].depths == runs[False].depths
    assert runs[True].steps <= runs[False].steps


def test_a_continuation_the_runner_cannot_make_fails_its_step_only(ckpts):
    """Should the runner not hold the token a plan continues (a scheduler/runner mismatch),
    the step fails the requests it runs (carried and continued), changing nothing else; the
    engine goes on serving, and nothing is left behind."""
    core = make_core(ckpts["ouro"], max_num_seqs=4)
    p = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for i in range(3):
        core.add_request(f"r{i}", [1 + i, 2, 3], p)
    finish: dict[str, str] = {}
    corrupted = None
    while core.has_work():
        plan = core.plan()
        if plan is None:
            continue
        if corrupted is None and plan.continued:
            rid, _, key = plan.continued[0]
            plan.continued[0] = (rid, 999, key)  # a key the runner never ended
            corrupted = {c[0] for c in plan.continued}
            corrupted |= {w.request_id for w in core.runner.carried.items}
            core.add_request("later", [4, 5, 6], p)  # admitted after the failure
        for update in core.execute(plan):
            if update.finish_reason is not None:
                finish[update.request_id] = update.finish_reason.value
    assert corrupted, "no continuation was planned"
    assert {rid for rid, why in finish.items() if why == "error"} == corrupted
    assert finish["later"] == "length"
    final = core.plan()  # the releases reach the runner
    if final is not None:
        core.execute(final)
    assert core.kv.usage == 0 and not core.runner.live and not core.runner._dropped
    assert not core.runner.carried.items and not core.runner.carried._ended
    assert not core.scheduler._carried


# Requests at max_loops=1 beside deeper ones, preempted again and again (a tight pool): the
# first token after each resume has a recorded input, so it runs its first loop as a plan
# item (with a ``carry``), and ends there, in steps that also carry other tokens.
RECORDED_INPUT_CASES = {  # mode: (max_loops, max_tokens and arrival step of each request)
    "swap": ([1, 4], [6, 4], [2, 1]),
    "recompute": ([1, None, None], [6, 6, 6], [2, 1, 0]),
}


@pytest.mark.parametrize("mode", list(RECORDED_INPUT_CASES))
def test_recorded_input_tokens_ending_at_their_first_loop_match_the_oracle(tmp_path, mode):
    """Such a token is kept for a continuation only: it never joins the carried rows (a row
    past its last loop would run a loop it has no table for), and its events, in the same
    step as carried rows' events, name it by its own key. Every request gives the oracle's
    tokens."""
    from engine_util import tight_blocks
    from reference import Reference

    from rltserve.models.presets import make_model

    path = make_model("nanbeige-tiny", tmp_path / "nanbeige")
    ref = Reference.load(path)
    loops, lengths, arrivals = RECORDED_INPUT_CASES[mode]
    prompts = [
        [97, 173, 321, 23, 61, 78, 42, 86, 64, 366, 47, 272],
        [97, 173, 321, 23, 61, 165, 342, 154],
        [5, 6, 7],
    ][: len(loops)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, max_loops=m)
        for m, n in zip(loops, lengths)
    ]
    engine = {"kv_policy": "full", "preemption_mode": mode, "kv_watermark": 0.0}
    engine.update(preemption_time_slice=5, block_size=4)
    engine["num_blocks"] = tight_blocks(path, prompts, params, kv_policy="full")
    run = run_core(make_core(path, **engine), prompts, params, arrivals=arrivals)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        want = oracle_run(ref, prompt, p, kv_policy="full")
        assert run.tokens[f"r{i}"] == want.tokens, f"request {i}"
        assert run.depths[f"r{i}"] == want.exit_depths, f"request {i}"
