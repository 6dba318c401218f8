"""Bounded thinking with logprobs (core/thinking.py): every forced token's entry holds the
model's logprob of it given everything before it (raw, at the cap, as ``prompt_logprobs`` would
score prompt + output there), with its top-k and rank, delivered by a later update; they equal
the dense oracle's for greedy and seeded sampling, with and without preemption."""

from __future__ import annotations

import pytest
from engine_util import make_core, run_core
from engine_util import tight_blocks as _tight_blocks
from reference_parts import thinking_logprobs

from rltserve.sampling import SamplingParams

PROMPTS = [[3, 17, 42, 7, 8], [99, 5, 61], [12, 250, 31, 4, 77, 2, 6]]
K = 3
INTERRUPTION = (40, 41)
FORCED = set(range(K, K + 3))


def _params(ref, prompt, **kw) -> SamplingParams:
    thinking = ref.generate(prompt, K, kv_policy="last_exited").tokens
    end = next(t for t in range(300, 400) if t not in thinking)  # (the budget ends the span)
    base = dict(temperature=0.0, max_tokens=10, ignore_eos=True, max_thinking_tokens=K)
    base.update(thinking_end_token_ids=(end,), thinking_interruption=INTERRUPTION)
    return SamplingParams(**{**base, **kw})


def _check(ref, run, prompts, params, kv_policy="last_exited") -> None:
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        rid = f"r{i}"
        out, depths = run.tokens[rid], run.depths[rid]
        assert out[K : K + 3] == [*INTERRUPTION, *p.thinking_end_token_ids]
        forced = FORCED & set(range(len(out)))
        want = thinking_logprobs(ref, prompt, out, depths, forced, p.logprobs, kv_policy=kv_policy)
        got = run.logprobs[rid]
        assert len(got) == len(out) and None not in got
        for j, (lp, top, _) in enumerate(want):
            assert got[j] == pytest.approx(lp, abs=1e-4), (rid, j)
            assert [t for t, _ in run.top_logprobs[rid][j]] == [t for t, _ in top], (rid, j)
            values = [v for _, v in run.top_logprobs[rid][j]]
            assert values == pytest.approx([v for _, v in top], abs=1e-4), (rid, j)
        assert set(run.forced_ranks[rid]) == forced
        for j, got_rank in run.forced_ranks[rid].items():
            assert abs(got_rank - want[j][2]) <= 1, (rid, j)  # (up to float noise at ties)


@pytest.mark.parametrize("top", [0, 2])
@pytest.mark.parametrize("kv_policy", ["last_exited", "full"])
def test_greedy_forced_logprobs_equal_the_oracle(ouro_rv1, ouro_ref, kv_policy, top):
    params = [_params(ouro_ref, p, logprobs=top) for p in PROMPTS]
    run = run_core(make_core(ouro_rv1, kv_policy=kv_policy), PROMPTS, params)
    _check(ouro_ref, run, PROMPTS, params, kv_policy)


@pytest.mark.parametrize("top", [0, 2])
@pytest.mark.parametrize("mode", [None, "recompute", "swap"])
def test_seeded_sampling_with_and_without_preemption(ouro_rv1, ouro_ref, mode, top):
    prompts = PROMPTS * 2
    params = [
        _params(ouro_ref, p, max_tokens=16, temperature=1.0, seed=5 + i, exit_threshold=0.5)
        for i, p in enumerate(prompts)
    ]
    params = [p.replace(logprobs=top) for p in params]
    kw = {"prefill_chunk_size": 8, "max_num_batched_tokens": 32, "block_size": 4}
    if mode is None:
        core = make_core(ouro_rv1, num_blocks=1024, **kw)
    else:
        blocks = _tight_blocks(ouro_rv1, prompts, params, **kw)
        core = make_core(ouro_rv1, num_blocks=blocks, kv_watermark=0.0, preemption_mode=mode, **kw)
    run = run_core(core, prompts, params)
    if mode is not None:
        assert core.stats().num_preemptions > 0
    _check(ouro_ref, run, prompts, params)


def test_forced_ids_that_fill_max_tokens_get_theirs_before_the_end(ouro_rv1, ouro_ref):
    # Room for 2 of the 3 forced ids: the request ends (length) once both are scored.
    params = [_params(ouro_ref, p, max_tokens=K + 2, logprobs=1) for p in PROMPTS]
    run = run_core(make_core(ouro_rv1), PROMPTS, params)
    for i, prompt in enumerate(PROMPTS):
        rid = f"r{i}"
        assert run.tokens[rid][K:] == list(INTERRUPTION) and run.finish[rid] == "length"
        out, depths = run.tokens[rid], run.depths[rid]
        want = thinking_logprobs(ouro_ref, prompt, out, depths, {K, K + 1}, 1)
        assert run.logprobs[rid] == pytest.approx([w[0] for w in want], abs=1e-4)


def test_without_logprobs_nothing_is_scored(ouro_rv1, ouro_ref):
    params = [_params(ouro_ref, p) for p in PROMPTS]
    run = run_core(make_core(ouro_rv1), PROMPTS, params)
    assert all(lp is None for rid in run.logprobs for lp in run.logprobs[rid])
    assert not run.forced_ranks


def test_the_assembler_writes_forced_logprobs_into_earlier_entries():
    from rltserve.outputs import OutputAssembler, vllm_logprobs
    from rltserve.updates import RequestUpdate

    asm = OutputAssembler("r", [1, 2], want_logprobs=True)
    asm.add(
        RequestUpdate("r", [5, 40, 41], [3, 4, 4], [-0.5, None, None], [[(5, -0.5)], None, None])
    )
    assert [e["logprob"] for e in asm.output.logprobs] == [-0.5, None, None]
    later = RequestUpdate("r", [7], [2], [-0.25], [[(7, -0.25)]])
    later.forced_logprobs = [(1, -3.0, [(9, -0.1)], 4), (2, -2.0, [(41, -2.0)], 1)]
    asm.add(later)
    entries = asm.output.logprobs
    assert [e["logprob"] for e in entries] == [-0.5, -3.0, -2.0, -0.25]
    assert entries[1] == {"token_id": 40, "logprob": -3.0, "rank": 4, "top_logprobs": [(9, -0.1)]}
    assert all(vllm_logprobs(entries, None))  # (no empty dict left)


def test_a_score_that_comes_with_its_token_is_in_the_delta():
    """A budget of 0 with prompt logprobs: the withheld forced ids go out with the prompt's
    last chunk's score of the first one, in one update. The delta a stream sends has it."""
    from rltserve.outputs import OutputAssembler
    from rltserve.updates import RequestUpdate

    asm = OutputAssembler("r", [1, 2], want_logprobs=True)
    update = RequestUpdate("r", [40, 41], [4, 4], [None, None], [None, None])
    update.forced_logprobs = [(0, -3.0, [(9, -0.1)], 4)]
    delta = asm.add(update)
    assert [e["logprob"] for e in delta.logprobs] == [-3.0, None]
    assert delta.logprobs == asm.output.logprobs
    assert delta.logprobs[0]["top_logprobs"] == [(9, -0.1)]


def test_llm_outputs_have_every_forced_logprob(tiny):
    from rltserve import LLM

    with LLM(str(tiny), in_process=True, num_blocks=64) as llm:
        end = llm.tokenizer.get_vocab()["</think>"]
        params = SamplingParams(
            temperature=0.0, max_tokens=8, ignore_eos=True, max_thinking_tokens=2, logprobs=2
        )
        think = {"chat_template_kwargs": {"enable_thinking": True}}
        messages = [{"role": "user", "content": "Why?"}]
        (out,) = llm.chat(messages, params, use_tqdm=False, **think)
        sample = out.outputs[0]
        assert end in sample.token_ids and len(sample.logprobs) == len(sample.token_ids)
        for token, lp in zip(sample.token_ids, sample.logprobs):
            assert next(iter(lp.values())).logprob == lp[token].logprob  # (TRL's, verl's)
        total = sum(lp[t].logprob for t, lp in zip(sample.token_ids, sample.logprobs))
        assert sample.cumulative_logprob == pytest.approx(total)


@pytest.mark.parametrize("top", [0, 2])
def test_huginn_forced_logprobs_equal_the_oracle(huginn_rv1, huginn_ref, top):
    """Huginn (coda attention, initial state zero): the forced tokens' rows are scored from
    their coda's output, as its prompts' are."""
    params = [
        _params(huginn_ref, p, logprobs=top, init_state="zero").replace(max_loops=4)
        for p in PROMPTS
    ]
    run = run_core(make_core(huginn_rv1, kv_policy="last_exited"), PROMPTS, params)
    _check(huginn_ref, run, PROMPTS, params)


def test_the_assembler_holds_a_stopped_output_until_its_forced_tokens_are_scored():
    from rltserve.outputs import OutputAssembler
    from rltserve.updates import FinishReason, RequestUpdate

    asm = OutputAssembler("r", [1, 2], want_logprobs=True)
    asm.add(RequestUpdate("r", [5], [3], [-0.5], [[(5, -0.5)]]))
    assert not asm.awaiting_scores
    # A stop string (the front end's: the engine goes on) ends the output at a forced token.
    stopped = RequestUpdate("r", [40, 41], [4, 4], [None, None], [None, None])
    asm.add(stopped)
    asm.output.finish_reason = "stop"
    assert asm.awaiting_scores and asm.stopped_awaiting_scores(stopped)
    later = RequestUpdate("r", [7], [2], [-0.25], [[(7, -0.25)]])
    later.forced_logprobs = [(1, -3.0, [(9, -0.1)], 4)]
    assert not asm.add_late(later)  # (index 2 still missing)
    later = RequestUpdate("r", [8], [2], [-0.5], [[(8, -0.5)]])
    later.forced_logprobs = [(2, -2.0, [(41, -2.0)], 1), (3, -1.0, [], 1)]
    assert asm.add_late(later) and not asm.awaiting_scores
    out = asm.output
    assert out.token_ids == [5, 40, 41] and out.finish_reason == "stop"  # (nothing else taken)
    assert [e["logprob"] for e in out.logprobs] == [-0.5, -3.0, -2.0]
    # The engine's end gives up waiting: the output keeps what it has.
    asm = OutputAssembler("r", [1, 2], want_logprobs=True)
    asm.add(stopped)
    assert asm.add_late(RequestUpdate("r", finish_reason=FinishReason.ABORT))
    assert asm.awaiting_scores


THINK = {"chat_template_kwargs": {"enable_thinking": True}}
STOPPED = SamplingParams(
    temperature=0.0, max_thinking_tokens=2, logprobs=2, stop=["</think>"], max_tokens=20
)


@pytest.mark.parametrize("include", [True, False])
def test_a_stop_string_in_the_forced_tokens_leaves_none_unscored(tiny, include):
    """A stop string matching in the forced text ends the output before the engine scored the
    forced tokens: the request runs on until their scores came, then is aborted, and the
    result has every one, equal to the oracle's (TRL reads ``next(iter(lp.values()))``)."""
    from reference import Reference

    from rltserve import LLM

    params = STOPPED.replace(include_stop_str_in_output=include)
    with LLM(str(tiny), in_process=True, num_blocks=64) as llm:
        end = llm.tokenizer.get_vocab()["</think>"]
        (out,) = llm.chat([[{"role": "user", "content": "hi"}]], params, use_tqdm=False, **THINK)
    sample = out.outputs[0]
    assert sample.finish_reason == "stop" and sample.stop_reason == "</think>"
    assert sample.token_ids[2:] == [end] and sample.text.endswith("</think>") == include
    assert len(sample.logprobs) == len(sample.token_ids)
    want = thinking_logprobs(
        Reference.load(tiny), out.prompt_token_ids, sample.token_ids, sample.exit_depths, {2}, 2
    )
    for token, lp, (logprob, top, rank) in zip(sample.token_ids, sample.logprobs, want):
        assert (
            next(iter(lp.values())).logprob == lp[token].logprob == pytest.approx(logprob, abs=1e-4)
        )
        assert [t for t in lp if t != token or t in dict(top)] == [t for t, _ in top]
        assert abs(lp[token].rank - rank) <= 1
    total = sum(lp[t].logprob for t, lp in zip(sample.token_ids, sample.logprobs))
    assert sample.cumulative_logprob == pytest.approx(total)
