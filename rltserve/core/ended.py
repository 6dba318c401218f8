"""``EndedTokens``: the carried tokens that ended, each its request's newest, for a plan to
continue (``StepPlan.continued``; ``CarriedRows.advance``). Part of the runner; torch-free.

A decode batch's rows end together every few steps, and the next plan continues them all, in
the order they ended (``Standing.take``): they are kept as one batch of columns, as they
ended, and handed back as they are when a plan continues exactly them. Anything else (some
of them continued, a request dropped, a token ending while they wait) moves them into
per-request entries first (``_flush``), which a plan continues in any order.

An entry is (item, request state, position, key, block, index): ``block`` the ``_rows`` and
``_lens`` arrays of the carried rows that ended with it and their spec columns (or None:
not kept), or None for a token that ended at its first loop (a plan item); ``index`` its row
there. (Those arrays stay alive until every token that ended with them is continued or
dropped: a few KB per batch.) The batch's tokens are newer than any entry of their requests
when it was kept (those were removed then) and older than any added since.
"""

from __future__ import annotations

from collections.abc import Collection
from itertools import repeat
from operator import is_, itemgetter
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # (torch-free at run time)
    from rltserve.core.live import LiveRequest
    from rltserve.core.plan import WorkItem

_KEY = itemgetter(3)
_BLOCK = itemgetter(4)
_AT = itemgetter(5)


class EndedTokens:
    def __init__(self) -> None:
        self._entries: dict[str, tuple] = {}  # request id -> its newest ended token
        # The carried rows that ended in the last step that ended any: (request ids, items,
        # request states, positions, keys, block), in row order.
        self._batch: tuple | None = None

    def __len__(self) -> int:
        """Requests with a token here."""
        if self._batch is None:
            return len(self._entries)
        return len(self._entries.keys() | set(self._batch[0]))

    def add_rows(
        self,
        rids: list[str],
        items: list[WorkItem],
        lives: list[LiveRequest],
        starts: list[int],
        keys: list[int],
        block: tuple,
    ) -> None:
        """The carried rows that ended in a step, in row order. The lists are kept as they are
        (none is changed here) and handed back by ``take``, whose caller may change ``items``
        and ``lives``: those two must be lists no step reads."""
        self._flush()
        if self._entries:  # (older tokens of theirs)
            list(map(self._entries.pop, rids, repeat(None)))
        self._batch = (rids, items, lives, starts, keys, block)
        if len(set(rids)) < len(rids):  # (a request's two tokens: only its newest continues)
            self._flush()

    def add(self, rid: str, item: WorkItem, live: LiveRequest, start: int, key: int) -> None:
        """A token that ended at its first loop (a plan item), after the step's rows."""
        self._entries[rid] = (item, live, start, key, None, 0)

    def take(self, continued: list[tuple[str, int, int]]) -> tuple:
        """The ended tokens the plan continues (``StepPlan.continued``: request id, ended
        token's key, new key), each once: their new keys, items, request states, positions
        (lists the caller may keep and change), their table rows (``_rows``, ``_lens``) when
        known and their first loop's spec columns when kept. Raises ``RuntimeError``, every
        token left here, when one is not (or is not its request's newest)."""
        rids, previous, keys = map(list, zip(*continued))
        batch = self._batch
        if batch is not None and not self._entries and rids == batch[0] and previous == batch[4]:
            self._batch = None  # (every row of the batch continues, in order)
            _, items, lives, starts, _, (rows, lens, columns) = batch
            return keys, items, lives, starts, (rows, lens), columns
        self._flush()
        ended = list(map(self._entries.get, rids))
        if None in ended or list(map(_KEY, ended)) != previous:
            rid, key = next(
                (r, p) for r, e, p in zip(rids, ended, previous) if e is None or e[3] != p
            )
            raise RuntimeError(f"{rid}: no ended carried token {key} to continue")
        list(map(self._entries.pop, rids))
        # Their table rows: usually all in one block (the tokens that ended in one step).
        first = ended[0][4]
        tables = columns = None
        if first is not None and all(map(is_, map(_BLOCK, ended), repeat(first))):
            rows, lens, specs = first
            at = list(map(_AT, ended))
            if len(at) == rows.shape[0] and at == list(range(len(at))):
                tables, columns = (rows, lens), specs  # (every token that ended with them)
            else:
                if specs is not None and len(at) > 1:
                    columns = tuple(map(itemgetter(*at), specs))
                at = np.array(at, dtype=np.intp)  # (converted once for both)
                tables = (rows[at], lens[at])
        items, lives, starts = list(zip(*ended))[:3]
        return keys, list(items), list(lives), starts, tables, columns

    def drop(self, request_ids: Collection[str]) -> None:
        """Forgets the tokens of requests the runner no longer runs."""
        if not request_ids:
            return  # (the batch stays one)
        self._flush()
        for rid in request_ids:
            self._entries.pop(rid, None)

    def clear(self) -> None:
        self._entries.clear()
        self._batch = None

    def _flush(self) -> None:
        """Moves the batch's tokens into entries, each unless a newer token of its request is
        there (and a request's last in the batch, its newest)."""
        batch = self._batch
        if batch is None:
            return
        self._batch = None
        rids, items, lives, starts, keys, block = batch
        ended = zip(items, lives, starts, keys, repeat(block), range(len(rids)))
        entries = dict(zip(rids, ended))
        entries.update(self._entries)
        self._entries = entries
