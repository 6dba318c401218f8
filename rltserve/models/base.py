"""The looped-model contract shared by every model family.

A looped model runs, per token: a *prelude* once, the shared *core* block once per loop (depth
1..D), and a *coda* once after the token's last loop. The engine drives these pieces separately so
that one batch can hold rows at different depths:

    e     = model.prelude(input_ids, positions, attn=boundary_attn)      # [N, E]
    state = model.initial_state(e, noise)                                # [N, S]
    state = model.loop(state, e, positions, attn=core_attn)              # once per loop
    g     = model.exit_logit(state)                                      # [N] fp32 or None
    h     = model.coda(state, positions, attn=boundary_attn)             # [N, H]
    logits = model.logits(h)                                             # [N, V] fp32

Attention is injected: a layer never owns a KV cache. It calls ``attn(layer, q, k, v)`` and the
callable stores this step's K/V and attends over each row's context (paged in the engine, a dense
cache in the naive loop). Which *plane* (per-depth KV copy) a row reads and writes is the
callable's business, so model code is depth-agnostic. Core layers are numbered
``0..num_core_layers-1`` on the core callable; prelude and coda layers (Huginn only) are
numbered ``0..num_boundary_layers-1`` on the boundary callable (prelude first, then coda).
"""

from __future__ import annotations

from abc import ABCMeta, abstractmethod
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from rltserve.seeds import LOW_BITS, SEED_MODULUS, cpu_generator


class AttentionFn(Protocol):
    """Stores K/V of the current rows and returns causal attention over each row's context.

    q: [N, num_heads, head_dim]; k, v: [N, num_kv_heads, head_dim] (RoPE already applied).
    Returns [N, num_heads, head_dim] in q's dtype. The softmax scale is ``1/sqrt(head_dim)``.
    """

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor: ...


@dataclass(frozen=True)
class LoopedSpec:
    """Static facts the engine needs about a loaded model (plain values only)."""

    family: str  # "ouro" | "nanbeige" | "huginn_raven"
    vocab_size: int
    hidden_size: int  # width of the coda output fed to logits()
    state_size: int  # width of the recurrent state
    num_loops: int  # D: default number of loops (Ouro total_ut_steps, Huginn mean_recurrence)
    max_loops: int  # hard upper bound on loops a request may ask for
    num_core_layers: int  # attention layers per loop (= per plane)
    num_boundary_layers: int  # prelude + coda attention layers (0 unless Huginn)
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position: int  # context limit (max_position_embeddings / block_size)
    has_gate: bool  # True for Ouro: exit_logit() returns values
    needs_noise: bool  # True for Huginn: initial_state() consumes a random/zero state
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]  # every id that ends generation by default
    pad_token_id: int | None
    # Of those, the generation config's beyond the model's own: as in vLLM (which adds them to
    # a request's stop_token_ids) a stop on one reports it as the output's stop_reason.
    stop_reason_ids: tuple[int, ...] = ()


class LoopedModel(nn.Module, metaclass=ABCMeta):
    """Base class of every family. Subclasses fill ``spec`` and implement the pieces below."""

    spec: LoopedSpec

    @abstractmethod
    def prelude(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionFn | None
    ) -> torch.Tensor:
        """input_ids, positions: [N] int64 -> input injection e: [N, E]."""

    @abstractmethod
    def initial_state(self, e: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
        """State entering loop 1: [N, S]. ``noise`` ([N, S], from ``draw_noise``) is used only
        when ``spec.needs_noise``; otherwise it is ignored and may be None."""

    def draw_noise(self, seed: int | None, positions: list[int]) -> torch.Tensor:
        """Initial recurrent state of the given positions of one request, on the CPU in fp32:
        [len(positions), S]. ``seed=None`` means the all-zero state. Each position draws from its
        own generator (``noise_generator(seed, position)``), so the values do not depend on
        chunking, batching or recomputation. Models without a recurrent state return zeros."""
        return torch.zeros(len(positions), self.spec.state_size, dtype=torch.float32)

    @abstractmethod
    def loop(
        self,
        state: torch.Tensor,
        e: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionFn,
    ) -> torch.Tensor:
        """One pass through the shared block: [N, S] -> [N, S]."""

    def exit_logit(self, state: torch.Tensor) -> torch.Tensor | None:
        """Exit-gate logit of the post-loop state in fp32: [N], or None without a gate."""
        return None

    @abstractmethod
    def coda(
        self, state: torch.Tensor, positions: torch.Tensor, attn: AttentionFn | None
    ) -> torch.Tensor:
        """Final state after the last loop -> hidden state for logits: [N, H]."""

    @abstractmethod
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] -> [N, V] in fp32."""


def noise_seed(seed: int, position: int) -> int:
    """Seed of the generator that draws the initial state of one position of a request."""
    return (seed * 1_000_003 + position) % (2**63)


def noise_generator(seed: int, position: int) -> torch.Generator:
    """The generator that draws the initial state of one position of a request:
    ``manual_seed(noise_seed(seed, position))``, whose mt19937 reads the low 32 bits, with the
    seed's high 32 bits mixed in where they are not 0 (``seeds``), so that seeds apart by a
    multiple of 2**32 draw different states."""
    high = (seed % SEED_MODULUS) >> LOW_BITS
    return cpu_generator(noise_seed(seed, position), high)
