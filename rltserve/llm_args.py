"""vLLM's ``EngineArgs`` and ``AsyncEngineArgs``: ``LLM``'s keyword arguments held as one object,
so that ``AsyncLLM.from_engine_args(AsyncEngineArgs(model=..., max_model_len=...))`` (and
``AsyncLLMEngine``'s) ports unchanged. vLLM's are dataclasses of its ~150 engine settings; here
an object holds the arguments it was given, as attributes, and the engine checks them as
``LLM(...)`` does when it is built.
"""

from __future__ import annotations

import inspect
from functools import cache
from typing import Any

from rltserve.vllm_args import INERT


@cache
def _llm_defaults() -> dict[str, Any]:
    """``LLM``'s named keyword arguments and their defaults (imported when first asked: the
    engine, and torch, load with it)."""
    from rltserve.llm import LLM

    params = inspect.signature(LLM.__init__).parameters.values()
    return {
        p.name: p.default
        for p in params
        if p.name != "self" and p.kind is not inspect.Parameter.VAR_KEYWORD
    }


class EngineArgs:
    """``LLM``'s keyword arguments (``model`` first, as vLLM's), and vLLM's engine arguments
    ``LLM`` accepts (``vllm_args.INERT``: ``enable_prefix_caching``, ``disable_log_stats``, ...).
    A name ``LLM`` does not take is a TypeError now, as a dataclass's unexpected keyword; values
    are checked when the engine is built. An argument left out reads as ``LLM``'s default.
    ``LLM(**vars(args))`` builds an ``LLM`` from it; ``AsyncLLM.from_engine_args(args)`` an
    ``AsyncLLM``."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        named = _llm_defaults()
        for name in kwargs:
            if name not in named and name not in INERT:
                raise TypeError(
                    f"{type(self).__name__}.__init__() got an unexpected keyword argument "
                    f"{name!r} (LLM's keyword arguments and the vLLM ones it accepts)"
                )
        self.model = model
        self.__dict__.update(kwargs)

    def __getattr__(self, name: str) -> Any:
        # (only for names not set: LLM's default of an argument left out)
        named = _llm_defaults()
        if name in named:
            return named[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __repr__(self) -> str:
        given = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({given})"

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return vars(self) == vars(other)

    __hash__ = None  # (mutable, as vLLM's dataclass)


class AsyncEngineArgs(EngineArgs):
    """vLLM's ``AsyncEngineArgs``: the same arguments (vLLM's logging switches among them:
    ``enable_log_requests``, ``disable_log_requests``)."""
