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
