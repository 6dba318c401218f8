"""The session key of the request being handled, for replica affinity.

A multi-turn chat reuses its earlier turns as a prompt prefix; sending its requests to one
replica lets that replica's KV prefix serve them. The key is the ``X-Session-Id`` header, else
the request body's ``user`` field. It is kept in a context variable set while the body is read,
so it reaches the stage client's ``add_request`` in the same handler task without widening the
frontend's interface; other tasks (other requests) never see it.
"""

from __future__ import annotations

import contextvars
from collections.abc import Mapping

SESSION_HEADER = "X-Session-Id"
_MAX_CHARS = 256  # a key longer than this is cut: it only feeds a hash

_session: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "rltserve_session", default=None
)


def remember(headers: Mapping[str, str], user: object) -> None:
    """Records the session key of the request whose body was just read (in its task)."""
    key = headers.get(SESSION_HEADER) or (user if isinstance(user, str) else None)
    _session.set(key[:_MAX_CHARS] if key else None)


def current_session() -> str | None:
    return _session.get()
