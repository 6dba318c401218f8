"""``logit_bias`` (OpenAI's) and ``allowed_token_ids`` (vLLM's) shape what a request samples:
the bias is added to the logits and ids outside the allowed list cannot be drawn, greedy or not.
The oracle applies both the same way; every engine mode gives its tokens and exit depths.
Logprobs describe the model's distribution without them (vLLM's default raw logprobs)."""

from __future__ import annotations

import random

import pytest
import torch
from engine_util import ENGINE_MODES, make_core, oracle_run, run_core, run_mode

from rltserve.core.sampler import Sampler, SampleRow
from rltserve.sampling import SamplingParams


def _workload(ref, n: int = 8, seed: int = 5):
    """Prompts, and per prompt params that change its free (greedy) run: a -100 bias on its
    first token, +4 on a token it does not pick, or an allowed list without its first token."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(384) for _ in range(rng.randint(2, 12))] for _ in range(n)]
    params = []
    for i, prompt in enumerate(prompts):
        base = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, exit_threshold=0.5)
        free = oracle_run(ref, prompt, base).tokens
        if i % 3 == 0:
            params.append(base.replace(logit_bias={free[0]: -100.0, 7: 4.0}))
        elif i % 3 == 1:
            allowed = tuple(t for t in rng.sample(range(384), 12) if t != free[0])
            params.append(base.replace(allowed_token_ids=allowed))
        else:
            allowed = (free[0], *rng.sample(range(384), 6))
            params.append(base.replace(allowed_token_ids=allowed, logit_bias={free[0]: -3.5}))
    return prompts, params


@pytest.mark.parametrize("mode", ENGINE_MODES)
def test_bias_and_allowed_ids_match_the_oracle_in_every_mode(ckpts, ouro_ref, mode):
    prompts, params = _workload(ouro_ref)
    if mode == "pipelined":  # (pipelining is for full-depth requests)
        params = [p.replace(exit_threshold=1.0) for p in params]
    kw = ENGINE_MODES[mode]
    core, run = run_mode(ckpts["ouro"], prompts, params, **kw)
    exit_mode = kw.get("exit_mode", "gate")
    changed = 0
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        want = oracle_run(ouro_ref, prompt, p, exit_mode=exit_mode, kv_policy="last_exited")
        rid = f"r{i}"
        assert run.tokens[rid] == want.tokens, f"request {i}"
        assert run.depths[rid] == want.exit_depths, f"request {i}"
        if p.allowed_token_ids is not None:
            assert set(run.tokens[rid]) <= set(p.allowed_token_ids), f"request {i}"
        free = oracle_run(
            ouro_ref,
            prompt,
            p.replace(logit_bias=None, allowed_token_ids=None),
            exit_mode=exit_mode,
            kv_policy="last_exited",
        )
        changed += free.tokens != want.tokens
    assert changed == len(prompts)  # every request's bias or list changed what it sampled
    if "preemption_mode" in kw:
        assert core.stats().num_preemptions > 0
    core.kv.check_no_leaks()


def test_huginn_with_bias_matches_the_oracle(ckpts, huginn_ref):
    prompts = [[3, 9, 27, 81], [5, 6]]
    params = [
        SamplingParams(
            temperature=0.0, max_tokens=6, ignore_eos=True, init_state="zero", logit_bias={11: 6.0}
        ),
        SamplingParams(
            temperature=0.0,
            max_tokens=6,
            ignore_eos=True,
            init_state="zero",
            allowed_token_ids=[4, 8],
        ),
    ]
    run = run_core(make_core(ckpts["huginn"]), prompts, params)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        want = oracle_run(huginn_ref, prompt, p)
        assert (run.tokens[f"r{i}"], run.depths[f"r{i}"]) == (want.tokens, want.exit_depths)
    assert set(run.tokens["r1"]) <= {4, 8}


def test_seeded_sampling_draws_only_allowed_ids_and_stays_reproducible(ckpts):
    allowed = tuple(range(100, 140))
    params = [
        SamplingParams(
            max_tokens=8, temperature=1.5, seed=s, allowed_token_ids=allowed, logit_bias={101: 3}
        )
        for s in range(6)
    ]
    run = run_core(make_core(ckpts["ouro"]), [[5, 6, 7]] * 6, params)
    again = run_core(make_core(ckpts["ouro"]), [[5, 6, 7]] * 6, params)
    assert run.tokens == again.tokens
    for rid, tokens in run.tokens.items():
        assert tokens and set(tokens) <= set(allowed), rid


def test_a_bias_on_an_id_outside_the_allowed_list_leaves_it_out(ckpts, ouro_ref):
    """An id ``allowed_token_ids`` leaves out stays out whatever ``logit_bias`` adds to it (the
    bias adds to its -inf, never replaces it): here the model's own first choice, biased up."""
    prompt = [5, 6, 7]
    base = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    first = oracle_run(ouro_ref, prompt, base).tokens[0]
    allowed = tuple(range(100, 110))
    assert first not in allowed
    p = base.replace(allowed_token_ids=allowed, logit_bias={first: 50.0, 101: 2.0})
    run = run_core(make_core(ckpts["ouro"]), [prompt], [p])
    assert run.tokens["r0"] == oracle_run(ouro_ref, prompt, p).tokens
    assert set(run.tokens["r0"]) <= set(allowed)


def test_logprobs_describe_the_model_without_the_bias():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]] * 2)
    plain = SamplingParams(temperature=0.0, logprobs=2)
    biased = SamplingParams(
        temperature=0.0, logprobs=2, logit_bias={0: 100.0}, allowed_token_ids=[0, 1]
    )
    bias = torch.tensor([100.0, 0.0, float("-inf"), float("-inf")])
    out = Sampler().sample(logits, [SampleRow(plain), SampleRow(biased, bias=bias)])
    assert out.token_ids == [3, 0]
    assert out.top_logprobs[0] == out.top_logprobs[1]  # (the model's top 2: ids 3 and 2)
    assert out.logprobs[1] == pytest.approx(torch.log_softmax(logits[0], -1)[0].item())
    assert out.finite == [True, True]


def test_the_engine_refuses_ids_outside_the_vocabulary_and_lists_min_tokens_empties(ckpts):
    core = make_core(ckpts["ouro"])
    vocab = core.spec.vocab_size
    with pytest.raises(ValueError, match=f"logit_bias: token id {vocab} is outside"):
        core.make_request(None, [5], SamplingParams(temperature=0.0, logit_bias={vocab: 1.0}))
    with pytest.raises(ValueError, match=f"allowed_token_ids: token id {vocab} is outside"):
        core.make_request(None, [5], SamplingParams(temperature=0.0, allowed_token_ids=[1, vocab]))
    only_stops = SamplingParams(
        temperature=0.0, max_tokens=4, min_tokens=2, stop_token_ids=[1, 2], allowed_token_ids=[2, 1]
    )
    with pytest.raises(ValueError, match="allowed_token_ids: every one is EOS or a stop"):
        core.make_request(None, [5], only_stops)
    # Without min_tokens it stops at its first token, which is one of them.
    run = run_core(core, [[5, 6]], [only_stops.replace(min_tokens=0)])
    assert run.tokens["r0"][0] in (1, 2) and run.finish["r0"] == "stop"


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        ({"logit_bias": {-1: 1.0}}, "key -1 is not a token id"),
        ({"logit_bias": {"5": 1.0}}, "key '5' is not a token id"),
        ({"logit_bias": {5: 100.5}}, "must be in [-100, 100]"),
        ({"logit_bias": {5: float("nan")}}, "must be in [-100, 100]"),
        ({"logit_bias": {5: True}}, "must be a number"),
        ({"logit_bias": [5]}, "must map token ids to biases"),
        ({"allowed_token_ids": []}, "at least one token id"),
        ({"allowed_token_ids": [3, -2]}, "non-negative token ids"),
        ({"allowed_token_ids": 7}, "must be a list"),
    ],
)
def test_sampling_params_validate_them(changes, fragment):
    name = next(iter(changes))
    with pytest.raises(ValueError, match=rf"^{name}=") as info:
        SamplingParams(**changes)
    assert fragment in str(info.value)


def test_sampling_params_keep_them():
    p = SamplingParams(temperature=0.0, logit_bias={3: -2, 9: 0.5}, allowed_token_ids=[9, 3])
    assert p.logit_bias == {3: -2, 9: 0.5} and p.allowed_token_ids == [9, 3]
    assert p.replace(n=2).logit_bias == p.logit_bias
