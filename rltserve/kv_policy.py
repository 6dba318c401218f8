"""KV policies: how a request's core KV planes map to loop depths (DESIGN.md §4).

Torch-free and at the bottom of the package: the config validates ``--kv-policy`` with
``KVPolicy.parse`` and the KV manager (``rltserve.core.kv_cache``, which re-exports these names)
lays out planes by it.
"""

from __future__ import annotations

from dataclasses import dataclass

POLICY_KINDS = ("full", "last_exited", "shared", "ring")


@dataclass(frozen=True)
class KVPolicy:
    """How core planes map to depths, and what an early exit does to the deeper planes."""

    kind: str = "last_exited"
    ring_size: int = 0  # k of ``ring:k``; 0 for every other kind

    def __post_init__(self) -> None:
        if self.kind not in POLICY_KINDS:
            raise ValueError(f"kind={self.kind!r}: must be one of {POLICY_KINDS}")
        if self.kind == "ring":
            if not isinstance(self.ring_size, int) or self.ring_size < 1:
                raise ValueError(f"ring_size={self.ring_size!r}: must be an int >= 1 for ring")
        elif self.ring_size != 0:
            raise ValueError(f"ring_size={self.ring_size!r}: only ring takes a size")

    @classmethod
    def parse(cls, text: str) -> KVPolicy:
        """``"full" | "last_exited" | "shared" | "ring:K"`` -> policy."""
        if text in ("full", "last_exited", "shared"):
            return cls(text)
        if text.startswith("ring:"):
            size = text[len("ring:") :]
            if size.isdigit() and int(size) >= 1:
                return cls("ring", int(size))
        raise ValueError(
            f"kv policy {text!r}: expected 'full', 'last_exited', 'shared' or 'ring:K' (K >= 1)"
        )

    def __str__(self) -> str:
        return f"ring:{self.ring_size}" if self.kind == "ring" else self.kind

    def num_planes(self, num_loops: int) -> int:
        """Core planes a request with ``num_loops`` loops needs."""
        if num_loops < 1:
            raise ValueError(f"num_loops={num_loops}: must be >= 1")
        if self.kind == "shared":
            return 1
        if self.kind == "ring":
            return min(self.ring_size, num_loops)
        return num_loops

    def plane(self, depth: int) -> int:
        """Core plane that loop ``depth`` (1-based) reads and writes."""
        if depth < 1:
            raise ValueError(f"depth={depth}: must be >= 1")
        if self.kind == "shared":
            return 0
        if self.kind == "ring":
            return (depth - 1) % self.ring_size
        return depth - 1

    @property
    def copies_on_exit(self) -> bool:
        """An early-exited token's KV must be copied into the planes of the loops it skips:
        every deeper plane under ``last_exited``; under ``ring:k`` (k > 1) the planes it never
        wrote, those of depths e+1..k (without the copy a later query would read whatever the
        block held before)."""
        return self.kind == "last_exited" or (self.kind == "ring" and self.ring_size > 1)

    def copy_depths(self, num_loops: int) -> int:
        """The deepest depth whose plane an early exit's copy reaches: under ``ring:k`` deeper
        loops share planes the token wrote itself, which keep its own versions."""
        return min(num_loops, self.ring_size) if self.kind == "ring" else num_loops

    @property
    def per_depth(self) -> bool:
        """Every depth has its own plane."""
        return self.kind in ("full", "last_exited")


def is_policy_name(value: object) -> bool:
    """A policy's name (which ones a request may ask for depends on the engine's)."""
    if not isinstance(value, str):
        return False
    try:
        KVPolicy.parse(value)
    except ValueError:
        return False
    return True
