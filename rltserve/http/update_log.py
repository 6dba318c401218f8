"""The weight updates a server applied, so that a restarted stage serves the same weights.

A restarted stage loads the checkpoint again and must then get every tensor the updates since
start changed, each from the last update that wrote it. The log records, per applied update,
its files (with their identity: inode, size and modification time) and the tensor names they
hold (read from the safetensors headers; no tensor data, no torch). ``replay`` returns only the
updates that still provide some tensor, oldest first, so a full update makes every earlier one
unnecessary (their files may be gone). A file that vanished or changed since its update was
applied cannot give back what it gave: ``replay`` then raises ``UpdateLost`` rather than let a
stage serve other weights under the same version (RL trainers often overwrite one path).
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass

from rltserve.weights import update_files


class UpdateLost(ValueError):
    """An update's files changed or vanished since it was applied: its weights are lost."""


@dataclass(frozen=True)
class AppliedUpdate:
    paths: tuple[str, ...]
    files: tuple[tuple[str, tuple[int, int, int]], ...]  # (file, (inode, size, mtime_ns))
    names: frozenset[str]  # the tensors its files hold
    unreadable: str | None = None  # why its files could not be read after it was applied

    @classmethod
    def record(cls, paths: list[str]) -> AppliedUpdate:
        try:
            files = [str(f) for path in paths for f in update_files(path)]
            stamps = tuple((f, _identity(f)) for f in files)
            names = frozenset().union(*(tensor_names(f) for f in files))
        except (OSError, ValueError) as exc:  # (gone at once: what it changed is unknown)
            return cls(tuple(paths), (), frozenset(), f"unreadable after it was applied: {exc}")
        return cls(tuple(paths), stamps, names)

    def lost(self) -> str | None:
        """Why this update's files no longer hold what was applied; None when they do."""
        if self.unreadable is not None:
            return self.unreadable
        for file, identity in self.files:
            try:
                if _identity(file) != identity:
                    return f"{file} changed since it was applied"
            except OSError:
                return f"{file} is gone"
        return None


class UpdateLog:
    def __init__(self) -> None:
        self._applied: list[AppliedUpdate] = []

    def __len__(self) -> int:
        return len(self._applied)

    def add(self, paths: list[str]) -> None:
        """Records an update the stage applied (its files as they are now)."""
        self._applied.append(AppliedUpdate.record(paths))

    def replay(self) -> list[AppliedUpdate]:
        """The updates a restarted stage needs, oldest first; UpdateLost when one of them can no
        longer give what it gave."""
        seen: set[str] = set()
        needed: list[tuple[int, AppliedUpdate]] = []
        for number in range(len(self._applied), 0, -1):
            update = self._applied[number - 1]
            if update.unreadable is not None or update.names - seen:
                needed.append((number, update))
                seen |= update.names
        needed.reverse()
        for number, update in needed:
            if (why := update.lost()) is not None:
                raise UpdateLost(f"the weights of update {number} ({list(update.paths)}): {why}")
        return [update for _, update in needed]


def tensor_names(file: str) -> frozenset[str]:
    """The tensor names of a safetensors file, from its header."""
    with open(file, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return frozenset(name for name in header if name != "__metadata__")


def _identity(file: str) -> tuple[int, int, int]:
    st = os.stat(file)
    return st.st_ino, st.st_size, st.st_mtime_ns
