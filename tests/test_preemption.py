"""Preemption under KV pressure: with a pool so small that requests are preempted again and
again, token ids and exit depths equal an unpressured run and the dense oracle, in both modes
(recompute and swap), for every KV policy, exit rule, prefill mode, async lag and token
pipelining; no victim ever has an item in the step being built; after every run the pool and
the swap space are empty. Priority preemption and aborts of preempted requests:
``test_preemption_priority_aborts.py``."""

from __future__ import annotations

import random

import pytest
from engine_util import make_core, oracle_run, random_workload, run_core, stream_all
from engine_util import tight_blocks as _tight_blocks

from rltserve.config import EngineConfig
from rltserve.core.request import Resume
from rltserve.core.stage import InProcessStageClient
from rltserve.sampling import SamplingParams

MODES = ["recompute", "swap"]
SWAP_GB = 1e-5  # (the tiny model's KV: a few requests fit, others fall back)
HUGINN_SWAP_GB = 1e-4  # (room for every victim of the Huginn pressure tests)
TIGHT = {"tight": True}
ROOMY = {"block_size": 4, "num_blocks": 1024}


def _workload(n: int, seed: int, thresholds=(1.0, 0.5, 0.3), max_tokens=(10, 16)):
    # Short prompts and long outputs: requests are admitted on their first chunk and collide
    # as they grow.
    return random_workload(n, seed, thresholds, max_prompt=12, max_tokens=max_tokens, max_arrival=0)


def _run(
    path,
    prompts,
    params,
    arrivals=None,
    *,
    lag=0,
    deferred=False,
    aborts=None,
    abort_when=None,
    on_core=None,
    **kw,
):
    """Runs the workload on a new core (``on_core(core)`` sees it first); ``tight=True``: in a
    pool so small that requests are preempted again and again."""
    if kw.pop("tight", False):
        kw.update(block_size=4, kv_watermark=0.0)
        kw["num_blocks"] = _tight_blocks(path, prompts, params, **kw)
    core = make_core(path, **kw)
    _guard_victims(core)
    if on_core is not None:
        on_core(core)
    run = run_core(
        core,
        prompts,
        params,
        arrivals=arrivals,
        lag=lag,
        deferred=deferred,
        aborts=aborts,
        abort_when=abort_when,
    )
    _assert_empty(core)
    return run, core.stats()


def _guard_victims(core) -> None:
    """Fails a run in which a victim has an item planned in the step being built (freeing its
    blocks would hand them to other items of that step while its own still write them)."""
    scheduler = core.scheduler
    preemptor = scheduler.preemptor
    preempt = preemptor.preempt

    def checked(victim) -> None:
        assert victim.request_id not in scheduler._in_step, f"victim {victim.request_id}"
        preempt(victim)

    preemptor.preempt = checked


def _assert_empty(core) -> None:
    core.kv.check_no_leaks()  # cached prompt blocks no request holds are evictable, not leaked
    assert core.kv.usage == 0.0
    assert not core.runner.host_swap.num_requests
    assert not core.runner.kept_generators
    stats = core.stats()
    assert stats.swapped_bytes == 0 and stats.num_swapped == 0 and stats.num_recomputing == 0


def _same(a, b) -> None:
    assert a.tokens == b.tokens
    assert a.depths == b.depths


def _oracle(ref, run, prompts, params, kv_policy, exit_mode="gate") -> None:
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        want = oracle_run(ref, prompt, p, kv_policy=kv_policy, exit_mode=exit_mode)
        assert run.tokens[f"r{i}"] == want.tokens, f"request {i}"
        assert run.depths[f"r{i}"] == want.exit_depths, f"request {i}"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kv_policy", ["last_exited", "full"])
def test_pressure_equals_unpressured_and_oracle(ckpts, ouro_ref, mode, kv_policy):
    prompts, params, arrivals = _workload(6, seed=1)
    kw = {"kv_policy": kv_policy, "prefill_chunk_size": 8, "max_num_batched_tokens": 32}
    plain, _ = _run(ckpts["ouro"], prompts, params, arrivals, **kw, **ROOMY)
    tight, stats = _run(
        ckpts["ouro"], prompts, params, arrivals, preemption_mode=mode, **kw, **TIGHT
    )
    assert stats.num_preemptions >= 3
    _same(tight, plain)
    _oracle(ouro_ref, tight, prompts, params, kv_policy)


@pytest.mark.parametrize("mode", MODES)
def test_shared_policy_under_pressure(ckpts, ouro_ref, mode):
    # `shared` depends on chunking, so prompts run as one chunk, as in the oracle.
    prompts, params, arrivals = _workload(6, seed=2)
    tight, stats = _run(
        ckpts["ouro"],
        prompts,
        params,
        arrivals,
        kv_policy="shared",
        preemption_mode=mode,
        tight=True,
    )
    assert stats.num_preemptions >= 3
    _oracle(ouro_ref, tight, prompts, params, "shared")


@pytest.mark.parametrize("mode", MODES)
def test_shared_prompt_preempted_with_its_last_loop_in_flight(ckpts, ouro_ref, mode):
    """Async: a prompt is preempted while its last loop's result is not applied. Under
    shared/ring its positions read each other's version of every loop, which later loops
    overwrite, so a swap keeps whole prompt chunks: recomputing only the last position would
    read its chunk's last versions (found by scripts/fuzz_oracle.py)."""
    head = [234, 254, 376, 31, 205]
    prompts = [head + [71, 223, 228], head + [150, 14, 308]]
    params = [
        SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, exit_threshold=0.9),
        SamplingParams(
            temperature=0.0, max_tokens=3, ignore_eos=True, exit_threshold=0.7, min_loops=2,
            max_loops=3,
        ),
    ]  # fmt: skip
    blocks = _tight_blocks(ckpts["ouro"], prompts, params, kv_policy="shared")
    run, stats = _run(
        ckpts["ouro"], prompts, params, [3, 2], lag=1, async_scheduling=True,
        exit_mode="delayed", kv_policy="shared", preemption_mode=mode, block_size=4,
        num_blocks=blocks,
    )  # fmt: skip
    assert stats.num_preemptions >= 1
    _oracle(ouro_ref, run, prompts, params, "shared", "delayed")


@pytest.mark.parametrize("mode", MODES)
def test_seeded_sampling_under_pressure(ckpts, mode):
    prompts, params, arrivals = _workload(6, seed=3)
    params = [
        p.replace(temperature=0.9, top_p=0.95, seed=100 + i, repetition_penalty=1.0 + (i % 2) / 5)
        for i, p in enumerate(params)
    ]
    plain, _ = _run(ckpts["ouro"], prompts, params, arrivals, **ROOMY)
    tight, stats = _run(ckpts["ouro"], prompts, params, arrivals, preemption_mode=mode, **TIGHT)
    assert stats.num_preemptions >= 3
    _same(tight, plain)


@pytest.mark.parametrize("mode", MODES)
def test_seeded_sampling_resumes_kept_generators_async_and_aborted(ckpts, mode, monkeypatch):
    # Two steps in flight: a step launched before a preemption may sample a token whose result
    # is dropped, leaving the kept generator a draw ahead; the resume must replay from the seed
    # then, and continue the kept generator otherwise. Aborted preempted requests drop theirs.
    from rltserve.core.sampler import SeededGenerator

    prompts, params, arrivals = _workload(6, seed=3, thresholds=(0.5, 0.3, 1.0))
    params = [p.replace(temperature=0.9, seed=200 + i) for i, p in enumerate(params)]
    kw = {"exit_mode": "delayed", "async_scheduling": True}
    plain, _ = _run(ckpts["ouro"], prompts, params, arrivals, **kw, **ROOMY)
    resumes = []
    original = SeededGenerator.resume.__func__

    def resume(cls, seed, device, draws, width, kept=None):
        gen = original(cls, seed, device, draws, width, kept)
        resumes.append((kept is not None, gen is kept))
        return gen

    monkeypatch.setattr(SeededGenerator, "resume", classmethod(resume))
    tight, stats = _run(
        ckpts["ouro"], prompts, params, arrivals, lag=1, preemption_mode=mode, **kw, **TIGHT
    )
    assert stats.num_preemptions >= 3
    _same(tight, plain)
    assert (True, True) in resumes  # a kept generator was continued
    aborts = {1: 9, 3: 14, 4: 20, 5: 25}
    cut, stats = _run(
        ckpts["ouro"], prompts, params, arrivals, aborts=aborts, preemption_mode=mode, **kw, **TIGHT
    )
    assert stats.num_preemptions >= 1
    for rid, tokens in cut.tokens.items():
        assert tokens == plain.tokens[rid][: len(tokens)]


@pytest.mark.parametrize("mode", MODES)
def test_resumed_request_is_admitted_only_when_all_it_wrote_fits(ckpts, mode):
    # Admitted on its first chunk alone, a resumed request would take the blocks for the rest
    # of its replay by preempting later arrivals.
    prompts, params, _ = _workload(6, seed=11)
    kw = {"block_size": 4, "kv_watermark": 0.0, "preemption_mode": mode}
    core = make_core(ckpts["ouro"], **kw, num_blocks=_tight_blocks(ckpts["ouro"], prompts, params))
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        core.add_request(f"r{i}", prompt, p)
    sched, checked = core.scheduler, 0
    while core.has_work():
        for r in sched.waiting:
            if r.num_preemptions and r.output_token_ids:
                written = r.num_prompt_tokens + len(r.output_token_ids)
                item = sched.item_maker.next_item(r, 1 << 20)
                assert sched.admission.blocks(r, item) == core.kv.blocks_needed(
                    written, r.num_loops
                )
                checked += 1
        core.step()
    assert checked > 0
    _assert_empty(core)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("prefill", ["chunked", "wavefront"])
def test_chunked_and_wavefront_prefill_under_pressure(ckpts, ouro_ref, mode, prefill):
    prompts, params, arrivals = _workload(6, seed=4)
    kw = {"prefill_chunk_size": 5, "max_num_batched_tokens": 24}
    if prefill == "wavefront":
        kw["wavefront_prefill"] = True
    tight, stats = _run(
        ckpts["ouro"], prompts, params, arrivals, preemption_mode=mode, **kw, **TIGHT
    )
    assert stats.num_preemptions >= 3
    _oracle(ouro_ref, tight, prompts, params, "last_exited")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("deferred", [False, True])
def test_async_lag_and_delayed_exit_under_pressure(ckpts, ouro_ref, mode, deferred):
    prompts, params, arrivals = _workload(6, seed=5, thresholds=(0.5, 0.3, 1.0))
    kw = {"exit_mode": "delayed", "prefill_chunk_size": 8, "max_num_batched_tokens": 24}
    tight, stats = _run(
        ckpts["ouro"],
        prompts,
        params,
        arrivals,
        lag=1,
        deferred=deferred,
        async_scheduling=True,
        preemption_mode=mode,
        **kw,
        **TIGHT,
    )
    assert stats.num_preemptions >= 3
    _oracle(ouro_ref, tight, prompts, params, "last_exited", "delayed")


@pytest.mark.parametrize("mode", MODES)
def test_token_pipelining_under_pressure(ckpts, ouro_ref, mode):
    prompts, params, arrivals = _workload(6, seed=6, thresholds=(1.0,))
    params = [p.replace(min_loops=1) for p in params]
    tight, stats = _run(
        ckpts["ouro"],
        prompts,
        params,
        arrivals,
        speculative_tokens=2,
        draft_loops=2,
        preemption_mode=mode,
        **TIGHT,
    )
    assert stats.num_preemptions >= 3
    _oracle(ouro_ref, tight, prompts, params, "last_exited")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("deferred", [False, True])
def test_token_pipelining_with_two_steps_in_flight_under_pressure(ckpts, ouro_ref, mode, deferred):
    """A request preempted after drafts were rejected resumes at its rollback count (the
    runner's state started over at 0 and took items planned before a later rollback for
    current ones: 'no in-flight state')."""
    prompts, params, arrivals = _workload(6, seed=6, thresholds=(1.0,))
    prompts[:2] = [[163], [163]]
    params = [p.replace(min_loops=1) for p in params]
    tight, stats = _run(
        ckpts["ouro"],
        prompts,
        params,
        arrivals,
        lag=1,
        deferred=deferred,
        speculative_tokens=1,
        async_scheduling=True,
        preemption_mode=mode,
        **TIGHT,
    )
    assert stats.num_preemptions >= 3 and stats.drafts_rejected > 0
    _oracle(ouro_ref, tight, prompts, params, "last_exited")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "kv_policy,init_state", [("full", "random"), ("last_exited", "zero"), ("ring:2", "random")]
)
def test_huginn_under_pressure(ckpts, huginn_ref, mode, kv_policy, init_state):
    rng = random.Random(7)
    prompts = [[rng.randrange(384) for _ in range(rng.randint(1, 8))] for _ in range(5)]
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=rng.randint(8, 14),
            ignore_eos=True,
            max_loops=rng.choice([2, 3, 4]),
            init_state=init_state,
            seed=i,
        )
        for i in range(5)
    ]
    # ring:K depends on chunking like shared: prompts run as one chunk.
    tight, stats = _run(
        ckpts["huginn"],
        prompts,
        params,
        kv_policy=kv_policy,
        preemption_mode=mode,
        tight=True,
    )
    assert stats.num_preemptions >= 3
    _oracle(huginn_ref, tight, prompts, params, kv_policy)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kv_policy", ["full", "last_exited", "ring:2"])
def test_huginn_traced_exits_under_pressure(ckpts, huginn_ref, mode, kv_policy):
    """Recomputed tokens of a model with coda attention keep their codas' inputs: under
    ``full`` a token that exited early keeps its exit state for its coda, the prompt's last
    position the first output's; and a token's coda never runs before an earlier one's.
    (``ring:2``: a recomputed token exiting at loop 1 fills plane 1 again.)"""
    rng = random.Random(5)
    prompts = [[rng.randrange(384) for _ in range(rng.randint(1, 10))] for _ in range(6)]
    params = []
    for i in range(6):
        loops, k = rng.choice([3, 4]), rng.randint(6, 10)
        trace = [rng.randint(1, loops) for _ in range(k)]
        params.append(
            SamplingParams(
                temperature=0.0,
                max_tokens=k,
                ignore_eos=True,
                max_loops=loops,
                trace_depths=trace,
                init_state="random",
                seed=i,
            )
        )
    kw = {"kv_policy": kv_policy, "exit_mode": "trace", "preemption_mode": mode}
    swapped = []

    def count_swaps(core):
        preemptor = core.scheduler.preemptor
        preempt = preemptor.preempt

        def counted(victim):
            preempt(victim)
            swapped.append(victim.resume is Resume.SWAP)

        preemptor.preempt = counted

    swap_gb = HUGINN_SWAP_GB  # (swap itself runs with traced exits: no victim falls back)
    tight, stats = _run(
        ckpts["huginn"], prompts, params, swap_space_gb=swap_gb, on_core=count_swaps, **kw, **TIGHT
    )
    assert stats.num_preemptions >= 3
    assert swapped == [mode == "swap"] * len(swapped)  # (swap: no victim fell back)
    _oracle(huginn_ref, tight, prompts, params, kv_policy, exit_mode="trace")


def test_swap_full_falls_back_to_recompute(ckpts, ouro_ref, caplog):
    """... and the log says so, as it says the engine preempts (the first of every 50 each)."""
    prompts, params, arrivals = _workload(6, seed=9)
    tight, stats = _run(
        ckpts["ouro"],
        prompts,
        params,
        arrivals,
        preemption_mode="swap",
        swap_space_gb=1e-6,
        **TIGHT,
    )
    assert stats.swap_fallbacks > 0
    said = [r.getMessage() for r in caplog.records if r.name == "rltserve.core.preemption"]
    assert len(said) == 2 + (stats.num_preemptions - 1) // 50 + (stats.swap_fallbacks - 1) // 50
    assert "swap space full:" in said[0] and "(1 such so far); raise swap_space_gb" in said[0]
    assert "preempted (recompute) to free KV blocks: 1 preemptions so far" in said[1]
    _oracle(ouro_ref, tight, prompts, params, "last_exited")


def test_swap_mode_swaps_and_reports_it(ckpts):
    prompts, params, _ = _workload(6, seed=10)
    blocks = _tight_blocks(ckpts["ouro"], prompts, params)
    core = make_core(ckpts["ouro"], preemption_mode="swap", block_size=4, num_blocks=blocks)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        core.add_request(f"r{i}", prompt, p)
    seen = 0
    for _ in range(5000):
        if not core.has_work():
            break
        core.step()
        stats = core.stats()
        # The scheduler's accounting and the runner's host copies agree after every step.
        assert stats.swapped_bytes == core.runner.host_swap.used_bytes
        assert stats.num_swapped == core.runner.host_swap.num_requests
        seen = max(seen, stats.swapped_bytes)
    core.step()  # hands the last releases to the runner
    assert seen > 0
    _assert_empty(core)


def test_full_reservation_never_preempts(ckpts, ouro_ref):
    prompts, params, arrivals = _workload(6, seed=11)
    run, stats = _run(ckpts["ouro"], prompts, params, arrivals, kv_reservation="full", **TIGHT)
    assert stats.num_preemptions == 0
    _oracle(ouro_ref, run, prompts, params, "last_exited")


@pytest.mark.parametrize("mode", MODES)
def test_engine_loop_two_steps_in_flight_under_pressure(ckpts, ouro_ref, mode):
    prompts, params, _ = _workload(6, seed=12, thresholds=(0.5, 1.0))
    blocks = _tight_blocks(ckpts["ouro"], prompts, params, exit_mode="delayed")
    config = EngineConfig.from_flat(
        model=str(ckpts["ouro"]),
        block_size=4,
        num_blocks=blocks,
        kv_watermark=0.0,
        exit_mode="delayed",
        async_scheduling=True,
        preemption_mode=mode,
    )
    client = InProcessStageClient(config)
    try:
        client.wait_ready(60)
        run = stream_all(client, prompts, params)
    finally:
        client.close()
    assert client.stats.num_preemptions >= 1
    assert client.stats.kv_usage == 0.0 and client.stats.swapped_bytes == 0
    _oracle(ouro_ref, run, prompts, params, "last_exited", "delayed")


@pytest.mark.parametrize("mode", MODES)
def test_recomputing_count_follows_every_request(ckpts, mode):
    """``num_recomputing`` (read by stats every step, without a scan of every request) equals
    a count over every request at every step of a pressured run, aborts included."""
    prompts, params, arrivals = _workload(6, seed=4)
    kw = {"preemption_mode": mode, "prefill_chunk_size": 8, "max_num_batched_tokens": 32}
    kw.update(block_size=4, kv_watermark=0.0)
    kw["num_blocks"] = _tight_blocks(ckpts["ouro"], prompts, params, **kw)
    if mode == "swap":
        kw["swap_space_gb"] = SWAP_GB  # swaps some; the others fall back to recompute
    core = make_core(ckpts["ouro"], **kw)
    counts = []
    plan = core.plan

    def checked():
        every = sum(r.resume is Resume.RECOMPUTE for r in core.scheduler.requests.values())
        counts.append(every)
        assert core.stats().num_recomputing == every
        return plan()

    core.plan = checked
    run_core(core, prompts, params, arrivals=arrivals, aborts={2: 9})
    stats = core.stats()
    assert max(counts) > 0 and stats.num_preemptions > 0
    if mode == "swap":  # both: swapped (recomputing what follows, if anything) and fallen back
        assert 0 < stats.swap_fallbacks < stats.num_preemptions
    _assert_empty(core)
