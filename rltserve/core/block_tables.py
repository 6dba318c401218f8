"""``BlockTables``: the runner's persistent host copy of the block tables its steps use.

A step's attention metadata needs every item's block table as one padded int64 array. Built
from the tables' Python lists each step, that costs one list-to-array conversion per item (most
of a decode step's metadata time at long contexts). Here each table a request uses, keyed by
(request id, depth), keeps a row of one persistent array; a step compares each table with the
snapshot its row was written from (a C-speed list comparison) and rewrites only rows whose
table changed (a block appended, or replaced), then takes its rows with one fancy index.

Invariants: a row holds exactly its snapshot's blocks, then the snapshot's first block in every
further column (padding that is always a valid block id); a row is used only after its
snapshot compares equal to the table, so a row is right whatever happened to the table since.
Torch-free.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np


class BlockTables:
    def __init__(self, rows: int = 64, cols: int = 16) -> None:
        self.array = np.zeros((rows, cols), dtype=np.int64)  # [rows, cols] block ids
        # (request id, which table) -> [row, snapshot of the table the row was written from]
        self._entries: dict[tuple[str, Hashable], list] = {}
        self._keys_of: dict[str, list[tuple[str, Hashable]]] = {}  # request id -> its keys
        self._free = list(range(rows - 1, -1, -1))

    @property
    def num_rows_used(self) -> int:
        return self.array.shape[0] - len(self._free)

    def gather(
        self, keys: Sequence[tuple[str, Hashable]], tables: Sequence[list[int]]
    ) -> np.ndarray:
        """[len(tables), max table length] int64: the tables, padded as the rows are. ``keys``
        name the tables: (request id, anything telling a request's tables apart)."""
        entries = self._entries
        rows = []
        for key, table in zip(keys, tables):
            entry = entries.get(key)
            if entry is None or entry[1] != table:
                entry = self._sync(key, table, entry)
            rows.append(entry[0])
        width = max(map(len, tables))
        return self.array[np.array(rows, dtype=np.int64), :width]

    def release(self, request_id: str) -> None:
        """Frees the rows of a request the runner no longer runs."""
        for key in self._keys_of.pop(request_id, ()):
            self._free.append(self._entries.pop(key)[0])

    def clear(self) -> None:
        """Frees every row (the runner forgot every request)."""
        for request_id in list(self._keys_of):
            self.release(request_id)

    def _sync(self, key: tuple[str, Hashable], table: list[int], entry: list | None) -> list:
        """The entry of ``key``, its row rewritten from a snapshot of ``table``."""
        if entry is None:
            entry = self._entries[key] = [self._new_row(), None]
            self._keys_of.setdefault(key[0], []).append(key)
        # One snapshot, written and kept: a table changed meanwhile by another thread is
        # caught by the next step's comparison.
        snapshot = table[:]
        self._write(entry[0], snapshot)
        entry[1] = snapshot
        return entry

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
