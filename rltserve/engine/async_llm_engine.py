"""vLLM's ``vllm.engine.async_llm_engine``: ``from rltserve.engine.async_llm_engine import
AsyncLLMEngine`` (``AsyncLLM``, as in vLLM V1)."""

from __future__ import annotations

from rltserve.async_llm import AsyncLLM as AsyncLLMEngine

__all__ = ["AsyncLLMEngine"]
