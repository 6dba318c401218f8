"""``StepAttention``: a step's attention (``AttentionFn``) from its items' spans, the metadata
built on the host from the runner's persistent ``BlockTables`` and sent to the device in one
transfer.

Three shapes take short paths: a decode batch (one-row items, one attention group:
``decode_metadata``, its positions' part kept while the carried rows keep their positions
array), a decode batch beside prompt chunks (the two groups, already in the step's row order:
``groups_in_order``), and anything else through ``attention_over``'s grouping. With a pad
budget, steps whose items fit it attend as one padded batch instead.
"""

from __future__ import annotations

import numpy as np
import torch

from rltserve.core.attention import attention_over, groups_in_order, one_group, paged_attention
from rltserve.core.block_tables import BlockTables
from rltserve.core.metadata import (
    DecodePositions,
    HostMetadata,
    Spans,
    decode_metadata,
    decode_positions,
    group_indices,
)
from rltserve.models.base import AttentionFn


class StepAttention:
    def __init__(
        self,
        kv: torch.Tensor,
        tables: BlockTables,
        block_size: int,
        device: torch.device,
        pad_budget: int = 0,
    ) -> None:
        """``pad_budget``: as for ``group_indices``."""
        self.kv = kv  # the paged KV cache of every plane
        self.block_tables = tables
        self.block_size = block_size
        self.device = device
        self.pad_budget = pad_budget
        # The last decode batch's positions array and its ``decode_positions``.
        self._decode_positions: tuple[np.ndarray | None, DecodePositions | None] = (None, None)

    def build(
        self,
        spans: list[tuple[int, int, list[int]]],
        keys: list[tuple[str, int]] | None = None,
        carried: tuple[Spans, np.ndarray] | None = None,
        one_row: bool = False,
    ) -> AttentionFn:
        """Attention over ``(start, num_tokens, block_table)`` spans, one per item; with the
        tables' ``keys`` ((request id, depth), depth 0 for the boundary plane) the tables come
        from the persistent ``BlockTables``. ``carried``: the rows before ``spans`` (carried
        tokens), as ``CarriedRows.spans`` gives them. ``one_row``: every item has one row."""
        if keys is None:
            if carried is not None:
                raise ValueError("carried rows' tables are BlockTables rows: keys are needed")
            return paged_attention(
                self.kv, spans, self.block_size, self.device, pad_budget=self.pad_budget
            )
        rows = self.block_tables.rows(keys, [span[2] for span in spans]) if spans else []
        table = self.block_tables.array
        if (
            carried is not None
            and spans
            and not one_row
            and min(s[1] for s in spans) > 1
            and not self._one_padded_batch(carried[0], spans)
        ):
            # A decode batch beside prompt chunks (a mixed step): when the carried rows are one
            # attention group, ``attention_over``'s groups are they and the chunks, in order.
            head, head_rows = carried
            host = self._decode_host(head, head_rows, table)
            if host is not None:
                tail = Spans.of(spans).on_rows(rows, table)
                hosts = [host, HostMetadata.of(tail, self.block_size)]
                return groups_in_order(self.kv, hosts, self.block_size, self.device)
        if carried is None:
            given = Spans.of(spans)
        else:
            given, carried_rows = carried
            if spans:
                given = Spans.concat(given, Spans.of(spans))
                rows = np.concatenate((carried_rows, rows))
            else:
                rows = carried_rows
        if one_row:  # (a decode step: usually one attention group, built in one pass)
            host = self._decode_host(given, rows, table)
            if host is not None:
                return one_group(self.kv, host, self.block_size, self.device)
        # (Each attention group takes its tables' rows at its own width.)
        return attention_over(
            self.kv, given.on_rows(rows, table), self.block_size, self.device, self.pad_budget
        )

    def _one_padded_batch(self, head: Spans, spans: list[tuple[int, int, list[int]]]) -> bool:
        """Whether carried rows ``head`` and the chunks ``spans`` beside them attend as one
        padded batch (within the pad budget: ``group_indices``)."""
        if not self.pad_budget:
            return False
        starts = np.concatenate((head.starts, [s for s, _, _ in spans]))
        lens = np.concatenate((head.lens, [n for _, n, _ in spans]))
        return len(group_indices(starts, lens, self.block_size, self.pad_budget)) == 1

    def _decode_host(self, given: Spans, rows, table: np.ndarray) -> HostMetadata | None:
        """``decode_metadata`` of one-row items ``given`` whose tables are rows ``rows`` of
        ``table``; None when they are not one attention group (or a table is short: the
        general path names the item). A decode batch's carried rows keep one positions array
        from step to step (a numpy column of ``CarriedRows`` is replaced, never changed): its
        part of the metadata is computed once per array."""
        known = self._decode_positions
        if known[0] is not given.starts:
            known = (given.starts, decode_positions(given.starts, self.block_size))
            self._decode_positions = known
        if known[1] is None:
            return None
        return decode_metadata(known[1], given.table_lens, table, rows, self.block_size)
