"""vLLM's ``vllm.v1.engine.async_llm``: ``from rltserve.v1.engine.async_llm import AsyncLLM``."""

from __future__ import annotations

from rltserve.async_llm import AsyncLLM

__all__ = ["AsyncLLM"]
