"""Preemption on the paths the pressure tests of ``test_preemption.py`` do not take: decode
steps through the (emulated) graph buffers, whose padding block and static tables must follow
blocks that preemption frees and swap-in refills; and Nanbeige, whose fixed depth replays every
token at full depth. Outputs equal the dense oracle; pool and swap space end empty."""

from __future__ import annotations

import random

import pytest
from engine_util import oracle_run
from recipe import build_nanbeige
from reference import Reference
from test_engine_graphs import _emulated
from test_preemption import MODES, TIGHT, _oracle, _run, _workload

from rltserve.sampling import SamplingParams


@pytest.mark.parametrize("pad_budget", [0, 1 << 20], ids=["groups", "one-padded-batch"])
@pytest.mark.parametrize("mode", MODES)
def test_emulated_decode_graphs_under_pressure(ckpts, ouro_ref, mode, pad_budget):
    prompts, params, arrivals = _workload(8, seed=21)
    cores = []

    def graphed(core):
        _emulated(core, max_rows=4, pad_budget=pad_budget)
        cores.append(core)

    run, stats = _run(
        ckpts["ouro"], prompts, params, arrivals, preemption_mode=mode, on_core=graphed, **TIGHT
    )
    assert stats.num_preemptions >= 3
    if mode == "swap":
        assert stats.swap_fallbacks == 0  # (the emulated runner's swap space is unbounded)
    graphs = cores[0].runner.graphs
    assert graphs.num_replays > 0 and graphs.num_eager > 0
    _oracle(ouro_ref, run, prompts, params, "last_exited")


@pytest.fixture(scope="module")
def nanbeige(tmp_path_factory):
    path = build_nanbeige(tmp_path_factory.mktemp("nanbeige") / "ckpt")
    return path, Reference.load(path)


@pytest.mark.parametrize("kv_policy", ["last_exited", "full"])
@pytest.mark.parametrize("mode", MODES)
def test_nanbeige_under_pressure(nanbeige, mode, kv_policy):
    path, ref = nanbeige
    rng = random.Random(22)
    prompts = [[rng.randrange(384) for _ in range(rng.randint(1, 12))] for _ in range(6)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=rng.randint(8, 14), ignore_eos=True)
        for _ in prompts
    ]
    run, stats = _run(
        path,
        prompts,
        params,
        preemption_mode=mode,
        kv_policy=kv_policy,
        swap_space_gb=1e-3,
        **TIGHT,
    )
    assert stats.num_preemptions >= 2
    if mode == "swap":
        assert stats.swap_fallbacks == 0
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        want = oracle_run(ref, prompt, p, kv_policy=kv_policy)
        assert run.tokens[f"r{i}"] == want.tokens, f"request {i}"
        assert run.depths[f"r{i}"] == want.exit_depths, f"request {i}"
