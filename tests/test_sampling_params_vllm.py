"""vLLM's SamplingParams as rltserve takes them: its names (``thinking_token_budget``,
``best_of``, ``output_kind``, ``skip_clone``), its temperature range and floor, ``from_optional``,
and NumPy numbers as RL code passes them."""

from __future__ import annotations

import pytest

from rltserve.sampling import SamplingParams


def test_numpy_scalars_are_taken_as_plain_numbers():
    """vLLM's params keep a NumPy seed or temperature (RL code draws them from arrays): they are
    taken as the int or float they hold, and a NumPy bool is still no int."""
    import numpy as np

    kw = {"max_tokens": 8, "seed": 7, "top_k": 5, "n": 2, "logprobs": 1, "min_loops": 2}
    params = SamplingParams(
        **{k: np.int64(v) for k, v in kw.items()},
        temperature=np.float32(0.5),
        top_p=np.float16(0.5),
        thinking_token_budget=np.int32(4),
    )
    assert params == SamplingParams(**kw, temperature=0.5, top_p=0.5, max_thinking_tokens=4)
    assert all(type(getattr(params, k)) is int for k in kw) and type(params.top_p) is float
    assert SamplingParams(seed=np.int64(-1)).seed is None  # vLLM's "no seed"
    with pytest.raises(ValueError, match=r"top_k=np.True_: must be an int"):
        SamplingParams(top_k=np.bool_(True))


def test_logprobs_take_a_bool_as_vllm_does():
    """vLLM compares ``logprobs`` as a number: True asks for one top logprob, False for the
    sampled token's alone (0); another count field still refuses a bool."""
    assert SamplingParams(logprobs=True) == SamplingParams(logprobs=1)
    assert type(SamplingParams(logprobs=True).logprobs) is int
    assert SamplingParams(prompt_logprobs=False).prompt_logprobs == 0
    with pytest.raises(ValueError, match=r"top_k=True: must be an int"):
        SamplingParams(top_k=True)


def test_temperature_takes_vllms_range():
    # vLLM accepts any temperature >= 0 (the HTTP API keeps OpenAI's [0, 2]).
    assert SamplingParams(temperature=5.0).temperature == 5.0
    for bad in (-0.1, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="temperature="):
            SamplingParams(temperature=bad)


def test_vllms_best_of_bad_words_logits_processors_and_output_kind():
    """vLLM's fields that scripts pass: accepted where they ask for nothing rltserve lacks
    (``best_of`` equal to ``n``, empty lists, any ``output_kind``, kept as vLLM's enum), else a
    ValueError naming the field and what to use instead."""
    from rltserve.samples import expand_samples
    from rltserve.sampling import RequestOutputKind

    p = SamplingParams(best_of=1, bad_words=[], logits_processors=[], output_kind=2)
    want = (1, [], [], RequestOutputKind.FINAL_ONLY)
    assert (p.best_of, p.bad_words, p.logits_processors, p.output_kind) == want
    assert p.clone().output_kind is RequestOutputKind.FINAL_ONLY
    assert SamplingParams().output_kind is RequestOutputKind.CUMULATIVE  # (vLLM's default)
    assert SamplingParams(output_kind=RequestOutputKind.DELTA).output_kind.value == 1
    assert SamplingParams(flat_logprobs=False) == SamplingParams()
    assert SamplingParams(bad_words=None, logits_processors=None) == SamplingParams()
    four = SamplingParams(n=4, best_of=4, seed=1)
    assert [s.best_of for s in expand_samples(four)] == [None] * 4
    for kw, message in [
        ({"n": 2, "best_of": 3}, r"best_of=3: no best-of or beam search \(must be None or n=2"),
        ({"n": 3, "best_of": 2}, r"best_of=2: no best-of or beam search \(must be None or n=3"),
        ({"best_of": True}, "best_of=True: must be an int"),
        ({"bad_words": ["x"]}, r"bad_words=\['x'\]: not supported .*logit_bias"),
        ({"logits_processors": [print]}, "logits_processors=.*: not supported .*logit_bias"),
        ({"output_kind": 3}, r"output_kind=3: must be a RequestOutputKind \(0, 1 or 2\)"),
        ({"output_kind": "delta"}, "output_kind='delta': must be a RequestOutputKind"),
        ({"output_kind": True}, "output_kind=True: must be a RequestOutputKind"),
        ({"output_kind": 1.0}, "output_kind=1.0: must be a RequestOutputKind"),
        ({"flat_logprobs": True}, r"flat_logprobs=True: not supported \(False"),
    ]:
        with pytest.raises(ValueError, match=message):
            SamplingParams(**kw)


def test_a_temperature_below_vllms_floor_is_raised_to_it(caplog):
    """vLLM raises a positive temperature below 1e-2 to 1e-2 (dividing by less overflows the
    logits to inf: NaN probabilities, token 0); 0 stays greedy."""
    with caplog.at_level("WARNING", logger="rltserve.sampling"):
        tiny = SamplingParams(temperature=1e-38)
    assert (tiny.temperature, tiny.greedy) == (0.01, False)
    assert "temperature 1e-38 is below 0.01" in caplog.text
    assert SamplingParams(temperature=0.004).temperature == 0.01
    caplog.clear()
    with caplog.at_level("WARNING", logger="rltserve.sampling"):
        assert SamplingParams(temperature=0.01).temperature == 0.01
    assert not caplog.records  # (the floor itself is not raised: nothing to warn of)
    assert SamplingParams(temperature=0.0).greedy


def test_from_optional_is_vllms():
    """vLLM's classmethod: None means the default for n, penalties, temperature and top_p, and
    logit_bias keys become ints and biases are clamped to [-100, 100]."""
    p = SamplingParams.from_optional(
        n=None, temperature=None, top_p=None, repetition_penalty=None, max_tokens=3,
        logit_bias={"5": 250, 7: -101.5, 9: 2.5},
    )  # fmt: skip
    assert p == SamplingParams(max_tokens=3, logit_bias={5: 100.0, 7: -100.0, 9: 2.5})
    with pytest.raises(ValueError, match="logit_bias=.*: must map token ids to biases"):
        SamplingParams.from_optional(logit_bias={"x": 1.0})


def test_thinking_token_budget_is_vllms_name_for_max_thinking_tokens():
    """One field under two names, as the HTTP API takes them: given, read, set, cloned or
    replaced, either name is ``max_thinking_tokens``; both given must agree."""
    import dataclasses

    p = SamplingParams(thinking_token_budget=5)
    assert (p.max_thinking_tokens, p.thinking_token_budget) == (5, 5)
    assert p == SamplingParams(max_thinking_tokens=5)
    assert SamplingParams(max_thinking_tokens=4).thinking_token_budget == 4
    assert SamplingParams(thinking_token_budget=5, max_thinking_tokens=5).max_thinking_tokens == 5
    q = p.clone()
    q.thinking_token_budget = 7  # (RL code sets a field on a clone of its template)
    assert (q.max_thinking_tokens, p.max_thinking_tokens) == (7, 5)
    assert q.clone().thinking_token_budget == 7
    assert dataclasses.replace(q, n=2).thinking_token_budget == 7
    assert p.replace(max_thinking_tokens=None).thinking_token_budget is None
    # dataclasses.replace changes the budget too (an InitVar alias would bring the old back)
    assert dataclasses.replace(p, max_thinking_tokens=None).max_thinking_tokens is None
    assert dataclasses.replace(p, max_thinking_tokens=9).thinking_token_budget == 9
    with pytest.raises(ValueError, match="^thinking_token_budget: an alias of max_thinking_tok"):
        SamplingParams(thinking_token_budget=5, max_thinking_tokens=4)
    assert SamplingParams(thinking_token_budget=0).max_thinking_tokens == 0
    with pytest.raises(ValueError, match="max_thinking_tokens=-2: must be >= 0"):
        SamplingParams(thinking_token_budget=-2)


def test_vllms_skip_clone_is_accepted_without_effect():
    """vLLM's hint that its engine may skip copying the params: rltserve copies them anyway."""
    p = SamplingParams(skip_clone=True, max_tokens=3)
    assert p.skip_clone and p.clone() == p and p.clone() is not p
    assert SamplingParams().skip_clone is False
    with pytest.raises(ValueError, match="skip_clone=1: must be a bool"):
        SamplingParams(skip_clone=1)


def test_a_thinking_budget_of_minus_one_is_no_bound_as_vllms():
    """vLLM's ``thinking_token_budget=-1`` is "unlimited" (its validator maps it to None): a
    config ported from vLLM that sends it runs unbounded rather than being refused."""
    assert SamplingParams(thinking_token_budget=-1).max_thinking_tokens is None
    assert SamplingParams(max_thinking_tokens=-1).thinking_token_budget is None
    p = SamplingParams(max_thinking_tokens=5)
    p.thinking_token_budget = -1  # (set on a template, then validated by each call's copy)
    assert p.clone().max_thinking_tokens is None
    for bad in (-2, -3):
        with pytest.raises(ValueError, match=rf"={bad}: must be >= 0 \(-1: no bound\)"):
            SamplingParams(thinking_token_budget=bad)
    with pytest.raises(ValueError, match=r"max_thinking_tokens=-1.0: must be an int"):
        SamplingParams(max_thinking_tokens=-1.0)  # (only the int -1 is vLLM's "unlimited")
