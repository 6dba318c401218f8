"""The control calls (sleep, wake_up, update_weights, reset_prefix_cache) waiting for the stage's
answer, for the supervisor's watchdog (``http.supervisor``).

A stage answers a control within the call's own wait for running requests (the ``timeout_s`` of
a sleep or a weight update; none for the others) plus the time to apply it, which the watchdog
bounds as it bounds a step (``watchdog_s``). A call still unanswered past that means a stage
that stopped reading or is stuck. An idle stage shows no other sign (no request is open to go
without progress), and the call, with the requests a pending sleep or update holds back, would
wait for good.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Callable, Iterator


class PendingControls:
    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._lock = threading.Lock()  # (calls come from the server's worker threads)
        self._calls: dict[int, tuple[str, float, float]] = {}  # key -> (name, wait_s, sent at)
        self._keys = itertools.count()

    @contextlib.contextmanager
    def waiting(self, name: str, wait_s: float = 0.0) -> Iterator[None]:
        """Around a call of control ``name`` that may wait ``wait_s`` for running requests."""
        key = next(self._keys)
        with self._lock:
            self._calls[key] = (name, wait_s, self._clock())
        try:
            yield
        finally:
            with self._lock:
                del self._calls[key]

    def renew(self) -> None:
        """Measures every pending call afresh (the stage it waited for was replaced)."""
        now = self._clock()
        with self._lock:
            for key, (name, wait_s, _) in self._calls.items():
                self._calls[key] = (name, wait_s, now)

    def overdue(self, watchdog_s: float) -> str | None:
        """Why the stage is hung, if a call went unanswered ``watchdog_s`` past its wait."""
        now = self._clock()
        with self._lock:
            calls = list(self._calls.values())
        for name, wait_s, sent in calls:
            if now - sent > wait_s + watchdog_s:
                past = " past its timeout" if wait_s else ""
                return f"no answer to {name} within {watchdog_s:g} s{past} (stage watchdog)"
        return None
