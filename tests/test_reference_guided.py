"""The oracle's steers (``reference_guided``): bounded thinking's forced ids and a constraint's
allowed tokens, checked on their own and through ``Reference.generate``."""

from __future__ import annotations

import pytest
from reference import Reference
from reference_guided import Answer, Constraint, ThinkingBudget

PROMPT = [3, 17, 42, 7, 8]


def test_a_budget_forces_the_interruption_and_end_after_k_tokens():
    budget = ThinkingBudget(2, (40, 41), (300,))
    assert budget.forced_ids == [40, 41, 300]
    assert [budget.forced([9] * k) for k in range(6)] == [None, None, 40, 41, 300, None]
    assert budget.forced([300, 9]) is None  # (the model ended its thinking itself)
    assert budget.forced_at([9, 9, 40, 41, 300, 9]) == {2, 3, 4}
    assert ThinkingBudget(0, (), (300, 301)).forced([]) == 300
    assert ThinkingBudget(1, (40, 300), (300,)).forced_ids == [40, 300]  # (it holds the end)
    assert ThinkingBudget(-1, (40,), (300,)).forced_at([9] * 5) == set()


def test_generate_with_a_budget_equals_a_run_on_prompt_and_forced_ids(ouro_rv1):
    """At a fixed full depth a position computes the same from its inputs however they came:
    the steered run is the prompt + thinking + forced ids run, forced positions at D_r."""
    ref = Reference.load(ouro_rv1)
    depth = ref.depths(None)[1]
    for k in (0, 2):
        out = ref.generate(PROMPT, 7, steer=ThinkingBudget(k, (40, 41), (300,)))
        thinking = out.tokens[:k]
        assert thinking == ref.generate(PROMPT, k).tokens if k else not thinking
        rest = ref.generate(PROMPT + thinking + [40, 41, 300], 4 - k)
        assert out.tokens == thinking + [40, 41, 300] + rest.tokens
        assert out.exit_depths[k : k + 3] == [depth] * 3
    # Forced ids are never stops: an end id that is a stop id too goes on.
    out = ref.generate(PROMPT, 5, steer=ThinkingBudget(0, (), (300,)), stop_token_ids=(300,))
    assert out.tokens[0] == 300 and len(out.tokens) == 5


@pytest.fixture(scope="module")
def digits(tiny):
    return Constraint(tiny, 0, 512, choice=["1", "10"])


def test_a_choice_allows_the_prefixes_of_its_strings_and_then_the_end(digits):
    one, zero = 21, 20  # ("1", "0" in the tiny tokenizer)
    assert digits.text([one, zero]) == "10"
    assert digits.allowed([]) == [one]
    assert sorted(digits.allowed([one])) == [0, zero]  # (it may go on, or end)
    assert digits.allowed([one, zero]) == [0]
    assert digits.allowed([one, 0]) == [0]  # (after the end, the end)
    assert digits.first_outside([one, zero, 0]) is None
    assert digits.first_outside([one, one]) == 1


def test_a_regex_allows_its_partial_matches(tiny):
    number = Constraint(tiny, 0, 512, pattern=r"[0-9]+(\.[0-9]+)?")
    three, dot = 23, 18
    assert 0 not in number.allowed([]) and three in number.allowed([])
    assert 0 in number.allowed([three]) and dot in number.allowed([three])
    assert 0 not in number.allowed([three, dot])  # ("3." is no match yet)
    assert all(number.text([t]).isdigit() for t in number.allowed([three, dot]))
    special = Constraint(tiny, 0, 512, pattern=r"[a-z<>|/]+")
    assert not {0, 1, 2} & set(special.allowed([]))  # (special tokens: never)


def test_generate_with_a_constraint_pads_min_tokens_with_the_end(tiny, digits):
    ref = Reference.load(tiny)
    out = ref.generate(PROMPT, 8, steer=digits, min_tokens=5, eos_token_ids=ref.eos_token_ids)
    text = digits.text([t for t in out.tokens if t != 0])
    assert text in ("1", "10") and out.tokens[-1] == 0 and len(out.tokens) == 5


def test_with_a_budget_the_constraint_applies_to_the_answer_after_the_span(digits):
    """``Answer``: free thinking, the forced ids, then the constraint on the answer alone; the
    answer starts after end ids the output holds within its budget, else after the forced ids."""
    one, zero = 21, 20
    answer = Answer(ThinkingBudget(2, (40,), (300,)), digits)
    assert answer.allowed([9]) is None and answer.forced([9, 9]) == 40
    assert answer.start([9, 9, 40, 300]) == 4 and answer.allowed([9, 9, 40, 300]) == [one]
    assert answer.start([300]) == 1 and answer.allowed([300, one]) == digits.allowed([one])
    assert answer.start([9, 300, one]) == 2  # (the model closed the span at its budget)
    assert answer.first_outside([9, 9, 40, 300, one, zero, 0]) is None
    assert answer.first_outside([9, 9, 40, 300, zero]) == 4
    assert Answer(ThinkingBudget(0, (), (300,)), digits).start([300]) == 1
