"""Compiled constraints cross to each replica once, not with every call.

A guided request's params carry its compiled index (``GuideIndex``): megabytes at a real
vocabulary (``guide_registry``'s doc has the sizes). Each request is a call of its own through
Serve's handle, to whichever replica Serve picks, and each sample of ``n > 1`` is another call:
pickled with the params, the index would be serialized into every call, put in the object
store, fetched and restored by the replica each time. So the front end (``GuideShipper``) puts
an index in Ray's object store once and sends a ``GuideRef`` in its place, its key and the
object's ref; a replica (``GuideStore``) fetches the object the first time a key reaches it and
keeps the last ``KEPT`` indexes by key, as a stage worker's registry does.

The key is what makes an index (its pattern, end id and mask width): the front end's tokenizer
is every replica's, so one key is one index on each. The front end holds an index's object
while the index lives (its compiler's cache, or a request using it): an index compiled again
after it went is put again, and a replica that holds its key takes it from its own store.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from rltserve.core.guide_registry import KEPT
from rltserve.guide_index import GuideIndex, compiled_index, with_index
from rltserve.sampling import SamplingParams


@dataclass(frozen=True)
class GuideRef:
    """An index in Ray's object store, in place of the index in a call's params."""

    key: tuple[str, int, int]  # (pattern, eos, size)
    ref: Any  # ray.ObjectRef of the GuideIndex


def _key(index: GuideIndex) -> tuple[str, int, int]:
    return (index.pattern, index.eos, index.size)


class GuideShipper:
    """The front end's side: each index put in the object store once, while it lives. Used
    on the server's event loop (one thread)."""

    def __init__(self, put=None) -> None:
        """``put``: ``ray.put`` (tests count its calls), looked up when an index first ships:
        a server that never sees a guided request needs nothing of Ray's object store."""
        self._put = put
        self._refs: weakref.WeakKeyDictionary[GuideIndex, GuideRef] = weakref.WeakKeyDictionary()

    def detach(self, params: SamplingParams) -> SamplingParams:
        """``params`` to send: their index replaced by its ``GuideRef`` (unchanged without
        one)."""
        structured = params.structured_outputs
        index = compiled_index(structured) if structured is not None else None
        if not isinstance(index, GuideIndex):
            return params
        shipped = self._refs.get(index)
        if shipped is None:
            if self._put is None:
                import ray

                self._put = ray.put
            shipped = self._refs[index] = GuideRef(_key(index), self._put(index))
        return params.replace(structured_outputs=with_index(structured, shipped))

    def __len__(self) -> int:
        return len(self._refs)


class GuideStore:
    """A replica's side: the last ``kept`` indexes that reached it, by key. Used on the
    replica's event loop (one thread)."""

    def __init__(self, kept: int = KEPT) -> None:
        self.kept = kept
        self._indexes: OrderedDict[tuple, GuideIndex] = OrderedDict()
        self.fetches = 0  # (indexes fetched from the object store: tests read it)

    async def attach(self, params: SamplingParams) -> SamplingParams:
        """``params`` as the engine takes them: a ``GuideRef`` replaced by its index."""
        structured = params.structured_outputs
        shipped = compiled_index(structured) if structured is not None else None
        if not isinstance(shipped, GuideRef):
            return params
        index = self._indexes.get(shipped.key)
        if index is None:
            index = await shipped.ref
            self.fetches += 1
        self._indexes[shipped.key] = index
        self._indexes.move_to_end(shipped.key)
        while len(self._indexes) > self.kept:
            self._indexes.popitem(last=False)
        return params.replace(structured_outputs=with_index(structured, index))

    def __len__(self) -> int:
        return len(self._indexes)
