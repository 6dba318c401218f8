"""vLLM's import path ``vllm.sampling_params``, so that code written for vLLM runs with the
package name changed: ``from rltserve.sampling_params import SamplingParams,
RequestOutputKind``. Both live in ``sampling``; vLLM's other names there (beam search and
structured-output params) have no counterpart here."""

from __future__ import annotations

from rltserve.sampling import RequestOutputKind, SamplingParams

__all__ = ["RequestOutputKind", "SamplingParams"]
