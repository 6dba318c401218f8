"""``StepHost``: what a ``Step`` uses of the runner that launches it.

A structural type, so ``step.py`` needs no import of ``runner.py`` (which imports ``step.py``):
the runner satisfies it by having these members. Invariant: a ``Step`` touches the runner only
through the members listed here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from collections.abc import Callable

    import numpy as np
    import torch

    from rltserve.core.carried import CarriedRows
    from rltserve.core.cuda_graphs import DecodeGraphs
    from rltserve.core.live import LiveRequest, PendingRows
    from rltserve.core.metadata import Spans
    from rltserve.core.sampler import Sampler
    from rltserve.models.base import AttentionFn, LoopedModel, LoopedSpec


class StepHost(Protocol):
    model: LoopedModel
    spec: LoopedSpec
    device: torch.device
    block_size: int
    kv: torch.Tensor  # the paged KV cache of every plane
    sampler: Sampler
    live: dict[str, LiveRequest]
    logits_width: int
    keeps_e: bool
    gate_init: torch.Tensor
    graphs: DecodeGraphs | None
    pending_rows: PendingRows | None  # the last step's states, not yet in their ItemStates
    carried: CarriedRows  # the tokens whose loops the runner runs by itself
    drafts_checked: int
    drafts_rejected: int

    def deliver(self) -> None:
        """Delivers every launched step before this one."""
        ...

    def attention(
        self,
        spans: list[tuple[int, int, list[int]]],
        keys: list[tuple[str, int]] | None = None,
        carried: tuple[Spans, np.ndarray] | None = None,
        one_row: bool = False,
    ) -> AttentionFn: ...

    def timed(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, its wall time counted as model time."""
        ...

    def tensor(self, values: Any, dtype: torch.dtype | None = None) -> torch.Tensor: ...

    def scalar(self, value: float) -> torch.Tensor:
        """``value`` as a 0-dim fp32 tensor, a scalar operand of the step's ops."""
        ...
