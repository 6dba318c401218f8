"""Wavefront chunked prefill: (chunk, depth) cells run as soon as (chunk, depth-1) and
(chunk-1, depth) are done; outputs equal plain chunked prefill and the oracle, and a C-chunk
prompt takes C + D - 1 prefill steps instead of C * D."""

from __future__ import annotations

import random

import pytest
from engine_util import make_core, oracle_run, random_workload, run_core

from rltserve.sampling import SamplingParams


def _first_token_step(core, prompt, params) -> int:
    """Steps until the request's first output token arrives."""
    core.add_request("x", prompt, params)
    steps = 0
    while True:
        steps += 1
        updates = core.step()
        if any(u.new_token_ids for u in updates):
            break
    while core.has_work():
        core.step()
    return steps


@pytest.mark.parametrize("chunk", [1, 4, 8])
def test_prefill_steps_are_chunks_plus_depth_minus_one(ckpts, chunk):
    prompt = list(range(1, 4 * chunk + 1))  # C = 4 chunks
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)  # fixed depth D = 4
    kw = {"prefill_chunk_size": chunk, "max_num_batched_tokens": 64}
    plain = _first_token_step(make_core(ckpts["ouro"], **kw), prompt, params)
    wave = _first_token_step(make_core(ckpts["ouro"], wavefront_prefill=True, **kw), prompt, params)
    assert plain == 4 * 4  # C * D
    assert wave == 4 + 4 - 1  # C + D - 1


def _workload(n, seed, thresholds=(1.0, 0.5, 0.3)):
    return random_workload(
        n, seed, thresholds, max_prompt=45, max_tokens=(1, 8), max_arrival=10, vary_min_loops=False
    )


@pytest.mark.parametrize("kv_policy", ["last_exited", "full"])
@pytest.mark.parametrize("chunk,budget", [(4, 64), (7, 21), (3, 4)])
def test_wavefront_equals_chunked_prefill_and_oracle(ckpts, ouro_ref, kv_policy, chunk, budget):
    prompts, params, arrivals = _workload(10, seed=chunk * 7 + budget)
    kw = {"kv_policy": kv_policy, "prefill_chunk_size": chunk, "max_num_batched_tokens": budget}
    plain = run_core(make_core(ckpts["ouro"], **kw), prompts, params, arrivals=arrivals)
    wave = run_core(
        make_core(ckpts["ouro"], wavefront_prefill=True, **kw), prompts, params, arrivals=arrivals
    )
    assert wave.tokens == plain.tokens
    assert wave.depths == plain.depths
    assert wave.steps <= plain.steps
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        want = oracle_run(ouro_ref, prompt, p, kv_policy=kv_policy)
        assert wave.tokens[f"r{i}"] == want.tokens
        assert wave.depths[f"r{i}"] == want.exit_depths


@pytest.mark.parametrize("deferred", [False, True])
def test_wavefront_with_async_lag_and_delayed_exit(ckpts, ouro_ref, deferred):
    prompts, params, arrivals = _workload(8, seed=3, thresholds=(1.0, 0.5))
    kw = {"prefill_chunk_size": 5, "max_num_batched_tokens": 40, "exit_mode": "delayed"}
    plain = run_core(make_core(ckpts["ouro"], **kw), prompts, params, arrivals=arrivals)
    wave = run_core(
        make_core(ckpts["ouro"], wavefront_prefill=True, async_scheduling=True, **kw),
        prompts,
        params,
        arrivals=arrivals,
        lag=1,
        deferred=deferred,
    )
    assert wave.tokens == plain.tokens
    assert wave.depths == plain.depths
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        want = oracle_run(ouro_ref, prompt, p, kv_policy="last_exited", exit_mode="delayed")
        assert wave.tokens[f"r{i}"] == want.tokens, f"request {i}"
        assert wave.depths[f"r{i}"] == want.exit_depths, f"request {i}"


@pytest.mark.parametrize("deferred", [False, True])
def test_wavefront_huginn_boundary_plane(ckpts, huginn_ref, deferred):
    rng = random.Random(5)
    prompts = [[rng.randrange(384) for _ in range(rng.randint(5, 30))] for _ in range(4)]
    params = [
        SamplingParams(
            temperature=0.0, max_tokens=4, ignore_eos=True, max_loops=3, init_state="random", seed=i
        )
        for i in range(4)
    ]
    kw = {"prefill_chunk_size": 4, "max_num_batched_tokens": 32}
    plain = run_core(make_core(ckpts["huginn"], **kw), prompts, params)
    wave = run_core(
        make_core(ckpts["huginn"], wavefront_prefill=True, async_scheduling=True, **kw),
        prompts,
        params,
        lag=1,
        deferred=deferred,
    )
    assert wave.tokens == plain.tokens
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        want = oracle_run(huginn_ref, prompt, p, kv_policy="last_exited")
        assert wave.tokens[f"r{i}"] == want.tokens, f"request {i}"
        assert wave.depths[f"r{i}"] == want.exit_depths, f"request {i}"


def test_wavefront_rejects_shared_planes(ckpts):
    with pytest.raises(ValueError, match="per-depth"):
        make_core(ckpts["ouro"], wavefront_prefill=True, kv_policy="shared")
    with pytest.raises(ValueError, match="refill"):
        make_core(ckpts["ouro"], wavefront_prefill=True, scheduling="no_refill")


@pytest.mark.parametrize("deferred", [False, True])
def test_wavefront_with_lag_and_gate_exit(ckpts, ouro_ref, deferred):
    """As the delayed-exit test, under the gate rule with each step planned before the
    previous one's result is applied (``lag=1``, the gate-lag schedules of ``test_carried``):
    the newest item's exit is then not known yet (``exit_known`` is None), and a decode
    token, whose input is that item's output, must not enter the wavefront before it is."""
    prompts, params, arrivals = _workload(8, seed=3, thresholds=(1.0, 0.5))
    kw = {"prefill_chunk_size": 5, "max_num_batched_tokens": 40}
    wave = run_core(
        make_core(ckpts["ouro"], wavefront_prefill=True, **kw),
        prompts,
        params,
        arrivals=arrivals,
        lag=1,
        deferred=deferred,
    )
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        want = oracle_run(ouro_ref, prompt, p, kv_policy="last_exited")
        assert wave.tokens[f"r{i}"] == want.tokens, f"request {i}"
        assert wave.depths[f"r{i}"] == want.exit_depths, f"request {i}"
