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

Layout: a request's range holds ``kv.index_select(2, slots)`` flattened, [L, 2, n, Hkv, hd]
in that order; a slot is ``L * 2 * Hkv * hd`` elements.
"""

from __future__ import annotations

import bisect

import torch

MIN_SEGMENT_BYTES = 16 << 20


class HostSwap:
    def __init__(self, kv: torch.Tensor, device: torch.device) -> None:
        self.kv = kv  # [L, 2, num_slots, Hkv, hd]
        self.pin = device.type == "cuda"
        self.device = device
        layers, two, _, heads, head_dim = kv.shape
        self.slot_numel = layers * two * heads * head_dim
        self.segments: list[torch.Tensor] = []  # flat, kv.dtype, whole slots
        # Per segment: its free ranges (start slot, slots), sorted and never adjacent.
        self._free: list[list[tuple[int, int]]] = []
        self._held: dict[str, tuple[int, int, int]] = {}  # request id -> (segment, start, n)

    # ------------------------------------------------------------------ copies

    def put(self, request_id: str, slots: torch.Tensor) -> None:
        """Copies the K/V of ``slots`` [n] (on the KV's device) into host memory for
        ``request_id``, which must not hold any."""
        if request_id in self._held:
            raise ValueError(f"request {request_id!r} is already swapped out")
        n = slots.numel()
        segment, start = self._allocate(n)
        self._held[request_id] = (segment, start, n)
        view = self._view(segment, start, n)  # [L, 2, n, Hkv, hd]
        if self.pin:  # gathered on the device, then one copy over the link
            view.copy_(self.kv.index_select(2, slots), non_blocking=True)
        else:
            torch.index_select(self.kv, 2, slots, out=view)

    def take(self, request_id: str, slots: torch.Tensor) -> None:
        """Copies ``request_id``'s K/V back into ``slots`` [n] (its blocks now) and frees its
        range."""
        segment, start, n = self._held.pop(request_id)
        if slots.numel() != n:
            self._held[request_id] = (segment, start, n)
            raise ValueError(f"request {request_id!r}: {slots.numel()} slots for {n} swapped")
        saved = self._view(segment, start, n)  # [L, 2, n, Hkv, hd]
        if self.pin:
            saved = saved.to(self.device, non_blocking=True)
        self.kv.index_copy_(2, slots, saved)
        self._release(segment, start, n)

    def drop(self, request_id: str) -> None:
        """Forgets ``request_id``'s K/V, if it holds any (it ended while swapped out)."""
        held = self._held.pop(request_id, None)
        if held is not None:
            self._release(*held)

    def clear(self) -> None:
        """Forgets every request's K/V (the segments stay)."""
        self._held.clear()
        self._free = [[(0, self._slots_of(seg))] for seg in self.segments]

    # ------------------------------------------------------------------ queries

    def holds(self, request_id: str) -> bool:
        return request_id in self._held

    @property
    def num_requests(self) -> int:
        return len(self._held)

    @property
    def used_bytes(self) -> int:
        """Bytes the swapped requests hold (not the segments' size)."""
        slots = sum(n for _, _, n in self._held.values())
        return slots * self.slot_numel * self.kv.element_size()

    @property
    def segment_bytes(self) -> int:
        return sum(seg.numel() for seg in self.segments) * self.kv.element_size()

    # ------------------------------------------------------------------ ranges

    def _slots_of(self, segment: torch.Tensor) -> int:
        return segment.numel() // self.slot_numel

    def _view(self, segment: int, start: int, n: int) -> torch.Tensor:
        k = self.slot_numel
        layers, two, _, heads, head_dim = self.kv.shape
        flat = self.segments[segment][start * k : (start + n) * k]
        return flat.view(layers, two, n, heads, head_dim)

    def _allocate(self, n: int) -> tuple[int, int]:
        """(segment, start) of a free range of ``n`` slots: the first that fits, else a new
        segment (twice the others together, at least ``MIN_SEGMENT_BYTES`` and ``n``)."""
        for segment, free in enumerate(self._free):
            for k, (start, length) in enumerate(free):
                if length >= n:
                    if length == n:
                        del free[k]
                    else:
                        free[k] = (start + n, length - n)
                    return segment, start
        slot_bytes = self.slot_numel * self.kv.element_size()
        have = sum(self._slots_of(seg) for seg in self.segments)
        size = max(n, 2 * have, -(-MIN_SEGMENT_BYTES // slot_bytes))
        self.segments.append(
            torch.empty(size * self.slot_numel, dtype=self.kv.dtype, pin_memory=self.pin)
        )
        self._free.append([(n, size - n)] if size > n else [])
        return len(self.segments) - 1, 0

    def _release(self, segment: int, start: int, n: int) -> None:
        """Returns a range to its segment's free list, merged with free neighbours."""
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
