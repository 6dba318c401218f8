"""Which failed calls ``AsyncClient`` makes again, and after how long: the OpenAI SDK's rules
(connection failures and timeouts, 408, 409, 429 and 5xx; the server's Retry-After, else
exponential backoff with jitter)."""

from __future__ import annotations

import asyncio
import random

import aiohttp

from rltserve.client_errors import APIConnectionError, APIError, APIStatusError

# Retries as the OpenAI SDK makes them (openai/_constants.py).
DEFAULT_MAX_RETRIES = 2
INITIAL_RETRY_DELAY = 0.5  # seconds before the first retry without a Retry-After; doubles
MAX_RETRY_DELAY = 8.0
MAX_RETRY_AFTER = 120.0  # a server that asks for a longer wait is not retried
_RETRIED_STATUSES = (408, 409, 429)  # and every 5xx


def retryable(error: APIError) -> bool:
    """The OpenAI SDK's rule: connection failures and timeouts, 408, 409, 429 and 5xx, unless
    the server asks to wait longer than ``MAX_RETRY_AFTER``. A broken promise of the server's
    (invalid JSON, a stream's error event) is not a transport failure: not retried."""
    if isinstance(error, APIStatusError):
        if error.retry_after is not None and error.retry_after > MAX_RETRY_AFTER:
            return False
        return error.status in _RETRIED_STATUSES or (error.status or 0) >= 500
    transport = (aiohttp.ClientError, asyncio.TimeoutError)
    return isinstance(error, APIConnectionError) and isinstance(error.__cause__, transport)


def retry_delay(error: APIError, retries_taken: int) -> float:
    """The server's Retry-After when it is in (0, MAX_RETRY_AFTER], else exponential backoff
    from ``INITIAL_RETRY_DELAY`` up to ``MAX_RETRY_DELAY``, less up to 25 % jitter (the SDK's)."""
    hint = error.retry_after
    if hint is not None and 0 < hint <= MAX_RETRY_AFTER:
        return hint
    backoff = min(INITIAL_RETRY_DELAY * 2.0 ** min(retries_taken, 1000), MAX_RETRY_DELAY)
    return backoff * (1 - 0.25 * random.random())
