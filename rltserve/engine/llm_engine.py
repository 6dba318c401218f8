"""vLLM's ``vllm.engine.llm_engine.LLMEngine`` (top-level ``rltserve.LLMEngine`` too): vLLM's
step-wise engine, driven by its caller (``add_request``, ``step``,
``has_unfinished_requests``). rltserve has none: its engine runs its own loop in its stage.
The name imports, so that a script ported from vLLM fails where it makes one, with a
ValueError naming what does the same work."""

from __future__ import annotations

from typing import Any, NoReturn

__all__ = ["LLMEngine"]

_INSTEAD = (
    "LLMEngine: not supported: rltserve's engine runs its own step loop; for a batch use "
    "LLM(**vars(args)).generate(prompts, params), for requests added one at a time with their "
    "outputs as they come, AsyncLLM.from_engine_args(args) and its generate"
)


class LLMEngine:
    """Refused when made: see the module's docstring."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise ValueError(_INSTEAD)

    @classmethod
    def from_engine_args(cls, *args: Any, **kwargs: Any) -> NoReturn:
        raise ValueError(_INSTEAD)

    @classmethod
    def from_vllm_config(cls, *args: Any, **kwargs: Any) -> NoReturn:
        raise ValueError(_INSTEAD)
