"""The weight updates a server applied, so that a restarted stage serves the same weights.

A restarted stage loads the checkpoint again and must then get every tensor the updates since
start changed, each from the last update that wrote it. The log keeps, per applied update, the
weight version the stage gave it (the order it was applied in, whatever order the callers come
back in), its files with their identity (inode, size and modification time, taken before the
update and checked after it) and the tensor names they hold (read from the safetensors headers;
no tensor data, no torch). An update all of whose tensors later updates wrote is dropped at
once: it can never be needed again (so a long RL run keeps at most one entry per tensor, and the
files of superseded updates may go). ``replay`` returns the updates still needed, oldest first;
a file that vanished or changed since its update was applied cannot give back what it gave, and
``replay`` then raises ``UpdateLost`` rather than let a stage serve other weights under the same
version (RL trainers often overwrite one path).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

from rltserve.weights import safetensors_header, update_files

Stamps = tuple[tuple[str, tuple[int, int, int]], ...]  # (file, (inode, size, mtime_ns))


class UpdateLost(ValueError):
    """An update's files changed or vanished since it was applied: its weights are lost."""


@dataclass(frozen=True)
class AppliedUpdate:
    version: int  # the weight version it made
    paths: tuple[str, ...]
    files: Stamps
    names: frozenset[str]  # the tensors its files hold
    unreadable: str | None = None  # why what it changed cannot be known or read again

    @classmethod
    def record(cls, paths: list[str], version: int, before: Stamps | str) -> AppliedUpdate:
        """``before``: ``stamps(paths)`` taken before the update ran (or why it failed). An
        update whose tensors cannot be known is recorded as such (always needed, and lost)."""

        def unknown(why: str) -> AppliedUpdate:
            return cls(version, tuple(paths), (), frozenset(), why)

        if isinstance(before, str):
            return unknown(f"unreadable before it: {before}")
        try:
            after = stamps(paths)
            names = frozenset().union(*(tensor_names(f) for f, _ in after))
        except Exception as exc:  # noqa: BLE001 - torn or gone at once (any parse error)
            return unknown(f"unreadable after it: {exc}")
        if before != after:
            return unknown("its files changed while it ran")
        return cls(version, tuple(paths), after, names)

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
        self._lock = threading.Lock()  # (updates come back on the server's worker threads)
        self._applied: list[AppliedUpdate] = []  # in version order, superseded ones dropped
        self.last_version = 0  # of the latest update recorded

    def __len__(self) -> int:
        return len(self._applied)

    def add(self, paths: list[str], version: int, before: Stamps | str) -> None:
        """Records an update the stage applied as ``version``."""
        update = AppliedUpdate.record(paths, version, before)
        with self._lock:
            self._applied.append(update)
            self._applied.sort(key=lambda u: u.version)
            self.last_version = max(self.last_version, version)
            self._applied = _needed(self._applied)

    def replay(self) -> tuple[list[AppliedUpdate], int]:
        """The updates a restarted stage needs, oldest first, and the version it then serves
        (the latest recorded); UpdateLost when one of them can no longer give what it gave."""
        with self._lock:
            needed, version = list(self._applied), self.last_version
        for update in needed:
            if (why := update.lost()) is not None:
                raise UpdateLost(f"the weights of update {update.version} "
                                 f"({list(update.paths)}): {why}")  # fmt: skip
        return needed, version


def _needed(applied: list[AppliedUpdate]) -> list[AppliedUpdate]:
    """Those of ``applied`` (in version order) that last wrote some tensor, and every one whose
    tensors are unknown."""
    seen: set[str] = set()
    needed = []
    for update in reversed(applied):
        if update.unreadable is not None or update.names - seen:
            needed.append(update)
            seen |= update.names
    return needed[::-1]


def stamps(paths: list[str]) -> Stamps:
    """The files of an update and their identities now (ValueError/OSError: unreadable)."""
    files = [str(f) for path in paths for f in update_files(path)]
    return tuple((f, _identity(f)) for f in files)


def tensor_names(file: str) -> frozenset[str]:
    """The tensor names of a safetensors file, from its header."""
    header, _ = safetensors_header(file)
    return frozenset(name for name in header if name != "__metadata__")


def _identity(file: str) -> tuple[int, int, int]:
    st = os.stat(file)
    return st.st_ino, st.st_size, st.st_mtime_ns
