"""Engine flags for every command that builds an engine (``generate``, ``serve``, ``bench
offline``): one flag per field of the engine config dataclasses (``--max-num-seqs`` from
``SchedulerConfig.max_num_seqs``), so names and help texts have one source; and vLLM's flags of
the arguments ``LLM`` takes as vLLM's (``vllm_args.FLAGS``), accepted where their values ask
for nothing rltserve lacks, as ``LLM`` accepts them, so a ``vllm serve`` line ports unchanged.

Below both CLIs (``rltserve.cli`` and ``rltserve.http.cli`` import it, it imports neither) and
torch-free: argparse, the configs and the preflight checks only.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import types
import typing
from collections.abc import Callable
from decimal import Decimal
from typing import Any

from rltserve.config import CacheConfig, ExecutionConfig, ModelConfig, SchedulerConfig
from rltserve.preflight import check_engine, resolve_dtype, resolve_model, resolve_tokenizer
from rltserve.vllm_args import (
    FLAGS,
    INERT,
    NAMED,
    SHORT_FLAGS,
    check_flags,
    pool_kv_cache_gb,
)

ENGINE_CONFIGS = (ModelConfig, CacheConfig, SchedulerConfig, ExecutionConfig)
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def human_readable_int(text: str) -> int:
    """vLLM's token counts: an int, or a number with a suffix, decimal k, m, g, t (25.6k is
    25600) or binary K, M, G, T (1K is 1024; whole numbers only)."""
    value = text.strip()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgtKMGT])", value)
    if match is None:
        try:
            return int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"invalid int value: {text!r} (e.g. 2048, 2k, 25.6k or 2K)"
            ) from None
    number, suffix = match.groups()
    if suffix in _DECIMAL:  # (in decimal arithmetic: float's would make 1.001k 1000)
        count = Decimal(number) * _DECIMAL[suffix]
        if count != count.to_integral_value():
            raise argparse.ArgumentTypeError(f"{text!r}: not a whole number of tokens")
        return int(count)
    if "." in number:
        raise argparse.ArgumentTypeError(
            f"{text!r}: a binary suffix takes a whole number (did you mean "
            f"{number}{suffix.lower()}?)"
        )
    return int(number) * _BINARY[suffix]


def human_readable_int_or_auto(text: str) -> int:
    """``human_readable_int``, or vLLM's -1 or ``auto``: the model's context (what the KV pool
    holds of it, ``ModelConfig``)."""
    return -1 if text.strip().lower() in ("-1", "auto") else human_readable_int(text)


# The fields whose flags take vLLM's human-readable values (its own special cases).
_FIELD_PARSERS: dict[str, Callable[[str], int]] = {
    "max_model_len": human_readable_int_or_auto,
    "max_num_batched_tokens": human_readable_int,
}


def _flag_type(hint: object) -> type:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and args:
        hint = args[0]
    return hint if hint in (int, float, str) else str


class BoolFlag(argparse.BooleanOptionalAction):
    """``--flag`` / ``--no-flag`` with its help as given: Python 3.10's action appends its own
    " (default: ...)" to a flag with a default, which the help here states already (3.11 on
    append nothing)."""

    def __init__(self, *args: Any, help: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, help=help, **kwargs)
        self.help = help


def add_dataclass_args(
    parser: argparse.ArgumentParser, cls: type, title: str, keep_defaults: bool = False
) -> None:
    """One flag per field of dataclass ``cls`` (``--snake-name``, and the names in its
    metadata's ``aliases``), help from its metadata (and its ``nargs``: ``"+"`` takes several
    values); a field whose metadata says ``cli=False`` has none. A flag's default is the
    field's with ``keep_defaults``, else None, so that ``dataclass_kwargs`` passes only what
    was set."""
    group = parser.add_argument_group(title)
    hints = typing.get_type_hints(cls)
    for f in _flagged(cls):
        flags = ["--" + f.name.replace("_", "-"), *f.metadata.get("aliases", ())]
        help_text = f.metadata.get("help", "")
        if f.default is not None:
            help_text += f" (default: {f.default})"
        default = f.default if keep_defaults else None
        if hints[f.name] in (bool, bool | None):
            action = BoolFlag
            group.add_argument(*flags, dest=f.name, action=action, default=default, help=help_text)
        else:
            kind = _FIELD_PARSERS.get(f.name) or _flag_type(hints[f.name])
            nargs = {"nargs": f.metadata["nargs"]} if "nargs" in f.metadata else {}
            group.add_argument(
                *flags, dest=f.name, type=kind, default=default, help=help_text, **nargs
            )


def dataclass_kwargs(args: argparse.Namespace, cls: type) -> dict:
    """The fields of ``cls`` whose flags were given (``add_dataclass_args``)."""
    return {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(cls)
        if getattr(args, f.name, None) is not None
    }


def add_engine_args(parser: argparse.ArgumentParser, vllm_default: object = None) -> None:
    """Adds one flag per engine config field, with the field's default; except
    ``--kv-cache-gb``, None unless given: an explicit size wins over
    ``--gpu-memory-utilization``, as ``LLM``'s ``kv_cache_gb`` does (``checked_engine_kwargs``
    resolves it; ``engine_kwargs`` gives the field's default). ``vllm_default``: as
    ``add_vllm_args``'."""
    for cls in ENGINE_CONFIGS:
        add_dataclass_args(parser, cls, cls.__name__, keep_defaults=True)
    parser.set_defaults(kv_cache_gb=None)
    add_vllm_args(parser, vllm_default)


def add_vllm_args(parser: argparse.ArgumentParser, default: object = None) -> None:
    """vLLM's engine flags (``vllm_args.FLAGS``), each ``default`` unless given (None; or
    ``argparse.SUPPRESS``: not in the namespace, for ``EngineArgs.add_cli_args``); one the
    command already has (``serve``'s ``--disable-log-stats``) is left to it.
    ``checked_engine_kwargs`` refuses a value that asks for what rltserve lacks."""
    group = parser.add_argument_group("vLLM's engine flags (vllm serve's spellings)")
    for name, kind in FLAGS.items():
        flag = "--" + name.replace("_", "-")
        if flag in parser._option_string_actions:
            continue
        why = (NAMED.get(name) or INERT[name])[1]
        if callable(why):  # (the reason depends on the value)
            refused = " (else refused, saying why)"
        else:
            refused = f" (else refused: {why})" if why else ""
        help_text = "accepted where the value asks for nothing rltserve lacks" + refused
        if kind is bool:
            action = argparse.BooleanOptionalAction
            group.add_argument(flag, dest=name, action=action, default=default, help=help_text)
        else:
            short = (SHORT_FLAGS[name],) if name in SHORT_FLAGS else ()
            group.add_argument(flag, *short, dest=name, type=kind, default=default, help=help_text)


def vllm_flags(args: argparse.Namespace) -> dict[str, object]:
    """The ``add_vllm_args`` flags given."""
    return {name: getattr(args, name) for name in FLAGS if getattr(args, name, None) is not None}


def engine_kwargs(args: argparse.Namespace) -> dict:
    """Every engine field's flag (one not given: the field's default)."""
    return {
        f.name: f.default if getattr(args, f.name) is None else getattr(args, f.name)
        for cls in ENGINE_CONFIGS
        for f in _flagged(cls)
    }


def _flagged(cls: type) -> list[dataclasses.Field]:
    """The fields with a flag (``metadata["cli"]`` False: an offline API setting only)."""
    return [f for f in dataclasses.fields(cls) if f.metadata.get("cli", True)]


def checked_engine_kwargs(args: argparse.Namespace, **as_run: object) -> dict:
    """``engine_kwargs`` after the cheap checks (config, checkpoint path, device): bad flags
    fail here as usage errors, before a model loads. ``as_run`` overrides what the command
    changes before it builds engines. The chunk size is capped at the step's token budget, as
    ``LLM`` does, so a smaller ``--max-num-batched-tokens`` alone is valid. A Hugging Face repo
    id (``--model``, ``--tokenizer``) becomes its snapshot in the local cache (at
    ``--revision``, in ``--download-dir``), as ``LLM`` resolves it; those two are then spent
    (None), so that ``LLM(**kw)`` takes the directories as they are. ``kv_cache_gb`` is the
    pool's size as ``LLM`` finds it (``vllm_args.pool_kv_cache_gb``: on CUDA, what
    ``--gpu-memory-utilization`` leaves, unless ``--kv-cache-gb`` or ``--num-blocks`` is
    given). vLLM's flags are checked (``vllm_args.check_flags``); ``--enforce-eager`` turns
    CUDA graphs off, as ``LLM``'s ``enforce_eager``."""
    kw = engine_kwargs(args)
    vllm = vllm_flags(args)
    check_flags(vllm, replicas=hasattr(args, "replicas"))  # (its refusals name --replicas N)
    if vllm.get("enforce_eager"):
        kw["cuda_graphs"] = False
    if kw["exit_mode"] == "trace":
        raise ValueError(
            "--exit-mode trace: replays the exit depths each request gives "
            "(SamplingParams.trace_depths, offline API only); no command can give them"
        )
    given, revision, cache_dir = kw["model"], kw["revision"], kw["download_dir"]
    if given is not None:
        kw["model"] = resolve_model(given, revision, cache_dir)
    elif revision is not None:
        raise ValueError(f"--revision {revision}: only for a Hugging Face repo id as --model")
    if kw["tokenizer"] is not None:
        at = revision if kw["tokenizer"] == given else None  # (LLM's rule)
        kw["tokenizer"] = resolve_tokenizer(kw["tokenizer"], at, cache_dir)
    kw["revision"] = None  # (the model's: resolved above; download_dir stays for updates)
    kw["prefill_chunk_size"] = min(kw["prefill_chunk_size"], kw["max_num_batched_tokens"])
    kw["dtype"] = resolve_dtype(kw["dtype"], kw["model"])
    config = check_engine({**kw, **as_run})  # (the device is there before it is measured)
    kw["kv_cache_gb"] = pool_kv_cache_gb(config, args.kv_cache_gb)
    return kw
