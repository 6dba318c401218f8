"""A stand-in looped model whose pieces cost almost nothing: the host-overhead benchmark's model.

It implements the whole ``LoopedModel`` contract with an Ouro-like spec (a gate, D loops, no
boundary attention) over tiny tensors, so a step's time is the engine's host work: planning,
inputs and attention metadata, exit bookkeeping, sampling glue, results. It never calls the
attention callable (attending is device work), but the runner builds the metadata all the same.

The gate logit is a constant, so every token exits at the same depth for a given threshold
(``exit_logit``); the next token is ``(input + 1) % vocab``, so outputs are deterministic.
"""

from __future__ import annotations

import torch
from torch import nn

from rltserve.models.base import AttentionFn, LoopedModel, LoopedSpec


class StandInModel(LoopedModel):
    """State width 4; one core layer and one KV head of width 2 (the KV cache stays small at
    long contexts); ``vocab_size`` logits per sampled row."""

    def __init__(
        self, *, num_loops: int = 4, vocab_size: int = 512, max_position: int = 1 << 16
    ) -> None:
        super().__init__()
        width = 4
        self.spec = LoopedSpec(
            family="ouro",
            vocab_size=vocab_size,
            hidden_size=width,
            state_size=width,
            num_loops=num_loops,
            max_loops=num_loops,
            num_core_layers=1,
            num_boundary_layers=0,
            num_heads=1,
            num_kv_heads=1,
            head_dim=2,
            max_position=max_position,
            has_gate=True,
            needs_noise=False,
            bos_token_id=None,
            eos_token_ids=(),
            pad_token_id=None,
        )
        # The runner reads the dtype from the parameters.
        self.gate_logit = nn.Parameter(torch.zeros(()), requires_grad=False)

    def prelude(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionFn | None
    ) -> torch.Tensor:
        # Column 0 carries the token id through the loops to the logits.
        e = torch.zeros(input_ids.shape[0], self.spec.state_size)
        e[:, 0] = input_ids.float()
        return e

    def initial_state(self, e: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
        return e

    def loop(
        self, state: torch.Tensor, e: torch.Tensor, positions: torch.Tensor, attn: AttentionFn
    ) -> torch.Tensor:
        return state

    def exit_logit(self, state: torch.Tensor) -> torch.Tensor:
        # sigmoid(0) = 0.5 per loop: CDF 0.5, 0.75, 0.875, ... by depth.
        return self.gate_logit.expand(state.shape[0])

    def coda(
        self, state: torch.Tensor, positions: torch.Tensor, attn: AttentionFn | None
    ) -> torch.Tensor:
        return state

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        vocab = self.spec.vocab_size
        nxt = (hidden[:, 0].long() + 1) % vocab  # [M]
        # A one-hot row written in place (``one_hot(...).float()`` builds an int64 [M, V]
        # first: twice the time, the stand-in's own cost, not the engine's).
        logits = torch.zeros(hidden.shape[0], vocab)  # [M, V]
        return logits.scatter_(1, nxt.unsqueeze(1), 1.0)
