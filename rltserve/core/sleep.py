"""Sleep mode (vLLM's ``LLM.sleep`` / ``wake_up``): the device memory an idle engine holds is
handed back, so that an RL trainer sharing the device can train between rollouts.

Both levels free the KV pool; level 1 keeps a host copy of the weights, level 2 drops them (the
trainer loads new ones once they are awake). Tensors keep their identity: only their storage is
freed (``resize_(0)``) and later reallocated at its old size, so every view of the weights and
of the KV pool (the attention's, the swap space's, fused-parameter rows) stays valid. Captured
CUDA graphs hold the old addresses: the runner rebuilds them on waking.

On the CPU the weights stay where they are (host memory is where level 1 would keep them, and
dropping them saves a reload nothing) and only the KV pool is freed.

Invariant: ``asleep`` is the set of parts (``SLEEP_TAGS``) whose storage is freed; a part is
freed and restored as a whole.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from rltserve.updates import SLEEP_TAGS


class DeviceMemory:
    """The freeable storage of one runner: its KV pool ``kv`` and, on CUDA, ``weights``."""

    def __init__(self, kv: torch.Tensor, weights: Iterable[torch.Tensor]) -> None:
        self._kv = kv
        self._kv_bytes = kv.untyped_storage().nbytes()
        self._weights: list[tuple[torch.UntypedStorage, int]] = []
        if kv.device.type == "cuda":
            seen: set[int] = set()  # tied and fused parameters share a storage
            for t in weights:
                storage = t.untyped_storage()
                if storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    self._weights.append((storage, storage.nbytes()))
        self._backups: list[torch.Tensor] | None = None  # level 1: host copies, in order
        self.asleep: set[str] = set()

    def sleep(self, level: int) -> None:
        if "weights" not in self.asleep:
            if level == 1 and self._weights:
                self._backups = [_host_copy(s, n) for s, n in self._weights]
            for storage, _ in self._weights:
                storage.resize_(0)
        if "kv_cache" not in self.asleep:
            self._kv.untyped_storage().resize_(0)
        self.asleep = set(SLEEP_TAGS)
        if self._kv.device.type == "cuda":
            torch.cuda.empty_cache()  # back to the driver: the trainer may be another process

    def wake_up(self, tags: Iterable[str]) -> None:
        tags = set(tags)
        if "weights" in tags and "weights" in self.asleep:
            for i, (storage, nbytes) in enumerate(self._weights):
                storage.resize_(nbytes)  # (level 2: undefined values until new weights load)
                if self._backups is not None:
                    storage.copy_(self._backups[i].untyped_storage())
            self._backups = None
            self.asleep.discard("weights")
        if "kv_cache" in tags and "kv_cache" in self.asleep:
            self._kv.untyped_storage().resize_(self._kv_bytes)
            # Zeros, as allocated: masked attention still multiplies unused slots by 0.
            self._kv.zero_()
            self.asleep.discard("kv_cache")


def _host_copy(storage: torch.UntypedStorage, nbytes: int) -> torch.Tensor:
    copy = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    copy.untyped_storage().copy_(storage)
    return copy
