"""Async scheduling: planning one step ahead of results gives the same tokens and exit depths as
synchronous scheduling (and the oracle), with aborts, EOS inside the in-flight window, mixed
arrivals and chunked prefill interleaved with decode; nothing leaks."""

from __future__ import annotations

import random

import pytest
from engine_util import make_core, oracle_run, random_workload, run_core, stream_all, with_eos
from reference import Reference

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
def test_lagged_aborts_and_eos_in_flight(tmp_path, ckpts, ouro_ref, deferred):
    prompts, params, arrivals = _workload(10, seed=4, threshold=0.5)
    # The model's EOS ids are taken from the requests' own greedy outputs so that real EOS
    # (not a stop token) lands mid-generation while the next token is already planned.
    params = [p.replace(max_tokens=10, ignore_eos=False) for p in params]
    free = [
        oracle_run(ouro_ref, prompt, p, exit_mode="delayed", kv_policy="last_exited").tokens
        for prompt, p in zip(prompts, params)
    ]
    eos = sorted({out[min(3, len(out) - 1)] for out in free})
    path = with_eos(ckpts["ouro"], tmp_path / "ouro_eos", eos)
    ref = Reference.load(path)
    wants = [
        oracle_run(ref, prompt, p, exit_mode="delayed", kv_policy="last_exited")
        for prompt, p in zip(prompts, params)
    ]
    aborts = {1: 3, 6: 9}
    kw = {**ENGINE, "exit_mode": "delayed"}
    sync = run_core(make_core(path, **kw), prompts, params, arrivals=arrivals, aborts=aborts)
    lagged = run_core(
        make_core(path, async_scheduling=True, **kw),
        prompts,
        params,
        arrivals=arrivals,
        aborts=aborts,
        lag=1,
        deferred=deferred,
    )
    stopped = 0
    for i, want in enumerate(wants):
        rid = f"r{i}"
        if i in aborts:  # aborted mid-flight, or finished before the abort came
            assert lagged.finish[rid] in ("abort", "stop", "length")
            assert lagged.tokens[rid] == want.tokens[: len(lagged.tokens[rid])]
            continue
        assert lagged.tokens[rid] == sync.tokens[rid] == want.tokens, f"request {i}"
        assert lagged.depths[rid] == want.exit_depths, f"request {i}"
        ended_on_eos = len(want.tokens) < params[i].max_tokens
        assert lagged.finish[rid] == sync.finish[rid] == ("stop" if ended_on_eos else "length")
        if ended_on_eos:
            assert lagged.tokens[rid][-1] in ref.eos_token_ids
            stopped += 1
    assert stopped >= 4  # EOS really ended most requests early


@pytest.mark.parametrize("deferred", [False, True])
def test_lagged_huginn_fixed_depth(ckpts, huginn_ref, deferred):
    rng = random.Random(9)
    prompts = [[rng.randrange(384) for _ in range(rng.randint(1, 20))] for _ in range(5)]
    params = [
        SamplingParams(
            temperature=0.0, max_tokens=5, ignore_eos=True, max_loops=3, init_state="random", seed=i
        )
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
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        want = oracle_run(huginn_ref, prompt, p, kv_policy="last_exited")
        assert lagged.tokens[f"r{i}"] == want.tokens, f"request {i}"
        assert lagged.depths[f"r{i}"] == want.exit_depths == [3] * p.max_tokens


def test_async_rejects_in_step_gate_rule(ckpts):
    core = make_core(ckpts["ouro"], async_scheduling=True, exit_mode="gate")
    with pytest.raises(ValueError, match="exit_mode='delayed'"):
        core.add_request("x", [1, 2], SamplingParams(temperature=0.0, exit_threshold=0.5))
    core.add_request(
        "y", [1, 2], SamplingParams(temperature=0.0, exit_threshold=1.0)
    )  # fixed depth is fine


def test_engine_loop_two_steps_in_flight_matches_sync_and_oracle(ckpts, ouro_ref):
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
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        want = oracle_run(ouro_ref, prompt, p, exit_mode="delayed", kv_policy="last_exited")
        assert results[1][f"r{i}"] == want.tokens, f"request {i}"
