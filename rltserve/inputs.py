"""vLLM's import path ``vllm.inputs`` for its prompt dicts, so that code written for vLLM runs
with the package name changed: ``from rltserve.inputs import TokensPrompt, TextPrompt``. The
classes live in ``prompt_inputs``; vLLM's other names there (``PromptType``, encoder-decoder
prompts, the input registry) have no counterpart here."""

from __future__ import annotations

from rltserve.prompt_inputs import TextPrompt, TokensPrompt

__all__ = ["TextPrompt", "TokensPrompt"]
