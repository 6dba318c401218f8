"""vLLM's import path ``vllm.sampling_params``, so that code written for vLLM runs with the
package name changed: ``from rltserve.sampling_params import SamplingParams,
RequestOutputKind, StructuredOutputsParams`` (and ``GuidedDecodingParams``, its older name).
They live in ``sampling`` and ``structured``; vLLM's beam search params have no counterpart
here."""

from __future__ import annotations

from rltserve.sampling import RequestOutputKind, SamplingParams
from rltserve.structured import GuidedDecodingParams, StructuredOutputsParams

__all__ = ["GuidedDecodingParams", "RequestOutputKind", "SamplingParams", "StructuredOutputsParams"]
