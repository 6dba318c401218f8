"""A thinking budget of 0 (vLLM's ``thinking_token_budget=0``, core/thinking.py's
``force_at_start``): the interruption and end ids open the output, and the answer follows. The
output equals the oracle on prompt + forced ids, the forced tokens' logprobs are the oracle's
scores of them there (as ``prompt_logprobs`` gives them), in every engine mode, under
preemption, with groups and with prompt logprobs."""

from __future__ import annotations

import pytest
from engine_util import ENGINE_MODES, make_core, run_core, run_mode
from reference_parts import thinking_logprobs

from rltserve.sampling import SamplingParams

PROMPTS = [[3, 17, 42, 7, 8], [99, 5, 61], [12, 250, 31, 4, 77, 2, 6]]
INTERRUPTION = (40, 41)
END = 300
FORCED = [*INTERRUPTION, END]


def _params(**kw) -> SamplingParams:
    base = dict(temperature=0.0, max_tokens=8, ignore_eos=True, max_thinking_tokens=0)
    base.update(thinking_end_token_ids=(END,), thinking_interruption=INTERRUPTION)
    return SamplingParams(**{**base, **kw})


def _plain(p: SamplingParams) -> SamplingParams:
    """``p`` without the budget, for the prompt with the forced ids appended."""
    return p.replace(max_thinking_tokens=None, max_tokens=p.max_tokens - len(FORCED))


@pytest.mark.parametrize("kv_policy", ["last_exited", "full"])
def test_output_equals_the_oracle_on_prompt_and_forced_ids(ouro_rv1, ouro_ref, kv_policy):
    params = [_params() for _ in PROMPTS]
    run = run_core(make_core(ouro_rv1, kv_policy=kv_policy), PROMPTS, params)
    depth = ouro_ref.depths(None)[1]
    for i, prompt in enumerate(PROMPTS):
        rest = ouro_ref.generate(prompt + FORCED, 8 - len(FORCED), kv_policy=kv_policy)
        assert run.tokens[f"r{i}"] == FORCED + rest.tokens
        assert run.depths[f"r{i}"] == [depth] * len(FORCED) + rest.exit_depths
        assert run.finish[f"r{i}"] == "length"
        assert run.cached[f"r{i}"] == 0  # (the first output's update says it)


@pytest.mark.parametrize("mode", list(ENGINE_MODES))
def test_every_engine_mode_equals_the_unbudgeted_run_on_prompt_and_forced_ids(ouro_rv1, mode):
    """Seeded sampling with adaptive exits: the sampled tokens equal those of a run without
    the budget whose prompts end with the forced ids (the same seeds, the same draws)."""
    params = [_params(temperature=1.0, seed=7 + i, exit_threshold=0.5) for i in range(3)]
    _, run = run_mode(ouro_rv1, PROMPTS, params, **ENGINE_MODES[mode])
    _, plain = run_mode(
        ouro_rv1, [p + FORCED for p in PROMPTS], [_plain(p) for p in params], **ENGINE_MODES[mode]
    )
    for rid in run.tokens:
        assert run.tokens[rid] == FORCED + plain.tokens[rid], rid
        assert run.depths[rid][len(FORCED) :] == plain.depths[rid], rid


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_is_exact_and_replays_the_forced_ids(ouro_rv1, mode):
    prompts = PROMPTS * 2
    params = [
        _params(max_tokens=16, temperature=1.0, seed=5 + i, exit_threshold=0.5, logprobs=1)
        for i in range(len(prompts))
    ]
    kw = {"prefill_chunk_size": 8, "max_num_batched_tokens": 32}
    plain = run_core(make_core(ouro_rv1, block_size=4, num_blocks=1024, **kw), prompts, params)
    core, tight = run_mode(ouro_rv1, prompts, params, preemption_mode=mode, **kw)
    assert core.stats().num_preemptions > 0
    assert tight.tokens == plain.tokens and tight.depths == plain.depths
    for rid, logprobs in plain.logprobs.items():
        assert tight.logprobs[rid] == pytest.approx(logprobs, abs=1e-5), rid
    assert all(out[:3] == FORCED for out in tight.tokens.values())


@pytest.mark.parametrize("top", [0, 2])
@pytest.mark.parametrize("kv_policy", ["last_exited", "full"])
def test_forced_logprobs_are_the_oracles_scores_of_them(ouro_rv1, ouro_ref, kv_policy, top):
    # (A chunk size of 4 puts the prompt's last position in a later chunk for two prompts.)
    params = [_params(logprobs=top, max_tokens=6) for _ in PROMPTS]
    core = make_core(ouro_rv1, kv_policy=kv_policy, prefill_chunk_size=4)
    run = run_core(core, PROMPTS, params)
    for i, prompt in enumerate(PROMPTS):
        rid = f"r{i}"
        out, depths = run.tokens[rid], run.depths[rid]
        want = thinking_logprobs(ouro_ref, prompt, out, depths, {0, 1, 2}, top, kv_policy=kv_policy)
        assert run.logprobs[rid] == pytest.approx([w[0] for w in want], abs=1e-4), rid
        for j, (_, top_want, _) in enumerate(want):
            assert [t for t, _ in run.top_logprobs[rid][j]] == [t for t, _ in top_want], (rid, j)
        assert set(run.forced_ranks[rid]) == {0, 1, 2}
        for j, rank in run.forced_ranks[rid].items():
            assert abs(rank - want[j][2]) <= 1, (rid, j)  # (up to float noise at ties)


def test_with_prompt_logprobs_one_chunk_scores_both(ouro_rv1):
    """The prompt's last chunk scores its prompt tokens (top 3) and the first forced id (top
    1): each as a run without the budget on prompt + forced ids scores them."""
    params = [_params(logprobs=1, prompt_logprobs=3, max_tokens=5) for _ in PROMPTS]
    run = run_core(make_core(ouro_rv1), PROMPTS, params)
    plain = [_plain(p).replace(prompt_logprobs=3, max_tokens=2) for p in params]
    want = run_core(make_core(ouro_rv1), [p + FORCED for p in PROMPTS], plain)
    for i, prompt in enumerate(PROMPTS):
        rid, n = f"r{i}", len(prompt)
        got, scored = run.prompt_logprobs[rid], want.prompt_logprobs[rid]
        assert len(got) == n - 1
        for q in range(n - 1):
            assert got[q][0] == pytest.approx(scored[q][0], abs=1e-5)
            assert [t for t, _ in got[q][1]] == [t for t, _ in scored[q][1]]
        # The forced ids, as the prompt's rows from n - 1 on score them (top 1 only).
        for j in range(len(FORCED)):
            assert run.logprobs[rid][j] == pytest.approx(scored[n - 1 + j][0], abs=1e-5)
            assert [t for t, _ in run.top_logprobs[rid][j]] == [scored[n - 1 + j][1][0][0]]
        assert run.tokens[rid][len(FORCED) :] == want.tokens[rid]


@pytest.mark.parametrize("logprobs", [None, 1])
def test_forced_ids_that_fill_max_tokens_end_the_request(ouro_rv1, ouro_ref, logprobs):
    params = [_params(max_tokens=2, logprobs=logprobs), _params(max_tokens=3, logprobs=logprobs)]
    run = run_core(make_core(ouro_rv1), PROMPTS[:2], params)
    assert run.tokens == {"r0": FORCED[:2], "r1": FORCED}
    assert run.finish == {"r0": "length", "r1": "length"}
    if logprobs:
        for i, out in enumerate(run.tokens.values()):
            depths = run.depths[f"r{i}"]
            forced = set(range(len(out)))
            want = thinking_logprobs(ouro_ref, PROMPTS[i], out, depths, forced, 1)
            assert run.logprobs[f"r{i}"] == pytest.approx([w[0] for w in want], abs=1e-4)


def test_groups_and_the_prefix_cache_share_the_prompt(ouro_rv1):
    """n > 1 (a group: its followers take the prompt KV its leader computed) and a prefix
    cache hit: each sample equals its run without sharing."""
    prompt = list(range(3, 40))
    params = [_params(temperature=1.0, seed=s, logprobs=1) for s in (1, 2, 3)]
    alone = run_core(make_core(ouro_rv1), [prompt] * 3, params)
    core = make_core(ouro_rv1, enable_prefix_caching=True)
    grouped = run_core(core, [prompt] * 3, params, groups=["g", "g", "g"])
    assert grouped.tokens == alone.tokens
    for rid, logprobs in alone.logprobs.items():
        assert grouped.logprobs[rid] == pytest.approx(logprobs, abs=1e-5), rid
    assert grouped.cached["r1"] > 0
    again = run_core(core, [prompt], params[:1])
    assert again.tokens["r0"] == alone.tokens["r0"] and again.cached["r0"] > 0


def test_coda_attention_runs_the_prompts_last_position_as_a_prompts(huginn_rv1):
    """Huginn: the last prompt position's coda runs on its full-depth state (it samples
    nothing), as the prompt + forced ids run without the budget has it. (Under a zero-shot
    criterion the first sampled token is a decode token, which the criterion exits, where
    the run without the budget samples it at the prompt's last position, at the cap.)"""
    params = [_params(temperature=1.0, seed=3 + i, logprobs=1) for i in range(3)]
    for kw in ({}, {"prefill_chunk_size": 4, "wavefront_prefill": True}):
        run = run_core(make_core(huginn_rv1, **kw), PROMPTS, params)
        plain = [_plain(p).replace(prompt_logprobs=0) for p in params]
        want = run_core(make_core(huginn_rv1, **kw), [p + FORCED for p in PROMPTS], plain)
        for i, rid in enumerate(run.tokens):
            assert run.tokens[rid] == FORCED + want.tokens[rid], rid
            assert run.logprobs[rid][3:] == pytest.approx(want.logprobs[rid], abs=1e-5)
            scored = [lp for lp, _, _ in want.prompt_logprobs[rid][len(PROMPTS[i]) - 1 :]]
            assert run.logprobs[rid][:3] == pytest.approx(scored, abs=1e-4), rid


@pytest.mark.parametrize("logprobs", [None, 1])
def test_forced_ids_filling_a_pool_sized_context_are_admitted(ouro_rv1, logprobs):
    """A prompt as long as the pool holds, with room for the forced end alone: admission asks
    for the positions its recorded outputs need, not one more for a decode token it never
    runs (which the pool could never give: it waited for ever)."""
    core = make_core(ouro_rv1, block_size=4, num_blocks=32)
    prompt = [5 + q % 50 for q in range(core.max_model_len - 1)]
    params = _params(max_tokens=None, logprobs=logprobs, thinking_interruption=None)
    run = run_core(core, [prompt], [params], max_steps=500)
    assert run.tokens["r0"] == [END] and run.finish["r0"] == "length"
    assert (run.logprobs["r0"][0] is None) == (logprobs is None)


@pytest.mark.parametrize("kv_policy", ["last_exited", "full"])
def test_wavefront_prefill_sends_prompt_logprobs_and_forced_ids_together(ouro_rv1, kv_policy):
    """Wavefront prefill at 2 loops, a prompt whose last chunk is its last position alone:
    that chunk's first loop (which sends the forced ids) runs in the step whose earlier chunk
    completes the prompt's logprobs. Both go out in one update (the forced ids' own update
    replaced the other: the prompt logprobs never came)."""
    prompts = [[3, 17, 42, 7, 8], [12, 250, 31, 4, 77, 2, 6]]  # (odd: a last chunk of one)
    params = [_params(prompt_logprobs=2, max_loops=2, max_tokens=5) for _ in prompts]
    wave = make_core(ouro_rv1, kv_policy=kv_policy, prefill_chunk_size=2, wavefront_prefill=True)
    run = run_core(wave, prompts, params)
    want = run_core(make_core(ouro_rv1, kv_policy=kv_policy), prompts, params)
    for rid, scores in want.prompt_logprobs.items():
        assert run.tokens[rid] == want.tokens[rid] and run.tokens[rid][:3] == FORCED
        got = run.prompt_logprobs.get(rid)
        assert got is not None and len(got) == len(scores), rid
        assert [lp for lp, _, _ in got] == pytest.approx([lp for lp, _, _ in scores], abs=1e-5)
