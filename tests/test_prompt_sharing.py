"""Prefix caching and prompt sharing on the engine (float32, tiny checkpoints): with caching on,
every engine mode gives the token ids and exit depths of caching off and of the dense oracle,
for hits of one block, many blocks and the whole prompt but its last token, prompts diverging
mid-block, after evictions and under preemption; Huginn zero-state prompts hit, two random-state
seeds never share; the samples of one group equal independent requests; the next turn of a
conversation hits the answer's blocks where it ran the whole depth; no block leaks."""

from __future__ import annotations

import random

import pytest
from engine_util import make_core, oracle_run, run_core

from rltserve.cli import build_parser
from rltserve.config import CacheConfig
from rltserve.engine_args import checked_engine_kwargs
from rltserve.sampling import SamplingParams

BS = 4
LATE = 40  # arrival step of the requests that should hit: the first prompt is cached by then


def _workload(seed: int, thresholds=(1.0, 0.5, 0.3)):
    rng = random.Random(seed)
    base = [rng.randrange(384) for _ in range(21)]

    def tail(n: int) -> list[int]:
        return [rng.randrange(384) for _ in range(n)]

    prompts = [
        base,  # computes and caches blocks 0..4
        base[:4] + tail(5),  # one block
        base[:16] + tail(3),  # four blocks
        list(base),  # the whole prompt but the last token (5 blocks)
        base[:6] + tail(6),  # diverges mid-block: one block
        base[:12],  # ends on a block boundary: 2 blocks, its last block is computed
        tail(9),  # no hit
    ]
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=rng.randint(3, 6),
            ignore_eos=True,
            exit_threshold=thresholds[i % len(thresholds)],
        )
        for i in range(len(prompts))
    ]
    arrivals = [0] + [LATE + i for i in range(len(prompts) - 1)]
    return prompts, params, arrivals


def _run(path, prompts, params, arrivals=None, *, lag=0, groups=None, **kw):
    kw.setdefault("block_size", BS)
    core = make_core(path, **kw)
    run = run_core(core, prompts, params, arrivals=arrivals, lag=lag, groups=groups)
    core.kv.check_no_leaks()  # cached blocks no request holds are evictable, not leaked
    assert core.kv.usage == 0.0
    stats = core.stats()
    core.shutdown()
    return run, stats


def _oracle(ref, run, prompts, params, kv_policy="last_exited", exit_mode="gate") -> None:
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        want = oracle_run(ref, prompt, p, kv_policy=kv_policy, exit_mode=exit_mode)
        assert run.tokens[f"r{i}"] == want.tokens, f"request {i}"
        assert run.depths[f"r{i}"] == want.exit_depths, f"request {i}"


def _same(a, b) -> None:
    assert a.tokens == b.tokens
    assert a.depths == b.depths


# Hits per request of ``_workload``: blocks 1, 4, 5, 1, 2 and none (the first computes).
EXPECTED_HITS = BS * (1 + 4 + 5 + 1 + 2)


def test_caching_equals_no_caching_and_oracle(ckpts, ouro_ref):
    prompts, params, arrivals = _workload(1)
    on, stats = _run(ckpts["ouro"], prompts, params, arrivals)
    off, off_stats = _run(ckpts["ouro"], prompts, params, arrivals, enable_prefix_caching=False)
    assert stats.prefix_cache_hits == EXPECTED_HITS
    assert stats.prefix_cache_queries == sum(len(p) for p in prompts)
    assert off_stats.prefix_cache_queries == off_stats.prefix_cache_hits == 0
    _same(on, off)
    _oracle(ouro_ref, on, prompts, params)


MODES = {
    "chunked": {"prefill_chunk_size": 4, "max_num_batched_tokens": 16},
    "wavefront": {"prefill_chunk_size": 4, "wavefront_prefill": True},
    "full_no_refill": {"kv_policy": "full", "scheduling": "no_refill", "prefill_chunk_size": 8},
}


@pytest.mark.parametrize("mode", list(MODES))
def test_caching_matches_the_oracle_in_every_mode(ckpts, ouro_ref, mode):
    prompts, params, arrivals = _workload(1)
    kw = MODES[mode]
    on, stats = _run(ckpts["ouro"], prompts, params, arrivals, **kw)
    assert stats.prefix_cache_hits == EXPECTED_HITS
    _oracle(ouro_ref, on, prompts, params, kw.get("kv_policy", "last_exited"))


def test_async_scheduling_with_delayed_exit(ckpts, ouro_ref):
    prompts, params, arrivals = _workload(2, thresholds=(0.5, 0.3, 1.0))
    kw = {"exit_mode": "delayed", "async_scheduling": True, "prefill_chunk_size": 8}
    on, stats = _run(ckpts["ouro"], prompts, params, arrivals, lag=1, **kw)
    assert stats.prefix_cache_hits == EXPECTED_HITS
    _oracle(ouro_ref, on, prompts, params, "last_exited", "delayed")


def test_token_pipelining(ckpts, ouro_ref):
    prompts, params, arrivals = _workload(3, thresholds=(1.0,))
    on, stats = _run(ckpts["ouro"], prompts, params, arrivals, speculative_tokens=2, draft_loops=2)
    assert stats.prefix_cache_hits == EXPECTED_HITS
    _oracle(ouro_ref, on, prompts, params)


def test_hits_while_the_first_request_still_decodes(ckpts, ouro_ref):
    # Arrivals right after the first prompt's prefill: its blocks are shared while it runs.
    prompts, params, _ = _workload(4)
    params[0] = params[0].replace(max_tokens=30)
    arrivals = [0] + [8 + i for i in range(len(prompts) - 1)]
    on, stats = _run(ckpts["ouro"], prompts, params, arrivals)
    assert stats.prefix_cache_hits == EXPECTED_HITS
    _oracle(ouro_ref, on, prompts, params)


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_preemption_under_pressure(ckpts, ouro_ref, preemption_mode):
    prompts, params, _ = _workload(5)
    prompts, params = prompts[:5], [p.replace(max_tokens=10) for p in params[:5]]
    arrivals = [0, 12, 12, 13, 13]
    kw = {"kv_watermark": 0.0, "num_blocks": 44, "prefill_chunk_size": 8}
    on, stats = _run(
        ckpts["ouro"], prompts, params, arrivals, preemption_mode=preemption_mode, **kw
    )
    assert stats.num_preemptions >= 2
    assert stats.prefix_cache_hits > 0
    _oracle(ouro_ref, on, prompts, params)


def test_hits_after_evictions(ckpts, ouro_ref):
    rng = random.Random(6)
    first = [rng.randrange(384) for _ in range(13)]
    fillers = [[rng.randrange(384) for _ in range(13)] for _ in range(4)]
    prompts = [first, *fillers, first[:8] + [5, 6, 7]]
    params = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True) for _ in prompts]
    arrivals = [0, 30, 60, 90, 120, 150]
    # Room for two requests' blocks: the fillers evict the first prompt's cached blocks ...
    on, stats = _run(ckpts["ouro"], prompts, params, arrivals, num_blocks=40, kv_watermark=0.0)
    assert stats.prefix_cache_evictions > 0
    _oracle(ouro_ref, on, prompts, params)
    # ... and with a roomy pool the last prompt hits them.
    roomy, roomy_stats = _run(ckpts["ouro"], prompts, params, arrivals)
    assert roomy_stats.prefix_cache_evictions == 0 and roomy_stats.prefix_cache_hits == 2 * BS
    _same(on, roomy)


@pytest.mark.parametrize("kv_policy", ["last_exited", "full"])
def test_huginn_zero_state_hits(ckpts, huginn_ref, kv_policy):
    prompts, params, arrivals = _workload(7)
    params = [p.replace(init_state="zero", max_loops=3, exit_threshold=1.0) for p in params]
    on, stats = _run(ckpts["huginn"], prompts, params, arrivals, kv_policy=kv_policy)
    assert stats.prefix_cache_hits == EXPECTED_HITS
    _oracle(huginn_ref, on, prompts, params, kv_policy)


@pytest.mark.parametrize("kv_policy", ["last_exited", "full"])
def test_huginn_early_first_output_keeps_its_last_block_unshared(ckpts, huginn_ref, kv_policy):
    """A first output exiting before the prompt's last loop has its coda, and so the last
    prompt position's coda K/V, from that loop's state: that block is not cached for prompts
    that go on past it (whose position there needs its full-depth coda K/V)."""
    rng = random.Random(11)
    base = rng.choices(range(384), k=3 * BS)  # its last position ends a full block
    prompts = [base, base + rng.choices(range(384), k=3), base[:8] + rng.choices(range(384), k=2)]
    traces = [[1, 3, 2], [3, 1, 3], [2, 2, 1]]
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=3,
            ignore_eos=True,
            max_loops=3,
            init_state="zero",
            trace_depths=trace,
        )
        for trace in traces
    ]
    arrivals = [0, LATE, LATE + 1]
    kw = {"kv_policy": kv_policy, "exit_mode": "trace"}
    on, stats = _run(ckpts["huginn"], prompts, params, arrivals, **kw)
    assert stats.prefix_cache_hits == 2 * BS + 2 * BS  # two blocks each, not the first's third
    _oracle(huginn_ref, on, prompts, params, kv_policy, "trace")


def _next_turn(path, ref, first: SamplingParams, kv_policy="last_exited", second=None, **kw):
    """A request, then one whose prompt is its prompt and output and 3 more tokens (a chat's
    next turn; ``second``: its params' changes): the oracle's tokens and depths for both;
    returns the first's exit depths and the second's cached tokens."""
    rng = random.Random(5)
    prompt = rng.choices(range(384), k=10)
    core = make_core(path, block_size=BS, kv_policy=kv_policy, **kw)
    one = run_core(core, [prompt], [first])
    turn = prompt + one.tokens["r0"] + rng.choices(range(384), k=3)
    params = SamplingParams(
        temperature=0.0, max_tokens=4, ignore_eos=True, **first_state(first), **(second or {})
    )
    two = run_core(core, [turn], [params])
    cached = core.stats().prefix_cache_hits
    core.kv.check_no_leaks()
    core.shutdown()
    for run, (q, p) in ((one, (prompt, first)), (two, (turn, params))):
        want = oracle_run(ref, q, p, kv_policy=kv_policy, exit_mode=kw.get("exit_mode", "gate"))
        assert (run.tokens["r0"], run.depths["r0"]) == (want.tokens, want.exit_depths)
    return one.depths["r0"], cached


def first_state(p: SamplingParams) -> dict:
    return {"init_state": p.init_state, "max_loops": p.max_loops}


@pytest.mark.parametrize("kv_policy", ["last_exited", "full"])
def test_the_next_turn_hits_the_answers_full_depth_blocks(ckpts, ouro_ref, huginn_ref, kv_policy):
    # 10 prompt + 9 output tokens: 18 positions written, blocks 0..3 full; the next turn's
    # prompt (22 tokens) may hit blocks 0..4 but block 4 was never written in full.
    fixed = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
    depths, cached = _next_turn(ckpts["ouro"], ouro_ref, fixed, kv_policy)
    assert depths == [4] * 9 and cached == 4 * BS
    zero = fixed.replace(init_state="zero", max_loops=3)
    _, cached = _next_turn(ckpts["huginn"], huginn_ref, zero, kv_policy)
    assert cached == 4 * BS


def test_the_next_turn_stops_at_the_first_early_exit(ckpts, ouro_ref):
    # Position 9 + k produced output k: position 12 exited at loop 2 (its deeper planes hold
    # copies under last_exited), so blocks 0..2 are cached and block 3 on is not.
    trace = (4, 4, 4, 2, 4, 4, 4, 4, 4)
    traced = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True, trace_depths=trace)
    kw = {"exit_mode": "trace", "second": {"trace_depths": (4,) * 4}}
    depths, cached = _next_turn(ckpts["ouro"], ouro_ref, traced, **kw)
    assert depths == list(trace) and cached == 3 * BS
    adaptive = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True, exit_threshold=0.3)
    depths, cached = _next_turn(ckpts["ouro"], ouro_ref, adaptive)
    assert depths[0] < 4 and cached == 2 * BS  # the prompt's last position exited early


def test_huginn_random_state_seeds_never_share(ckpts, huginn_ref):
    prompt = random.Random(8).choices(range(384), k=13)
    params = [
        SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, init_state="random", seed=s)
        for s in (1, 2, 1)
    ]
    on, stats = _run(ckpts["huginn"], [prompt] * 3, params, [0, LATE, 2 * LATE])
    assert stats.prefix_cache_hits == 3 * BS  # only the third, seed 1 again
    _oracle(huginn_ref, on, [prompt] * 3, params)


def test_caching_is_refused_where_not_exact(ckpts):
    with pytest.raises(ValueError, match="enable_prefix_caching=True: kv_policy='shared'"):
        CacheConfig(kv_policy="shared", enable_prefix_caching=True)
    with pytest.raises(ValueError, match="enable_prefix_caching=True: kv_policy='ring:2'"):
        CacheConfig(kv_policy="ring:2", enable_prefix_caching=True)
    assert not CacheConfig(kv_policy="shared").prefix_caching
    assert CacheConfig().prefix_caching
    # The flag is derived from the config field, as every engine flag.
    args = build_parser().parse_args(
        ["generate", "--model", str(ckpts["ouro"]), "--kv-policy", "shared",
         "--enable-prefix-caching"]
    )  # fmt: skip
    with pytest.raises(ValueError, match="enable_prefix_caching=True"):
        checked_engine_kwargs(args)
    off = build_parser().parse_args(["generate", "--no-enable-prefix-caching"])
    assert off.enable_prefix_caching is False


def test_shared_policy_runs_without_caching(ckpts, ouro_ref):
    prompts, params, arrivals = _workload(9)
    on, stats = _run(ckpts["ouro"], prompts, params, arrivals, kv_policy="shared")
    assert stats.prefix_cache_queries == 0 and stats.prefix_cache_blocks == 0
    _oracle(ouro_ref, on, prompts, params, "shared")


def test_weight_update_invalidates(ckpts):
    core = make_core(ckpts["ouro"], block_size=BS)
    prompt = list(range(1, 14))
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    run_core(core, [prompt], [params])
    assert core.stats().prefix_cache_blocks > 0
    core.reset_prefix_cache()
    assert core.weight_version == 1 and core.stats().prefix_cache_blocks == 0
    run_core(core, [prompt], [params])
    assert core.stats().prefix_cache_hits == 0
    core.shutdown()


# ---------------------------------------------------------------- n samples of one prompt


def _samples(prompt_len: int, n: int, seed: int, temperature: float = 0.0, **extra):
    prompt = random.Random(seed).choices(range(384), k=prompt_len)
    base = SamplingParams(temperature=temperature, max_tokens=8, ignore_eos=True, seed=100, **extra)
    return [prompt] * n, [base.replace(seed=100 + j) for j in range(n)]


@pytest.mark.parametrize("prompt_len", [13, 12, 3])
@pytest.mark.parametrize("caching", [True, False])
def test_group_samples_equal_independent_requests(ckpts, prompt_len, caching):
    prompts, params = _samples(prompt_len, 4, seed=prompt_len, temperature=0.9, top_p=0.95)
    kw = {"prefill_chunk_size": 8}
    alone, alone_stats = _run(
        ckpts["ouro"], prompts, params, [0] * 4, enable_prefix_caching=False, **kw
    )
    group, stats = _run(
        ckpts["ouro"],
        prompts,
        params,
        [0] * 4,
        groups=["g"] * 4,
        enable_prefix_caching=caching,
        **kw,
    )
    _same(group, alone)
    # Each follower reuses all but the last prompt token, and computes that one alone.
    assert stats.prefix_cache_hits == 3 * (prompt_len - 1)
    assert stats.num_rows < alone_stats.num_rows
    if not caching:
        assert stats.prefix_cache_blocks == 0  # group-only sharing keeps nothing


def test_a_burst_sharing_a_prefix_computes_it_once(ckpts, ouro_ref):
    # Added at once: the later requests wait for the blocks the first one is computing.
    prompts, params, _ = _workload(13)
    on, stats = _run(ckpts["ouro"], prompts, params, [0] * len(prompts))
    assert stats.prefix_cache_hits == EXPECTED_HITS
    _oracle(ouro_ref, on, prompts, params)


def test_a_burst_whose_first_request_is_aborted_still_computes_its_prefix_once(ckpts, ouro_ref):
    """The request computing a burst's shared prefix (10 blocks) is aborted before any of it is
    cached: the next request computes it instead, and the other two wait for it and hit it
    whole, instead of each computing the part the aborted one had claimed."""
    rng = random.Random(14)
    base = rng.choices(range(384), k=10 * BS)
    prompts = [base + rng.choices(range(384), k=5) for _ in range(4)]
    params = [SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True) for _ in prompts]
    kw = {"prefill_chunk_size": 8, "max_num_batched_tokens": 16}
    core = make_core(ckpts["ouro"], block_size=BS, **kw)
    run = run_core(core, prompts, params, aborts={0: 2})
    stats = core.stats()
    assert core.scheduler.sharing._computing == {}
    core.shutdown()
    whole, whole_stats = _run(ckpts["ouro"], prompts, params, **kw)
    assert run.finish["r0"] == "abort"
    assert whole_stats.prefix_cache_hits == 3 * len(base)
    assert stats.prefix_cache_hits == 2 * len(base)  # r1 computed it, r2 and r3 hit it
    assert stats.num_rows < whole_stats.num_rows  # (the aborted one computed part of a prompt)
    for i in (1, 2, 3):
        want = oracle_run(ouro_ref, prompts[i], params[i])
        assert (run.tokens[f"r{i}"], run.depths[f"r{i}"]) == (want.tokens, want.exit_depths)
        assert run.tokens[f"r{i}"] == whole.tokens[f"r{i}"]


def test_group_samples_match_the_oracle_in_every_mode(ckpts, ouro_ref):
    prompts, params = _samples(14, 3, seed=10, exit_threshold=0.5)
    for kw in ({"wavefront_prefill": True, "prefill_chunk_size": 4}, {"scheduling": "no_refill"}):
        run, stats = _run(ckpts["ouro"], prompts, params, [0, 0, 0], groups=["g"] * 3, **kw)
        assert stats.prefix_cache_hits == 2 * 13
        _oracle(ouro_ref, run, prompts, params)


def test_group_under_async_and_pressure(ckpts, ouro_ref):
    prompts, params = _samples(14, 4, seed=11, exit_threshold=0.3)
    params = [p.replace(max_tokens=14) for p in params]
    kw = {"exit_mode": "delayed", "async_scheduling": True, "kv_watermark": 0.0}
    run, stats = _run(
        ckpts["ouro"], prompts, params, [0] * 4, lag=1, groups=["g"] * 4, num_blocks=36, **kw
    )
    assert stats.num_preemptions >= 1
    _oracle(ouro_ref, run, prompts, params, "last_exited", "delayed")


def test_huginn_random_state_group_computes_each_sample(ckpts, huginn_ref):
    prompts, params = _samples(9, 3, seed=12, init_state="random", max_loops=3)
    run, stats = _run(ckpts["huginn"], prompts, params, [0, 0, 0], groups=["g"] * 3)
    assert stats.prefix_cache_hits == 0  # each seed has its own initial state, hence its own KV
    _oracle(huginn_ref, run, prompts, params)


def test_huginn_random_state_group_with_a_prompt_inside_one_block_copies_nothing(ckpts, huginn_ref):
    """A prompt of 3 tokens (BS 4) has no full block to look up, so only the salt check keeps
    a follower from copying the leader's partly filled block 0, computed from another seed's
    initial state."""
    prompts, params = _samples(3, 3, seed=12, init_state="random", max_loops=3)
    run, stats = _run(ckpts["huginn"], prompts, params, [0, 0, 0], groups=["g"] * 3)
    assert stats.prefix_cache_hits == 0  # each seed has its own initial state, hence its own KV
    _oracle(huginn_ref, run, prompts, params)
