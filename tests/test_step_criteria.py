"""Huginn's zero-shot exit criteria (``core/step_criteria.py``, ``exit.py``): every engine mode
reproduces the oracle's token ids and exit depths with the four criteria mixed in one batch;
the prompt's output runs the cap; requests without a criterion beside them keep a fixed depth;
the settings are checked where a request is made."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from engine_util import (
    ENGINE_MODES,
    decode_took,
    make_core,
    oracle_run,
    run_core,
    run_mode,
    stream_all,
)

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
        assert decode_took(client) > 0  # (moved from the prefill stage)
    finally:
        client.close()


def test_nanbeige_criteria_equal_the_oracle(tmp_path):
    """A model without coda attention: its head reads the state alone."""
    from reference import Reference

    from rltserve.models.presets import make_model

    path = make_model("nanbeige-tiny", tmp_path / "n")
    ref = Reference.load(path)
    prompts, params = workload(n=4, seed=4)
    # (no init_state: Nanbeige has no recurrent state to start, and refuses one)
    params = [p.replace(exit_threshold=0.999, min_loops=1, init_state=None) for p in params]
    core, run = run_mode(path, prompts, params)
    core.shutdown()
    check(ref, prompts, params, run, kv_policy="last_exited")


def test_an_unnamed_criterion_is_kl(huginn_rv1, huginn_ref):
    """A threshold below 1 without a criterion named exits by kl (Hugging Face's default)."""
    prompts, params = workload(n=4, seed=8)
    params = [p.replace(exit_criterion=None, exit_threshold=THRESHOLDS["kl"]) for p in params]
    assert all(p.adaptive_exit for p in params)
    core, run = run_mode(huginn_rv1, prompts, params)
    core.shutdown()
    depths = check(huginn_ref, prompts, params, run, kv_policy="last_exited")
    assert len({d for out in depths for d in out[1:]}) > 1  # (adaptive: not one fixed depth)


def test_argmax_stability_exits_no_earlier_than_min_loops(huginn_rv1, huginn_ref):
    """A count that reaches its threshold before ``min_loops`` (2 at loop 3) waits for it."""
    prompts, params = workload(n=4, seed=9)
    params = [
        p.replace(exit_criterion="argmax-stability", exit_threshold=2, min_loops=5, max_loops=8)
        for p in params
    ]
    core, run = run_mode(huginn_rv1, prompts, params)
    core.shutdown()
    depths = check(huginn_ref, prompts, params, run, kv_policy="last_exited")
    assert min(d for out in depths for d in out[1:]) == 5


def peaked_head(tmp_path: Path) -> Path:
    """nanbeige-tiny at 4 loops with a head whose logits are 0 but token 0's, a large multiple
    of one direction of the state: every loop's distribution is one-hot on token 0 or, where
    that logit is negative, uniform over the rest (argmax 1), its other probabilities exactly 0.
    """
    from safetensors.torch import load_file, save_file

    from rltserve.models.presets import make_model

    path = make_model("nanbeige-tiny", tmp_path / "peaked")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "num_loops": 4}))
    tensors = load_file(str(path / "model.safetensors"))
    head = torch.zeros_like(tensors["lm_head.weight"])
    head[0] = 1e4 * tensors["lm_head.weight"][0] / tensors["lm_head.weight"][0].norm()
    save_file({**tensors, "lm_head.weight": head}, str(path / "model.safetensors"))
    return path


def test_criteria_of_peaked_distributions_equal_the_oracle(tmp_path):
    """Probabilities that underflow to 0 leave the entropy finite (its log's 1e-10), and token
    0 as the argmax of loop 1 starts no count (nothing precedes loop 1): a count of 2 needs 3
    loops."""
    from reference import Reference

    path = peaked_head(tmp_path)
    prompts, params = workload(n=8, seed=10)
    params = [
        p.replace(exit_criterion=c, exit_threshold=q, min_loops=1, init_state=None)  # (Nanbeige)
        for p, (c, q) in zip(params, [("argmax-stability", 2), ("entropy-diff", 0.6)] * 4)
    ]
    core, run = run_mode(path, prompts, params)
    core.shutdown()
    depths = check(Reference.load(path), prompts, params, run, kv_policy="last_exited")
    counted = [d for out in depths[::2] for d in out[1:]]
    entropy = [d for out in depths[1::2] for d in out[1:]]
    assert min(counted) == 3 and min(entropy) == 2
    assert {t for i in range(8) for t in run.tokens[f"r{i}"]} == {0, 1}


def test_one_coda_per_loop_before_the_cap(huginn_rv1):
    """A loop's statistic stays on the item for the next loop: a token runs one coda for its
    criterion at each loop before the cap (at ``min_loops`` 2, the loop-1 statistic is computed
    at loop 2 instead) and one on its exit state; a prompt's rows run theirs once."""
    prompts, params = workload(n=8, seed=11)
    params = [
        p.replace(exit_criterion="kl", exit_threshold=THRESHOLDS["kl"], min_loops=1 + i % 2)
        for i, p in enumerate(params)
    ]
    cap = params[0].max_loops or 4  # (the model's 4 loops)
    core = make_core(huginn_rv1, kv_policy="last_exited")
    model, rows = core.runner.model, []
    coda = model.coda

    def counted(state, *args):
        rows.append(state.shape[0])
        return coda(state, *args)

    model.coda = counted
    run = run_core(core, prompts, params)
    core.shutdown()
    decodes = [d for i in range(len(prompts)) for d in run.depths[f"r{i}"][1:]]
    assert min(decodes) < cap  # (tokens exit early: some loops compute no statistic)
    assert sum(rows) == sum(map(len, prompts)) + sum(min(d, cap - 1) + 1 for d in decodes)


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


def test_entropy_before_the_first_loop_is_100(huginn_rv1, huginn_ref):
    """``H(p_0) = 100``: a threshold of 100 exits every token at loop 1 (``100 - H(p_1)``, the
    entropy being positive and below ``log V``), one of 50 none."""
    prompts, params = workload(n=4, seed=12)
    params = [
        p.replace(exit_criterion="entropy-diff", exit_threshold=q, min_loops=1)
        for p, q in zip(params, [100.0, 50.0] * 2)
    ]
    core, run = run_mode(huginn_rv1, prompts, params)
    core.shutdown()
    depths = check(huginn_ref, prompts, params, run, kv_policy="last_exited")
    assert {d for out in depths[::2] for d in out[1:]} == {1}
    assert min(d for out in depths[1::2] for d in out[1:]) > 1


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


@pytest.mark.parametrize("mode", [m for m in ENGINE_MODES if m != "pipelined"])
def test_a_threshold_of_one_given_is_one(huginn_rv1, huginn_ref, mode):
    """An explicit 1 is a threshold like any other (a sweep over thresholds has no jump there):
    argmax-stability at 1 exits after one loop whose argmax repeats the loop before's (loop 2
    at the earliest; at the default 5, loop 6), kl below 1.0."""
    prompts, params = workload(n=4, seed=13, max_loops=6)
    params = [
        p.replace(exit_criterion=c, exit_threshold=1.0, max_tokens=5)
        for p, c in zip(params, ["argmax-stability", "kl"] * 2)
    ]
    engine = dict(ENGINE_MODES[mode])
    core, run = run_mode(huginn_rv1, prompts, params, **engine)
    core.shutdown()
    exit_mode = engine.get("exit_mode", "gate")
    depths = check(huginn_ref, prompts, params, run, exit_mode, kv_policy="last_exited")
    counted = [d for out in depths[::2] for d in out[1:]]
    assert min(counted) == (3 if exit_mode == "delayed" else 2), counted


def test_sampling_params_criterion_fields():
    assert SamplingParams(exit_criterion="kl").exit_threshold == 5e-4
    assert SamplingParams(exit_criterion="kl", exit_threshold=None).exit_threshold == 5e-4
    assert SamplingParams(exit_criterion="kl", exit_threshold=1.0).exit_threshold == 1.0
    assert SamplingParams(exit_criterion="argmax-stability", exit_threshold=1).exit_threshold == 1
    assert SamplingParams().exit_threshold == 1.0 and not SamplingParams().adaptive_exit
    assert not SamplingParams(exit_threshold=1.0).adaptive_exit  # (no criterion: fixed depth)
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
