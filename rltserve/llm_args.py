"""vLLM's ``EngineArgs`` and ``AsyncEngineArgs``: ``LLM``'s keyword arguments held as one object,
so that vLLM's scripts port unchanged: ``AsyncLLM.from_engine_args(AsyncEngineArgs(model=...))``,
``LLM(**dataclasses.asdict(EngineArgs(model=..., max_model_len=...)))``, and the command lines of
its examples (``EngineArgs.add_cli_args(parser)`` then ``LLM(**vars(parser.parse_args()))`` or
``EngineArgs.from_cli_args(args)``). vLLM's are dataclasses of its ~150 engine settings; these
are dataclasses of ``LLM``'s named arguments (its signature is the one source of their names
and defaults), and take vLLM's engine arguments ``LLM`` accepts as well (``vllm_args.INERT``:
``disable_log_stats``, ``load_format``, ...), checked on construction: each value accepted
changes nothing, so ``asdict`` (the fields only) leaves them out and loses nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
from typing import Any

from rltserve.engine_args import add_engine_args
from rltserve.llm import LLM
from rltserve.utils.argparse_utils import json_object_arg
from rltserve.vllm_args import INERT, check_inert

# ``LLM``'s named keyword arguments, in its order (``model`` first, as vLLM's).
_PARAMETERS = [
    p
    for p in inspect.signature(LLM.__init__).parameters.values()
    if p.name != "self" and p.kind is not inspect.Parameter.VAR_KEYWORD
]


def _as_dataclass(cls: type) -> type:
    """``cls`` made a dataclass whose fields are ``LLM``'s named arguments, with its defaults
    (none is mutable); ``cls``'s own ``__init__``, ``__repr__`` and ``__eq__`` stay."""
    cls.__annotations__ = {p.name: p.annotation for p in _PARAMETERS}
    for p in _PARAMETERS:
        setattr(cls, p.name, p.default)
    return dataclasses.dataclass(init=False, repr=False, eq=False)(cls)


@_as_dataclass
class EngineArgs:
    """``LLM``'s keyword arguments (``model`` first, as vLLM's), and vLLM's engine arguments
    ``LLM`` accepts (``vllm_args.INERT``: ``enable_prefix_caching``, ``disable_log_stats``, ...;
    a value ``LLM`` would refuse is a ValueError now). Another name is a TypeError, as a
    dataclass's unexpected keyword; the values of ``LLM``'s own are checked when the engine is
    built. ``LLM(**vars(args))`` and ``LLM(**dataclasses.asdict(args))`` build an ``LLM`` from
    it; ``AsyncLLM.from_engine_args(args)`` an ``AsyncLLM``."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        fields = {f.name for f in dataclasses.fields(self)}
        for name in kwargs:
            if name not in fields and name not in INERT:
                raise TypeError(
                    f"{type(self).__name__}.__init__() got an unexpected keyword argument "
                    f"{name!r} (LLM's keyword arguments and the vLLM ones it accepts)"
                )
        check_inert({k: v for k, v in kwargs.items() if k not in fields})
        self.model = model
        self.__dict__.update(kwargs)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """vLLM's: adds the engine flags to ``parser`` (``rltserve generate``'s: ``--model``,
        ``--max-model-len``, ``--max-num-seqs``, ... and vLLM's spellings it accepts) and returns
        it. Each engine flag's value is ``LLM``'s argument of that name, its default when not
        given; vLLM's flags are in the namespace only when given, so that
        ``LLM(**vars(parser.parse_args()))`` runs (after the script pops its own flags)."""
        add_engine_args(parser, vllm_default=argparse.SUPPRESS)
        _add_llm_flags(parser)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """vLLM's: the arguments of an ``add_cli_args`` parser's namespace (its other
        attributes, the script's own flags, are left out)."""
        names = [f.name for f in dataclasses.fields(cls)] + list(INERT)
        return cls(**{name: getattr(args, name) for name in names if hasattr(args, name)})

    def __repr__(self) -> str:
        # (the arguments that differ from LLM's defaults: fifty fields would hide them)
        defaults = {p.name: p.default for p in _PARAMETERS}
        given = ", ".join(
            f"{k}={v!r}"
            for k, v in vars(self).items()
            if k == "model" or k not in defaults or v != defaults[k]
        )
        return f"{type(self).__name__}({given})"

    def __eq__(self, other: object) -> bool:
        # (every field, as a dataclass compares them: an argument given at LLM's default, or
        # set by ``dataclasses.replace``, equals one left out; then the vLLM ones given)
        if type(other) is not type(self):
            return NotImplemented
        return _compared(self) == _compared(other)

    __hash__ = None  # (mutable, as vLLM's dataclass)


def _compared(args: EngineArgs) -> dict[str, Any]:
    return {**{f.name: getattr(args, f.name) for f in dataclasses.fields(args)}, **vars(args)}


class AsyncEngineArgs(EngineArgs):
    """vLLM's ``AsyncEngineArgs``: the same arguments (vLLM's logging switches among them:
    ``enable_log_requests``, ``disable_log_requests``)."""


def _add_llm_flags(parser: argparse.ArgumentParser) -> None:
    """vLLM's flags of the ``LLM`` arguments that no engine command has (``serve`` has its own
    ``--generation-config``), in the namespace only when given, as vLLM's other flags."""
    group = parser.add_argument_group("LLM's other arguments (vLLM's flags)")
    unset = argparse.SUPPRESS
    group.add_argument(
        "--generation-config",
        default=unset,
        help="sampling defaults: 'auto' the checkpoint's generation_config.json, 'vllm' "
        "vLLM's own, or a folder holding one",
    )
    group.add_argument(
        "--override-generation-config",
        type=json_object_arg,
        default=unset,
        help="sampling defaults over --generation-config's, a JSON object",
    )
    group.add_argument(
        "--max-logprobs", type=int, default=unset, help="the most logprobs a request may ask for"
    )
    group.add_argument(
        "--skip-tokenizer-init",
        action=argparse.BooleanOptionalAction,
        default=unset,
        help="no tokenizer: prompts are token ids and outputs have no text",
    )
