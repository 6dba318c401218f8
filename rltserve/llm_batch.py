"""The requests of one ``LLM.generate`` call, as their updates arrive on the stage client's
delivering thread."""

from __future__ import annotations

import threading
from collections.abc import Callable

from rltserve.outputs import OutputAssembler
from rltserve.updates import RequestUpdate


class PendingBatch:
    """The assemblers of one call's requests. ``cond`` guards ``finished``; the waiter wakes
    when every request has finished or one has failed (the caller then aborts the rest)."""

    def __init__(self) -> None:
        self.assemblers: list[OutputAssembler] = []
        self.finished: set[str] = set()
        self.failed = False
        self.cond = threading.Condition()

    def sink(
        self, asm: OutputAssembler, abort: Callable[[str], None]
    ) -> Callable[[RequestUpdate], None]:
        """The update callback of ``asm``'s request: assembles each update; a request that
        ends on a stop string (the engine does not know it ended) is ``abort``ed."""

        def sink(update: RequestUpdate) -> None:
            with self.cond:
                if asm.output.request_id in self.finished:
                    return
                try:
                    delta = asm.add(update)
                    finish = delta.finish_reason
                    asm.weight_version = update.weight_version
                except Exception as exc:  # fail this request rather than the client's thread
                    asm.output.finish_reason = finish = "error"
                    asm.output.error = f"{type(exc).__name__} while assembling output: {exc}"
                if finish is None:
                    return
                self._finish(asm.output.request_id, failed=finish == "error")
            if update.finish_reason is None:  # a stop string: stop the stage's work too
                abort(asm.output.request_id)

        return sink

    def _finish(self, request_id: str, failed: bool) -> None:
        """Called with ``cond`` held."""
        self.finished.add(request_id)
        self.failed = self.failed or failed
        self.cond.notify_all()

    def wait(self) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.failed or len(self.finished) == len(self.assemblers))

    def unfinished(self) -> list[str]:
        with self.cond:
            return [
                a.output.request_id
                for a in self.assemblers
                if a.output.request_id not in self.finished
            ]
