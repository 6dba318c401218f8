"""An engine configuration's modes checked against its model (each a ValueError naming the
setting), and the defaults they take from it; torch-free."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from rltserve.config import EngineConfig
from rltserve.kv_policy import KVPolicy

if TYPE_CHECKING:
    from rltserve.models.base import LoopedSpec


def draft_loops(spec: LoopedSpec) -> int:
    """Default draft depth of token pipelining: 2 loops, fewer on a model of 2 loops."""
    return max(1, min(2, spec.num_loops - 1))


def checked_modes(config: EngineConfig, spec: LoopedSpec) -> tuple[EngineConfig, KVPolicy]:
    """``config`` with its model-dependent defaults filled in (token pipelining's draft
    depth), and its KV policy; a ValueError for a KV policy, token pipelining or wavefront
    prefill the model cannot have."""
    if config.scheduler.speculative_tokens and config.scheduler.draft_loops is None:
        config = replace(config, scheduler=replace(config.scheduler, draft_loops=draft_loops(spec)))
    policy = KVPolicy.parse(config.cache.kv_policy)
    if policy.kind == "ring" and spec.family != "huginn_raven":
        raise ValueError(f"kv_policy={config.cache.kv_policy!r}: ring:K is for Huginn only")
    if config.scheduler.speculative_tokens:
        if config.scheduler.draft_loops >= spec.num_loops:
            raise ValueError(
                f"draft_loops={config.scheduler.draft_loops}: must be below the model's "
                f"{spec.num_loops} loops (at most {spec.num_loops - 1}; unset picks a default)"
                if spec.num_loops > 1
                else "speculative_tokens: token pipelining needs a model of 2 loops or more"
            )
        coda = spec.num_boundary_layers  # (named: "coda attention" alone means little)
        if not policy.per_depth or coda:
            why = f"{spec.family} (Huginn)" if coda else f"kv_policy={config.cache.kv_policy!r}"
            raise ValueError(
                "speculative_tokens: token pipelining needs a per-depth KV policy "
                f"(last_exited or full) and a model without coda attention, not {why}"
            )
    if config.scheduler.wavefront_prefill and not policy.per_depth:
        raise ValueError(
            f"kv_policy={config.cache.kv_policy!r}: wavefront_prefill needs a per-depth "
            "policy (last_exited or full); chunks at different depths would share a plane"
        )
    return config, policy
