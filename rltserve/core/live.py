"""Per-request execution state the runner keeps between steps.

The scheduler owns request progress; the runner owns what the device computed that the next step
needs, so the next step can be planned before this one's result is read: the in-flight item's
hidden states and exit-gate states (several items of one request may be in flight at different
depths: wavefront prefill), the last sampled token (the next decode token's input), the
sampling generator and, for penalties, the sampled history.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rltserve.core.plan import RequestSetup


@dataclass
class ItemState:
    """The in-flight work item of a request, as the device sees it."""

    start: int
    state: torch.Tensor | None = None  # [n, S] after the last loop run
    e: torch.Tensor | None = None  # [n, E] input injection (models that re-inject it)
    survival: float = 1.0  # exit gate of the output position: S and CDF after the last loop
    cdf: float = 0.0
    pending: bool = False  # delayed exit: the next loop is the exit
    exited: bool = False  # the output position has produced its token


@dataclass
class LiveRequest:
    setup: RequestSetup
    generator: torch.Generator | None
    items: dict[int, ItemState] = field(default_factory=dict)  # in-flight items by start
    last_token: int | None = None
    history: list[int] | None = None  # sampled tokens, kept only for penalties
    drafts: dict[int, int] = field(default_factory=dict)  # position -> drafted input token
    epoch: int = 0  # rollbacks so far; plan items of an older epoch are stale

    @classmethod
    def create(cls, setup: RequestSetup, device: torch.device) -> LiveRequest:
        generator = None
        if not setup.params.greedy:
            generator = torch.Generator(device=device).manual_seed(setup.seed)
        history = [] if setup.prompt_token_ids is not None else None
        return cls(setup, generator, history=history)

    def record(self, token: int) -> None:
        self.last_token = token
        if self.history is not None:
            self.history.append(token)

    def commit(self, next_position: int, token: int) -> bool:
        """Records a sampled token, the input of ``next_position``. Returns True when a draft
        of that input was used and differs: everything from ``next_position`` on must go."""
        draft = self.drafts.pop(next_position, None)
        self.record(token)
        return draft is not None and draft != token

    def rollback(self, position: int) -> None:
        """Drops the in-flight items and drafts at ``position`` and beyond."""
        for start in [s for s in self.items if s >= position]:
            del self.items[start]
        for key in [k for k in self.drafts if k >= position]:
            del self.drafts[key]
        self.epoch += 1

    def penalty_tokens(self) -> tuple[list[int], list[int]] | None:
        if self.history is None:
            return None
        return self.setup.prompt_token_ids, self.history
