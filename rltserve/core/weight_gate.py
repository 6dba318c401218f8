"""When a weight update (or a change of sleep mode) runs inside the engine loop: between steps,
with no request running.

The loop hands an ``("update_weights", token, files, abort, timeout_s)``, ``("sleep", token,
level, timeout_s)`` or ``("wake_up", token, tags)`` command to ``request``. From then on new
requests are held (not scheduled) so the running ones drain; with ``abort`` they are aborted
at once. ``poll`` applies the command once no request runs and no step is in flight, then
releases the held commands; if requests still run ``timeout_s`` after the command arrived, it
fails (nothing applied) and the held commands are released too. Each command gets exactly one
reply: ``reply(token, error, weight_version)``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rltserve.core.weight_update import update_weights
from rltserve.updates import UPDATE_ABORTED, UpdateTimeout
from rltserve.weights import update_files

if TYPE_CHECKING:
    from rltserve.core.engine import EngineCore

Reply = Callable[[int, str | None, int], None]


_WAKE_TIMEOUT_S = 300.0  # (an asleep engine runs nothing: waking waits for no request)


@dataclass
class _Pending:
    kind: str
    token: int
    args: tuple  # update_weights: (files,); sleep: (level,); wake_up: (tags,)
    deadline: float
    timeout_s: float


class WeightGate:
    def __init__(self, core: EngineCore, reply: Reply) -> None:
        self.core = core
        self.reply = reply
        self._pending: list[_Pending] = []
        self.held: list[tuple] = []  # commands that arrived while an update waited

    @property
    def waiting(self) -> bool:
        return bool(self._pending)

    def request(self, command: tuple) -> list:
        """Takes a command; returns the abort updates to emit (``abort=True``)."""
        kind, token, *rest = command
        if kind == "update_weights":
            files, abort, timeout_s = rest
            args: tuple = (list(files),)
        elif kind == "sleep":
            (level, timeout_s), abort = rest, False
            args = (level,)
        else:
            args, abort, timeout_s = (list(rest[0]),), False, _WAKE_TIMEOUT_S
        deadline = time.monotonic() + timeout_s
        self._pending.append(_Pending(kind, token, args, deadline, timeout_s))
        if not abort:
            return []
        core = self.core
        aborts = [u for rid in list(core.scheduler.requests) if (u := core.abort(rid))]
        for update in aborts:  # (the client's 503 says why, not only that it was aborted)
            update.error = UPDATE_ABORTED
        return aborts

    def drop_held(self, request_id: str) -> bool:
        """Forgets a held request (it was aborted); True when it was held."""
        for command in self.held:
            if command[0] == "add" and command[1] == request_id:
                self.held.remove(command)
                return True
        return False

    def poll(self, busy: bool) -> list[tuple]:
        """Applies the waiting updates when the engine is idle (``busy``: a step is in flight),
        or fails the expired ones. Returns the held commands to handle now, if any."""
        if not self._pending:
            return []
        core = self.core
        if not busy and not core.has_work():
            for p in self._pending:
                self._apply(p)
            self._pending = []
        else:
            now = time.monotonic()
            for p in [p for p in self._pending if now >= p.deadline]:
                # (engine requests: a request of n samples counts n)
                n = core.scheduler.num_running + core.scheduler.num_waiting
                how = " (abort=True aborts them instead of waiting)" * (p.kind == "update_weights")
                self.reply(
                    p.token,
                    f"{UpdateTimeout.PREFIX} {n} sequence(s) still running after "
                    f"{p.timeout_s:g} s; nothing applied{how}",
                    core.weight_version,
                )
                self._pending.remove(p)
        if self._pending:
            return []
        held, self.held = self.held, []
        return held

    def _apply(self, pending: _Pending) -> None:
        core = self.core
        try:
            if pending.kind == "sleep":
                core.sleep(*pending.args)
            elif pending.kind == "wake_up":
                core.wake_up(*pending.args)
            else:
                if "weights" in core.sleeping:
                    raise ValueError(
                        "weights: asleep; wake them first (wake_up(tags=['weights']); over "
                        "HTTP POST /wake_up?tags=weights)"
                    )
                files = [f for path in pending.args[0] for f in update_files(path)]
                update_weights(core.model, core.config.model.model, files)
                core.on_weights_updated()
        except Exception as exc:  # a bad command fails its caller, never the engine loop
            error = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
            self.reply(pending.token, error, core.weight_version)
            return
        self.reply(pending.token, None, core.weight_version)
