"""``LiveRequest`` (``live.py``): what the runner keeps of a request between steps. The sampled
history that penalties read holds every token the request sampled, also across a preemption
(a resumed request's history starts from the tokens it had)."""

from __future__ import annotations

from engine_util import make_core, oracle_run, run_core, run_mode

from rltserve.sampling import SamplingParams

# A repetition penalty this large leaves every seen token's logit at ~0 or far below: greedy
# takes an unseen token while any has a positive logit (always, in these short runs).
NO_REPEATS = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, repetition_penalty=1e4)
PROMPTS = [[(5 * i + k) % 300 + 1 for k in range(3 + i)] for i in range(4)]


def _unseen(run, prompts) -> None:
    for i, prompt in enumerate(prompts):
        tokens = run.tokens[f"r{i}"]
        assert len(tokens) == len(set(tokens)) == 16, f"request {i}"
        assert not set(tokens) & set(prompt), f"request {i}"


def test_the_penalty_history_holds_every_sampled_token(ckpts, ouro_ref):
    """Greedy with a huge repetition penalty never takes a token it has seen, its own
    outputs included (the history grows as it samples)."""
    run = run_core(make_core(ckpts["ouro"]), PROMPTS, [NO_REPEATS] * len(PROMPTS))
    _unseen(run, PROMPTS)
    # (Without the penalty the model repeats itself.)
    free = oracle_run(ouro_ref, PROMPTS[0], NO_REPEATS.replace(repetition_penalty=1.0)).tokens
    assert len(set(free)) < len(free)


def test_a_resumed_request_keeps_its_penalty_history(ckpts):
    """Preempted and recomputed again and again, a request resumes with the tokens it had in
    its history: the same tokens as an unpressured run, none repeated."""
    params = [NO_REPEATS] * len(PROMPTS)
    core, run = run_mode(ckpts["ouro"], PROMPTS, params, preemption_mode="recompute")
    assert core.stats().num_preemptions > 0
    _unseen(run, PROMPTS)
    assert run.tokens == run_core(make_core(ckpts["ouro"]), PROMPTS, params).tokens


def test_forced_ids_join_the_history_once_as_they_enter_as_inputs():
    """Bounded thinking's forced ids reach the runner only as recorded inputs (a replay item's
    ``token_ids`` from ``start``): the outputs among them that the history lacks join it, in
    order, each once; a prompt chunk adds nothing, nor does a replay after preemption (its
    history holds them already). Prompt [1, 2, 3]: output j is the input at 3 + j."""
    from types import SimpleNamespace

    from rltserve.core.live import LiveRequest

    def live(history: list[int]) -> LiveRequest:
        return LiveRequest(SimpleNamespace(prompt_token_ids=[1, 2, 3]), None, history=history)

    budget_1 = live([7])  # (the K-th token sampled; forced 40, 41, 300 follow)
    budget_1.record_inputs(3, [7, 40, 41])
    budget_1.record_inputs(6, [300])
    assert budget_1.history == [7, 40, 41, 300]
    budget_1.record_inputs(3, [7, 40, 41])  # (replayed after a preemption)
    assert budget_1.history == [7, 40, 41, 300]
    budget_0 = live([])  # (forced before the first output)
    budget_0.record_inputs(0, [1, 2, 3])
    budget_0.record_inputs(3, [40, 41])
    assert budget_0.history == [40, 41]
    behind = live([7])  # (inputs past outputs the history does not hold yet: not its next)
    behind.record_inputs(5, [40, 41])
    assert behind.history == [7]
    unpenalized = live(None)  # (no penalties: no history kept)
    unpenalized.record_inputs(3, [7, 40])
    assert unpenalized.history is None
