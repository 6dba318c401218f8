"""The sleep a supervised stage is in (``POST /sleep``, ``/wake_up``), put back on a stage that
restarts: a trainer that freed the device memory for training must not find weights and KV
allocated again behind its back, nor requests served before it wakes the engine."""

from __future__ import annotations

from rltserve.http.frontend import StageClientLike
from rltserve.updates import SLEEP_TAGS


class SleepState:
    """Invariant: ``asleep`` is what the stage's ``sleeping`` said after the last sleep or
    wake-up that succeeded; ``level`` is the sleep's while anything sleeps, else None;
    ``dropped``: a level-2 sleep dropped the weights and no update has loaded any since (the
    engine's ``weights_dropped``: it refuses requests until then, woken or not)."""

    def __init__(self) -> None:
        self.level: int | None = None
        self.asleep: frozenset[str] = frozenset()
        self.dropped = False

    def slept(self, level: int, sleeping: set[str]) -> None:
        self.dropped = self.dropped or (level == 2 and "weights" not in self.asleep)
        # A sleep over sleeping weights leaves them as the first left them (a level-1 host
        # copy, or none): that level still says how they come back.
        if self.level is None or "weights" not in self.asleep:
            self.level = level
        self.asleep = frozenset(sleeping)

    def loaded(self) -> None:
        """A weight update succeeded."""
        self.dropped = False

    def woke(self, sleeping: set[str]) -> None:
        self.asleep = frozenset(sleeping)
        if not self.asleep:
            self.level = None

    def restore(self, client: StageClientLike, timeout_s: float) -> None:
        """Puts a fresh stage (its weights loaded, the updates applied again) where the failed
        one was: asleep at the level, with the parts woken since woken again. After level 2
        the weights come back undefined, for the trainer to load, as on the stage it replaces,
        until an update loaded them (they were just applied again): level 1 keeps them then.
        Dropped weights woken already make a level-2 sleep and a wake-up, so that the new
        stage refuses requests until that load, as the failed one did."""
        if self.level is None and not self.dropped:
            return
        level = 2 if self.dropped else 1 if "weights" not in self.asleep else self.level
        client.sleep(level, timeout_s)
        awake = [tag for tag in SLEEP_TAGS if tag not in self.asleep]
        if awake:
            client.wake_up(awake)
