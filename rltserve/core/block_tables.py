"""``BlockTables``: the runner's persistent host copy of the block tables its steps use.

A step's attention metadata needs every item's block table as one padded int64 array. Built
from the tables' Python lists each step, that costs one list-to-array conversion per item (most
of a decode step's metadata time at long contexts). Here each table a request uses, keyed by
(request id, depth), keeps a row of one persistent array; a step rewrites only rows whose table
changed (a block appended, or replaced), then takes its rows with one fancy index.

Tables are lists the KV manager never changes once handed out: a table that grows is a new
list (``KVManager.grow``). So a row whose entry holds the very list it was written from, at
the length written, is current without reading the list (at 1k context, comparing every
table with a snapshot read ~256 KB per 256-row step). A table changed in place by appending
is caught by its length; a new list, equal or not, by identity.

A request's tables only grow while it holds KV (a table handed out is a prefix of every later
one of its plane), so rows never go back: a key given an earlier, shorter version of its
row's table uses the row as it is, whose extra blocks lie past that item's context. The
runner registers a carried token's tables for every depth when the token starts and reads
those rows in later steps without looking them up again; today's schedules never then hand
the same key an earlier table (a token is carried only when every earlier item of its
request is), and the rule keeps a row right should one ever do so.

Invariants: a row holds exactly the blocks of the list its entry holds, at the length
recorded, then that list's first block in every further column (padding that is always a
valid block id). The entry keeps the list alive, so an identity match is never an id reused.
Torch-free.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from operator import eq, getitem, itemgetter

import numpy as np

_ROW = itemgetter(0)
_TABLE = itemgetter(1)
_LENGTH = itemgetter(2)
_NEXT = (1).__add__


class BlockTables:
    def __init__(self, rows: int = 64, cols: int = 16) -> None:
        self.array = np.zeros((rows, cols), dtype=np.int64)  # [rows, cols] block ids
        # (request id, which table) -> [row, the table the row was written from, its length]
        self._entries: dict[tuple[str, Hashable], list] = {}
        # id(table) -> an entry holding that very list (which keeps it alive: the id is never
        # another list's), so a step finds its rows without building keys.
        self._by_table: dict[int, list] = {}
        self._keys_of: dict[str, list[tuple[str, Hashable]]] = {}  # request id -> its keys
        self._free = list(range(rows - 1, -1, -1))

    @property
    def num_rows_used(self) -> int:
        return self.array.shape[0] - len(self._free)

    def gather(
        self, keys: Sequence[tuple[str, Hashable]], tables: Sequence[list[int]]
    ) -> np.ndarray:
        """[len(tables), max table length] int64: the tables, padded with valid blocks.
        ``keys`` name the tables: (request id, anything telling a request's tables apart)."""
        rows = self.rows(keys, tables)  # first: it may replace the array
        return self.array[rows, : max(map(len, tables))]

    def rows(self, keys: Sequence[tuple[str, Hashable]], tables: Sequence[list[int]]) -> list[int]:
        """The rows of ``array`` holding ``tables`` (named by ``keys``), brought up to date."""
        lengths = list(map(len, tables))
        found = list(map(self._by_table.get, map(id, tables)))
        if all(found) and list(map(_LENGTH, found)) == lengths:  # every table as written
            return list(map(_ROW, found))
        if not any(found):  # (every table a new list: tokens entering a new block, say)
            rows = self._grown_by_one(keys, tables, lengths)
            if rows is not None:
                return rows
        # A few changed (a table grows every block_size tokens): only they are looked up.
        rows = [-1 if e is None or e[2] != n else e[0] for e, n in zip(found, lengths)]
        get = self._entries.get
        for k in [k for k, row in enumerate(rows) if row < 0]:
            key, table, n = keys[k], tables[k], lengths[k]
            entry = get(key)
            if entry is None or entry[1] is not table or entry[2] != n:
                if entry is not None and n < entry[2] and entry[1][:n] == table:
                    # An earlier version of the row's table (a request's tables only grow):
                    # the row holds it, and a later item of the request may still need more.
                    rows[k] = entry[0]
                    continue
                entry = self._sync(key, table, entry)
            else:
                self._by_table[id(table)] = entry
            rows[k] = entry[0]
        return rows

    def _grown_by_one(
        self, keys: Sequence[tuple[str, Hashable]], tables: Sequence[list[int]], lengths: list[int]
    ) -> list[int] | None:
        """When every table is its key's list written last (at its length) with one block
        appended, as decode tokens entering a new block get from the KV manager: those blocks
        written, the rows returned. Else None, nothing changed. (``_sync``'s usual case, for
        a batch at C speed: a 256-row decode batch at 16-token blocks brings 16 such tokens a
        step, each with a table per depth.)"""
        entries = list(map(self._entries.get, keys))
        if not all(entries) or len(set(map(id, entries))) != len(entries):
            return None  # (a new key, or one twice)
        olds = list(map(_TABLE, entries))
        written = list(map(_LENGTH, entries))
        if (
            list(map(_NEXT, written)) != lengths
            or 0 in written
            or max(lengths) > self.array.shape[1]
            # Each table's first ``written`` blocks are its old list (one appended to in place
            # since is longer, and fails).
            or not all(map(eq, map(getitem, tables, map(slice, written)), olds))
        ):
            return None
        rows = list(map(_ROW, entries))
        self.array[rows, written] = list(map(getitem, tables, written))
        by_table = self._by_table
        for entry in entries:  # (``_unmap``: the old lists are alive until replaced below)
            if by_table.get(id(entry[1])) is entry:
                del by_table[id(entry[1])]
        for entry, table, n in zip(entries, tables, lengths):
            entry[1], entry[2] = table, n
        by_table.update(zip(map(id, tables), entries))
        return rows

    def release(self, request_id: str) -> None:
        """Frees the rows of a request the runner no longer runs."""
        for key in self._keys_of.pop(request_id, ()):
            entry = self._entries.pop(key)
            self._unmap(entry)
            self._free.append(entry[0])

    def clear(self) -> None:
        """Frees every row (the runner forgot every request)."""
        for request_id in list(self._keys_of):
            self.release(request_id)

    def _sync(self, key: tuple[str, Hashable], table: list[int], entry: list | None) -> list:
        """The entry of ``key`` ([row, table, length]), its row rewritten from ``table``."""
        if entry is None:
            entry = self._entries[key] = [self._new_row(), None, 0]
            self._keys_of.setdefault(key[0], []).append(key)
        # The length is read before the blocks: a table appended to meanwhile (by another
        # thread) mismatches it at the next step and is rewritten then.
        n = len(table)
        old, m = entry[1], entry[2]
        if 0 < m < n <= self.array.shape[1] and table[:m] == (old if len(old) == m else old[:m]):
            # Grown (the usual change): only the new blocks are written; the padding after
            # them is the first block, the same in both.
            if n == m + 1:  # (a decode token's next block: one element, no list conversion)
                self.array[entry[0], m] = table[m]
            else:
                self.array[entry[0], m:n] = table[m:n]
        else:
            self._write(entry[0], table[:n])
        self._unmap(entry)
        entry[1], entry[2] = table, n
        self._by_table[id(table)] = entry
        return entry

    def _unmap(self, entry: list) -> None:
        """Drops the id of the entry's table from the lookup, if it leads to this entry (two
        keys may share one list: planes shared by several depths)."""
        if self._by_table.get(id(entry[1])) is entry:
            del self._by_table[id(entry[1])]

    def _new_row(self) -> int:
        if not self._free:
            old = self.array.shape[0]
            self.array = np.concatenate([self.array, np.zeros_like(self.array)])
            self._free = list(range(2 * old - 1, old - 1, -1))
        return self._free.pop()

    def _write(self, row: int, table: list[int]) -> None:
        n = len(table)
        cols = self.array.shape[1]
        if n > cols:
            while cols < n:
                cols *= 2
            grown = np.empty((self.array.shape[0], cols), dtype=np.int64)
            grown[:, : self.array.shape[1]] = self.array
            grown[:, self.array.shape[1] :] = self.array[:, :1]  # every row's padding
            self.array = grown
        dest = self.array[row]
        dest[:n] = table
        dest[n:] = table[0] if n else 0
