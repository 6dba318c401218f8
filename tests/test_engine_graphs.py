"""The engine with decode graphs gives the oracle's tokens and exit depths: on the CPU through
the emulated graphs (same padded static buffers, eager), on a GPU through real CUDA graphs and
the dedicated stream, synchronous and async (gpu marker)."""

from __future__ import annotations

import random

import pytest
from engine_util import (
    count_grouped_attention,
    make_core,
    oracle_run,
    random_workload,
    run_core,
    stream_all,
)

from rltserve.config import EngineConfig
from rltserve.core.runner import ModelRunner
from rltserve.core.stage import InProcessStageClient
from rltserve.sampling import SamplingParams

ENGINE = {"prefill_chunk_size": 8, "max_num_batched_tokens": 32, "max_num_seqs": 6}


def _workload(n: int, seed: int, thresholds=(1.0, 0.5, 0.3)):
    return random_workload(n, seed, thresholds, max_prompt=30, max_tokens=(2, 12), max_arrival=10)


def _emulated(core, max_rows: int = 4, pad_budget: int = 0):
    """Swaps in a runner whose decode steps go through the padded graph buffers (eagerly)."""
    core.runner = ModelRunner(
        core.model,
        num_blocks=core.kv.pool.num_total,
        block_size=core.kv.block_size,
        decode_graphs="emulate",
        graph_max_rows=max_rows,
        max_model_len=core.max_model_len,
        pad_budget=pad_budget,
    )
    return core


def _check(ref, run, prompts, params, **kw):
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        want = oracle_run(ref, prompt, p, **kw)
        assert run.tokens[f"r{i}"] == want.tokens, f"request {i}"
        assert run.depths[f"r{i}"] == want.exit_depths, f"request {i}"


@pytest.mark.parametrize("kv_policy", ["last_exited", "full"])
def test_emulated_graphs_match_oracle(ckpts, ouro_ref, kv_policy):
    prompts, params, arrivals = _workload(10, seed=1)
    core = _emulated(make_core(ckpts["ouro"], kv_policy=kv_policy, **ENGINE))
    run = run_core(core, prompts, params, arrivals=arrivals)
    _check(ouro_ref, run, prompts, params, kv_policy=kv_policy)
    graphs = core.runner.graphs
    assert graphs.num_replays > 0 and graphs.num_eager > 0  # decode steps and the rest


@pytest.mark.parametrize("pad_budget", [0, 1 << 20], ids=["groups", "one-padded-batch"])
def test_steps_outside_the_graphs_take_the_pad_budget(ckpts, ouro_ref, monkeypatch, pad_budget):
    """The steps the graphs do not cover (prompt chunks, mixed steps) and the boundary layers
    attend as one padded batch within the pad budget, in groups without it: the oracle's
    tokens and depths either way."""
    grouped = count_grouped_attention(monkeypatch)
    prompts, params, arrivals = _workload(10, seed=1)
    core = _emulated(make_core(ckpts["ouro"], **ENGINE), pad_budget=pad_budget)
    run = run_core(core, prompts, params, arrivals=arrivals)
    _check(ouro_ref, run, prompts, params, kv_policy="last_exited")
    assert core.runner.graphs.num_replays > 0 and core.runner.graphs.num_eager > 0
    assert (len(grouped) > 0) == (pad_budget == 0)


def test_emulated_graphs_async_deferred_delayed_exit(ckpts, ouro_ref):
    prompts, params, arrivals = _workload(10, seed=2, thresholds=(0.5, 0.3))
    core = make_core(ckpts["ouro"], async_scheduling=True, exit_mode="delayed", **ENGINE)
    run = run_core(_emulated(core), prompts, params, arrivals=arrivals, lag=1, deferred=True)
    _check(ouro_ref, run, prompts, params, kv_policy="last_exited", exit_mode="delayed")
    assert core.runner.graphs.num_replays > 0


def test_emulated_graphs_huginn_reinjects_e(ckpts, huginn_ref):
    rng = random.Random(4)
    prompts = [[rng.randrange(384) for _ in range(rng.randint(1, 20))] for _ in range(4)]
    params = [
        SamplingParams(
            temperature=0.0, max_tokens=4, ignore_eos=True, max_loops=3, init_state="random", seed=i
        )
        for i in range(4)
    ]
    core = _emulated(make_core(ckpts["huginn"], **ENGINE))
    run = run_core(core, prompts, params)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        want = huginn_ref.generate(
            prompt, p.max_tokens, max_loops=3, init_state="random", seed=p.seed
        )
        assert run.tokens[f"r{i}"] == want.tokens
    assert core.runner.graphs.num_replays > 0


def test_config_rejects_graphs_without_cuda(ckpts):
    with pytest.raises(ValueError, match="cuda_graphs=True"):
        EngineConfig.from_flat(model=str(ckpts["ouro"]), cuda_graphs=True)
    with pytest.raises(ValueError, match="cuda_graph_max_rows"):
        EngineConfig.from_flat(model=str(ckpts["ouro"]), cuda_graph_max_rows=0)


@pytest.mark.gpu
@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_cuda_engine_matches_oracle(ckpts, ouro_ref, async_scheduling, cuda_graphs):
    prompts, params, _ = _workload(12, seed=3, thresholds=(1.0, 0.5))
    config = EngineConfig.from_flat(
        model=str(ckpts["ouro"]),
        device="cuda",
        num_blocks=512,
        exit_mode="delayed",
        async_scheduling=async_scheduling,
        cuda_graphs=cuda_graphs,
        **ENGINE,
    )
    client = InProcessStageClient(config)
    try:
        client.wait_ready(120)
        run = stream_all(client, prompts, params, timeout=60)
    finally:
        client.close()
    assert client.stats.kv_usage == 0.0
    if cuda_graphs:
        assert client.stats.num_graph_steps > 0
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        want = oracle_run(ouro_ref, prompt, p, kv_policy="last_exited", exit_mode="delayed")
        assert run.tokens[f"r{i}"] == want.tokens, f"request {i}"
        assert run.depths[f"r{i}"] == want.exit_depths, f"request {i}"


def test_emulated_graphs_with_token_pipelining(ckpts, ouro_ref):
    prompts, _, arrivals = _workload(6, seed=5)
    params = [
        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True) for _ in prompts
    ]  # greedy, full
    core = make_core(ckpts["ouro"], speculative_tokens=2, draft_loops=1, **ENGINE)
    run = run_core(_emulated(core, max_rows=8), prompts, params, arrivals=arrivals)
    _check(ouro_ref, run, prompts, params, kv_policy="last_exited")
    assert core.runner.graphs.num_replays > 0 and core.runner.drafts_checked > 0
