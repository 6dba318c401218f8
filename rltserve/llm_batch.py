"""The requests of one ``LLM.generate`` call, as their updates arrive on the stage client's
delivering thread."""

from __future__ import annotations

import threading
from collections.abc import Callable

from tqdm import tqdm

from rltserve.outputs import OutputAssembler
from rltserve.updates import RequestUpdate


class PendingBatch:
    """The assemblers of one call's requests. ``cond`` guards ``finished``; the waiter wakes
    when every request has finished or one has failed (the caller then aborts the rest).
    ``progress`` (a tqdm bar, or None) counts the prompts all of whose samples finished."""

    def __init__(self, progress: tqdm | None = None) -> None:
        self.assemblers: list[OutputAssembler] = []
        self.finished: set[str] = set()
        self.failed = False
        self.cond = threading.Condition()
        self._progress = progress
        self._prompt_of: dict[str, int] = {}  # request id -> its prompt's index
        self._samples_left: dict[int, int] = {}  # prompt index -> its samples not finished

    def add(self, asm: OutputAssembler, prompt: int) -> None:
        """Registers ``asm``'s request, one sample of prompt ``prompt``, before it is added."""
        with self.cond:
            self.assemblers.append(asm)
            self._prompt_of[asm.output.request_id] = prompt
            self._samples_left[prompt] = self._samples_left.get(prompt, 0) + 1

    def prompt_index(self, asm: OutputAssembler) -> int:
        """The index, in the call's prompts, of the prompt ``asm``'s request samples."""
        return self._prompt_of[asm.output.request_id]

    def sink(
        self, asm: OutputAssembler, abort: Callable[[str], None]
    ) -> Callable[[RequestUpdate], None]:
        """The update callback of ``asm``'s request: assembles each update; a request that
        ends on a stop string (the engine does not know it ended) is ``abort``ed, once its
        kept forced tokens have their scores (``OutputAssembler.stopped_awaiting_scores``)."""
        request_id = asm.output.request_id

        def sink(update: RequestUpdate) -> None:
            with self.cond:
                if request_id in self.finished:
                    return
                if asm.scoring:  # (a stop string ended it already)
                    if not asm.add_late(update):
                        return
                    self._finish(request_id, failed=False)
                else:
                    if not self._add(asm, update):
                        return
                    if asm.stopped_awaiting_scores(update):
                        return
                    self._finish(request_id, failed=asm.output.finish_reason == "error")
            if update.finish_reason is None:  # a stop string: stop the stage's work too
                abort(request_id)

        return sink

    @staticmethod
    def _add(asm: OutputAssembler, update: RequestUpdate) -> bool:
        """Assembles ``update``; True when it ended the output."""
        try:
            finish = asm.add(update).finish_reason
            asm.weight_version = update.weight_version
        except Exception as exc:  # fail this request rather than the client's thread
            asm.fail(exc)
            finish = "error"
        return finish is not None

    def _finish(self, request_id: str, failed: bool) -> None:
        """Called with ``cond`` held."""
        self.finished.add(request_id)
        self.failed = self.failed or failed
        prompt = self._prompt_of[request_id]
        self._samples_left[prompt] -= 1
        if self._progress is not None and not self._samples_left[prompt]:
            self._progress.update(1)
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
