"""Bounded thinking under async scheduling (``core/thinking.py``'s ``awaits_budget``) and with
penalties (``LiveRequest.record_inputs``). A step planned before the previous one's result is
applied leaves the position after a token that may spend the budget unplanned until that
token is known, so a request runs the items of a synchronous run: token ids, exit depths,
logprobs (the forced tokens' raw scores included) and seeded draws equal it and the oracle,
with and without preemption, on one stage or two. Penalties count the forced tokens as output
tokens, live as after a resume."""

from __future__ import annotations

import pytest
from async_llm_util import ENGINE
from engine_util import ENGINE_MODES, make_core, run_core, run_mode, stream_all
from reference_guided import ThinkingBudget
from reference_parts import thinking_logprobs
from test_pd import _client

from rltserve import LLM
from rltserve.sampling import SamplingParams

PROMPTS = [[3, 17, 42, 7, 8], [99, 5, 61], [12, 250, 31, 4, 77, 2, 6]]
INTERRUPTION = (40, 41)
END = 300
FORCED = [*INTERRUPTION, END]
ASYNC = ENGINE_MODES["async"]
PENALTIES = {"repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.4}


def _params(budget: int, **kw) -> SamplingParams:
    base = dict(temperature=0.0, max_tokens=10, ignore_eos=True, max_thinking_tokens=budget)
    base.update(thinking_end_token_ids=(END,), thinking_interruption=INTERRUPTION)
    return SamplingParams(**{**base, **kw})


@pytest.mark.parametrize("deferred", [False, True])
@pytest.mark.parametrize("kv_policy", ["last_exited", "full"])
@pytest.mark.parametrize("budget", [0, 1, 3])
def test_greedy_async_equals_the_oracle_and_the_sync_run(
    ouro_rv1, ouro_ref, budget, kv_policy, deferred
):
    """Adaptive (delayed) exits, logprobs with their top 2: the oracle's tokens and depths under
    the README's budget rule, the forced tokens' logprobs its raw scores at the cap; and the
    synchronous run's, logprobs included."""
    params = [_params(budget, exit_threshold=0.5, logprobs=2) for _ in PROMPTS]
    core = make_core(ouro_rv1, kv_policy=kv_policy, **ASYNC)
    run = run_core(core, PROMPTS, params, lag=1, deferred=deferred)
    _, sync = run_mode(ouro_rv1, PROMPTS, params, kv_policy=kv_policy, exit_mode="delayed")
    steer = ThinkingBudget(budget, INTERRUPTION, (END,))
    for i, prompt in enumerate(PROMPTS):
        rid = f"r{i}"
        want = ouro_ref.generate(
            prompt, 10, kv_policy=kv_policy, exit_mode="delayed", exit_threshold=0.5, steer=steer
        )
        out, depths = run.tokens[rid], run.depths[rid]
        assert out[budget : budget + 3] == FORCED, rid
        assert (out, depths) == (want.tokens, want.exit_depths), rid
        assert (out, depths) == (sync.tokens[rid], sync.depths[rid]), rid
        forced = steer.forced_at(out)
        scores = thinking_logprobs(ouro_ref, prompt, out, depths, forced, 2, kv_policy=kv_policy)
        assert run.logprobs[rid] == pytest.approx([s[0] for s in scores], abs=1e-4), rid
        assert run.logprobs[rid] == pytest.approx(sync.logprobs[rid], abs=1e-5), rid
        assert set(run.forced_ranks[rid]) == forced


@pytest.mark.parametrize("penalties", [False, True])
@pytest.mark.parametrize("mode", [None, "recompute", "swap"])
def test_seeded_async_equals_the_sync_run_under_preemption(ouro_rv1, mode, penalties):
    """Seeded sampling with adaptive exits (and penalties): the same draws, so the same tokens
    as the synchronous run without preemption, with the forced ids after the K-th token."""
    prompts = PROMPTS * 2
    extra = PENALTIES if penalties else {}
    params = [
        _params(
            2, max_tokens=14, temperature=1.0, seed=5 + i, exit_threshold=0.5, logprobs=1
        ).replace(**extra)
        for i in range(len(prompts))
    ]
    _, sync = run_mode(ouro_rv1, prompts, params, exit_mode="delayed")
    engine = {**ASYNC, **({"preemption_mode": mode} if mode else {})}
    core, run = run_mode(ouro_rv1, prompts, params, **engine)
    assert (core.stats().num_preemptions > 0) == (mode is not None)
    assert run.tokens == sync.tokens and run.depths == sync.depths
    for rid, logprobs in sync.logprobs.items():
        assert run.logprobs[rid] == pytest.approx(logprobs, abs=1e-5), rid
    steer = ThinkingBudget(2, INTERRUPTION, (END,))
    for out in run.tokens.values():
        assert all(out[j] == steer.forced(out[:j]) for j in steer.forced_at(out))
        assert out[2:5] == FORCED or END in out[:2]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_span_closed_in_time_forces_nothing(ouro_rv1, mode):
    """The end id sampled before the budget, and as the K-th token itself (the token the next
    position waits for under async scheduling): no forcing, the plain run's output."""
    plain = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    _, base = run_mode(ouro_rv1, PROMPTS[:1], [plain], **ENGINE_MODES[mode])
    tokens = base.tokens["r0"]
    params = [
        plain.replace(max_thinking_tokens=budget, thinking_end_token_ids=(tokens[1],))
        for budget in (3, 2)
    ]
    _, run = run_mode(ouro_rv1, PROMPTS[:1] * 2, params, **ENGINE_MODES[mode])
    assert run.tokens == {"r0": tokens, "r1": tokens}


def test_penalties_count_the_forced_tokens(ouro_rv1):
    """Greedy with a repetition penalty (over prompt and output alike): the answer after the
    forced ids is the run without a budget whose prompt holds the thinking and forced ids."""
    params = [_params(3, repetition_penalty=1.5) for _ in PROMPTS]
    for engine in ({}, ASYNC):
        _, run = run_mode(ouro_rv1, PROMPTS, params, **engine)
        thinking = run_mode(ouro_rv1, PROMPTS, [p.replace(max_tokens=3) for p in params])[1]
        for i, prompt in enumerate(PROMPTS):
            rid = f"r{i}"
            assert run.tokens[rid][:6] == thinking.tokens[rid] + FORCED
            longer = [prompt + run.tokens[rid][:6]]
            plain = params[i].replace(max_thinking_tokens=None, max_tokens=4)
            _, rest = run_mode(ouro_rv1, longer, [plain], **engine)
            assert run.tokens[rid][6:] == rest.tokens["r0"], rid


def test_two_stages_under_async_scheduling_equal_the_oracle(ouro_rv1, ouro_ref):
    """Prefill/decode disaggregation: the decode stage runs the budget under async scheduling
    (prompts past one block, so their KV moves)."""
    prompts = [list(range(5, 19)), list(range(40, 57)), [7, 9, 11]]
    params = [_params(budget, exit_threshold=0.5) for budget in (0, 1, 3)]
    client = _client(ouro_rv1, kv_policy="last_exited", **ASYNC)
    try:
        run = stream_all(client, prompts, params)
    finally:
        client.close()
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        steer = ThinkingBudget(p.max_thinking_tokens, INTERRUPTION, (END,))
        want = ouro_ref.generate(
            prompt, 10, kv_policy="last_exited", exit_mode="delayed", exit_threshold=0.5,
            steer=steer,
        )  # fmt: skip
        assert run.tokens[f"r{i}"] == want.tokens and run.depths[f"r{i}"] == want.exit_depths


def test_llm_chat_with_n_samples_and_a_text_interruption_equals_the_sync_llm(tiny):
    """The offline API end to end (vLLM's ``thinking_token_budget``, a text interruption the
    front end tokenizes, n = 2 seeded samples, a penalty, logprobs): the same outputs."""
    params = SamplingParams(
        n=2, temperature=1.0, seed=3, max_tokens=12, ignore_eos=True, logprobs=1,
        thinking_token_budget=3, thinking_interruption="Time is up.", repetition_penalty=1.1,
    )  # fmt: skip
    think = {"chat_template_kwargs": {"enable_thinking": True}}
    messages = [{"role": "user", "content": "Why?"}]
    outs = []
    for engine in ({}, ASYNC):
        with LLM(str(tiny), **ENGINE, **engine) as llm:
            (out,) = llm.chat(messages, params, use_tqdm=False, **think)
            end = llm.tokenizer.get_vocab()["</think>"]
            outs.append(out.outputs)
    for sync, lagged in zip(*outs):
        assert lagged.token_ids == sync.token_ids and lagged.text == sync.text
        assert lagged.exit_depths == sync.exit_depths
        assert lagged.cumulative_logprob == pytest.approx(sync.cumulative_logprob, abs=1e-4)
        assert end in sync.token_ids[3:] and "Time is up." in sync.text


def _waits(core, prompt: list[int], params: SamplingParams) -> tuple[list[int], int]:
    """Runs one request as async scheduling does (each step planned before the previous one's
    result is applied): its tokens, and the steps it could not plan (waiting for a result)."""
    from collections import deque

    core.add_request("r", prompt, params)
    pending: deque = deque()
    tokens: list[int] = []
    waits = 0
    while core.has_work() or pending:
        plan = core.plan()
        if plan is None:
            waits += 1
        else:
            pending.append((plan, core.runner.launch(plan)))
        if len(pending) > 1 or (plan is None and pending):
            oldest, handle = pending.popleft()
            for update in core.apply(oldest, handle.result()):
                tokens.extend(update.new_token_ids)
    return tokens, waits


@pytest.mark.parametrize("budget", [0, 1, 3])
def test_the_budget_costs_one_wait_per_request(ouro_rv1, budget):
    """Only the position after the token that may spend the budget waits for its result, once:
    the steps before and after it (the span closed, forced or not) overlap as without a
    budget."""
    plain = _params(budget).replace(max_thinking_tokens=None)
    tokens, base = _waits(make_core(ouro_rv1, **ASYNC), PROMPTS[0], plain)
    forced, waits = _waits(make_core(ouro_rv1, **ASYNC), PROMPTS[0], _params(budget))
    assert forced[budget : budget + 3] == FORCED
    assert waits == base + (budget > 0)
    closed = _params(budget + 2, thinking_end_token_ids=(tokens[0],), max_tokens=budget + 6)
    early, waits = _waits(make_core(ouro_rv1, **ASYNC), PROMPTS[0], closed)
    assert early == tokens[: budget + 6] and waits == base


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_huge_repetition_penalty_never_repeats_a_forced_token(ouro_rv1, mode):
    """Greedy with a repetition penalty so large that a seen token is never taken again: the
    forced ids (here tokens the model favours: the ones a run without a budget takes next)
    are seen tokens too, so none comes again after them."""
    never = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, repetition_penalty=1e4)
    _, plain = run_mode(ouro_rv1, PROMPTS, [never] * len(PROMPTS), **ENGINE_MODES[mode])
    params = []
    for i in range(len(PROMPTS)):
        favoured = plain.tokens[f"r{i}"]
        params.append(
            never.replace(
                max_thinking_tokens=1,
                thinking_interruption=tuple(favoured[1:4]),
                thinking_end_token_ids=(favoured[4],),
            )
        )
    _, run = run_mode(ouro_rv1, PROMPTS, params, **ENGINE_MODES[mode])
    for i, prompt in enumerate(PROMPTS):
        out = run.tokens[f"r{i}"]
        assert out[1:5] == plain.tokens[f"r{i}"][1:5]  # (the forced ids)
        assert len(set(out)) == len(out) and not set(out) & set(prompt), i
