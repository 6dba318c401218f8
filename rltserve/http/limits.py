"""The server's per-request bounds (``ServerConfig.max_n``, ``max_tokens_limit``,
``max_loops_limit``, ``max_stop``, ``max_stop_chars``, ``max_logprobs``), checked after parsing
and before any tokenizing, so that a request asking for more than this server gives one is a
cheap 400 naming the field.

The schema's own ranges (n in [1, 128], logprobs in [0, 20]) are hard ceilings; these are the
operator's, at or below them.
"""

from __future__ import annotations

from rltserve.http.config import ServerConfig
from rltserve.http.schemas import ChatCompletionRequest, CompletionRequest
from rltserve.http.validation import SchemaError


def check_limits(req: CompletionRequest | ChatCompletionRequest, config: ServerConfig) -> None:
    """Raises SchemaError for the first field beyond this server's bound."""
    if req.n > config.max_n:
        raise SchemaError("n", f"n={req.n}: must be in [1, {config.max_n}]")
    if isinstance(req, ChatCompletionRequest):
        tokens, tokens_param = req.token_limit, req.token_limit_param
        logprobs, logprobs_param = req.top_logprobs, "top_logprobs"
    else:
        tokens, tokens_param = req.max_tokens, "max_tokens"
        logprobs, logprobs_param = req.logprobs, "logprobs"
    limit = config.max_tokens_limit
    if limit is not None and tokens is not None and tokens > limit:
        message = f"{tokens_param}={tokens}: must be <= {limit} (this server's max_tokens_limit)"
        raise SchemaError(tokens_param, message)
    loops = config.max_loops_limit
    if loops is not None:
        # (num_steps, Huginn's name for max_loops, is named as the client sent it)
        sent = "max_loops" if req.max_loops is not None else "num_steps"
        for name, value in ((sent, getattr(req, sent)), ("min_loops", req.min_loops)):
            if value is not None and value > loops:
                message = f"{name}={value}: must be <= {loops} (this server's max_loops_limit)"
                raise SchemaError(name, message)
    prompt_logprobs = getattr(req, "prompt_logprobs", None)  # (completions: vLLM's field)
    for value, name in ((logprobs, logprobs_param), (prompt_logprobs, "prompt_logprobs")):
        if value is not None and value > config.max_logprobs:
            raise SchemaError(name, f"{name}={value}: must be in [0, {config.max_logprobs}]")
    stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if len(stops) > config.max_stop:
        raise SchemaError(
            "stop", f"stop: {len(stops)} strings; this server allows at most {config.max_stop}"
        )
    longest = max((len(s) for s in stops), default=0)
    if longest > config.max_stop_chars:
        raise SchemaError(
            "stop",
            f"stop: a string of {longest} characters; this server allows at most "
            f"{config.max_stop_chars}",
        )
