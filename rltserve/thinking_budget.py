"""vLLM's ``thinking_token_budget``: another name for ``SamplingParams.max_thinking_tokens``,
taken by the constructor and read or set as a property (``add_budget_alias``), and the one rule
for the two given together (``thinking_budget``; HTTP bodies use it too)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

THINKING_BUDGET_ALIAS = "thinking_token_budget"


def _with_budget_alias(init: Callable[..., None]) -> Callable[..., None]:
    """The dataclass's ``__init__`` taking vLLM's ``thinking_token_budget`` too, for
    ``max_thinking_tokens``. Not a field (nor an InitVar, which ``dataclasses.replace`` would
    fill from the property below, bringing the old budget back)."""

    @functools.wraps(init)
    def __init__(self, *args: Any, thinking_token_budget: int | None = None, **kwargs: Any):
        if thinking_token_budget is not None:
            given = kwargs.get("max_thinking_tokens")
            kwargs["max_thinking_tokens"] = thinking_budget(given, thinking_token_budget)
        init(self, *args, **kwargs)

    return __init__


def add_budget_alias(cls: type) -> None:
    """Gives ``cls`` (SamplingParams) the alias: a constructor keyword and a property."""
    cls.__init__ = _with_budget_alias(cls.__init__)  # type: ignore[method-assign]
    cls.thinking_token_budget = property(  # type: ignore[attr-defined]
        lambda self: self.max_thinking_tokens,
        lambda self, value: setattr(self, "max_thinking_tokens", value),
        doc="vLLM's name for ``max_thinking_tokens``.",
    )


def thinking_budget(
    max_thinking_tokens: int | None, thinking_token_budget: int | None
) -> int | None:
    """The thinking budget given as ``max_thinking_tokens`` or as its alias (either may be
    None); ValueError where both are given and differ."""
    if thinking_token_budget is None:
        return max_thinking_tokens
    if max_thinking_tokens is not None and max_thinking_tokens != thinking_token_budget:
        raise ValueError(f"{THINKING_BUDGET_ALIAS}: an alias of max_thinking_tokens; they disagree")
    return thinking_token_budget
