"""Huginn's zero-shot exit criteria (``core/step_criteria.py``, ``exit.py``): every engine mode
reproduces the oracle's token ids and exit depths with the four criteria mixed in one batch;
the prompt's output runs the cap; requests without a criterion beside them keep a fixed depth;
the settings are checked where a request is made."""

from __future__ import annotations

import random

import pytest
from engine_util import ENGINE_MODES, make_core, oracle_run, run_core, run_mode, stream_all

from rltserve.core.exit import exit_known, exit_spec
from rltserve.core.request import InFlight
from rltserve.sampling import EXIT_CRITERIA, SamplingParams

# Thresholds at which the tiny random Huginn's tokens exit at every depth (its values are
# far larger than a trained model's).
THRESHOLDS = {"kl": 0.999, "minp-kl": 0.63, "entropy-diff": 0.6, "latent-diff": 0.97}


def workload(n: int = 8, seed: int = 0, **extra) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(384) for _ in range(rng.randint(2, 9))] for _ in range(n)]
    names = list(THRESHOLDS)
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=7,
            ignore_eos=True,
            exit_criterion=names[i % 4],
            exit_threshold=THRESHOLDS[names[i % 4]],
            min_loops=1 + (i // 4) % 2,
            init_state="zero",
            **extra,
        )
        for i in range(n)
    ]
    return prompts, params


def check(ref, prompts, params, run, exit_mode="gate", **oracle) -> list[list[int]]:
    depths = []
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        want = oracle_run(ref, prompt, p, exit_mode=exit_mode, **oracle)
        assert run.tokens[f"r{i}"] == want.tokens, f"r{i}"
        assert run.depths[f"r{i}"] == want.exit_depths, f"r{i}"
        depths.append(want.exit_depths)
    return depths


@pytest.mark.parametrize("mode", [m for m in ENGINE_MODES if m != "pipelined"])
def test_every_mode_equals_the_oracle(huginn_rv1, huginn_ref, mode):
    prompts, params = workload()
    engine = dict(ENGINE_MODES[mode])
    core, run = run_mode(huginn_rv1, prompts, params, **engine)
    core.shutdown()
    exit_mode = engine.get("exit_mode", "gate")
    depths = check(huginn_ref, prompts, params, run, exit_mode, kv_policy="last_exited")
    later = {d for out in depths for d in out[1:]}
    # (The workload exits at every depth; a delayed exit is never at the first loop.)
    assert later == ({2, 3, 4} if exit_mode == "delayed" else {1, 2, 3, 4})
    assert all(out[0] == 4 for out in depths)  # the prompt's output runs the cap


@pytest.mark.parametrize("kv_policy", ["full", "shared", "ring:2"])
def test_kv_policies_equal_the_oracle(huginn_rv1, huginn_ref, kv_policy):
    prompts, params = workload(seed=1)
    core, run = run_mode(huginn_rv1, prompts, params, kv_policy=kv_policy)
    core.shutdown()
    check(huginn_ref, prompts, params, run, kv_policy=kv_policy)


def test_deferred_async_and_random_states(huginn_rv1, huginn_ref):
    """Two steps in flight with results delivered late, seeded random initial states, and
    requests without a criterion (fixed depth) in the same batches."""
    prompts, params = workload(seed=2)
    params = [p.replace(init_state="random", seed=40 + i) for i, p in enumerate(params)]
    params[3] = params[3].replace(exit_criterion=None, exit_threshold=1.0, max_loops=3)
    core = make_core(
        huginn_rv1, kv_policy="last_exited", async_scheduling=True, exit_mode="delayed"
    )
    run = run_core(core, prompts, params, lag=1, deferred=True)
    core.shutdown()
    depths = check(huginn_ref, prompts, params, run, "delayed", kv_policy="last_exited")
    assert depths[3] == [3] * 7


def test_seeded_sampling_and_groups(huginn_rv1):
    """Seeded sampling (no oracle: it is greedy) equals one request at a time, and n samples
    of a prompt sharing its prefill equal the samples run alone."""
    prompts, params = workload(n=4, seed=3)
    params = [p.replace(temperature=0.8, seed=7 + i) for i, p in enumerate(params)]
    prompts = prompts[:2] * 2
    core = make_core(huginn_rv1, kv_policy="last_exited")
    run = run_core(core, prompts, params, groups=["a", "b", "a", "b"])
    core.shutdown()
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        alone = make_core(huginn_rv1, kv_policy="last_exited")
        one = run_core(alone, [prompt], [p])
        alone.shutdown()
        assert (run.tokens[f"r{i}"], run.depths[f"r{i}"]) == (one.tokens["r0"], one.depths["r0"])


def test_disaggregated_prefill_equals_the_oracle(huginn_rv1, huginn_ref):
    """Two stages: the prompt's KV moves to the decode stage, whose tokens then exit by their
    criteria."""
    from rltserve.config import EngineConfig
    from rltserve.core.pd import PDClient
    from rltserve.core.stage import InProcessStageClient

    prompts, params = workload(seed=5)
    prompts = [p + p + p for p in prompts]  # (a full block of 4 before the last token)
    config = EngineConfig.from_flat(
        model=str(huginn_rv1), disaggregate=True, num_blocks=512, block_size=4,
        kv_policy="last_exited",
    )  # fmt: skip
    client = PDClient(config, InProcessStageClient)
    try:
        client.wait_ready(120)
        run = stream_all(client, prompts, params)
        check(huginn_ref, prompts, params, run, kv_policy="last_exited")
        assert client.decode.stats.prefix_cache_hits > 0
    finally:
        client.close()


def test_nanbeige_criteria_equal_the_oracle(tmp_path):
    """A model without coda attention: its head reads the state alone."""
    from reference import Reference

    from rltserve.models.presets import make_model

    path = make_model("nanbeige-tiny", tmp_path / "n")
    ref = Reference.load(path)
    prompts, params = workload(n=4, seed=4)
    params = [p.replace(exit_threshold=0.999, min_loops=1) for p in params]
    core, run = run_mode(path, prompts, params)
    core.shutdown()
    check(ref, prompts, params, run, kv_policy="last_exited")


# --------------------------------------------------------------------------- settings


def test_thresholds_above_one_apply_to_a_named_criterion(huginn_rv1, huginn_ref):
    """A criterion's values are not bounded by 1 (kl, entropy differences): with one named,
    a threshold of 2 or 50 is adaptive exit, not a fixed depth."""
    prompts, params = workload(n=4, seed=6)
    params = [
        p.replace(exit_criterion=c, exit_threshold=q)
        for p, (c, q) in zip(params, [("kl", 2.0), ("entropy-diff", 50.0)] * 2)
    ]
    assert all(p.adaptive_exit for p in params)
    core, run = run_mode(huginn_rv1, prompts, params)
    core.shutdown()
    depths = check(huginn_ref, prompts, params, run, kv_policy="last_exited")
    assert min(d for out in depths for d in out[1:]) < 4


@pytest.mark.parametrize("mode", [m for m in ENGINE_MODES if m != "pipelined"])
def test_argmax_stability_equals_the_oracle(huginn_rv1, huginn_ref, mode):
    """A token exits once its argmax has stayed the same for the threshold's loops in a row:
    the count needs every loop's argmax, below ``min_loops`` too (min_loops 3 on half of the
    requests), through restarts; beside kl requests and one with ``none`` (full depth)."""
    prompts, params = workload(n=8, seed=7)
    params = [
        p.replace(
            exit_criterion="argmax-stability" if i % 4 else "kl",
            exit_threshold=2 if i % 4 else THRESHOLDS["kl"],
            min_loops=1 + 2 * (i % 2),
            max_loops=8,
        )
        for i, p in enumerate(params)
    ]
    params[4] = params[4].replace(exit_criterion="none", exit_threshold=0.5)
    engine = dict(ENGINE_MODES[mode])
    core, run = run_mode(huginn_rv1, prompts, params, **engine)
    core.shutdown()
    exit_mode = engine.get("exit_mode", "gate")
    depths = check(huginn_ref, prompts, params, run, exit_mode, kv_policy="last_exited")
    assert depths[4] == [8] * 7
    counted = {d for i, out in enumerate(depths) if i % 4 for d in out[1:]}
    assert min(counted) < 8 == max(counted), counted


def test_sampling_params_criterion_fields():
    assert SamplingParams(exit_criterion="kl").exit_threshold == 5e-4
    assert SamplingParams(exit_criterion="latent-diff").exit_threshold == 0.03
    assert SamplingParams(exit_criterion="kl", exit_threshold=0.2).exit_threshold == 0.2
    assert SamplingParams(exit_criterion="minp-kl").clone().exit_threshold == 1e-6
    assert SamplingParams(exit_criterion="argmax-stability").exit_threshold == 5
    assert SamplingParams(exit_criterion="argmax-stability", exit_threshold=3).adaptive_exit
    assert sorted(EXIT_CRITERIA) == [
        "argmax-stability", "entropy-diff", "kl", "latent-diff", "minp-kl", "none",
    ]  # fmt: skip
    for bad in ("cosine", "", 3, ["kl"]):
        with pytest.raises(ValueError, match=r"^exit_criterion=.*: must be one of"):
            SamplingParams(exit_criterion=bad)
    for bad in (2.5, float("inf")):
        with pytest.raises(ValueError, match=r"^exit_threshold=.*: argmax-stability counts"):
            SamplingParams(exit_criterion="argmax-stability", exit_threshold=bad)
    # "none" never exits early, at any threshold (Hugging Face's): a fixed depth.
    assert not SamplingParams(exit_criterion="none", exit_threshold=0.5).adaptive_exit
    assert not SamplingParams(exit_criterion="none").adaptive_exit


def test_async_in_step_criterion_is_refused(huginn_rv1):
    core = make_core(huginn_rv1, async_scheduling=True, exit_mode="gate")
    with pytest.raises(ValueError, match=r"needs exit_mode='delayed'"):
        core.make_request(None, [5, 6], SamplingParams(exit_criterion="kl"))
    core.shutdown()


def test_the_prompts_output_has_a_fixed_spec(huginn_rv1):
    core = make_core(huginn_rv1)
    request = core.make_request("x", [5, 6, 7], SamplingParams(exit_criterion="kl", max_loops=3))
    core.scheduler.add_request(request)
    assert (request.exit_mode, request.criterion) == ("gate", "kl")
    prompt = InFlight(start=0, num_tokens=3, ends_at=3, stop_at_exit=True, has_output=True)
    assert [exit_spec(request, prompt, d).mode for d in (1, 2, 3)] == ["fixed"] * 3
    assert [exit_spec(request, prompt, d).exit_now for d in (1, 2, 3)] == [False, False, True]
    assert [exit_known(request, prompt, d) for d in (1, 2, 3)] == [False, False, True]
    decode = InFlight(start=3, num_tokens=1, ends_at=3, stop_at_exit=True, has_output=True)
    decode.output_index = 1
    assert exit_spec(request, decode, 1).mode == "gate"
    assert exit_known(request, decode, 1) is None  # (until the step's result is applied)
    plain = core.make_request("y", [5], SamplingParams(exit_threshold=1.0))
    core.scheduler.add_request(plain)
    assert (plain.exit_mode, plain.criterion) == ("fixed", None)
    core.shutdown()
