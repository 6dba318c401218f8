"""Values as callers hand them over, made plain or checked before any field check: NumPy
numbers (token ids from an array, as RL code has them) as Python's, and token ids against the
vocabulary (a message naming the field); and the type checks ``SamplingParams``' fields share."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence


def plain_number(value: object) -> object:
    """A NumPy integer (token ids from an array, as RL code has them) as the int it holds, a
    NumPy float as a float; anything else as it is, for the field's check to judge."""
    if isinstance(value, (int, float)):  # (bool too: the checks refuse it)
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return value


# SamplingParams' scalar number fields. vLLM's msgspec params keep whatever they are given, so
# RL code passes ``seed=rng.integers(...)`` or a float32 temperature: taken as Python's numbers
# (``plain_fields``) before the int and number checks, which would refuse NumPy's.
NUMBER_FIELDS = (
    *("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty"),
    *("presence_penalty", "frequency_penalty", "seed", "min_tokens", "min_loops", "max_loops"),
    *("exit_threshold", "priority", "logprobs", "n", "max_thinking_tokens", "prompt_logprobs"),
    *("truncate_prompt_tokens", "best_of"),
)


# The counts vLLM takes a bool for, as the int it is (``logprobs=True``: 1, ``False``: 0, the
# sampled token's alone), since its msgspec params keep the value and compare it as a number.
BOOL_COUNT_FIELDS = ("logprobs", "prompt_logprobs")


def plain_fields(obj: object, names: Sequence[str] = NUMBER_FIELDS) -> None:
    """``obj``'s fields ``names`` as ``plain_number`` makes them (set with object's
    ``__setattr__``: no setter side effects, such as SamplingParams' threshold bookkeeping),
    a bool in ``BOOL_COUNT_FIELDS`` as its int."""
    for name in names:
        value = plain_number(getattr(obj, name))
        if name in BOOL_COUNT_FIELDS and isinstance(value, bool):
            value = int(value)
        object.__setattr__(obj, name, value)


def at_prompt(index: int, size: int) -> str:
    """What a refusal of prompt ``index`` of a call's ``size`` prompts adds to its message (the
    offline ``LLM``'s and the server's): in a batch of thousands the message alone does not
    find the prompt. One prompt: nothing."""
    return f" (prompt index {index})" if size > 1 else ""


def outside_vocab(name: str, ids: Sequence[int], vocab_size: int) -> str | None:
    """The message for the first of ``ids`` (the field ``name``'s) outside the vocabulary."""
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is None:
        return None
    return f"{name}: token id {bad} is outside the vocabulary [0, {vocab_size})"


def is_int(value: object) -> bool:
    """An int, but not a bool (``True`` is no count)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_token_id(value: object) -> bool:
    return is_int(value) and value >= 0


def is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)


def check_int(obj: object, name: str) -> None:
    value = getattr(obj, name)
    if not is_int(value):
        raise ValueError(f"{name}={value!r}: must be an int")


def check_number(obj: object, name: str) -> None:
    value = getattr(obj, name)
    if not is_number(value):
        raise ValueError(f"{name}={value!r}: must be a number")


def nonempty(value: object) -> bool:
    """Whether an optional list field asks for something (a value that is no list does)."""
    return value is not None and not (isinstance(value, (list, tuple)) and not value)
