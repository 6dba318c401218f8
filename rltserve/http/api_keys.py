"""The server's API keys: where one comes from when no ``--api-key`` is given, and how a
request's bearer token is checked against them (``--api-key K1 K2``: any of them, as vLLM's)."""

from __future__ import annotations

import hmac
import os

API_KEY_ENV = "RLTSERVE_API_KEY"
# Where ``ServerConfig.with_env`` looks for the API key, the first set wins: rltserve's own
# variable, then vLLM's (a deployment configured for vLLM must not come up unauthenticated).
API_KEY_ENVS = (API_KEY_ENV, "VLLM_API_KEY")


def api_key_env() -> str | None:
    """The environment variable ``ServerConfig.with_env`` takes the API key from (None: none
    set)."""
    return next((name for name in API_KEY_ENVS if os.environ.get(name)), None)


def matches(token: str, keys: tuple[str, ...]) -> bool:
    """Whether ``token`` is one of ``keys``. Every key is compared, in constant time, so the
    time taken tells nothing about which key came close. (aiohttp keeps header bytes that
    are not UTF-8 as surrogates: the token is compared as sent.)"""
    sent = token.encode("utf-8", "surrogateescape")
    found = [hmac.compare_digest(sent, key.encode()) for key in keys]
    return any(found)
