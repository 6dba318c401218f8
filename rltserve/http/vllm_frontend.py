"""vLLM's ``vllm serve`` flags that have no ``ServerConfig`` field, so that a deployment's
command line ports with only the binary's name changed: those rltserve can go without are
taken and the start-up log says they change nothing; those it cannot honour are a usage error
saying what to do instead, never argparse's bare "unrecognized arguments"."""

from __future__ import annotations

import argparse

# flag -> (its argparse options, why it changes nothing here: the start-up log's line)
IGNORED: dict[str, tuple[dict, str]] = {
    "--disable-frontend-multiprocessing": (
        {"action": "store_true"},
        "the engine always runs in its own worker process, apart from the API server's",
    ),
    "--otlp-traces-endpoint": (
        {"metavar": "URL"},
        "no OpenTelemetry traces are exported (the /metrics series and --enable-log-requests' "
        "lines remain)",
    ),
    "--collect-detailed-traces": (
        {"metavar": "MODULES"},
        "no OpenTelemetry traces are exported",
    ),
}
# flag -> (its argparse options, why it is refused and what to do instead)
REFUSED: dict[str, tuple[dict, str]] = {
    "--lora-modules": (
        {"nargs": "+", "metavar": "NAME=PATH"},
        "LoRA adapters are not supported; merge the adapter into its base model (as peft's "
        "merge_and_unload does), and serve that checkpoint under the adapter's name with "
        "--served-model-name",
    ),
    "--enable-ssl-refresh": (
        {"action": "store_true"},
        "the TLS certificate and key load once, at start; restart the server (roll the pods) to "
        "serve renewed ones",
    ),
    "--tool-parser-plugin": (
        {"metavar": "PATH"},
        "no tool parser plugins; --tool-call-parser takes the built-in parsers",
    ),
}


def _dest(flag: str) -> str:
    return flag[2:].replace("-", "_")


def add_vllm_frontend_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("vLLM's server flags rltserve has no use for")
    for flag, (options, why) in IGNORED.items():
        group.add_argument(
            flag, default=None, help=f"vLLM's; accepted, no effect: {why}", **options
        )
    for flag, (options, why) in REFUSED.items():
        group.add_argument(flag, default=None, help=f"vLLM's; refused: {why}", **options)


def _given(args: argparse.Namespace, flag: str) -> object:
    return getattr(args, _dest(flag), None) or None  # (store_true's False: not given)


def check_vllm_frontend_args(args: argparse.Namespace) -> None:
    """ValueError for the first refused flag given, naming it and what to do."""
    for flag, (_, why) in REFUSED.items():
        value = _given(args, flag)
        if value is not None:
            shown = value if isinstance(value, list) else [] if value is True else [value]
            raise ValueError(" ".join([flag, *shown]) + f": not supported: {why}")


def ignored_vllm_frontend_args(args: argparse.Namespace) -> list[str]:
    """The start-up log's line for each accepted flag given that changes nothing."""
    return [
        f"{flag}: has no effect: {why}"
        for flag, (_, why) in IGNORED.items()
        if _given(args, flag) is not None
    ]
