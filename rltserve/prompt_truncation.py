"""``truncate_prompt_tokens`` (vLLM's left truncation of a prompt): when a value is refused
and which tokens a kept prompt has. The HTTP schema, ``SamplingParams``, the engine and the
disaggregated client all apply the one rule."""

from __future__ import annotations


def truncation_error(keep: int) -> str | None:
    """Why ``truncate_prompt_tokens=keep`` (an int) is refused, or None (the HTTP schema
    checks it before the prompt is encoded, ``SamplingParams`` on construction)."""
    if keep == 0 or keep < -1:
        return (
            f"truncate_prompt_tokens={keep}: must be >= 1 (keep the prompt's last k tokens) "
            "or -1 (as many as fit)"
        )
    return None


def truncated_prompt(ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """``ids`` as ``truncate_prompt_tokens=keep`` runs them (vLLM's left truncation): the last
    ``keep`` tokens; -1 keeps ``max_model_len - 1``, the longest prompt that leaves room for a
    token (vLLM's -1 keeps ``max_model_len``, a prompt this engine refuses). A ``keep`` above
    ``max_model_len`` is a ValueError, as in vLLM."""
    if keep is None:
        return ids
    if keep == -1:
        keep = max_model_len - 1
    elif keep > max_model_len:
        raise ValueError(
            f"truncate_prompt_tokens={keep}: greater than the maximum context length "
            f"({max_model_len} tokens); choose a smaller truncation size"
        )
    return ids[-keep:] if len(ids) > keep else ids
