"""Bounded thinking's rules before a request runs (``core/thinking.py``): the ids forced at the
budget (an interruption that holds the end ids, as vLLM's ``"Time is up.</think>"`` does, gets
no second end) and each penalty taken with a budget."""

from __future__ import annotations

import pytest

from rltserve.core.thinking import check_thinking, forced_ids
from rltserve.sampling import SamplingParams


@pytest.mark.parametrize(
    ("interruption", "end", "forced"),
    [
        ((40, 41), (4,), [40, 41, 4]),
        ((40, 41, 4), (4,), [40, 41, 4]),  # (vLLM's: the end last)
        ((4, 40), (4,), [4, 40]),
        ((40, 4, 5), (4, 5), [40, 4, 5]),
        ((40, 4), (4, 5), [40, 4, 4, 5]),  # (part of the end is not the end)
        ((), (4,), [4]),
    ],
)
def test_the_forced_ids_close_the_span_once(interruption, end, forced):
    assert forced_ids(interruption, end) == forced


@pytest.mark.parametrize("penalty", ["repetition_penalty", "presence_penalty", "frequency_penalty"])
def test_each_penalty_combines_with_a_budget(penalty):
    """The runner's penalty history takes the forced tokens too (``test_thinking_async.py``)."""
    check_thinking(
        SamplingParams(max_thinking_tokens=2, thinking_end_token_ids=(4,), **{penalty: 1.5})
    )
