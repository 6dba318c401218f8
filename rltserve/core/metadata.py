"""Attention metadata on the host: the items of a step as columns (``Spans``) and the int64
arrays one attention group needs (``HostMetadata``), computed with numpy. Torch-free: the
runner sends them to the device in one transfer (``attention.to_device_packed``).

Items are ``ItemSpec``s; rows of the step are the items' tokens concatenated in item order.
``attention_groups`` splits a step so that neither a prompt chunk's rows nor the step's longest
context pad a short decode row (unless the padded batch is within a pad budget:
``group_indices``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# (start, num_tokens, block_table): rows at positions start..start+num_tokens-1 whose context is
# positions [0, start + num_tokens) under block_table.
ItemSpec = tuple[int, int, Sequence[int]]


@dataclass(frozen=True)
class Spans:
    """Items (``ItemSpec``s) as columns: what metadata needs of them, built without a Python
    step per item when the caller keeps them as arrays (the runner's carried rows)."""

    starts: np.ndarray  # [B] int64: each item's first position
    lens: np.ndarray  # [B] int64: its rows
    table_lens: np.ndarray  # [B] int64: blocks its table holds
    # [B, >= the columns used] int64, past each table's length padded with valid blocks;
    # None: rows ``rows`` of ``source`` (``BlockTables.array``, padded the same way), taken
    # once the column count is known, or else built from ``lists`` (the tables as lists).
    tables: np.ndarray | None = None
    lists: Sequence[Sequence[int]] | None = None
    rows: np.ndarray | None = None  # [B]
    source: np.ndarray | None = None

    @classmethod
    def of(cls, items: Sequence[ItemSpec], tables: np.ndarray | None = None) -> Spans:
        """``items`` as columns; ``tables``: their tables already padded (``BlockTables``)."""
        if not items:
            raise ValueError("attention metadata needs at least one item")
        columns = list(zip(*items))
        starts = np.array(columns[0], dtype=np.int64)
        lens = np.array(columns[1], dtype=np.int64)
        table_lens = np.fromiter(map(len, columns[2]), dtype=np.int64, count=len(items))
        return cls(starts, lens, table_lens, tables, None if tables is not None else columns[2])

    @staticmethod
    def concat(first: Spans, second: Spans) -> Spans:
        """The items of ``first``, then those of ``second``, without tables (the caller
        gives the joined items' ``tables``, ``lists`` or ``rows`` anew)."""
        return Spans(
            np.concatenate((first.starts, second.starts)),
            np.concatenate((first.lens, second.lens)),
            np.concatenate((first.table_lens, second.table_lens)),
        )

    def on_rows(self, rows, source: np.ndarray) -> Spans:
        """The items, their tables rows ``rows`` of ``source`` (``BlockTables.array``)."""
        rows = np.asarray(rows, dtype=np.int64)
        return Spans(self.starts, self.lens, self.table_lens, rows=rows, source=source)

    def take(self, ks: np.ndarray) -> Spans:
        """The items ``ks`` (an index array), in that order."""
        return Spans(
            self.starts[ks],
            self.lens[ks],
            self.table_lens[ks],
            None if self.tables is None else self.tables[ks],
            None if self.lists is None else [self.lists[k] for k in ks.tolist()],
            None if self.rows is None else self.rows[ks],
            self.source,
        )

    def padded_tables(self, num_cols: int) -> np.ndarray:
        """[B, num_cols] int64: the tables, each padded with its first block."""
        if self.tables is not None:
            return self.tables[:, :num_cols]
        if self.rows is not None:
            return self.source[self.rows, :num_cols]
        assert self.lists is not None
        tables = np.empty((len(self.lists), num_cols), dtype=np.int64)
        for row, table in zip(tables, self.lists):
            m = min(len(table), num_cols)
            row[:m] = table[:m]
            row[m:] = table[0]  # padding: a valid block, masked
        return tables


@dataclass(frozen=True)
class HostMetadata:
    """The host half of one group's metadata: int64 arrays computed with numpy from the items,
    before anything reaches the device. ``tables`` is [B, num_cols], padded with valid blocks."""

    num_rows: int  # N
    num_items: int  # B
    max_q: int
    max_ctx: int
    num_cols: int
    starts: np.ndarray  # [B]
    lens: np.ndarray  # [B]
    positions: np.ndarray  # [N]
    slot_mapping: np.ndarray  # [N]
    pad_index: np.ndarray  # [N]
    tables: np.ndarray  # [B, num_cols]
    # ``parts()`` concatenated, when the arrays above are views of it (``decode_metadata``).
    packed: np.ndarray | None = None

    @classmethod
    def build(
        cls,
        items: Sequence[ItemSpec],
        block_size: int,
        *,
        num_cols: int | None = None,
        tables: np.ndarray | None = None,
    ) -> HostMetadata:
        """``tables``: the items' block tables already padded, [B, >= num_cols] int64 (rows
        past a table's length hold valid blocks), e.g. from ``BlockTables``; default: built
        from the items' lists."""
        return cls.of(Spans.of(items, tables), block_size, num_cols=num_cols)

    @classmethod
    def of(cls, spans: Spans, block_size: int, *, num_cols: int | None = None) -> HostMetadata:
        """The metadata of ``spans``; ``num_cols`` as for ``AttentionMetadata.build``."""
        starts, lens = spans.starts, spans.lens
        num_items = len(starts)
        if num_items == 1:
            return cls._one(spans, block_size, num_cols)
        if not num_items:
            raise ValueError("attention metadata needs at least one item")
        ends = starts + lens
        if lens.min() < 1 or starts.min() < 0:
            k = int(np.flatnonzero((lens < 1) | (starts < 0))[0])
            raise ValueError(
                f"item (start={starts[k]}, num_tokens={lens[k]}): need start >= 0, n >= 1"
            )
        short = spans.table_lens * block_size < ends
        if short.any():
            k = int(np.flatnonzero(short)[0])
            raise ValueError(
                f"block table of {spans.table_lens[k]} blocks cannot hold position "
                f"{int(ends[k]) - 1}"
            )
        max_q = int(lens.max())
        max_ctx = int(ends.max())
        num_cols = _width(num_cols, max_ctx, block_size)
        tables = spans.padded_tables(num_cols)
        if max_q == 1:  # decode rows: one row per item
            row_item = pad_index = np.arange(num_items)
            positions = starts
            num_rows = num_items
        else:
            num_rows = int(lens.sum())
            row_item = np.repeat(np.arange(num_items), lens)  # [N]
            first_row = np.cumsum(lens) - lens  # [B]
            row_q = np.arange(num_rows) - first_row[row_item]  # [N]
            positions = starts[row_item] + row_q  # [N]
            pad_index = row_item * max_q + row_q
        slot_mapping = tables[row_item, positions // block_size] * block_size + (
            positions % block_size
        )
        return cls(
            num_rows=num_rows,
            num_items=num_items,
            max_q=max_q,
            max_ctx=max_ctx,
            num_cols=num_cols,
            starts=starts,
            lens=lens,
            positions=positions,
            slot_mapping=slot_mapping,
            pad_index=pad_index,
            tables=tables,
        )

    @classmethod
    def _one(cls, spans: Spans, block_size: int, num_cols: int | None) -> HostMetadata:
        """``of`` one item (a group of one, such as a mixed step's prompt chunk): its checks
        and arrays from Python ints and ranges, not reductions and index arithmetic over
        one-element arrays."""
        start, n, blocks = int(spans.starts[0]), int(spans.lens[0]), int(spans.table_lens[0])
        if n < 1 or start < 0:
            raise ValueError(f"item (start={start}, num_tokens={n}): need start >= 0, n >= 1")
        end = start + n
        if blocks * block_size < end:
            raise ValueError(f"block table of {blocks} blocks cannot hold position {end - 1}")
        num_cols = _width(num_cols, end, block_size)
        tables = spans.padded_tables(num_cols)
        positions = np.arange(start, end, dtype=np.int64)  # [N]
        offsets = np.arange(n, dtype=np.int64)  # [N]: each row's index in the item (its pad index)
        slot_mapping = tables[0, positions // block_size] * block_size + positions % block_size
        return cls(
            num_rows=n,
            num_items=1,
            max_q=n,
            max_ctx=end,
            num_cols=num_cols,
            starts=spans.starts,
            lens=spans.lens,
            positions=positions,
            slot_mapping=slot_mapping,
            pad_index=offsets,
            tables=tables,
        )

    def parts(self) -> list[np.ndarray]:
        """What the device needs, in the order ``AttentionMetadata.on_device`` reads it."""
        if self.packed is not None:
            return [self.packed]
        return [
            self.starts,
            self.lens,
            self.positions,
            self.slot_mapping,
            self.pad_index,
            self.tables.reshape(-1),
        ]

    @property
    def size(self) -> int:
        return 2 * self.num_items + 3 * self.num_rows + self.num_items * self.num_cols


def _width(num_cols: int | None, max_ctx: int, block_size: int) -> int:
    """The table columns of a group whose longest context is ``max_ctx`` positions:
    ``num_cols`` (a ValueError when too few), or just enough."""
    needed = -(-max_ctx // block_size)
    if num_cols is None:
        return needed
    if num_cols < needed:
        raise ValueError(
            f"num_cols={num_cols}: a context of {max_ctx} positions needs {needed} blocks"
        )
    return num_cols


@dataclass(frozen=True)
class DecodePositions:
    """What the metadata of one-row items (decode tokens) takes from their positions alone
    (``decode_positions``). A decode batch keeps its positions array for several steps (one
    per loop of its tokens), so these are computed once per array, not per step."""

    starts: np.ndarray  # [B] the positions they were computed from (never changed)
    max_ctx: int  # the furthest position + 1
    num_cols: int  # the blocks it needs
    index: np.ndarray  # [B] each position's block in its table ...
    offset: np.ndarray  # [B] ... and its slot in that block
    head: np.ndarray  # [5 B] starts, lens, positions, (slot mapping: per step), pad index


def decode_positions(starts: np.ndarray, block_size: int) -> DecodePositions | None:
    """The positions' part of ``decode_metadata``; None when the items are not one attention
    group (``group_indices``: the general path then groups them)."""
    n = len(starts)
    lo, hi = int(starts.min()), int(starts.max())
    if lo < 0:
        k = int(np.flatnonzero(starts < 0)[0])
        raise ValueError(f"item (start={starts[k]}, num_tokens=1): need start >= 0, n >= 1")
    num_cols = hi // block_size + 1
    if _bucket(lo // block_size + 1) != _bucket(num_cols):
        return None
    head = np.zeros(5 * n, dtype=np.int64)  # (as ``parts`` orders them)
    head[:n] = starts
    head[n : 2 * n] = 1
    head[2 * n : 3 * n] = starts
    head[4 * n :] = np.arange(n)
    index, offset = np.divmod(starts, block_size)
    return DecodePositions(starts, hi + 1, num_cols, index, offset, head)


def decode_metadata(
    positions: DecodePositions,
    table_lens: np.ndarray,
    tables: np.ndarray,
    rows,
    block_size: int,
) -> HostMetadata | None:
    """``HostMetadata.of`` one-row items at ``positions`` whose block tables, ``table_lens``
    blocks long, are rows ``rows`` of ``tables`` (``BlockTables.array``), built straight into
    one packed buffer (``packed``), a new one per call; None when a table is too short for its
    item's position (the general path then names the item in its error). A decode step's
    metadata in a handful of numpy calls, and no concatenation of its parts."""
    index = positions.index
    if (table_lens <= index).any():  # (table_lens * block_size <= starts)
        return None
    n, num_cols = len(index), positions.num_cols
    flat = np.empty(5 * n + n * num_cols, dtype=np.int64)
    flat[: 5 * n] = positions.head
    slot_mapping = flat[3 * n : 4 * n]
    np.multiply(tables[rows, index], block_size, out=slot_mapping)
    slot_mapping += positions.offset
    table = flat[5 * n :].reshape(n, num_cols)
    table[...] = tables[rows, :num_cols]
    return HostMetadata(
        num_rows=n,
        num_items=n,
        max_q=1,
        max_ctx=positions.max_ctx,
        num_cols=num_cols,
        starts=flat[:n],
        lens=flat[n : 2 * n],
        positions=flat[2 * n : 3 * n],
        slot_mapping=slot_mapping,
        pad_index=flat[4 * n : 5 * n],
        tables=table,
        packed=flat,
    )


# One-row items whose contexts need at most this many blocks share one attention group:
# below it, padding costs less than another SDPA call per layer.
GROUP_MIN_COLS = 8


def attention_groups(items: Sequence[ItemSpec], block_size: int) -> list[list[int]]:
    """Indices of ``items`` per attention group: one-row items (decode tokens) by the power of
    two of their context blocks (at least ``GROUP_MIN_COLS``), so that neither a prompt chunk's
    rows nor the step's longest context pad a short decode row; longer items together."""
    starts = np.fromiter((it[0] for it in items), dtype=np.int64, count=len(items))
    lens = np.fromiter((it[1] for it in items), dtype=np.int64, count=len(items))
    return [g.tolist() for g in group_indices(starts, lens, block_size)]


def _bucket(cols: int) -> int:
    return max(GROUP_MIN_COLS, 1 << (cols - 1).bit_length())


def gathered_slots(starts: np.ndarray, lens: np.ndarray, block_size: int) -> int:
    """Context slots the items gather as one padded attention batch: each item the whole
    blocks of the furthest context."""
    return len(starts) * -(-int((starts + lens).max()) // block_size) * block_size


def padded_pairs(starts: np.ndarray, lens: np.ndarray, block_size: int) -> int:
    """Query-key pairs per head of the items as one padded attention batch: every item padded
    to the longest one's rows and to the furthest context's whole blocks."""
    return int(lens.max()) * gathered_slots(starts, lens, block_size)


# A padded batch may gather up to this many times the context slots its groups gather apart.
PAD_GATHER_SLACK = 2


def group_indices(
    starts: np.ndarray, lens: np.ndarray, block_size: int, pad_budget: int = 0
) -> list[np.ndarray]:
    """``attention_groups`` over the items' starts and lengths: index arrays, in order.

    With a ``pad_budget``, items that would form several groups are one when their padded
    batch has at most that many query-key pairs per head (``padded_pairs``: the attention's
    work) and gathers at most ``PAD_GATHER_SLACK`` times the context slots of the groups
    (``gathered_slots``: the gather's memory traffic, which grows with the model's KV width).
    For a device where another attention call costs more than that padding: a GPU, whose step
    of a small model is bound by kernel launches, each group costing about a dozen per layer.
    On the CPU padding is computed work (docs/benchmarks.md, "Mixed steps")."""
    groups = _groups(starts, lens, block_size)
    if pad_budget and len(groups) > 1 and padded_pairs(starts, lens, block_size) <= pad_budget:
        apart = sum(gathered_slots(starts[ks], lens[ks], block_size) for ks in groups)
        if gathered_slots(starts, lens, block_size) <= PAD_GATHER_SLACK * apart:
            return [np.arange(len(starts))]
    return groups


def _groups(starts: np.ndarray, lens: np.ndarray, block_size: int) -> list[np.ndarray]:
    single = lens == 1
    if not single.any():
        return [np.arange(len(starts))]
    if single.all():
        lo, hi = int(starts.min()) // block_size + 1, int(starts.max()) // block_size + 1
        if _bucket(lo) == _bucket(hi):
            return [np.arange(len(starts))]
    multi = np.flatnonzero(~single)
    ones = np.flatnonzero(single)
    cols = starts[ones] // block_size + 1
    if len(multi) and _bucket(int(cols.min())) == _bucket(int(cols.max())):
        # One bucket of decode rows beside prompt chunks (the usual mixed step).
        return [ones, multi]
    # The power of two at or above cols: exact in float64 for any realistic context.
    bucket = np.maximum(GROUP_MIN_COLS, 1 << np.ceil(np.log2(cols)).astype(np.int64))
    groups = [ones[bucket == b] for b in np.unique(bucket)]
    return groups + [multi] if len(multi) else groups
