"""rltserve: an inference and serving engine for looped (recurrent-depth) language models.

The public names load lazily so that torch-free modules (the scheduler, the KV manager) can be
imported without pulling in torch. vLLM's import paths of the offline API's names are modules
here too (``rltserve.inputs``, ``rltserve.sampling_params``, ``rltserve.logprobs``,
``rltserve.utils``' ``FlexibleArgumentParser``), and
``get_metrics``' classes (vLLM's ``vllm.v1.metrics.reader``) are ``rltserve.metrics_reader``'s.
vLLM's top-level ``EngineArgs``, ``AsyncEngineArgs`` and ``AsyncLLMEngine`` are here too, and
its ``LLMEngine``, a ValueError when made that says what to use instead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = [
    "LLM",
    "AsyncLLM",
    "AsyncLLMEngine",
    "AsyncEngineArgs",
    "EngineArgs",
    "CompletionOutput",
    "Counter",
    "Gauge",
    "Histogram",
    "Logprob",
    "Metric",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "StructuredOutputsParams",
    "GuidedDecodingParams",
    "TextPrompt",
    "TokensPrompt",
    "Vector",
    "__version__",
]

if TYPE_CHECKING:
    from rltserve.async_llm import AsyncLLM, AsyncLLMEngine
    from rltserve.llm import LLM
    from rltserve.llm_args import AsyncEngineArgs, EngineArgs
    from rltserve.metrics_reader import Counter, Gauge, Histogram, Metric, Vector
    from rltserve.outputs import CompletionOutput, Logprob, RequestOutput
    from rltserve.prompt_inputs import TextPrompt, TokensPrompt
    from rltserve.sampling import RequestOutputKind, SamplingParams
    from rltserve.structured import GuidedDecodingParams, StructuredOutputsParams

_EXPORTS = {
    "LLM": "rltserve.llm",
    "AsyncLLM": "rltserve.async_llm",
    "AsyncLLMEngine": "rltserve.async_llm",
    "AsyncEngineArgs": "rltserve.llm_args",
    "EngineArgs": "rltserve.llm_args",
    "CompletionOutput": "rltserve.outputs",
    "Counter": "rltserve.metrics_reader",
    "Gauge": "rltserve.metrics_reader",
    "Histogram": "rltserve.metrics_reader",
    "Logprob": "rltserve.outputs",
    "Metric": "rltserve.metrics_reader",
    "Vector": "rltserve.metrics_reader",
    "RequestOutput": "rltserve.outputs",
    "RequestOutputKind": "rltserve.sampling",
    "SamplingParams": "rltserve.sampling",
    "StructuredOutputsParams": "rltserve.structured",
    "GuidedDecodingParams": "rltserve.structured",
    "TextPrompt": "rltserve.prompt_inputs",
    "TokensPrompt": "rltserve.prompt_inputs",
    # Not in __all__: it only refuses (rltserve has no step-wise engine).
    "LLMEngine": "rltserve.engine.llm_engine",
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'rltserve' has no attribute {name!r}")
