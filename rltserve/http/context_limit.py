"""The 400s of a request longer than the context, in vLLM's words.

Agent frameworks (CrewAI, LiteLLM) tell a context overflow from other 400s by the phrase
"maximum context length", so every such refusal starts as vLLM's does: "This model's maximum
context length is N tokens." Where the KV pool lowered the limit the client is told so; what
an operator can do about it (a larger pool) is the server log's, said at start-up.
"""

from __future__ import annotations

# After the refusal, where ``max_model_len`` is what the KV pool holds (``pool_limited``).
POOL_NOTE = " (This limit is what the server's KV cache holds.)"


def _head(max_model_len: int) -> str:
    return f"This model's maximum context length is {max_model_len} tokens."


def prompt_too_long(num_tokens: int, max_model_len: int, pool_limited: bool) -> str:
    """A prompt of ``num_tokens`` tokens that the context cannot hold with a token to
    generate (``request_checks.longest_prompt``)."""
    room = ", which leave no room for the completion" if num_tokens <= max_model_len else ""
    return (
        f"{_head(max_model_len)} However, your request has {num_tokens} input tokens{room}. "
        "Please reduce the length of the input messages."
    ) + (POOL_NOTE if pool_limited else "")


def tokens_too_many(prompt_tokens: int, asked: int, max_model_len: int, pool_limited: bool) -> str:
    """A prompt of ``prompt_tokens`` tokens with ``asked`` to generate, more than the context."""
    return (
        f"{_head(max_model_len)} However, you requested {prompt_tokens + asked} tokens "
        f"({prompt_tokens} in the messages, {asked} in the completion). Please reduce the "
        "length of the messages or completion."
    ) + (POOL_NOTE if pool_limited else "")


def chars_too_many(num_chars: int, max_model_len: int, token_chars: int, pool_limited: bool) -> str:
    """A text of ``num_chars`` characters, more than ``max_model_len`` tokens of at most
    ``token_chars`` characters each can hold (``encoding``'s bound)."""
    return (
        f"{_head(max_model_len)} However, your request has {num_chars} input characters, more "
        f"than {max_model_len * token_chars} (no token covers more than {token_chars}). "
        "Please reduce the length of the input messages."
    ) + (POOL_NOTE if pool_limited else "")
