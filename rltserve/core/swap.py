"""Host swap space for the KV of preempted requests: the scheduler's accounting (torch-free).

The runner holds the bytes (``ModelRunner.swap_out`` / ``swap_in``); this class only decides
whether a victim's blocks fit within ``capacity_blocks`` and remembers how many each swapped
request holds. Invariant: ``used_blocks`` is the sum over the requests held.
"""

from __future__ import annotations


class SwapSpace:
    def __init__(self, capacity_blocks: int, block_bytes: int) -> None:
        if capacity_blocks < 0 or block_bytes < 1:
            raise ValueError(
                f"capacity_blocks={capacity_blocks}, block_bytes={block_bytes}: must be >= 0, >= 1"
            )
        self.capacity_blocks = capacity_blocks
        self.block_bytes = block_bytes
        self._held: dict[str, int] = {}
        self.used_blocks = 0

    def can_hold(self, num_blocks: int) -> bool:
        return self.used_blocks + num_blocks <= self.capacity_blocks

    def hold(self, request_id: str, num_blocks: int) -> None:
        if request_id in self._held:
            raise ValueError(f"request {request_id!r} is already swapped out")
        if not self.can_hold(num_blocks):
            raise ValueError(f"{num_blocks} blocks do not fit the swap space")
        self._held[request_id] = num_blocks
        self.used_blocks += num_blocks

    def release(self, request_id: str) -> int:
        """Frees a request's swap blocks; returns how many. Unknown ids raise ``KeyError``."""
        n = self._held.pop(request_id)
        self.used_blocks -= n
        return n

    def holds(self, request_id: str) -> bool:
        return request_id in self._held

    @property
    def used_bytes(self) -> int:
        return self.used_blocks * self.block_bytes

    @property
    def num_requests(self) -> int:
        return len(self._held)
