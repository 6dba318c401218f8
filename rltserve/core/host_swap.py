"""The runner's side of swap space: the KV of swapped-out requests in host memory.

``SwapSpace`` (torch-free) decides which victims fit; this class holds their bytes. Host
memory is a few large buffers ("segments"), allocated when the ones there cannot take a
request and kept for the runner's life; each swapped request holds one contiguous range of
slots in one segment. On CUDA the segments are pinned and both copies are non-blocking,
ordered on the runner's stream: a swap never makes the host wait for the device, where a
copy to or from pageable memory would wait for every step queued before it (and a fresh
pinned buffer per swap costs a page-locking allocation each time). The host never reads or
writes a segment itself, so a range is free for reuse as soon as the copy that empties it is
queued: the next copy into it runs after on the same stream.

Growth is bounded by ``capacity_bytes`` (the swap space ``SwapSpace`` accounts for): a new
segment is at most what is left of it, unless a request fits no range when the segments reach
it (first-fit fragmentation); such a segment is dropped once it is empty again.

Layout: a request's range holds ``kv.index_select(2, slots)`` flattened, [L, 2, n, Hkv, hd]
in that order; a slot is ``L * 2 * Hkv * hd`` elements.
"""

from __future__ import annotations

import bisect

import torch

MIN_SEGMENT_BYTES = 16 << 20


class HostSwap:
    def __init__(self, kv: torch.Tensor, device: torch.device, capacity_bytes: int = 0) -> None:
        """``capacity_bytes``: the swap space's size (0: no bound on the segments)."""
        self.kv = kv  # [L, 2, num_slots, Hkv, hd]
        self.pin = device.type == "cuda"
        self.device = device
        layers, two, _, heads, head_dim = kv.shape
        self.slot_numel = layers * two * heads * head_dim
        self.slot_bytes = self.slot_numel * kv.element_size()
        self.capacity_slots = capacity_bytes // self.slot_bytes if capacity_bytes else 0
        self.segments: dict[int, torch.Tensor] = {}  # id -> flat, kv.dtype, whole slots
        # Per segment: its free ranges (start slot, slots), sorted and never adjacent.
        self._free: dict[int, list[tuple[int, int]]] = {}
        self._held: dict[str, tuple[int, int, int]] = {}  # request id -> (segment, start, n)
        self._next_id = 0

    # ------------------------------------------------------------------ copies

    def put(self, request_id: str, slots: torch.Tensor) -> None:
        """Copies the K/V of ``slots`` [n] (on the KV's device) into host memory for
        ``request_id``, which must not hold any. If the copy fails nothing is held."""
        if request_id in self._held:
            raise ValueError(f"request {request_id!r} is already swapped out")
        n = slots.numel()
        segment, start = self._allocate(n)
        view = self._view(segment, start, n)  # [L, 2, n, Hkv, hd]
        try:
            if self.kv.is_cpu:
                torch.index_select(self.kv, 2, slots, out=view)
            else:  # gathered on the device, then one copy over the link
                view.copy_(self.kv.index_select(2, slots), non_blocking=self.pin)
        except BaseException:
            self._release(segment, start, n)
            raise
        self._held[request_id] = (segment, start, n)

    def take(self, request_id: str, slots: torch.Tensor) -> None:
        """Copies ``request_id``'s K/V back into ``slots`` [n] (its blocks now) and frees its
        range (also when the copy fails: the request fails with its step)."""
        segment, start, n = self._held[request_id]
        if slots.numel() != n:
            raise ValueError(f"request {request_id!r}: {slots.numel()} slots for {n} swapped")
        del self._held[request_id]
        try:
            saved = self._view(segment, start, n)  # [L, 2, n, Hkv, hd]
            if not self.kv.is_cpu:
                saved = saved.to(self.device, non_blocking=self.pin)
            self.kv.index_copy_(2, slots, saved)
        finally:
            self._release(segment, start, n)

    def drop(self, request_id: str) -> None:
        """Forgets ``request_id``'s K/V, if it holds any (it ended while swapped out)."""
        held = self._held.pop(request_id, None)
        if held is not None:
            self._release(*held)

    def clear(self) -> None:
        """Forgets every request's K/V (the segments within the capacity stay)."""
        for segment, start, n in list(self._held.values()):
            self._release(segment, start, n)
        self._held.clear()

    # ------------------------------------------------------------------ queries

    def holds(self, request_id: str) -> bool:
        return request_id in self._held

    @property
    def num_requests(self) -> int:
        return len(self._held)

    @property
    def used_bytes(self) -> int:
        """Bytes the swapped requests hold (not the segments' size)."""
        return sum(n for _, _, n in self._held.values()) * self.slot_bytes

    @property
    def segment_bytes(self) -> int:
        return self._segment_slots() * self.slot_bytes

    # ------------------------------------------------------------------ ranges

    def _segment_slots(self) -> int:
        return sum(seg.numel() for seg in self.segments.values()) // self.slot_numel

    def _view(self, segment: int, start: int, n: int) -> torch.Tensor:
        k = self.slot_numel
        layers, two, _, heads, head_dim = self.kv.shape
        flat = self.segments[segment][start * k : (start + n) * k]
        return flat.view(layers, two, n, heads, head_dim)

    def _allocate(self, n: int) -> tuple[int, int]:
        """(segment, start) of a free range of ``n`` slots: the first that fits, else a new
        segment: twice the others together, at least ``MIN_SEGMENT_BYTES``, at most what is
        left of the capacity, and at least ``n``."""
        for segment, free in self._free.items():
            for k, (start, length) in enumerate(free):
                if length >= n:
                    if length == n:
                        del free[k]
                    else:
                        free[k] = (start + n, length - n)
                    return segment, start
        have = self._segment_slots()
        size = max(2 * have, -(-MIN_SEGMENT_BYTES // self.slot_bytes))
        if self.capacity_slots:
            size = min(size, self.capacity_slots - have)
        size = max(size, n)
        segment = self._next_id
        self._next_id += 1
        self.segments[segment] = torch.empty(
            size * self.slot_numel, dtype=self.kv.dtype, pin_memory=self.pin
        )
        self._free[segment] = [(n, size - n)] if size > n else []
        return segment, 0

    def _release(self, segment: int, start: int, n: int) -> None:
        """Returns a range to its segment's free list, merged with free neighbours; drops a
        segment beyond the capacity once it is empty (a copy still reading it keeps its
        memory: the pinned allocator waits for it)."""
        free = self._free[segment]
        k = bisect.bisect_left(free, (start, 0))
        end = start + n
        if k < len(free) and free[k][0] == end:  # the next range follows it
            end += free[k][1]
            del free[k]
        if k > 0 and free[k - 1][0] + free[k - 1][1] == start:  # the previous one precedes it
            start = free[k - 1][0]
            del free[k - 1]
            k -= 1
        free.insert(k, (start, end - start))
        size = self.segments[segment].numel() // self.slot_numel
        over = self.capacity_slots and self._segment_slots() > self.capacity_slots
        if over and free == [(0, size)]:
            del self.segments[segment], self._free[segment]
