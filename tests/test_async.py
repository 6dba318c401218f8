"""Async scheduling: planning one step ahead of results gives the same tokens and exit depths as
synchronous scheduling (and the oracle), with aborts, EOS inside the in-flight window, mixed
arrivals and chunked prefill interleaved with decode; nothing leaks."""

from __future__ import annotations

import random

import pytest
from engine_util import make_core, oracle_run, random_workload, run_core, stream_all

from rltserve.config import EngineConfig
from rltserve.core.stage import InProcessStageClient
from rltserve.sampling import SamplingParams


def _workload(n: int, seed: int, threshold: float):
    return random_workload(n, seed, (threshold,), max_prompt=30, max_tokens=(1, 10), max_arrival=12)


ENGINE = {"prefill_chunk_size": 8, "max_num_batched_tokens": 24, "max_num_seqs": 6}


@pytest.mark.parametrize("exit_mode,threshold", [("gate", 1.0), ("delayed", 0.5), ("delayed", 0.3)])
@pytest.mark.parametrize("kv_policy", ["last_exited", "full"])
@pytest.mark.parametrize("deferred", [False, True])
def test_lagged_planning_equals_sync_and_oracle(
    ckpts, ouro_ref, exit_mode, threshold, kv_policy, deferred
):
    prompts, params, arrivals = _workload(14, seed=int(threshold * 10), threshold=threshold)
    kw = {**ENGINE, "exit_mode": exit_mode, "kv_policy": kv_policy}
    sync = run_core(make_core(ckpts["ouro"], **kw), prompts, params, arrivals=arrivals)
    lagged = run_core(
        make_core(ckpts["ouro"], async_scheduling=True, **kw),
        prompts,
        params,
        arrivals=arrivals,
        lag=1,
        deferred=deferred,
    )
    assert lagged.tokens == sync.tokens
    assert lagged.depths == sync.depths
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        want = oracle_run(ouro_ref, prompt, p, kv_policy=kv_policy, exit_mode=exit_mode)
        assert lagged.tokens[f"r{i}"] == want.tokens
        assert lagged.depths[f"r{i}"] == want.exit_depths


@pytest.mark.parametrize("deferred", [False, True])
def test_lagged_aborts_and_eos_in_flight(ckpts, ouro_ref, deferred):
    prompts, params, arrivals = _workload(10, seed=4, threshold=0.5)
    # Stop tokens chosen from each request's own greedy output so EOS lands mid-generation,
    # while the next token is already planned.
    stopped, wants = [], []
    for prompt, p in zip(prompts, params):
        want = oracle_run(
            ouro_ref, prompt, p.replace(max_tokens=10), exit_mode="delayed", kv_policy="last_exited"
        )
        stop = want.tokens[min(3, len(want.tokens) - 1)]
        stopped.append(p.replace(max_tokens=10, stop_token_ids=(stop,)))
        wants.append(want.tokens[: want.tokens.index(stop) + 1])
    aborts = {1: 3, 6: 9}
    kw = {**ENGINE, "exit_mode": "delayed"}
    sync = run_core(
        make_core(ckpts["ouro"], **kw), prompts, stopped, arrivals=arrivals, aborts=aborts
    )
    lagged = run_core(
        make_core(ckpts["ouro"], async_scheduling=True, **kw),
        prompts,
        stopped,
        arrivals=arrivals,
        aborts=aborts,
        lag=1,
        deferred=deferred,
    )
    for i in range(len(prompts)):
        rid = f"r{i}"
        if i in aborts:  # aborted mid-flight, or finished before the abort came
            assert lagged.finish[rid] in ("abort", "stop")
            assert lagged.tokens[rid] == wants[i][: len(lagged.tokens[rid])]
            continue
        assert lagged.tokens[rid] == sync.tokens[rid] == wants[i]
        assert lagged.finish[rid] == sync.finish[rid] == "stop"
        assert lagged.tokens[rid][-1] in stopped[i].stop_token_ids


@pytest.mark.parametrize("deferred", [False, True])
def test_lagged_huginn_fixed_depth(ckpts, deferred):
    rng = random.Random(9)
    prompts = [[rng.randrange(384) for _ in range(rng.randint(1, 20))] for _ in range(5)]
    params = [
        SamplingParams(max_tokens=5, ignore_eos=True, max_loops=3, init_state="random", seed=i)
        for i in range(5)
    ]
    sync = run_core(make_core(ckpts["huginn"], **ENGINE), prompts, params)
    lagged = run_core(
        make_core(ckpts["huginn"], async_scheduling=True, **ENGINE),
        prompts,
        params,
        lag=1,
        deferred=deferred,
    )
    assert lagged.tokens == sync.tokens


def test_async_rejects_in_step_gate_rule(ckpts):
    core = make_core(ckpts["ouro"], async_scheduling=True, exit_mode="gate")
    with pytest.raises(ValueError, match="exit_mode='delayed'"):
        core.add_request("x", [1, 2], SamplingParams(exit_threshold=0.5))
    core.add_request("y", [1, 2], SamplingParams(exit_threshold=1.0))  # fixed depth is fine


def test_engine_loop_two_steps_in_flight_matches_sync(ckpts):
    prompts, params, _ = _workload(12, seed=21, threshold=0.5)
    results = []
    for async_scheduling in (False, True):
        config = EngineConfig.from_flat(
            model=str(ckpts["ouro"]),
            num_blocks=512,
            exit_mode="delayed",
            async_scheduling=async_scheduling,
            **ENGINE,
        )
        client = InProcessStageClient(config)
        try:
            client.wait_ready(60)
            results.append(stream_all(client, prompts, params).tokens)
        finally:
            client.close()
        assert client.stats.kv_usage == 0.0
    assert results[0] == results[1]
