"""A request's own KV policy (``SamplingParams.kv_policy``: ``full`` or ``last_exited`` on an
engine running either, whose planes they share): in one batch beside requests on the engine's
policy, every engine mode reproduces the oracle run with each request's policy; an engine whose
planes differ (``shared``, ``ring:k``) refuses another policy, and every engine takes its own."""

from __future__ import annotations

import random

import pytest
from engine_util import ENGINE_MODES, make_core, oracle_run, run_core, run_mode

from rltserve.sampling import REQUEST_KV_POLICIES, SamplingParams


def _workload(seed: int, policies: tuple, n: int = 8):
    rng = random.Random(seed)
    prompts = [[rng.randrange(384) for _ in range(rng.randint(2, 11))] for _ in range(n)]
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=rng.randint(6, 12),
            ignore_eos=True,
            exit_threshold=(0.3, 0.5, 1.0)[i % 3],
            kv_policy=policies[i % len(policies)],
        )
        for i in range(n)
    ]
    return prompts, params


def _check(ref, prompts, params, run, engine_policy, exit_mode="gate") -> None:
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        policy = p.kv_policy or engine_policy
        want = oracle_run(ref, prompt, p, kv_policy=policy, exit_mode=exit_mode)
        assert run.tokens[f"r{i}"] == want.tokens, (i, policy)
        assert run.depths[f"r{i}"] == want.exit_depths, (i, policy)


@pytest.mark.parametrize("mode", list(ENGINE_MODES))
def test_full_requests_on_a_last_exited_engine(ckpts, ouro_ref, mode):
    prompts, params = _workload(4, ("full", None, "last_exited"))  # (3 full ones differ)
    engine = dict(ENGINE_MODES[mode])
    if mode == "pipelined":  # (pipelining takes greedy full-depth requests: it drafts those)
        params = [p.replace(exit_threshold=1.0) if i % 2 else p for i, p in enumerate(params)]
    core, run = run_mode(ckpts["ouro"], prompts, params, **engine)
    core.shutdown()
    _check(ouro_ref, prompts, params, run, "last_exited", engine.get("exit_mode", "gate"))


@pytest.mark.parametrize("mode", ["sync", "recompute", "swap"])
def test_last_exited_requests_on_a_full_engine(ckpts, ouro_ref, mode):
    prompts, params = _workload(2, ("last_exited", None))
    engine = {**ENGINE_MODES[mode], "kv_policy": "full"}
    core, run = run_mode(ckpts["ouro"], prompts, params, **engine)
    core.shutdown()
    _check(ouro_ref, prompts, params, run, "full")


def test_a_prompt_cached_under_one_policy_is_hit_under_the_other(ckpts, ouro_ref):
    """A prompt runs all its loops under either policy, so its blocks hold the same KV: the
    prefix cache shares them whatever each request's policy (it split them by policy, the
    second full request hitting the first's and the last_exited one nothing)."""
    rng = random.Random(3)
    prompts = [[rng.randrange(384) for _ in range(37)]] * 5
    params = [
        SamplingParams(
            temperature=0.0, max_tokens=6, ignore_eos=True, exit_threshold=0.5, kv_policy=policy
        )
        for policy in ("full", "full", "last_exited", "full", None)
    ]
    core = make_core(ckpts["ouro"], kv_policy="last_exited", block_size=16)
    # One at a time: each arrives after the one before has ended and cached its prompt.
    run = run_core(core, prompts, params, arrivals=[0, 100, 200, 300, 400])
    assert [run.finish[f"r{i}"] for i in range(5)] == ["length"] * 5
    assert [run.cached[f"r{i}"] for i in range(5)] == [0, 32, 32, 32, 32]
    _check(ouro_ref, prompts, params, run, "last_exited")
    # (the exits differ between the policies, so the outputs after the prompt are not shared)
    assert run.depths["r0"] != run.depths["r2"]


def test_huginn_criteria_under_both_policies(ckpts, huginn_ref):
    """Coda attention and zero-shot exits: an early exit's deeper planes are copies under
    ``last_exited``, its own later loops under ``full``."""
    prompts, params = _workload(3, ("full", "last_exited"))
    params = [
        p.replace(exit_criterion="entropy-diff", exit_threshold=0.6, init_state="zero")
        for p in params
    ]
    core = make_core(ckpts["huginn"], kv_policy="last_exited")
    run = run_core(core, prompts, params)
    core.shutdown()
    _check(huginn_ref, prompts, params, run, "last_exited")


def test_settings_are_checked():
    assert REQUEST_KV_POLICIES == ("full", "last_exited")
    for bad in ("ring:0", "dense", "", 3):
        with pytest.raises(ValueError, match=r"^kv_policy=.*: must be one of"):
            SamplingParams(kv_policy=bad)
    # (Any policy's name: whether a request may run it is the engine's to say.)
    assert SamplingParams(kv_policy="ring:2").kv_policy == "ring:2"


@pytest.mark.parametrize("engine_policy", ["shared", "ring:2"])
def test_an_engine_with_other_planes_refuses_another_policy(ckpts, engine_policy):
    core = make_core(ckpts["huginn"], kv_policy=engine_policy)
    unlike = "ring:2" if engine_policy == "shared" else "shared"
    for other in ("full", "last_exited", "ring:3", unlike):
        with pytest.raises(ValueError, match=rf"^kv_policy='{other}': this engine runs kv_policy="):
            core.make_request(None, [5, 6], SamplingParams(kv_policy=other))
    core.make_request(None, [5, 6], SamplingParams())  # (its own: fine)
    request = core.make_request(None, [5, 6], SamplingParams(kv_policy=engine_policy))
    assert request.kv_policy is None  # (named: the engine's own, a no-op)
    core.shutdown()


def test_a_per_depth_engine_refuses_shared_and_ring(ckpts):
    core = make_core(ckpts["huginn"], kv_policy="full")
    for other in ("shared", "ring:2"):
        message = (
            rf"^kv_policy='{other}': this engine runs kv_policy='full', where a request may pick "
            r"one of \('full', 'last_exited'\)"
        )
        with pytest.raises(ValueError, match=message):
            core.make_request(None, [5, 6], SamplingParams(kv_policy=other))
    core.shutdown()


def test_requests_naming_a_ring_engines_policy_equal_the_oracle(ckpts, huginn_ref):
    """A ring:2 engine runs requests that name ring:2 as those that name none."""
    rng = random.Random(6)
    prompts = [[rng.randrange(384) for _ in range(rng.randint(2, 11))] for _ in range(4)]
    params = [
        SamplingParams(
            temperature=0.0, max_tokens=5, ignore_eos=True, init_state="random", seed=i,
            kv_policy=("ring:2", None)[i % 2],
        )
        for i in range(4)
    ]  # fmt: skip
    core = make_core(ckpts["huginn"], kv_policy="ring:2")
    run = run_core(core, prompts, params)
    core.shutdown()
    _check(huginn_ref, prompts, params, run, "ring:2")
