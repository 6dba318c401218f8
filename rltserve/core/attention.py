"""Paged attention over block tables: the torch reference implementation of ``AttentionFn``.

KV storage is one tensor per call-site kind (core loop, boundary): ``[num_layers, 2, num_slots,
num_kv_heads, head_dim]`` with ``num_slots = num_blocks * block_size`` and slot ``block *
block_size + offset``. Which plane a row uses is decided entirely by the block table its work item
carries, so this module knows nothing about depths or policies.

Per step and call-site the runner builds one ``AttentionMetadata`` per attention group; every
layer then reuses it. Its host half (``metadata.HostMetadata``) is computed with numpy from the
items' starts, lengths and padded block tables, and all of a step's groups reach the device in
one transfer. Rows of the step are the items' tokens concatenated in item order. Internally the
items are padded to ``[B, max_q]`` queries over ``[B, max_ctx]`` gathered keys; padding is
excluded by a boolean mask, and padded query rows attend to a valid key so they never produce NaN.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch
import torch.nn.functional as F

from rltserve.core.metadata import HostMetadata, ItemSpec, Spans, group_indices
from rltserve.core.staging import move_to


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


def to_device_packed(parts: Sequence[np.ndarray], device: torch.device) -> torch.Tensor:
    """The int64 arrays ``parts`` concatenated and sent as one tensor: one host-to-device
    transfer (pinned, non-blocking on CUDA) for a step's metadata."""
    flat = np.concatenate(parts) if len(parts) > 1 else np.ascontiguousarray(parts[0])
    return move_to(torch.from_numpy(flat), device)


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
    num_cols: int
    starts: torch.Tensor  # [B] int64: position of each item's first row
    lens: torch.Tensor  # [B] int64: rows of each item
    positions: torch.Tensor  # [N] int64: position of each row
    slot_mapping: torch.Tensor  # [N] int64: where each row's K/V is written
    pad_index: torch.Tensor  # [N] int64: row -> item * max_q + q index (into [B * max_q])
    gather_blocks: torch.Tensor  # [B * num_cols] int64: blocks holding each item's context

    @classmethod
    def build(
        cls,
        items: Sequence[ItemSpec],
        block_size: int,
        device: torch.device | str = "cpu",
        *,
        num_cols: int | None = None,
        tables: np.ndarray | None = None,
    ) -> AttentionMetadata:
        """Metadata of ``items``. ``num_cols`` fixes the number of context block columns (default:
        just enough for the longest context), so that the tensor shapes depend only on (number
        of items, max_q, num_cols); an item whose context needs more blocks is a ValueError.
        ``tables``: as for ``HostMetadata.build``."""
        host = HostMetadata.build(items, block_size, num_cols=num_cols, tables=tables)
        dev = torch.device(device)
        return cls.on_device(host, to_device_packed(host.parts(), dev), block_size)

    @classmethod
    def on_device(
        cls, host: HostMetadata, flat: torch.Tensor, block_size: int
    ) -> AttentionMetadata:
        """The metadata from ``host.parts()`` as they arrived on the device (``flat`` starts with
        them)."""
        b, n, cols = host.num_items, host.num_rows, host.num_cols
        sizes = [b, b, n, n, n, b * cols]
        if flat.shape[0] > host.size:
            sizes.append(flat.shape[0] - host.size)
        # (``split_with_sizes``: ``Tensor.split``'s Python wrapper costs as much again.)
        starts, lens, positions, slot_mapping, pad_index, gather_blocks = flat.split_with_sizes(
            sizes
        )[:6]
        return cls(
            num_rows=n,
            num_items=b,
            max_q=host.max_q,
            max_ctx=host.max_ctx,
            block_size=block_size,
            num_cols=cols,
            starts=starts,
            lens=lens,
            positions=positions,
            slot_mapping=slot_mapping,
            pad_index=pad_index,
            gather_blocks=gather_blocks,
        )

    @cached_property
    def mask(self) -> torch.Tensor:
        """[B, 1, max_q, num_cols * block_size] bool: True = attend. Device work, computed
        where the first layer attends (building a step's metadata queues none of it)."""
        dev = self.starts.device
        # Context is gathered whole blocks at a time (one contiguous copy per block, not per
        # slot); the mask drops positions past each item's context.
        key_pos = torch.arange(self.num_cols * self.block_size, device=dev)  # [cols * bs]
        if self.max_q == 1:
            mask = key_pos[None, :] <= self.starts[:, None]  # [B, cols * bs]
            return mask[:, None, None, :]
        # Query (b, i) attends to keys at positions <= min(start_b + i, ctx_b - 1): causal
        # for real rows, and all of the item's context for padded rows (i >= len_b).
        q_idx = torch.arange(self.max_q, device=dev)  # [max_q]
        last_key = torch.minimum(
            self.starts[:, None] + q_idx[None, :], (self.starts + self.lens - 1)[:, None]
        )  # [B, max_q]
        return (key_pos[None, None, :] <= last_key[:, :, None])[:, None]


class PagedAttention:
    """``AttentionFn`` over one KV tensor and one step's metadata.

    ``layer`` indexes ``kv``'s first dimension. Each call first writes the rows' K/V at their
    slots, then attends over the gathered context, so an item's rows see each other causally.
    K/V are stored in ``kv.dtype``; attention runs in q's dtype. Every item is padded to the
    longest one's rows; ``paged_attention`` avoids that for steps mixing decode rows and prompt
    chunks, unless the padded batch is within its pad budget (``group_indices``).
    """

    def __init__(self, kv: torch.Tensor, metadata: AttentionMetadata) -> None:
        self.kv = kv  # [L, 2, num_slots, Hkv, hd]
        self.md = metadata
        self.positions = metadata.positions  # [N]: each row's position
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
        max_ctx = md.num_cols * bs  # whole blocks
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
    context (5-8x the attention time of the groups apart in typical mixed steps on the CPU,
    docs/benchmarks.md; within a pad budget, for a GPU, one batch is used instead). Each group
    attends on its own, and the rows return to the step's order. K/V of all rows are written
    before any group attends.

    When each group's rows are consecutive, group after group (``rows`` None: a decode batch,
    then the prompt chunks beside it, the usual mixed step), a group attends over a view of the
    step's queries and the outputs are concatenated: per layer one copy instead of a gather and
    a scatter per group (on a GPU whose step is bound by kernel launches, each is one).
    """

    def __init__(
        self,
        kv: torch.Tensor,
        groups: Sequence[tuple[torch.Tensor | None, PagedAttention]],
        slot_mapping: torch.Tensor,
        positions: torch.Tensor,
    ) -> None:
        self.kv = kv  # [L, 2, num_slots, Hkv, hd]
        # (rows [N_g] int64 in the step's row order, the group's attention); rows None: every
        # group's are None, each group taking the rows after the one before.
        self.groups = groups
        self.in_order = groups[0][0] is None
        self.slot_mapping = slot_mapping  # [N]
        self.positions = positions  # [N]: each row's position
        self.num_rows = slot_mapping.shape[0]

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        if q.shape[0] != self.num_rows:
            raise ValueError(f"{q.shape[0]} rows, the step has {self.num_rows}")
        write_kv(self.kv, layer, self.slot_mapping, k, v)
        if self.in_order:
            outs = []
            first = 0
            for _, attn in self.groups:
                end = first + attn.md.num_rows
                outs.append(attn.attend(layer, q[first:end]))
                first = end
            return torch.cat(outs)  # [N, Hq, hd]
        out = torch.empty_like(q)  # [N, Hq, hd]
        for rows, attn in self.groups:
            out.index_copy_(0, rows, attn.attend(layer, q.index_select(0, rows)))
        return out

    def group_rows(self) -> list[list[int]]:
        """Each group's rows in the step's row order (host lists: a device read)."""
        if not self.in_order:
            return [rows.tolist() for rows, _ in self.groups]
        out, first = [], 0
        for _, attn in self.groups:
            out.append(list(range(first, first + attn.md.num_rows)))
            first += attn.md.num_rows
        return out


def paged_attention(
    kv: torch.Tensor,
    items: Sequence[ItemSpec],
    block_size: int,
    device: torch.device | str = "cpu",
    tables: np.ndarray | None = None,
    pad_budget: int = 0,
) -> PagedAttention | GroupedAttention:
    """The attention of one step's ``items``: one padded batch when they form one group
    (``attention_groups``, or ``pad_budget`` as for ``group_indices``), else each group on
    its own. ``tables``: as for ``HostMetadata.build`` (rows aligned with ``items``).
    Everything the groups need reaches the device in one transfer; ``positions`` of the result
    are the rows' positions."""
    return attention_over(kv, Spans.of(items, tables), block_size, device, pad_budget)


def one_group(
    kv: torch.Tensor, host: HostMetadata, block_size: int, device: torch.device
) -> PagedAttention:
    """The attention of one group's metadata, sent in one transfer."""
    md = AttentionMetadata.on_device(host, to_device_packed(host.parts(), device), block_size)
    return PagedAttention(kv, md)


def attention_over(
    kv: torch.Tensor,
    spans: Spans,
    block_size: int,
    device: torch.device | str = "cpu",
    pad_budget: int = 0,
) -> PagedAttention | GroupedAttention:
    """``paged_attention`` of items given as columns; ``pad_budget``: as for
    ``group_indices``."""
    dev = torch.device(device)
    starts, lens = spans.starts, spans.lens
    groups = group_indices(starts, lens, block_size, pad_budget)
    if len(groups) == 1:
        return one_group(kv, HostMetadata.of(spans, block_size), block_size, dev)
    hosts = [HostMetadata.of(spans.take(ks), block_size) for ks in groups]
    offsets = np.cumsum(lens) - lens
    # The groups' rows, in the step's row order, group after group.
    rows = np.concatenate(
        [
            np.concatenate([np.arange(offsets[k], offsets[k] + lens[k]) for k in ks])
            if host.max_q > 1
            else offsets[ks]
            for ks, host in zip(groups, hosts)
        ]
    )
    num_rows = int(lens.sum())
    slot_mapping = np.empty(num_rows, dtype=np.int64)
    positions = np.empty(num_rows, dtype=np.int64)
    first = 0
    for host in hosts:
        group_rows = rows[first : first + host.num_rows]
        slot_mapping[group_rows] = host.slot_mapping
        positions[group_rows] = host.positions
        first += host.num_rows
    return _grouped(kv, hosts, rows, slot_mapping, positions, block_size, dev)


def groups_in_order(
    kv: torch.Tensor, hosts: list[HostMetadata], block_size: int, device: torch.device | str
) -> GroupedAttention:
    """``attention_over`` of items whose groups (``hosts``, one each) are consecutive items in
    the step's order: a decode batch's carried rows, then the prompt chunks beside them."""
    rows = np.arange(sum(host.num_rows for host in hosts))
    slot_mapping = np.concatenate([host.slot_mapping for host in hosts])
    positions = np.concatenate([host.positions for host in hosts])
    return _grouped(kv, hosts, rows, slot_mapping, positions, block_size, torch.device(device))


def _grouped(
    kv: torch.Tensor,
    hosts: list[HostMetadata],
    rows: np.ndarray,
    slot_mapping: np.ndarray,
    positions: np.ndarray,
    block_size: int,
    dev: torch.device,
) -> GroupedAttention:
    """Groups ``hosts`` whose rows are ``rows`` of the step (group after group), and the step's
    rows' slots and positions, sent in one transfer (``rows`` only when they are not simply
    the step's rows in order)."""
    num_rows = len(rows)
    in_order = bool((rows[1:] > rows[:-1]).all())  # (a permutation: increasing is 0..N-1)
    parts = [slot_mapping, positions] if in_order else [rows, slot_mapping, positions]
    for host in hosts:
        parts += host.parts()
    flat = to_device_packed(parts, dev)
    rows_t = None if in_order else flat[:num_rows]
    at = 0 if in_order else num_rows  # where slot_mapping starts
    offset = at + 2 * num_rows
    attns = []
    first = 0
    for host in hosts:
        md = AttentionMetadata.on_device(host, flat[offset : offset + host.size], block_size)
        offset += host.size
        group_rows = None if rows_t is None else rows_t[first : first + host.num_rows]
        attns.append((group_rows, PagedAttention(kv, md)))
        first += host.num_rows
    return GroupedAttention(
        kv, attns, flat[at : at + num_rows], flat[at + num_rows : at + 2 * num_rows]
    )
