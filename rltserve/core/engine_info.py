"""What an engine tells its front ends: ``EngineInfo`` (facts fixed at start) and
``EngineStats`` (counters). Plain values that cross the stage boundary; torch-free, so a front
end (the ``LLM`` parent process, the HTTP server) never imports torch for them."""

from __future__ import annotations

from dataclasses import dataclass, fields
from operator import attrgetter
from typing import TYPE_CHECKING

from rltserve.kv_policy import KVPolicy

if TYPE_CHECKING:
    from rltserve.config import CacheConfig
    from rltserve.models.base import LoopedSpec

# Upper bounds of the per-step histograms' buckets: tokens (vLLM's ``iteration_tokens_total``,
# its buckets) and rows.
STEP_ROW_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of engine counters (plain values; crosses the stage boundary)."""

    num_running: int
    num_waiting: int
    kv_usage: float  # fraction of KV blocks in use
    num_steps: int
    num_rows: int  # rows run through the core loop, all steps together
    num_coda_rows: int  # rows that reached the coda
    busy_seconds: float  # wall time the runner spent executing steps
    model_seconds: float = 0.0  # of which inside model calls (the rest is the runner's host work)
    drafts_checked: int = 0  # token pipelining: drafts compared with committed tokens
    drafts_rejected: int = 0
    num_graph_steps: int = 0  # steps whose loop was replayed from a CUDA graph
    num_preemptions: int = 0  # requests preempted under KV pressure or by priority, in all
    num_swapped: int = 0  # preempted requests whose KV waits in host swap space
    num_recomputing: int = 0  # preempted requests that will recompute (or are recomputing) KV
    swapped_bytes: int = 0  # host swap space in use
    swap_fallbacks: int = 0  # swap-mode preemptions recomputed because swap space was full
    # Prompt tokens looked up in the prefix cache at first admission (a preempted request's
    # re-admissions are not counted), and of those the ones reused (cached, or shared within
    # a group; on a PD decode stage only those the prefill stage reused).
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_blocks: int = 0  # blocks the prefix cache holds (all planes)
    prefix_cache_evictions: int = 0  # cached prompt blocks (every plane's copy) evicted
    # PD decode stage: prompt tokens found in its prefix cache that the prefill stage computed
    # for the request (moved by ``kv_transfer``, or held from an earlier answer); not in
    # ``prefix_cache_hits``.
    kv_transfer_hits: int = 0
    # PD decode stage: prompt tokens the prefill stage moved here that no hit used (waste).
    kv_transfer_unused: int = 0
    # PD client: prompt tokens whose KV did not move because the transfer files' bound
    # (``kv_transfer_gb``) was reached; the decode stage computed them.
    kv_transfer_skipped: int = 0
    # Steps by their rows (vLLM's ``iteration_tokens``): the count of steps with at most
    # ``STEP_ROW_BUCKETS[i]`` rows (and more than the bound before) at i, those above the
    # last bound at the end.
    step_rows_counts: tuple[int, ...] = ()
    # Steps by their tokens, as ``step_rows_counts`` (vLLM's ``iteration_tokens``: the prompt
    # tokens of the requests a step gave their first token plus the tokens it output), and
    # those tokens, all steps together.
    step_tokens_counts: tuple[int, ...] = ()
    num_step_tokens: int = 0

    def __reduce__(self) -> tuple:
        # Positional (one goes with every step's updates): a quarter of the default's bytes
        # (a dict of field names per object), pickled in two thirds of its time. Both ends
        # run the same rltserve (as for ``RequestUpdate``).
        return (EngineStats, _STATS_FIELDS(self))


_STATS_FIELDS = attrgetter(*(f.name for f in fields(EngineStats)))  # every field, in order

# What an idle engine's gauges read; with ``prefix_cache_blocks`` the fields that are gauges
# (the others are counters, which only go up).
IDLE_GAUGES = {
    "num_running": 0,
    "num_waiting": 0,
    "kv_usage": 0.0,
    "num_swapped": 0,
    "num_recomputing": 0,
    "swapped_bytes": 0,
}
GAUGE_FIELDS = (*IDLE_GAUGES, "prefix_cache_blocks")
_HISTOGRAMS = ("step_rows_counts", "step_tokens_counts")  # (bucket counts: summed bucketwise)


def sum_stats(stats: list[EngineStats], retired: EngineStats | None = None) -> EngineStats | None:
    """Counters and gauges summed over engines (replicas); ``kv_usage`` is their mean.
    ``retired``: the counters of engines that died, so that the sums never go down (with no
    live engine the gauges read 0)."""
    if not stats and retired is None:
        return None
    names = [f.name for f in fields(EngineStats) if f.name not in _HISTOGRAMS]
    total = {name: sum(getattr(s, name) for s in stats) for name in names}
    for name in _HISTOGRAMS:
        counts = [getattr(s, name) for s in [*stats, retired] if s is not None and getattr(s, name)]
        total[name] = tuple(map(sum, zip(*counts))) if counts else ()
    total["kv_usage"] = total["kv_usage"] / len(stats) if stats else 0.0
    if retired is not None:
        for name in names:
            if name not in GAUGE_FIELDS:
                total[name] += getattr(retired, name)
    return EngineStats(**total)


@dataclass(frozen=True)
class EngineInfo:
    """Plain facts about a started engine, for front ends."""

    model_path: str
    family: str
    num_loops: int
    max_loops: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    num_blocks: int
    block_size: int
    kv_policy: str
    has_gate: bool = False  # tokens exit by a learned gate (Ouro), else fixed or a criterion
    needs_noise: bool = False  # a recurrent initial state requests set (Huginn's init_state)
    stop_reason_ids: tuple[int, ...] = ()  # (``LoopedSpec.stop_reason_ids``)
    # KV planes a token takes at the model's depth (``num_loops``): it holds a block slot on
    # each (the policy's core planes, plus the coda's with coda attention), so the pool holds
    # ``num_blocks * block_size / kv_planes`` tokens, not ``num_blocks * block_size``.
    kv_planes: int = 1
    # max_model_len is what the KV pool holds (``kv_sizing.PoolSize.pool_limited``): a prompt
    # past it is told to grow the pool, not that the model is too short.
    pool_limited: bool = False
    kv_block_bytes: int = 0  # one KV block on one plane (a PD client bounds its files by it)

    @classmethod
    def of_model(
        cls, spec: LoopedSpec, cache: CacheConfig, model_path: str, max_model_len: int,
        num_blocks: int, kv_planes: int, pool_limited: bool = False, kv_block_bytes: int = 0,
    ) -> EngineInfo:  # fmt: skip
        """What an engine of ``spec`` on a pool of ``num_blocks`` tells its clients."""
        return cls(
            model_path=model_path,
            family=spec.family,
            num_loops=spec.num_loops,
            max_loops=spec.max_loops,
            max_model_len=max_model_len,
            vocab_size=spec.vocab_size,
            eos_token_ids=tuple(spec.eos_token_ids),
            num_blocks=num_blocks,
            block_size=cache.block_size,
            kv_policy=cache.kv_policy,
            has_gate=spec.has_gate,
            needs_noise=spec.needs_noise,
            stop_reason_ids=tuple(spec.stop_reason_ids),
            kv_planes=kv_planes,
            pool_limited=pool_limited,
            kv_block_bytes=kv_block_bytes,
        )

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens the KV pool holds at the model's depth (vLLM's "KV cache size")."""
        return self.num_blocks // self.kv_planes * self.block_size

    def context_alone(self, max_loops: int | None) -> int:
        """The most positions (prompt and output) a request asking ``max_loops`` (None: the
        model's depth) can take holding the whole KV pool alone: the context, or less where
        the depth it runs at takes more planes than the model's (its last token writes no
        KV). What a request that names no max_tokens gets at most (``Engine.make_request``,
        ``http.plans``): the rest of the context would be refused as larger than the pool."""
        cap = max_loops or self.num_loops
        loops = max(self.num_loops, cap) if self.has_gate else cap  # (``Engine.make_request``)
        policy = KVPolicy.parse(self.kv_policy)
        boundary = max(0, self.kv_planes - policy.num_planes(self.num_loops))  # (coda's plane)
        planes = policy.num_planes(loops) + boundary
        return min(self.max_model_len, self.num_blocks // planes * self.block_size + 1)

    @property
    def max_concurrency(self) -> float:
        """Requests of ``max_model_len`` tokens the pool holds at once (vLLM's "maximum
        concurrency"): a request writes KV for all its tokens but the last, on every plane."""
        per_plane = max(1, -(-(self.max_model_len - 1) // self.block_size))
        return self.num_blocks / (per_plane * self.kv_planes)
