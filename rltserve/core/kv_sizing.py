"""The KV pool's size and the context it holds: blocks from ``kv_cache_gb`` when
``num_blocks`` is not given, and ``max_model_len`` within the pool (vLLM's rule: one request
of the whole context fits in the pool)."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from rltserve.config import EngineConfig
from rltserve.kv_policy import KVPolicy
from rltserve.models.base import LoopedSpec

logger = logging.getLogger(__name__)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class PoolSize:
    num_blocks: int
    max_model_len: int
    # The pool bounds the context: the model's limit was lowered to what it holds, or (an
    # explicit max_model_len) it holds that context only as one that generates, whose last
    # token writes no KV, so a prompt filling the context cannot be scored. A prompt past the
    # limit is told to grow the pool.
    pool_limited: bool


def block_bytes(spec: LoopedSpec, config: EngineConfig) -> int:
    """Bytes of one KV block (K and V of every layer of one plane)."""
    layers = max(spec.num_core_layers, spec.num_boundary_layers)
    itemsize = torch.empty((), dtype=_DTYPES[config.model.dtype]).element_size()
    return layers * 2 * config.cache.block_size * spec.num_kv_heads * spec.head_dim * itemsize


def pool_size(
    spec: LoopedSpec, config: EngineConfig, policy: KVPolicy, role: str | None = None
) -> PoolSize:
    """The pool's blocks (``num_blocks``, else as many as ``kv_cache_gb`` holds, never more
    than every running request at full context could use) and ``max_model_len`` within them:
    one request of that context at the model's default depth fits in the whole pool (without
    it, a chat request that sends no max_tokens, so asks for the whole context, could never be
    admitted). The model's own limit is lowered to it (logged); an explicit max_model_len past
    it is a ValueError, as is one past the model's. ``role``: the stage of a disaggregated
    engine this pool is for (prefill, decode), which the log line names (each stage logs its
    own, and their pools may differ)."""
    cache, sched = config.cache, config.scheduler
    asked = config.model.max_model_len
    if asked is not None and asked > spec.max_position:
        raise ValueError(
            f"max_model_len={asked}: the model's context is {spec.max_position} tokens"
        )
    context = asked or spec.max_position
    num_blocks = cache.num_blocks
    if num_blocks is None:
        budget = int(cache.kv_cache_gb * 2**30 // block_bytes(spec, config))
        planes = policy.num_planes(spec.max_loops) + (spec.num_boundary_layers > 0)
        ceiling = sched.max_num_seqs * math.ceil(context / cache.block_size) * planes
        num_blocks = max(1, min(budget, ceiling))
    planes = policy.num_planes(spec.num_loops) + (spec.num_boundary_layers > 0)
    fits = num_blocks // planes * cache.block_size + 1  # (a context's last token writes no KV)
    if fits >= context:
        return PoolSize(num_blocks, context, pool_limited=fits == context)
    planes_text = f"{planes} plane" + "s" * (planes != 1)
    pool = (
        f"the KV pool ({num_blocks} blocks of {cache.block_size} tokens; a request at "
        f"{spec.num_loops} loops takes {planes_text}) holds a context of at most {fits} tokens"
    )
    if asked is not None:
        raise ValueError(
            f"max_model_len={asked}: {pool}; lower max_model_len or raise kv_cache_gb or num_blocks"
        )
    if fits < 2:
        raise ValueError(f"num_blocks={num_blocks}: {pool}; raise kv_cache_gb or num_blocks")
    logger.warning(
        "%smax_model_len lowered to %d (the model's: %d): %s; raise kv_cache_gb or num_blocks "
        "for longer contexts",
        f"{role} stage: " if role else "",
        fits,
        context,
        pool,
    )
    return PoolSize(num_blocks, fits, pool_limited=True)
