"""A prefill/decode client's transfer files (``pd.py``, DESIGN §8): named in the client's own
directory (``transfer_dir``), and the bytes of those that wait for the decode stage bounded.

A file waits in shared memory (tmpfs: RAM) from its prefill until the decode stage admits its
request, so a burst of long prompts on a busy decode stage would otherwise hold memory without
limit. Each transfer claims its file's bytes before its prefill starts (an estimate from the
prompt's blocks, made exact once the file is written: ``settle``) and gives them back when the
file is gone (``release``: the decode stage read it, or its request ended or moved on without
it). A transfer that would pass the bound is not made: the decode stage computes that prompt
itself (the output is the same), and ``skipped_tokens`` counts the prompt tokens that did not
move (``rltserve:kv_transfer_skipped_total``)."""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import threading
import weakref

from rltserve.core import transfer_dir
from rltserve.core.engine_info import EngineInfo
from rltserve.kv_policy import KVPolicy
from rltserve.sampling import SamplingParams

# The default bound's share of the space free in the directory at start: the rest stays for
# everything else that uses shared memory (the stages' own tensors, other processes).
DEFAULT_SHARE = 0.5
logger = logging.getLogger(__name__)


class TransferFiles:
    """The transfer directory (``dir``), the files named in it, and the bytes they hold at
    most (``limit``: ``limit_gb`` GiB, None for ``DEFAULT_SHARE`` of the free space)."""

    def __init__(self, limit_gb: float | None) -> None:
        self.dir, owner = transfer_dir.create()
        self._finalizer = weakref.finalize(self, transfer_dir.drop, self.dir, owner)
        if limit_gb is None:
            self.limit = int(shutil.disk_usage(self.dir).free * DEFAULT_SHARE)
        else:
            self.limit = int(limit_gb * 2**30)
        # (tmpfs pages count against a container's memory limit: the operator sizes one by it)
        logger.info(
            "KV transfer files: at most %.2f GiB in %s (--kv-transfer-gb%s)",
            self.limit / 2**30,
            self.dir,
            ": half the space free there" if limit_gb is None else "",
        )
        warning = transfer_dir.fallback_warning(self.dir)
        if warning is not None and self.limit > 0:  # (0: no file is written anywhere)
            logger.warning("%s", warning)
        self._lock = threading.Lock()  # guards the rest (claims come from request threads)
        self._held: dict[str, int] = {}  # path -> its bytes, while the file may exist
        self.held_bytes = 0
        self.skipped_tokens = 0
        self._names = itertools.count()

    def claim(self, size: int, tokens: int) -> str | None:
        """A new file's path, ``size`` bytes held for it; None when they would pass the limit
        (``tokens``, the prompt tokens it would move, then count as skipped)."""
        with self._lock:
            if self.held_bytes + size > self.limit:
                self.skipped_tokens += tokens
                return None
            path = os.path.join(self.dir, f"{next(self._names)}.safetensors")
            self._held[path] = size
            self.held_bytes += size
            return path

    def settle(self, path: str) -> None:
        """Once the prefill stage wrote the file (or wrote none): its real size is held."""
        try:
            size = os.stat(path).st_size
        except OSError:
            size = 0
        with self._lock:
            if path in self._held:
                self.held_bytes += size - self._held[path]
                self._held[path] = size

    def release(self, path: str | None) -> None:
        """Deletes the file, if any, and frees its bytes: once its request ended, moved on
        without it, or the decode stage took it (which deletes it as it reads it). Only the
        first call for a path does anything."""
        with self._lock:
            size = self._held.pop(path, None) if path is not None else None
            if size is None:
                return
            self.held_bytes -= size
        transfer_dir.remove(path)

    def close(self) -> None:
        """Removes the directory and every file in it."""
        self._finalizer()


def transfer_size(info: EngineInfo, prompt: list[int], params: SamplingParams) -> tuple[int, int]:
    """What the file of ``prompt``'s KV takes at most, and the prompt tokens it moves
    (``kv_transfer``'s layout: its full blocks before the last token, on every plane the
    request's depth takes)."""
    policy = KVPolicy.parse(info.kv_policy)
    boundary = info.kv_planes - policy.num_planes(info.num_loops)  # (the coda's plane)
    loops = max(info.num_loops, params.max_loops or 0)  # (a gated request runs at least these)
    blocks = (len(prompt) - 1) // info.block_size
    size = blocks * (policy.num_planes(loops) + boundary) * info.kv_block_bytes
    return size, blocks * info.block_size
