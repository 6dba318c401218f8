"""``prompt_logprobs=k`` (vLLM's): for each prompt token after the first, its logprob and the
top ``k`` as the position before predicts it after every loop. They come with the first output
token, once, and equal the oracle's in every engine mode: chunked and wavefront prefill, async
steps, preemption in both modes (a prompt recomputed keeps what it had), a prompt others have
cached (computed again: no hits), the samples of one prompt (only the first scores it), and
Huginn's coda."""

from __future__ import annotations

import random

import pytest
import torch
from engine_util import ENGINE_MODES, make_core, oracle_run, run_core, run_mode

from rltserve.samples import expand_samples
from rltserve.sampling import SamplingParams

TOP = 3


def _check(ref, prompt, params, got, **kw) -> None:
    """``got`` (an update's prompt logprobs) against the oracle's prompt logits."""
    want = torch.log_softmax(oracle_run(ref, prompt, params, **kw).prompt_logits, dim=-1)
    assert len(got) == len(prompt) - 1
    for q, (lp, top, rank) in enumerate(got):
        assert lp == pytest.approx(want[q, prompt[q + 1]].item(), abs=1e-4), q
        # vLLM's rank (the count of logprobs >= the token's), up to float noise at ties.
        assert abs(rank - int((want[q] >= want[q, prompt[q + 1]]).sum())) <= 1, q
        values, ids = want[q].topk(params.prompt_logprobs or 0)
        assert [t for t, _ in top] == ids.tolist(), q
        assert [v for _, v in top] == pytest.approx(values.tolist(), abs=1e-4), q


def _workload(n: int = 6, seed: int = 11):
    rng = random.Random(seed)
    prompts = [[rng.randrange(384) for _ in range(rng.randint(2, 14))] for _ in range(n)]
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=5,
            ignore_eos=True,
            exit_threshold=0.5,
            prompt_logprobs=TOP if i % 2 else 0,
        )
        for i in range(n)
    ]
    params[-1] = params[-1].replace(prompt_logprobs=None)  # one without, beside them
    return prompts, params


# Pipelining is for greedy full-depth requests (their prompts score as any other's); preempted
# prompts are chunked, so a recomputed one may end in another chunk.
MODES = {
    **{k: v for k, v in ENGINE_MODES.items() if k != "pipelined"},
    "reserved": {"kv_reservation": "full", "num_blocks": 64},
    "recompute": {"preemption_mode": "recompute", "prefill_chunk_size": 4},
    "swap": {"preemption_mode": "swap", "prefill_chunk_size": 4},
    # Two steps in flight: a victim's last planned prompt loop may not be applied yet (its
    # result is dropped): it is scored again after the swap.
    "async_swap": {
        "preemption_mode": "swap",
        "prefill_chunk_size": 4,
        "async_scheduling": True,
        "exit_mode": "delayed",
    },
    "async_recompute": {
        "preemption_mode": "recompute",
        "prefill_chunk_size": 4,
        "async_scheduling": True,
        "exit_mode": "delayed",
    },
}


@pytest.mark.parametrize("mode", MODES)
def test_prompt_logprobs_match_the_oracle_in_every_mode(ckpts, ouro_ref, mode):
    prompts, params = _workload()
    # (One ends at its first output, likely before its prompt's last loop: a withheld end.)
    params = [p.replace(max_tokens=1 if i == 1 else 5 + i) for i, p in enumerate(params)]
    kw = MODES[mode]
    core, run = run_mode(ckpts["ouro"], prompts, params, **kw)
    exit_mode = kw.get("exit_mode", "gate")
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        rid = f"r{i}"
        want = oracle_run(ouro_ref, prompt, p, exit_mode=exit_mode, kv_policy="last_exited")
        assert (run.tokens[rid], run.depths[rid]) == (want.tokens, want.exit_depths), rid
        if p.prompt_logprobs is None:
            assert rid not in run.prompt_logprobs
            continue
        _check(ouro_ref, prompt, p, run.prompt_logprobs[rid], exit_mode=exit_mode)
    if "preemption_mode" in kw:
        assert core.stats().num_preemptions > 0
    core.kv.check_no_leaks()


def test_prompt_logprobs_in_slabs_of_rows(ckpts, ouro_ref, monkeypatch):
    monkeypatch.setattr("rltserve.core.step.PROMPT_SLAB", 3)  # (256 rows at a time)
    prompts, params = _workload()
    core, run = run_mode(ckpts["ouro"], prompts, params)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        if p.prompt_logprobs is not None:
            _check(ouro_ref, prompt, p, run.prompt_logprobs[f"r{i}"])


def test_a_cached_prompt_is_scored_in_full(ckpts, ouro_ref):
    """A prompt others cached is computed again for a request that scores it (nothing to
    score in a cached block); what it computes still serves later requests."""
    prompt = list(range(40, 57))  # 17 tokens: 4 full blocks of 4 before the last
    core = make_core(ckpts["ouro"], block_size=4, enable_prefix_caching=True)
    plain = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    scored = plain.replace(prompt_logprobs=2)
    first = run_core(core, [prompt], [plain])
    again = run_core(core, [prompt, prompt], [scored, plain], arrivals=[0, 6])
    assert again.tokens["r0"] == again.tokens["r1"] == first.tokens["r0"]
    _check(ouro_ref, prompt, scored, again.prompt_logprobs["r0"])
    assert core.stats().prefix_cache_hits >= 16  # (the plain one hit)


def test_only_the_first_sample_scores_the_prompt(ckpts, ouro_ref):
    prompt = [7, 8, 9, 10, 11, 12]
    params = SamplingParams(max_tokens=4, n=3, temperature=1.0, seed=4, prompt_logprobs=1)
    samples = expand_samples(params)
    assert [s.prompt_logprobs for s in samples] == [1, None, None]
    core = make_core(ckpts["ouro"])
    run = run_core(core, [prompt] * 3, samples, groups=["g"] * 3)
    assert list(run.prompt_logprobs) == ["r0"]
    _check(ouro_ref, prompt, samples[0].replace(temperature=0.0), run.prompt_logprobs["r0"])


def test_huginn_prompt_logprobs_come_from_its_coda(ckpts, huginn_ref):
    prompts = [[3, 9, 27, 81, 5, 6, 7], [5, 6]]
    params = [
        SamplingParams(
            temperature=0.0, max_tokens=3, ignore_eos=True, init_state="zero", prompt_logprobs=TOP
        )
    ] * 2
    for chunk in (64, 3):
        run = run_core(make_core(ckpts["huginn"], prefill_chunk_size=chunk), prompts, params)
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            _check(huginn_ref, prompt, p, run.prompt_logprobs[f"r{i}"])


@pytest.mark.parametrize("max_loops", [2, 3, 6])
def test_prompt_logprobs_come_after_max_loops(ckpts, ouro_ref, max_loops):
    """Ouro's prompts loop at least the model's 4 times (the planes later tokens read); scores
    are those after the request's max_loops, as a token forced there would get."""
    prompts, params = _workload(n=3)
    params = [p.replace(max_loops=max_loops, prompt_logprobs=2) for p in params]
    for mode in ("sync", "chunked"):
        core, run = run_mode(ckpts["ouro"], prompts, params, **ENGINE_MODES[mode])
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            _check(ouro_ref, prompt, p, run.prompt_logprobs[f"r{i}"])
    full = oracle_run(ouro_ref, prompts[0], params[0].replace(max_loops=None)).prompt_logits
    assert not torch.allclose(oracle_run(ouro_ref, prompts[0], params[0]).prompt_logits, full)


def test_prompts_scored_in_one_step_get_their_own_top_counts(ckpts, ouro_ref):
    """Prompts scored in one step with different counts: the step takes the largest count's
    top, and each request gets as many as it asked for."""
    prompts = [[3, 9, 27, 81, 5], [6, 7, 8, 9]]
    params = [
        SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=k)
        for k in (1, 4)
    ]
    run = run_core(make_core(ckpts["ouro"]), prompts, params)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        got = run.prompt_logprobs[f"r{i}"]
        assert [len(top) for _, top, _ in got] == [p.prompt_logprobs] * (len(prompt) - 1)
        _check(ouro_ref, prompt, p, got)


def test_a_prompt_the_model_would_write_ranks_first_throughout(ckpts, ouro_ref):
    """A prompt that goes on with the model's own greedy tokens: each of them is the most
    likely at its position, so its rank is 1 (vLLM's) and it heads its top list."""
    start = [17, 4]
    base = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    written = oracle_run(ouro_ref, start, base).tokens
    p = base.replace(max_tokens=1, prompt_logprobs=1)
    run = run_core(make_core(ckpts["ouro"]), [start + written], [p])
    got = run.prompt_logprobs["r0"][len(start) - 1 :]  # (the positions that predict them)
    assert [rank for _, _, rank in got] == [1] * len(written)
    assert [top[0][0] for _, top, _ in got] == written


def test_a_one_token_prompt_has_none_to_score(ckpts):
    run = run_core(
        make_core(ckpts["ouro"]), [[5]], [SamplingParams(temperature=0.0, prompt_logprobs=2)]
    )
    assert run.prompt_logprobs["r0"] == []


@pytest.mark.parametrize("value", [-2, 1.5, "1"])
def test_sampling_params_validate_prompt_logprobs(value):
    # (-1 is vLLM's every token; a count above the engine's max_logprobs is the engine's call;
    # True is 1, as vLLM takes it: test_sampling_params_vllm)
    with pytest.raises(ValueError, match="^prompt_logprobs="):
        SamplingParams(temperature=0.0, prompt_logprobs=value)


@pytest.mark.parametrize(
    "engine",
    [{}, {"prefill_chunk_size": 4}, {"num_blocks": 4 * 3}, {"kv_reservation": "full"}],
    ids=["whole", "chunked", "pool-of-the-context", "full-reservation"],
)
def test_a_prompt_that_fills_the_context_is_scored(ckpts, ouro_ref, engine):
    """lm-eval's loglikelihood of a full-context prompt (the HTTP API's echo with
    max_tokens=0): one token asked for, which the last prompt position predicts and whose KV
    is never written, so the prompt may take every position (4 planes of 3 blocks of 4 hold
    12). Offline, as vLLM's, any max_tokens: the context leaves that one token, which ends
    "length" (on demand and under a full reservation alike)."""
    core = make_core(ckpts["ouro"], block_size=4, max_model_len=12, **engine)
    assert not core.info.pool_limited
    prompt = list(range(30, 42))
    scored = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, prompt_logprobs=TOP)
    want = oracle_run(ouro_ref, prompt, scored)
    for params in (scored, *(scored.replace(max_tokens=n) for n in (2, None, 5))):
        run = run_core(core, [prompt], [params])
        _check(ouro_ref, prompt, scored, run.prompt_logprobs["r0"])  # (whatever max_tokens)
        assert (run.tokens["r0"], run.depths["r0"]) == (want.tokens, want.exit_depths)
        assert run.finish["r0"] == "length", params.max_tokens
    plain = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    run = run_core(core, [prompt], [plain])
    assert (run.tokens["r0"], run.finish["r0"]) == (want.tokens, "length")
    with pytest.raises(ValueError, match="^prompt: 13 tokens exceed the maximum context length"):
        core.make_request(None, [*prompt, 5], scored)


def test_a_pool_of_the_context_less_one_position_scores_no_full_prompt(ckpts):
    """8 blocks over 4 planes hold 8 positions: a context of 9 for a request that generates
    (its last token writes no KV), but a 9-token prompt to score would write all 9: refused at
    once, naming the pool, as the KV reservation would refuse it later."""
    core = make_core(ckpts["ouro"], block_size=4, num_blocks=8, max_model_len=9)
    assert core.info.pool_limited
    scored = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    with pytest.raises(ValueError, match=r"^prompt: 9 tokens leave no room .*\(what the KV pool"):
        core.make_request(None, list(range(30, 39)), scored)
    assert core.make_request(None, list(range(30, 38)), scored) is not None
