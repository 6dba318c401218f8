"""Paged attention over block tables: the torch reference implementation of ``AttentionFn``.

KV storage is one tensor per call-site kind (core loop, boundary): ``[num_layers, 2, num_slots,
num_kv_heads, head_dim]`` with ``num_slots = num_blocks * block_size`` and slot ``block *
block_size + offset``. Which plane a row uses is decided entirely by the block table its work item
carries, so this module knows nothing about depths or policies.

Per step and call-site the runner builds one ``AttentionMetadata`` from plain lists; every layer
then reuses it. Rows of the step are the items' tokens concatenated in item order. Internally the
items are padded to ``[B, max_q]`` queries over ``[B, max_ctx]`` gathered keys; padding is
excluded by a boolean mask, and padded query rows attend to a valid key so they never produce NaN.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rltserve.core.staging import host_tensor, move_to

# (start, num_tokens, block_table): rows at positions start..start+num_tokens-1 whose context is
# positions [0, start + num_tokens) under block_table.
ItemSpec = tuple[int, int, Sequence[int]]


def allocate_kv_cache(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> torch.Tensor:
    """Zeroed KV storage: [num_layers, 2, num_blocks * block_size, num_kv_heads, head_dim]."""
    shape = (num_layers, 2, num_blocks * block_size, num_kv_heads, head_dim)
    return torch.zeros(shape, dtype=dtype, device=device)


def copy_slots(kv: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> torch.Tensor:
    """Copy K and V of ``src_slots`` into ``dst_slots`` in every layer at once (in place).

    src_slots, dst_slots: [M] int64 on kv's device. The sources are read before any write, so
    overlapping lists are safe; a destination listed twice gets one of its sources.
    """
    kv.index_copy_(2, dst_slots, kv.index_select(2, src_slots))
    return kv


@dataclass(frozen=True)
class AttentionMetadata:
    """Index tensors of one step at one call-site, shared by all its layers.

    Invariant: every block in ``gather_blocks`` is a valid block (padding points at a real block
    and is masked), so gathering never goes out of bounds.
    """

    num_rows: int  # N
    num_items: int  # B
    max_q: int
    max_ctx: int
    block_size: int
    positions: torch.Tensor  # [N] int64: position of each row
    slot_mapping: torch.Tensor  # [N] int64: where each row's K/V is written
    pad_index: torch.Tensor  # [N] int64: row -> item * max_q + q index (into [B * max_q])
    gather_blocks: torch.Tensor  # [B * num_cols] int64: blocks holding each item's context
    mask: torch.Tensor  # [B, 1, max_q, num_cols * block_size] bool: True = attend

    @classmethod
    def build(
        cls,
        items: Sequence[ItemSpec],
        block_size: int,
        device: torch.device | str = "cpu",
        *,
        num_cols: int | None = None,
    ) -> AttentionMetadata:
        """Metadata of ``items``. ``num_cols`` fixes the number of context block columns (default:
        just enough for the longest context), so that the tensor shapes depend only on (number
        of items, max_q, num_cols); an item whose context needs more blocks is a ValueError."""
        if not items:
            raise ValueError("attention metadata needs at least one item")
        starts, lens, tables = [], [], []
        for start, n, table in items:
            if n < 1 or start < 0:
                raise ValueError(f"item (start={start}, num_tokens={n}): need start >= 0, n >= 1")
            if len(table) * block_size < start + n:
                raise ValueError(
                    f"block table of {len(table)} blocks cannot hold position {start + n - 1}"
                )
            starts.append(start)
            lens.append(n)
            tables.append(table)
        max_q = max(lens)
        max_ctx = max(s + n for s, n in zip(starts, lens))
        needed = -(-max_ctx // block_size)
        if num_cols is None:
            num_cols = needed
        elif num_cols < needed:
            raise ValueError(
                f"num_cols={num_cols}: a context of {max_ctx} positions needs {needed} blocks"
            )
        num_items, num_rows = len(items), sum(lens)
        # One host list leaves the host (non-blocking from pinned memory on CUDA, so building a
        # step's metadata never waits for the device): starts, lens, then every table padded to
        # num_cols blocks with a valid block id (its own first block). The rest is computed
        # where it is used.
        packed = starts + lens
        for t in tables:
            k = min(len(t), num_cols)
            packed.extend(t[:k])
            if k < num_cols:
                packed.extend([t[0]] * (num_cols - k))
        dev = torch.device(device)
        packed_t = move_to(host_tensor(packed, torch.int64), dev)  # [2B + B * num_cols]
        start_t = packed_t[:num_items]  # [B]
        len_t = packed_t[num_items : 2 * num_items]  # [B]
        table_t = packed_t[2 * num_items :].view(num_items, num_cols)  # [B, num_cols]

        item_ids = torch.arange(num_items, device=dev)
        row_item = torch.repeat_interleave(item_ids, len_t, output_size=num_rows)  # [N]
        first_row = torch.cumsum(len_t, 0) - len_t  # [B]
        row_q = torch.arange(num_rows, device=dev) - first_row[row_item]  # [N]
        positions = start_t[row_item] + row_q  # [N]
        slot_mapping = (
            table_t[row_item, positions // block_size] * block_size + positions % block_size
        )

        # Context is gathered whole blocks at a time (one contiguous copy per block, not per
        # slot); the mask drops positions past each item's context.
        key_pos = torch.arange(num_cols * block_size, device=dev)  # [num_cols * bs]

        # Query (b, i) attends to keys at positions <= min(start_b + i, ctx_b - 1): causal for
        # real rows, and all of the item's context for padded rows (i >= len_b).
        q_idx = torch.arange(max_q, device=dev)  # [max_q]
        last_key = torch.minimum(
            start_t[:, None] + q_idx[None, :], (start_t + len_t - 1)[:, None]
        )  # [B, max_q]
        mask = key_pos[None, None, :] <= last_key[:, :, None]  # [B, max_q, num_cols * bs]
        return cls(
            num_rows=num_rows,
            num_items=num_items,
            max_q=max_q,
            max_ctx=max_ctx,
            block_size=block_size,
            positions=positions,
            slot_mapping=slot_mapping,
            pad_index=row_item * max_q + row_q,
            gather_blocks=table_t.reshape(-1),
            mask=mask[:, None],
        )


class PagedAttention:
    """``AttentionFn`` over one KV tensor and one step's metadata.

    ``layer`` indexes ``kv``'s first dimension. Each call first writes the rows' K/V at their
    slots, then attends over the gathered context, so an item's rows see each other causally.
    K/V are stored in ``kv.dtype``; attention runs in q's dtype. Every item is padded to the
    longest one's rows; ``paged_attention`` avoids that for steps mixing decode rows and prompt
    chunks.
    """

    def __init__(self, kv: torch.Tensor, metadata: AttentionMetadata) -> None:
        self.kv = kv  # [L, 2, num_slots, Hkv, hd]
        self.md = metadata
        self._masks: dict[tuple[int, torch.dtype], torch.Tensor] = {}

    def _prefill_mask(self, rep: int, dtype: torch.dtype) -> torch.Tensor:
        """The additive mask (0 attend, -inf not) of a step with prompt chunks, for ``rep``
        query heads folded into rows: [B, 1, rep * max_q, ctx] in ``dtype``. Built once and
        shared by the step's layers: SDPA would convert a boolean mask on every call (what it
        builds is the same tensor, so results are bit-identical). Only steps with prompt
        chunks cache it: their metadata lives for one step, while a decode graph bucket's
        mask changes in place between replays."""
        key = (rep, dtype)
        if key not in self._masks:
            mask = self.md.mask.repeat(1, 1, rep, 1) if rep > 1 else self.md.mask
            additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
            self._masks[key] = additive.masked_fill_(~mask, float("-inf"))
        return self._masks[key]

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        if q.shape[0] != self.md.num_rows:
            raise ValueError(f"{q.shape[0]} rows, metadata has {self.md.num_rows}")
        write_kv(self.kv, layer, self.md.slot_mapping, k, v)
        return self.attend(layer, q)

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """Attention of the rows ``q`` [N, Hq, hd] over their items' context, whose K/V (these
        rows' included) are already in ``kv``: [N, Hq, hd]."""
        md = self.md
        _, num_heads, head_dim = q.shape
        num_kv_heads = self.kv.shape[3]
        k_cache, v_cache = self.kv[layer, 0], self.kv[layer, 1]  # [num_slots, Hkv, hd]
        b, max_q, bs = md.num_items, md.max_q, md.block_size
        max_ctx = md.mask.shape[-1]  # whole blocks
        blocks = (-1, bs, num_kv_heads, head_dim)
        keys = k_cache.view(blocks).index_select(0, md.gather_blocks)  # [B * cols, bs, Hkv, hd]
        values = v_cache.view(blocks).index_select(0, md.gather_blocks)
        keys = keys.view(b, max_ctx, num_kv_heads, head_dim).to(q.dtype).transpose(1, 2)
        values = values.view(b, max_ctx, num_kv_heads, head_dim).to(q.dtype).transpose(1, 2)
        scale = 1.0 / math.sqrt(head_dim)
        # GQA: q head h reads kv head h // rep. A kv head's rep query heads become rep times as
        # many query rows over the same keys, so K/V are never copied per query head (that copy
        # costs more than the attention, docs/benchmarks.md), and the kernels that take a mask
        # (memory-efficient, cuDNN) apply; enable_gqa with a mask would fall back to the math one.
        rep = num_heads // num_kv_heads
        if max_q == 1:  # decode-only step: rows are items already, no padding to undo
            q_rows = q.reshape(b, num_kv_heads, rep, head_dim)  # [B, Hkv, rep, hd]
            mask = md.mask.expand(b, 1, rep, max_ctx)
            out = F.scaled_dot_product_attention(q_rows, keys, values, attn_mask=mask, scale=scale)
            return out.reshape(b, num_heads, head_dim)  # [N, Hq, hd]
        q_pad = q.new_zeros(b * max_q, num_heads, head_dim)
        q_pad.index_copy_(0, md.pad_index, q)
        q_rows = (
            q_pad.view(b, max_q, num_kv_heads, rep, head_dim)
            .permute(0, 2, 3, 1, 4)
            .reshape(b, num_kv_heads, rep * max_q, head_dim)
        )  # row r * max_q + i: query i of head kv * rep + r
        out = F.scaled_dot_product_attention(
            q_rows, keys, values, attn_mask=self._prefill_mask(rep, q.dtype), scale=scale
        )  # [B, Hkv, rep * max_q, hd]
        out = (
            out.view(b, num_kv_heads, rep, max_q, head_dim)
            .permute(0, 3, 1, 2, 4)
            .reshape(b * max_q, num_heads, head_dim)
        )
        return out.index_select(0, md.pad_index)  # [N, Hq, hd]


def write_kv(
    kv: torch.Tensor, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Writes rows' K/V ([N, Hkv, hd] each) at ``slots`` [N] of ``layer``."""
    k_cache, v_cache = kv[layer, 0], kv[layer, 1]  # [num_slots, Hkv, hd]
    k_cache.index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.index_copy_(0, slots, v.to(v_cache.dtype))


class GroupedAttention:
    """``AttentionFn`` of a step whose items form several groups (``attention_groups``): decode
    rows apart from prompt chunks, and decode rows of short contexts apart from long ones.

    One padded batch would pad every decode row to the longest chunk's rows and to the longest
    context (5-8x the attention time of the groups apart in typical mixed steps,
    docs/benchmarks.md). Each group attends on its own, and the rows return to the step's order.
    K/V of all rows are written before any group attends.
    """

    def __init__(
        self,
        kv: torch.Tensor,
        groups: Sequence[tuple[torch.Tensor, PagedAttention]],
        slot_mapping: torch.Tensor,
    ) -> None:
        self.kv = kv  # [L, 2, num_slots, Hkv, hd]
        self.groups = groups  # (rows [N_g] int64 in the step's row order, the group's attention)
        self.slot_mapping = slot_mapping  # [N]
        self.num_rows = slot_mapping.shape[0]

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        if q.shape[0] != self.num_rows:
            raise ValueError(f"{q.shape[0]} rows, the step has {self.num_rows}")
        write_kv(self.kv, layer, self.slot_mapping, k, v)
        out = torch.empty_like(q)  # [N, Hq, hd]
        for rows, attn in self.groups:
            out.index_copy_(0, rows, attn.attend(layer, q.index_select(0, rows)))
        return out


# One-row items whose contexts need at most this many blocks share one attention group:
# below it, padding costs less than another SDPA call per layer.
GROUP_MIN_COLS = 8


def attention_groups(items: Sequence[ItemSpec], block_size: int) -> list[list[int]]:
    """Indices of ``items`` per attention group: one-row items (decode tokens) by the power of
    two of their context blocks (at least ``GROUP_MIN_COLS``), so that neither a prompt chunk's
    rows nor the step's longest context pad a short decode row; longer items together."""
    by_cols: dict[int, list[int]] = {}
    multi = []
    for k, (start, n, _) in enumerate(items):
        if n > 1:
            multi.append(k)
            continue
        cols = start // block_size + 1
        by_cols.setdefault(max(GROUP_MIN_COLS, 1 << (cols - 1).bit_length()), []).append(k)
    groups = [by_cols[c] for c in sorted(by_cols)]
    return groups + [multi] if multi else groups


def paged_attention(
    kv: torch.Tensor,
    items: Sequence[ItemSpec],
    block_size: int,
    device: torch.device | str = "cpu",
) -> PagedAttention | GroupedAttention:
    """The attention of one step's ``items``: one padded batch when they form one group
    (``attention_groups``), else each group on its own."""
    groups = attention_groups(items, block_size)
    if len(groups) == 1:
        return PagedAttention(kv, AttentionMetadata.build(items, block_size, device))
    offsets = [0]
    for _, n, _ in items:
        offsets.append(offsets[-1] + n)
    rows = [r for ks in groups for k in ks for r in range(offsets[k], offsets[k + 1])]
    dev = torch.device(device)
    rows_t = move_to(host_tensor(rows, torch.int64), dev)  # [N]: the groups' rows, in order
    slot_mapping = torch.empty(offsets[-1], dtype=torch.int64, device=dev)  # [N]
    parts = []
    first = 0
    for ks in groups:
        num = sum(items[k][1] for k in ks)
        group_rows = rows_t[first : first + num]
        first += num
        md = AttentionMetadata.build([items[k] for k in ks], block_size, dev)
        slot_mapping.index_copy_(0, group_rows, md.slot_mapping)
        parts.append((group_rows, PagedAttention(kv, md)))
    return GroupedAttention(kv, parts, slot_mapping)
