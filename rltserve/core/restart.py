"""How a failed stage is started again: the rule (``RestartPolicy``: attempts in a row, a backoff
that doubles per attempt, the time after which a stage counts as stable) and how a failed stage
is stopped (``stop_stage``). The server's supervisor restarts whole stages under the policy its
flags give (``http.supervisor``); a disaggregated engine restarts its prefill stage under a
fixed one (``core.pd_prefill``)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RestartPolicy:
    """How a failed stage is handled. ``watchdog_s`` 0 turns hang detection off."""

    watchdog_s: float = 300.0
    max_restarts: int = 3
    backoff_s: float = 1.0
    backoff_max_s: float = 30.0
    stable_s: float = 60.0  # a stage that ran this long starts a fresh count of restarts
    startup_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        for name in ("watchdog_s", "backoff_s", "backoff_max_s", "stable_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{name}={value!r}: must be a number >= 0")
        restarts = self.max_restarts
        if isinstance(restarts, bool) or not isinstance(restarts, int) or restarts < 0:
            raise ValueError(f"max_restarts={restarts!r}: must be an int >= 0")
        if not self.startup_timeout_s > 0:
            raise ValueError(f"startup_timeout_s={self.startup_timeout_s!r}: must be > 0")

    def backoff(self, attempt: int) -> float:
        """Seconds before restart attempt ``attempt`` (1-based)."""
        return min(self.backoff_s * 2 ** (attempt - 1), self.backoff_max_s)


def stop_stage(client: Any, **close_kwargs: Any) -> None:
    """Stops a failed stage for good: killed first (it may be hung), then closed
    (``close_kwargs``: the client's ``close`` arguments)."""
    kill = getattr(client, "kill", None)
    if kill is not None:
        with contextlib.suppress(Exception):
            kill()
    with contextlib.suppress(Exception):
        client.close(**close_kwargs)
