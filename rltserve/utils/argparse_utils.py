"""vLLM's ``vllm.utils.argparse_utils``: ``FlexibleArgumentParser``, the parser its example
scripts build their command lines with; and ``json_object_arg``, the type of rltserve's flags
that take a JSON object."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

__all__ = ["FlexibleArgumentParser"]


class FlexibleArgumentParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` that takes a long flag with underscores as with dashes
    (``--max_model_len 4096`` is ``--max-model-len 4096``), as vLLM's."""

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        import sys

        given = sys.argv[1:] if args is None else list(args)
        return super().parse_known_args(_dashed(given), namespace)


def _dashed(args: list[str]) -> list[str]:
    """``--a_b`` and ``--a_b=v`` as ``--a-b`` and ``--a-b=v``; values, what follows a flag's
    ``=``, and everything after a bare ``--`` (positional arguments) as they are. An argument
    whose name part holds whitespace is no flag: argparse takes it as a value (a prompt such
    as ``"--- title_case ---"``), so it keeps its underscores."""
    out = []
    for i, arg in enumerate(args):
        if arg == "--":
            return out + args[i:]
        if arg.startswith("--"):
            flag, eq, value = arg.partition("=")
            if not any(c.isspace() for c in flag):
                arg = flag.replace("_", "-") + eq + value
        out.append(arg)
    return out


def json_object_arg(text: str) -> dict:
    """A flag's JSON object (``--chat-template-kwargs``, ``--override-generation-config``);
    argparse's usage error for anything else."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r}: must be a JSON object")
    return value
