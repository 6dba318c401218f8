"""Token pipelining (self-speculative decode): a token's state after ``draft_loops`` drafts the
next token, which enters loop 1 while the first keeps looping. Output must equal block mode and
the oracle for every rejection position; rejected drafts discard every later in-flight token."""

from __future__ import annotations

import random

import pytest
from engine_util import make_core, oracle_run, run_core, with_eos
from reference import Reference

from rltserve.sampling import SamplingParams


def _workload(n: int, seed: int, max_tokens: int = 12):
    rng = random.Random(seed)
    prompts = [[rng.randrange(384) for _ in range(rng.randint(1, 20))] for _ in range(n)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=rng.randint(1, max_tokens), ignore_eos=True)
        for _ in prompts
    ]
    return prompts, params


@pytest.mark.parametrize("k,d", [(1, 2), (2, 1), (3, 1), (1, 3), (2, 2)])
@pytest.mark.parametrize("kv_policy", ["last_exited", "full"])
def test_pipelined_equals_block_mode_and_oracle(ouro_rv1, ouro_ref, k, d, kv_policy):
    prompts, params = _workload(10, seed=k * 10 + d)
    block = run_core(make_core(ouro_rv1, kv_policy=kv_policy), prompts, params)
    core = make_core(ouro_rv1, kv_policy=kv_policy, speculative_tokens=k, draft_loops=d)
    piped = run_core(core, prompts, params)
    assert piped.tokens == block.tokens
    assert piped.depths == block.depths
    stats = core.stats()
    assert stats.drafts_rejected > 0  # rollbacks were exercised
    if d >= 2:  # rv1 is untrained: a depth-1 draft rarely survives, deeper ones often do
        assert stats.drafts_rejected < stats.drafts_checked
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        want = oracle_run(ouro_ref, prompt, p, kv_policy=kv_policy)
        assert piped.tokens[f"r{i}"] == want.tokens, f"request {i}"
        assert piped.depths[f"r{i}"] == want.exit_depths, f"request {i}"


def test_pipelining_takes_fewer_steps_alone(ouro_rv1):
    prompt, p = [5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    block = run_core(make_core(ouro_rv1), [prompt], [p])
    piped = run_core(make_core(ouro_rv1, speculative_tokens=1, draft_loops=2), [prompt], [p])
    assert piped.tokens == block.tokens
    assert piped.steps < block.steps


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 6])
def test_the_last_output_drafts_nothing(ouro_rv1, max_tokens):
    """Every output but the last has a successor entering on its draft, so a request checks
    max_tokens - 1 drafts: the token producing its last output makes none (none would be used,
    and the draft stats would count it), the prompt's last chunk too when it makes the only
    output."""
    core = make_core(ouro_rv1, speculative_tokens=2, draft_loops=2)
    p = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    run = run_core(core, [[5, 6, 7]], [p])
    assert len(run.tokens["r0"]) == max_tokens
    stats = core.stats()
    assert stats.drafts_checked == max_tokens - 1 and stats.drafts_rejected <= max_tokens - 1


def test_eos_and_max_tokens_inside_the_window(tmp_path, ouro_rv1, ouro_ref):
    prompts, params = _workload(8, seed=5)
    # Real EOS ids, taken from the outputs so they land inside the speculative window; half the
    # requests also hold EOS back with min_tokens.
    params = [
        p.replace(max_tokens=12, ignore_eos=False, min_tokens=6 * (i % 2))
        for i, p in enumerate(params)
    ]
    free = [oracle_run(ouro_ref, prompt, p).tokens for prompt, p in zip(prompts, params)]
    path = with_eos(ouro_rv1, tmp_path / "ouro_eos", sorted({t[min(4, len(t) - 1)] for t in free}))
    ref = Reference.load(path)
    block = run_core(make_core(path), prompts, params)
    piped = run_core(make_core(path, speculative_tokens=2, draft_loops=1), prompts, params)
    assert piped.tokens == block.tokens
    assert piped.finish == block.finish
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        want = oracle_run(ref, prompt, p)
        assert piped.tokens[f"r{i}"] == want.tokens, f"request {i}"
        assert piped.finish[f"r{i}"] == ("stop" if len(want.tokens) < 12 else "length")
    assert sum(f == "stop" for f in piped.finish.values()) >= 3


@pytest.mark.parametrize("deferred", [False, True])
def test_aborts_and_async_lag(ouro_rv1, ouro_ref, deferred):
    prompts, params = _workload(8, seed=8)
    aborts = {2: 4, 5: 9}
    kw = {"speculative_tokens": 2, "draft_loops": 1, "async_scheduling": True}
    piped = run_core(
        make_core(ouro_rv1, **kw), prompts, params, aborts=aborts, lag=1, deferred=deferred
    )
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        want = oracle_run(ouro_ref, prompt, p).tokens
        got = piped.tokens[f"r{i}"]
        if i in aborts:
            assert got == want[: len(got)]
        else:
            assert got == want


def test_mixed_pipelined_and_ordinary_requests(ouro_rv1, ouro_ref):
    prompts, params = _workload(9, seed=13)
    mixed = [
        p
        if i % 3 == 0
        else p.replace(exit_threshold=0.5)
        if i % 3 == 1
        else p.replace(temperature=0.9, seed=i)
        for i, p in enumerate(params)
    ]
    block = run_core(make_core(ouro_rv1), prompts, mixed)
    piped = run_core(make_core(ouro_rv1, speculative_tokens=1, draft_loops=2), prompts, mixed)
    assert piped.tokens == block.tokens
    assert piped.depths == block.depths
    for i, (prompt, p) in enumerate(zip(prompts, mixed)):
        if p.greedy:  # the oracle is greedy only
            want = oracle_run(ouro_ref, prompt, p, kv_policy="last_exited")
            assert piped.tokens[f"r{i}"] == want.tokens, f"request {i}"
            assert piped.depths[f"r{i}"] == want.exit_depths, f"request {i}"


def test_requirements_are_enforced(ouro_rv1):
    core = make_core(ouro_rv1, speculative_tokens=1)
    with pytest.raises(ValueError, match="greedy"):
        core.add_request("a", [1], SamplingParams(temperature=0.7, speculative=True))
    with pytest.raises(ValueError, match="fixed full depth"):
        core.add_request(
            "b", [1], SamplingParams(temperature=0.0, exit_threshold=0.5, speculative=True)
        )
    with pytest.raises(ValueError, match="speculative_tokens=0"):
        make_core(ouro_rv1).add_request("c", [1], SamplingParams(temperature=0.0, speculative=True))
    with pytest.raises(ValueError, match="draft_loops"):
        make_core(ouro_rv1, speculative_tokens=1, draft_loops=4)
    with pytest.raises(ValueError, match="draft_loops=2: only with token pipelining"):
        make_core(ouro_rv1, draft_loops=2)  # (was silently unused)
    with pytest.raises(ValueError, match="per-depth"):
        make_core(ouro_rv1, speculative_tokens=1, kv_policy="shared")


def test_huginn_is_refused_by_name(huginn_rv1):
    """Token pipelining needs a model without coda attention: the refusal names the model
    (it said "a model without coda attention", which a Huginn user cannot map to Huginn)."""
    with pytest.raises(ValueError, match=r"without coda attention, not huginn_raven \(Huginn\)$"):
        make_core(huginn_rv1, speculative_tokens=2)
