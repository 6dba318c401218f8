"""The session key of a request, for replica affinity.

A multi-turn chat reuses its earlier turns as a prompt prefix; sending its requests to one
replica lets that replica's KV prefix serve them. The key is the ``X-Session-Id`` header, else
the request body's ``user`` field. The handler computes it and it travels with each
``ChoiceRequest`` to the stage client's ``add_request`` (see ``SupervisedStage.add_request``).
"""

from __future__ import annotations

from collections.abc import Mapping

SESSION_HEADER = "X-Session-Id"
_MAX_CHARS = 256  # a key longer than this is cut: it only feeds a hash


def session_key(headers: Mapping[str, str], user: object) -> str | None:
    """The request's session key: the ``X-Session-Id`` header, else ``user`` (a string), else
    None (no affinity)."""
    key = headers.get(SESSION_HEADER) or (user if isinstance(user, str) else None)
    return key[:_MAX_CHARS] if key else None
