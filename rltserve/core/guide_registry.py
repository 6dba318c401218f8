"""Compiled constraints cross to a stage worker once per channel, not with every request.

A guided request's params carry its compiled index (``GuideIndex``): megabytes at a real
vocabulary (a ``json_object`` index over 166k tokens pickles to 23 MB, a six-field schema's to
5 MB). Pickled with every request, and with every sample of ``n > 1``, the channel would carry
it again each time, and the caller (the server's event loop) would spend a tenth of a second
pickling it. Instead ``GuidePickler`` (one per worker channel, ``WorkerProcess``) pickles an
index in full the first time it crosses and by reference after; the worker's side is this
module's ``registry``, filled and read as the messages are unpickled, in the order they were
pickled (``WorkerProcess.send`` pickles under a lock).

The pickler keeps the last ``KEPT`` indexes it sent (and with them their ids, which stay unique
while kept). When a new one pushes the oldest out, its message tells the worker to drop that
one too, so the worker holds exactly what the pickler believes it holds. A request already in
the engine keeps its index (it holds the object, not the key). A message that fails to pickle
leaves the record as it was. A restarted stage is a new worker with a new channel: its pickler
starts empty. Torch-free: the client imports it.
"""

from __future__ import annotations

import io
import pickle
from collections import OrderedDict
from multiprocessing.reduction import ForkingPickler
from types import FunctionType
from typing import Any

from rltserve.guide_index import CACHE_SIZE, GuideIndex

KEPT = CACHE_SIZE  # indexes a worker holds: as many as a front end keeps compiled

# The worker's indexes by the sender's key (a worker process has one channel, one sender).
registry: dict[int, GuideIndex] = {}


class GuidePickler:
    """Pickles messages to one worker, each ``GuideIndex`` in full once (see the module doc),
    refusing classes and functions of the caller's ``__main__`` (the worker could not read
    them). Not thread-safe: the caller serialises ``dumps`` with the writes."""

    def __init__(self, kept: int = KEPT) -> None:
        self.kept = kept
        self._sent: OrderedDict[int, GuideIndex] = OrderedDict()  # what the worker holds

    def dumps(self, message: object) -> memoryview:
        buffer = io.BytesIO()
        pickler = _Pickler(buffer, self)
        try:
            pickler.dump(message)
        except BaseException:
            if pickler.before is not None:
                self._sent = pickler.before
            raise
        return buffer.getbuffer()

    def reduce(self, index: GuideIndex) -> tuple:
        key = id(index)
        if key in self._sent:
            self._sent.move_to_end(key)
            return _held, (key,)
        self._sent[key] = index
        dropped = self._sent.popitem(last=False)[0] if len(self._sent) > self.kept else None
        # (In full as ``GuideIndex`` pickles itself: serialized once however many channels
        # carry it, and restored once per worker process by content.)
        restore, args = index.__reduce__()
        return _register, (key, dropped, restore, args)

    def __len__(self) -> int:
        return len(self._sent)


class _Pickler(ForkingPickler):
    def __init__(self, file: io.BytesIO, owner: GuidePickler) -> None:
        super().__init__(file)
        self.owner = owner
        self.before: OrderedDict | None = None  # the record before this message changed it

    def reducer_override(self, obj: Any) -> Any:
        # (Called for objects other than plain ints, strings, lists...: a prompt's ids cost
        # nothing here.)
        if type(obj) is not GuideIndex:
            if isinstance(obj, (type, FunctionType)) and obj.__module__ == "__main__":
                # Pickled by name, and the worker's __main__ is not the caller's: it could not
                # read the message, and would fail the stage (``stage_loop.serve``). Refused here,
                # the request alone fails.
                raise pickle.PicklingError(
                    f"{obj.__qualname__} is defined in __main__, which the stage worker does "
                    "not run: it cannot cross to the worker (define it in a module the worker "
                    "imports: an installed one, or one on PYTHONPATH)"
                )
            return NotImplemented
        if self.before is None:
            self.before = OrderedDict(self.owner._sent)
        return self.owner.reduce(obj)


def _register(key: int, dropped: int | None, restore: Any, args: tuple) -> GuideIndex:
    """Unpickled in the worker: an index arriving in full."""
    if dropped is not None:
        registry.pop(dropped, None)
    index = registry[key] = restore(*args)
    return index


def _held(key: int) -> GuideIndex:
    """Unpickled in the worker: an index it was sent before."""
    try:
        return registry[key]
    except KeyError:
        raise RuntimeError(f"compiled constraint {key} was never sent to this worker") from None
