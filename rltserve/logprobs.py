"""vLLM's import path ``vllm.logprobs``, so that code written for vLLM runs with the package
name changed: ``from rltserve.logprobs import Logprob``. The class lives in ``outputs``, beside
the outputs that hold it."""

from __future__ import annotations

from rltserve.outputs import Logprob

__all__ = ["Logprob"]
