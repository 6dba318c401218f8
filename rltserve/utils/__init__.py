"""vLLM's import path ``vllm.utils`` for the names its example scripts take from it:
``FlexibleArgumentParser`` (``parser = FlexibleArgumentParser();
EngineArgs.add_cli_args(parser)``; also at vLLM's newer ``vllm.utils.argparse_utils``, which
its current examples import) and ``random_uuid`` (an ``AsyncLLM.generate`` request id), so that
they run with the package name changed."""

from __future__ import annotations

import uuid

from rltserve.utils.argparse_utils import FlexibleArgumentParser

__all__ = ["FlexibleArgumentParser", "random_uuid"]


def random_uuid() -> str:
    """A random request id: 32 hex digits, as vLLM's."""
    return uuid.uuid4().hex
