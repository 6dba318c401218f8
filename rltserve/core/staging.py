"""Moving a step's small tensors between host and device without stalling the device.

- ``to_device`` / ``move_to``: plain host lists (block tables, positions, indices) and host
  tensors become device tensors. On CUDA they go through pinned memory with a non-blocking copy
  (a pageable copy would synchronise the stream), so building the next step's inputs never
  waits for the device.
- ``StepOutputs``: the few small device tensors whose values the scheduler needs (exit
  decisions, gate state, sampled tokens, logprobs, drafts). On CUDA they are packed into one
  buffer, copied to pinned host memory with one non-blocking copy and an event is recorded;
  ``read()`` waits on that event only, when the result is delivered. On the CPU there is no
  asynchrony to preserve, and ``read()`` simply converts.
"""

from __future__ import annotations

import array
from collections.abc import Sequence

import torch

# array.array type codes of the dtypes host_tensor builds through a buffer.
_TYPECODES = {torch.int64: "q", torch.int32: "i", torch.float32: "f", torch.float64: "d"}


def host_tensor(values: Sequence, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A flat host list as a CPU tensor, as ``torch.tensor(values, dtype=dtype)`` (``None``
    infers int64 for ints, the default float dtype for floats, bool for bools) but 3-4x faster
    for the int and float lists a step builds: they pass through an ``array.array`` buffer."""
    if not values:
        return torch.tensor(values, dtype=dtype)
    want = dtype
    if want is None:
        first = values[0]
        if type(first) is int:
            want = torch.int64
        elif type(first) is float:
            want = torch.get_default_dtype()
    code = _TYPECODES.get(want)
    if code is not None:
        try:
            return torch.frombuffer(array.array(code, values), dtype=want)
        except (TypeError, OverflowError):  # mixed or out-of-range values: torch's rules
            pass
    return torch.tensor(values, dtype=dtype)


def to_device(
    values: Sequence, device: torch.device, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """A host list as a tensor on ``device`` (pinned, non-blocking on CUDA); ``dtype`` as for
    ``host_tensor``."""
    host = host_tensor(values, dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def move_to(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``; on CUDA through pinned memory with a non-blocking copy (a
    plain ``.to(cuda)`` of pageable memory waits for the stream)."""
    if device.type != "cuda" or tensor.device.type == "cuda":
        # (Already there, the usual case on CPU: ``to`` would return it after parsing.)
        return tensor if device.type == "cpu" and tensor.is_cpu else tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


class StepOutputs:
    """Named device tensors of one step, read on the host after the step.

    Invariant: tensors added are not written again by later work (they are fresh results of
    this step), so copying them after the step's other work was queued is safe.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._parts: list[tuple[str, torch.Tensor]] = []
        self._host: torch.Tensor | None = None  # packed float64, pinned (CUDA only)
        self._event: torch.cuda.Event | None = None
        self._values: dict[str, list] | None = None

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if self._host is not None or self._values is not None:
            raise RuntimeError("StepOutputs: add() after stage()")
        self._parts.append((name, tensor))

    def stage(self) -> None:
        """Starts the device-to-host copy (CUDA); call once, after the step's work is queued."""
        if self.device.type != "cuda" or not self._parts:
            return
        # float64 holds every int32/int64 token id and every fp32 value exactly.
        flat = torch.cat([t.detach().reshape(-1).to(torch.float64) for _, t in self._parts])
        self._host = torch.empty(flat.shape, dtype=torch.float64, pin_memory=True)
        self._host.copy_(flat, non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record()

    def ready(self) -> bool:
        """Whether ``read()`` would return without waiting for the device."""
        return self._event is None or self._event.query()

    def read(self) -> dict[str, list]:
        """Name -> ``tensor.tolist()``; waits for the step's copy on CUDA."""
        if self._values is not None:
            return self._values
        if self._host is None:
            values = {name: t.tolist() for name, t in self._parts}
        else:
            assert self._event is not None
            self._event.synchronize()
            values, offset = {}, 0
            for name, t in self._parts:
                n = t.numel()
                part = self._host[offset : offset + n].view(t.shape).to(t.dtype)
                values[name] = part.tolist()
                offset += n
        self._values = values
        self._parts = []
        return values
