"""vLLM's ``vllm.engine.arg_utils``: ``from rltserve.engine.arg_utils import AsyncEngineArgs``."""

from __future__ import annotations

from rltserve.llm_args import AsyncEngineArgs, EngineArgs

__all__ = ["AsyncEngineArgs", "EngineArgs"]
