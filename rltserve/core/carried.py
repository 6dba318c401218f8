"""``CarriedRows``: the decode tokens the runner runs by itself (``plan.Carry``).

A carried token's first loop comes in a plan (a ``WorkItem``, or, continuing the request's
previous token, a key in ``StepPlan.continued``); the runner keeps the item and runs one
loop of the token in every later step, one depth deeper each time, until the step in which it
ends or its request is dropped. A token whose input is on the runner (the token its request
sampled last) joins the rows before its first loop (``advance``, ``start``), so a decode
batch stays carried rows alone; one whose input was recorded (the first after a replay:
resumed after preemption, or after forced thinking tokens) runs its first loop as a plan item
and joins after it (``keep``). Carried rows run first in a step, in the order they joined (a
request's older token first), so a decode batch keeps its row order from step to step
(``PendingRows`` then passes states on).

A request's next token usually continues it (``StepPlan.continued``): the same ``Carry`` at
the next position. It keeps the item of the token it continues as its own (a *template*:
every field but the position, the key and the input is the same; a token entering a new KV
block gets the template with its new tables, ``StepPlan.moved``, ``_move``), so a
row's position and key are columns (``starts``, ``keys``), never its item's ``start`` and
``carry.key``, and a continued row's input is on the runner, whatever its item's
``token_ids``. The tokens that ended wait in ``EndedTokens`` (``ended.py``) for the plan that
continues them: a decode batch's, as the columns they ended with.

What moves from loop to loop is kept as columns beside the items, never written into them:
the depths, the exit specs (a fixed exit's spec changes at its exit loop), and for attention
metadata the positions and, per depth, the ``BlockTables`` row of the token's table there
(registered when the token starts; a request's next token reuses its rows while its tables are
the same lists). Beside them, the runner's ``LiveRequest`` and ``ItemState`` of each token,
which stay the same objects while it is carried. A step reads its carried rows' depths, specs,
tables, request states and held states from these columns; an item's own ``depth``,
``block_table``, ``exit`` and ``exit_copy_blocks`` are its first loop's (the block table and
copy targets of depth d come from the ``Carry``: ``table_at``, ``carry.copy_blocks[d:]``).

Invariants: plans' ``WorkItem``s are never changed; ``advance`` replaces the ``depths`` and
``specs`` lists rather than changing them (and every column list, and every numpy column, is
replaced, not changed, when rows come or go), so a step that still holds the lists it ran with
reads them unchanged, and ended tokens' table rows (``keep``) may become a refilled batch's
columns as they are; so may the ended rows' spec columns (tuples), kept only when
no row has a fixed exit (so every row's spec is its item's ``exit``, its successor's first
spec). The table rows are valid whenever a step reads them: a request's
rows are released with its carried tokens dropped before the next step is built (by the launch
that releases or preempts it; after a failed step, which releases its requests' rows at once,
by the next launch, which drops them first), and rows never go back to an earlier table
(``BlockTables``). So are the request and held states: a request's ``LiveRequest`` is replaced
only after a launch dropped its carried tokens, and a carried token's ``ItemState`` is never
replaced (only a rollback, never a carried token's, or a new item at loop 1 makes one).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Collection
from itertools import chain, compress
from operator import add, attrgetter, is_
from typing import TYPE_CHECKING

import numpy as np

from rltserve.core.block_tables import BlockTables
from rltserve.core.ended import EndedTokens
from rltserve.core.metadata import Spans
from rltserve.core.plan import Carry, ExitSpec, WorkItem

if TYPE_CHECKING:  # (torch-free at run time)
    from rltserve.core.live import ItemState, LiveRequest

_RID = attrgetter("request_id")
_EXIT = attrgetter("exit")
_ENDS_AT = attrgetter("ends_at")
_EXIT_AT = attrgetter("carry.exit_at")
_START = attrgetter("start")
_NEXT = (1).__add__
_SPEC = attrgetter("mode", "exit_now", "min_loops", "max_loops", "threshold")


class CarriedRows:
    def __init__(self, tables: BlockTables) -> None:
        self._tables = tables
        self._empty()
        # Request id -> its last carried token's tables and their rows and lengths.
        self._known: dict[str, tuple[list[list[int]], list[int], list[int]]] = {}
        self._ended = EndedTokens()  # the tokens a plan may continue

    def drop(self, request_ids: Collection[str]) -> None:
        """Forgets the tokens of requests the runner no longer runs."""
        self._ended.drop(request_ids)
        for rid in request_ids:
            self._known.pop(rid, None)  # their BlockTables rows are released
        if self.items and request_ids:
            gone = [k for k, w in enumerate(self.items) if w.request_id in request_ids]
            if gone:
                self._remove(gone)

    def clear(self) -> None:
        self._remove(range(len(self.items)))
        self._known.clear()
        self._ended.clear()

    def table_at(self, k: int, depth: int) -> list[int]:
        """Row ``k``'s block table at loop ``depth``."""
        return self.items[k].carry.tables[depth - 1]

    def spec_columns(self) -> tuple:
        """The columns of ``specs`` (modes, exit_now, min_loops, max_loops, thresholds), then
        the set of modes and the lowest cap, built once per ``specs`` list (a decode batch
        keeps one for several steps)."""
        if self._spec_columns[0] is not self.specs:
            columns = tuple(zip(*map(_SPEC, self.specs))) if self.specs else ((),) * 5
            self._spec_columns = (self.specs, _with_summary(columns))
        return self._spec_columns[1]

    def spans(self) -> tuple[Spans, np.ndarray]:
        """The carried rows at their current depths (after ``advance``): their attention spans
        without tables, and [B] the ``BlockTables`` rows holding the tables."""
        n = len(self.items)
        depths = self.depths
        if n and depths.count(depths[0]) == n:  # (a decode batch in lockstep: one column)
            d = depths[0] - 1
            lens, rows = self._lens[:, d], self._rows[:, d]
        else:
            ar = np.arange(n)
            d = np.fromiter(depths, dtype=np.int64, count=n) - 1
            lens, rows = self._lens[ar, d], self._rows[ar, d]
        return Spans(self._starts, np.ones(n, dtype=np.int64), lens), rows

    def advance(
        self, continued: list[tuple[str, int, int]] = (), moved: list[tuple] = ()
    ) -> list[WorkItem]:
        """Moves every carried token to its next loop, then starts the ``continued`` tokens
        (``StepPlan.continued``; ``moved``: those entering a new KV block) at loop 1 after
        them; returns them all, in carry order. A continued token's state is set by the step
        that runs its first loop (``held``)."""
        if continued:  # (checked before anything changes)
            keys, templates, lives, starts, tables, columns = self._ended.take(continued)
        if self.items:
            depths = self.depths
            if depths.count(depths[0]) == len(depths):  # (a decode batch in lockstep)
                self.depths = [depths[0] + 1] * len(depths)
            else:
                self.depths = list(map(_NEXT, depths))
            if self._fixed:
                specs = self.specs = self.specs[:]
                for k in self._fixed:
                    c = self.items[k].carry
                    specs[k] = c.specs[self.depths[k] >= c.exit_at]
        if continued:  # the next positions, each under its predecessor's item
            # Their tables are their predecessors': so are the table rows, kept when they
            # ended, and their first loop's specs, their predecessors' columns when kept.
            if moved:
                tables = self._move(templates, keys, moved, tables)
            n = len(keys)
            self._append(
                templates, list(map(_NEXT, starts)), keys, lives, [None] * n, tables, columns
            )
        return self.items

    def _move(
        self,
        templates: list[WorkItem],
        keys: list[int],
        moved: list[tuple],
        tables: tuple[np.ndarray, np.ndarray] | None,
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """Continued tokens entering a new KV block (``StepPlan.moved``; ``keys``: the
        continued tokens'): each gets an item of its own (``_moved``) in ``templates``, its
        tables registered; returns the continued rows' ``_rows`` and ``_lens`` (``tables``,
        their predecessors' when known) with those rows rewritten, in new arrays. (Entries of
        tokens not continued, their requests dropped, are passed over.)"""
        index = {key: k for k, key in enumerate(keys)}
        at = []
        for key, carry_tables, boundary, blocks in moved:
            k = index.get(key)
            if k is not None:
                templates[k] = _moved(templates[k], carry_tables, boundary, blocks)
                at.append(k)
        if tables is None or not at:
            return tables  # (``_append`` registers every continued token's tables)
        known = self._register([templates[k] for k in at])
        rows, lens = tables[0].copy(), tables[1].copy()  # (arrays are replaced, not changed)
        width = rows.shape[1]
        for k, (_, table_rows, table_lens) in zip(at, known):
            pad = width - len(table_rows)  # (a row narrower than the widest repeats its last)
            rows[k] = table_rows + table_rows[-1:] * pad
            lens[k] = table_lens + table_lens[-1:] * pad
        return rows, lens

    def start(self, fresh: list[WorkItem], lives: list[LiveRequest]) -> list[WorkItem]:
        """Starts a plan's new carried tokens (``fresh``, at loop 1; ``lives``: their
        requests' states) after the others, as ``advance`` starts continued ones: their
        inputs are on the runner. Returns every carried item, in carry order."""
        keys = [w.carry.key for w in fresh]
        self._append(fresh, list(map(_START, fresh)), keys, lives, [None] * len(fresh))
        return self.items

    def keep(
        self,
        items: list[WorkItem],
        num_carried: int,
        ending: list[int],
        lives: list[LiveRequest],
        held: list[ItemState],
    ) -> None:
        """After a step over ``items`` (its first ``num_carried`` the carried ones; ``lives``
        and ``held`` aligned with them; ``ending``: the items that end, in increasing order):
        the tokens that go on are the carried ones that did not end, then the plan's new
        carried tokens that ran their first loop as plan items (a recorded input: the others
        joined before the step). Each request's newest token that ended is kept for a plan to
        continue."""
        if ending:
            ended = self._ended
            gone = ending[: bisect_left(ending, num_carried)]  # (the carried rows')
            # Their table rows, for the tokens that continue them (``advance``): these arrays
            # when every row ends (``_remove`` replaces them, never changes them).
            if gone:
                starts, keys = self.starts, self.keys  # (the carried rows' columns)
                if len(gone) == num_carried:  # (a decode batch's tokens ending together)
                    # With the rows' spec columns when each row's spec is its item's ``exit``
                    # (no fixed exit changed one), the first loop's spec of its successor.
                    columns = self._spec_columns
                    specs = None
                    if not self._fixed and columns[0] is self.specs:
                        specs = columns[1][:5]
                    block = (self._rows, self._lens, specs)
                    ws, ls = items[:num_carried], lives[:num_carried]
                else:
                    block = (self._rows[gone], self._lens[gone], None)
                    ws, ls = [items[i] for i in gone], [lives[i] for i in gone]
                    starts, keys = [starts[i] for i in gone], [keys[i] for i in gone]
                ended.add_rows(list(map(_RID, ws)), ws, ls, starts, keys, block)
            for i in ending[len(gone) :]:  # a plan's item that is a carried token's first loop
                w = items[i]
                if w.carry is not None:
                    ended.add(w.request_id, w, lives[i], w.start, w.carry.key)
            if gone:
                self._remove(gone)
        new = [i for i, w in enumerate(items[num_carried:], num_carried) if w.carry is not None]
        if new and ending:
            ends = set(ending)
            new = [i for i in new if i not in ends]
        if new:
            fresh = [items[i] for i in new]
            self._append(
                fresh,
                [w.start for w in fresh],
                [w.carry.key for w in fresh],
                [lives[i] for i in new],
                [held[i] for i in new],
            )

    def _append(
        self,
        fresh: list[WorkItem],
        starts: list[int],
        keys: list[int],
        lives: list[LiveRequest],
        held: list[ItemState | None],
        tables: tuple[np.ndarray, np.ndarray] | None = None,
        columns: tuple | None = None,
    ) -> None:
        """Adds carried tokens at loop 1 after the others: ``fresh`` their items (or
        templates), then their columns; ``tables``: their rows of ``_rows`` and ``_lens``
        when known, else their tables are registered where new; ``columns``: the spec
        columns of their items' ``exit`` when known (``spec_columns``' first five), given
        only for items without a fixed exit (``keep`` keeps none of a batch with one)."""
        refilled = not self.items
        if tables is None:
            known = self._register(fresh)
            widths = [len(k[1]) for k in known]
            width = max(widths)
            rows = _columns([k[1] for k in known], widths, width)
            lens = _columns([k[2] for k in known], widths, width)
        else:
            rows, lens = tables
        if refilled:  # (its columns are the new rows', as they are)
            self._starts = np.array(starts, dtype=np.int64)
            self._rows, self._lens = rows, lens
        else:
            width = rows.shape[1]
            if width > self._rows.shape[1]:
                self._rows = _widen(self._rows, width)
                self._lens = _widen(self._lens, width)
            elif width < self._rows.shape[1]:
                rows = _widen(rows, self._rows.shape[1])
                lens = _widen(lens, self._rows.shape[1])
            self._starts = np.concatenate((self._starts, starts))
            self._rows = np.concatenate((self._rows, rows))
            self._lens = np.concatenate((self._lens, lens))
        n = len(self.items)
        fixed = []  # (none when their spec columns were kept: ``keep`` keeps no fixed exit's)
        if columns is None:
            fixed = list(compress(range(n, n + len(fresh)), map(_EXIT_AT, fresh)))
        if fixed:
            self._fixed = self._fixed + fixed
        self.items = self.items + fresh
        self.starts = self.starts + starts
        self.keys = self.keys + keys
        self.ends = self.ends + list(map(_ENDS_AT, fresh))
        self.lives = self.lives + lives
        self.held = self.held + held
        self.depths = self.depths + [1] * len(fresh)
        old, added = self.specs, list(map(_EXIT, fresh))  # (their first loop's)
        self.specs = old + added
        if refilled and columns is not None:
            self._spec_columns = (self.specs, _with_summary(columns))
        elif self._spec_columns[0] is old and added:  # (the columns grow with the rows)
            columns = self._spec_columns[1][:5]
            columns = tuple(map(add, columns, zip(*map(_SPEC, added))))
            self._spec_columns = (self.specs, _with_summary(columns))

    def _register(self, fresh: list[WorkItem]) -> list[tuple]:
        """Per starting token: (tables, their BlockTables rows, their lengths): its request's
        previous token's when the tables are the same lists (they change every block_size
        tokens), else registered now (all such tokens in one ``BlockTables.rows``)."""
        known = list(map(self._known.get, map(_RID, fresh)))
        stale = [
            k
            for k, (w, kn) in enumerate(zip(fresh, known))
            if kn is None or (kn[0] is not w.carry.tables and not _same(kn[0], w.carry.tables))
        ]
        if not stale:
            return known
        keys, tables = [], []
        for k in stale:
            w = fresh[k]
            keys += [(w.request_id, d) for d in range(1, len(w.carry.tables) + 1)]
            tables += w.carry.tables
        rows = self._tables.rows(keys, tables)
        lens = list(map(len, tables))
        at = 0
        for k in stale:
            w = fresh[k]
            n = len(w.carry.tables)
            entry = (w.carry.tables, rows[at : at + n], lens[at : at + n])
            known[k] = self._known[w.request_id] = entry
            at += n
        return known

    def _empty(self) -> None:
        """No rows: every column empty (new lists and arrays: a step may hold the old)."""
        self.items: list[WorkItem] = []  # each carried token's item (template), carry order
        self.starts: list[int] = []  # each token's position
        self.keys: list[int] = []  # its ``Carry.key`` (the scheduler's name for it)
        self.ends: list[int] = []  # its item's ``ends_at`` (its last loop at the latest)
        self.depths: list[int] = []  # each token's depth at the step last built
        self.specs: list[ExitSpec | None] = []  # its exit spec at that depth
        # The runner's values of each token, which stay the same objects while it is carried:
        # its request's ``LiveRequest`` and its ``ItemState``.
        self.lives: list[LiveRequest] = []
        # (None for a token that joined before its first loop, ``advance`` or ``start``,
        # until the step running that loop enters it.)
        self.held: list[ItemState | None] = []
        self._fixed: list[int] = []  # rows whose spec changes at a fixed exit loop
        self._spec_columns: tuple[list | None, tuple] = (None, ())  # (specs, their columns)
        # Columns of ``items`` for metadata: positions, and per depth 1..W (W: the widest
        # token; narrower rows repeat their last) the BlockTables row of the table there and
        # the table's length.
        self._starts = np.zeros(0, dtype=np.int64)  # [n]
        self._rows = np.zeros((0, 1), dtype=np.int64)  # [n, W]
        self._lens = np.zeros((0, 1), dtype=np.int64)  # [n, W]

    def _remove(self, gone: Collection[int]) -> None:
        """Drops the rows ``gone`` (indices)."""
        if len(gone) == len(self.items):  # (a decode batch's tokens ending together)
            self._empty()
            return
        keep = np.ones(len(self.items), dtype=bool)
        keep[list(gone)] = False
        kept = keep.tolist()
        self.items = list(compress(self.items, kept))
        self.starts = list(compress(self.starts, kept))
        self.keys = list(compress(self.keys, kept))
        self.ends = list(compress(self.ends, kept))
        self.depths = list(compress(self.depths, kept))
        old = self.specs
        self.specs = list(compress(old, kept))
        if self._spec_columns[0] is old:  # (the columns lose the rows too)
            columns = tuple(tuple(compress(c, kept)) for c in self._spec_columns[1][:5])
            self._spec_columns = (self.specs, _with_summary(columns))
        self.lives = list(compress(self.lives, kept))
        self.held = list(compress(self.held, kept))
        if self._fixed:
            index = np.cumsum(keep) - 1  # old row -> new row, where kept
            self._fixed = [int(index[k]) for k in self._fixed if kept[k]]
        self._starts = self._starts[keep]
        self._rows = self._rows[keep]
        self._lens = self._lens[keep]


def _moved(
    template: WorkItem,
    tables: list[list[int]],
    boundary: list[int] | None,
    copy_blocks: list[int],
) -> WorkItem:
    """``template``'s item with the fields a new KV block changes (``StepPlan.moved``), as
    ``ItemMaker.carried_item`` builds a carried token's item. (Positional, in field order.)"""
    carry = template.carry
    return WorkItem(
        template.request_id,  # request_id
        template.start,  # start (a continued row's is a column)
        1,  # num_tokens
        1,  # depth
        template.ends_at,  # ends_at
        template.stop_at_exit,  # stop_at_exit
        tables[0],  # block_table
        template.token_ids,  # token_ids (a continued row's input is on the runner)
        boundary,  # boundary_table
        template.exit,  # exit (its first loop's spec: the request's, as the predecessor's)
        copy_blocks[1:],  # exit_copy_blocks
        False,  # draft (carried tokens are never pipelined)
        template.epoch,  # epoch
        Carry(carry.key, tables, carry.specs, carry.exit_at, copy_blocks),  # carry
    )


def _with_summary(columns: tuple) -> tuple:
    """Spec columns (modes, exit_now, min_loops, max_loops, thresholds), then the set of
    modes and the lowest cap (0 without rows)."""
    return (*columns, frozenset(columns[0]), min(columns[3]) if columns[3] else 0)


def _same(known: list[list[int]], tables: list[list[int]]) -> bool:
    """Whether a token's tables (not the list an earlier token registered: the KV manager
    hands out one list until the tables change, but a capped token gets a slice of it) are
    those lists."""
    return len(known) == len(tables) and all(map(is_, known, tables))


def _columns(values: list[list[int]], widths: list[int], width: int) -> np.ndarray:
    """[len(values), width] int64: the lists, each padded with its last value."""
    if widths.count(width) < len(widths):
        values = [v + v[-1:] * (width - len(v)) for v in values]
    flat = np.fromiter(chain.from_iterable(values), dtype=np.int64, count=len(values) * width)
    return flat.reshape(len(values), width)


def _widen(array: np.ndarray, width: int) -> np.ndarray:
    """``array`` [n, w] with its last column repeated up to ``width`` columns."""
    return np.pad(array, ((0, 0), (0, width - array.shape[1])), mode="edge")
