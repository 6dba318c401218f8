"""What the server logs about its engine, as vLLM logs it: the KV pool's capacity at start, and
a stats line every ``VLLM_LOG_STATS_INTERVAL`` seconds (vLLM's variable; 10 by default) while
serving.

vLLM's start lines ("GPU KV cache size: N tokens", "Maximum concurrency for M tokens per
request: X x") count tokens, and a looped model's token takes a block slot on each of its KV
planes (4 at Ouro's 4 loops under ``last_exited``): the pool's blocks times their size would
overstate it by that factor. The periodic line reads what ``/metrics`` reads (the latest
``EngineStats`` and the server's counters), over the interval since the last line:

``Engine 000: Avg prompt throughput: X tokens/s, Avg generation throughput: Y tokens/s,
Running: N reqs, Waiting: M reqs, Preemptions: K, GPU KV cache usage: Z%, Prefix cache hit
rate: W%``

vLLM's line, word for word (log parsers key on it): its engine index, and ``Preemptions`` only
when the interval had some. "GPU KV cache usage" whatever the device, as vLLM's on the CPU.
Prompt tokens count once their request's first token comes (vLLM's accounting), preemptions
are the interval's, and the hit rate is vLLM's: over the prefix cache lookups of the most recent
1000 requests (``RecentHitRate``), not the interval's alone, which would read 0.0% in every
interval that only decodes (a chat server's long answers) however well the cache serves. An idle
server logs nothing: a line is due while anything runs, waits or was processed in the
interval, plus one more after that (which shows it went idle).
"""

from __future__ import annotations

import logging
import os
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

from rltserve.core.engine_info import EngineInfo
from rltserve.http.metrics import ServingMetrics, StatsSource
from rltserve.llm_metrics import ENGINE_INDEX

INTERVAL_ENV = "VLLM_LOG_STATS_INTERVAL"
INTERVAL_S = 10.0  # its default
RECENT_REQUESTS = 1000  # vLLM's CachingMetrics window

log = logging.getLogger(__name__)


def log_stats_interval(environ: Mapping[str, str] = os.environ) -> float:
    """Seconds between stats lines: ``VLLM_LOG_STATS_INTERVAL`` as vLLM reads it (a float; not
    above 0: the default). One that is no number is warned about and the default used: the
    stats line is not worth failing the server's start."""
    text = environ.get(INTERVAL_ENV)
    if text is None:
        return INTERVAL_S
    try:
        value = float(text)
    except ValueError:
        log.warning("%s=%r is not a number: stats every %g s", INTERVAL_ENV, text, INTERVAL_S)
        return INTERVAL_S
    return value if value > 0 else INTERVAL_S


def kv_capacity_lines(info: EngineInfo, disaggregated: bool = False) -> list[str]:
    """vLLM's start lines about the KV pool, in tokens at the model's depth; ``disaggregated``:
    the prefill and the decode stage each have a pool of that size, and requests decode (and
    so run concurrently) on the decode stage's."""
    planes = f"{info.kv_planes} KV plane" + "s" * (info.kv_planes != 1)
    each = "; two stages, prefill and decode, each with its own pool of this size" * disaggregated
    return [
        f"KV cache size: {info.kv_capacity_tokens} tokens at {info.num_loops} loops "
        f"({info.num_blocks} blocks of {info.block_size} tokens; a token takes a block slot "
        f"on each of its {planes}, kv_policy {info.kv_policy}{each})",
        f"Maximum concurrency for {info.max_model_len} tokens per request: "
        f"{info.max_concurrency:.2f}x" + " (on the decode stage)" * disaggregated,
    ]


@dataclass(frozen=True)
class _Totals:
    """The running totals one line's interval is measured against."""

    at: float  # (time.monotonic())
    requests: int  # requests that got their first token (and so looked their prompt up)
    prompt_tokens: int
    generation_tokens: int
    prefix_queries: int
    prefix_hits: int
    preemptions: int


class RecentHitRate:
    """vLLM's ``CachingMetrics``: the prefix cache hit rate over the lookups of the most recent
    ``RECENT_REQUESTS`` requests, kept as (requests, queries, hits) per interval. An interval
    without requests adds nothing (so the rate outlasts a stretch of decoding); its lookups (a
    request admitted, its first token still to come) go with the next interval's requests. The
    oldest intervals go once the rest hold more requests than the window; the latest stays."""

    def __init__(self, window: int = RECENT_REQUESTS) -> None:
        self.window = window
        self.reset()

    def reset(self) -> None:
        self.intervals: deque[tuple[int, int, int]] = deque()
        self.requests = self.queries = self.hits = 0
        self.pending = (0, 0)  # lookups of an interval without requests

    def observe(self, requests: int, queries: int, hits: int) -> None:
        queries, hits = queries + self.pending[0], hits + self.pending[1]
        if not requests:
            self.pending = (queries, hits)
            return
        self.pending = (0, 0)
        self.intervals.append((requests, queries, hits))
        self.requests += requests
        self.queries += queries
        self.hits += hits
        while len(self.intervals) > 1 and self.requests > self.window:
            old_requests, old_queries, old_hits = self.intervals.popleft()
            self.requests -= old_requests
            self.queries -= old_queries
            self.hits -= old_hits

    @property
    def rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class StatsLog:
    """Makes the periodic stats line: ``line(now)`` each interval (None: nothing to log)."""

    def __init__(self, metrics: ServingMetrics, stats: StatsSource, now: float) -> None:
        self.metrics = metrics
        self.stats = stats
        self._last = self._totals(now)
        self._active = False  # the last line reported activity
        self.hit_rate = RecentHitRate()

    def _totals(self, now: float) -> _Totals:
        stats = self.stats()[0]
        return _Totals(
            now,
            self.metrics.num_prefilled_requests,
            self.metrics.num_prefilled,
            self.metrics.num_tokens,
            stats.prefix_cache_queries if stats is not None else 0,
            stats.prefix_cache_hits if stats is not None else 0,
            stats.num_preemptions if stats is not None else 0,
        )

    def line(self, now: float) -> str | None:
        """The line for the interval since the last call, or None when the server was and
        is idle."""
        stats, queued, _ = self.stats()
        totals, last = self._totals(now), self._last
        self._last = totals

        # (A restarted stage starts its counters again: never a negative interval.)
        def delta(name: str) -> int:
            return max(0, getattr(totals, name) - getattr(last, name))

        prompt, generated = delta("prompt_tokens"), delta("generation_tokens")
        queries, hits = delta("prefix_queries"), delta("prefix_hits")
        if totals.prefix_queries < last.prefix_queries:  # a restarted stage: a new cache
            self.hit_rate.reset()
            queries, hits = totals.prefix_queries, totals.prefix_hits  # (its own, from zero)
        self.hit_rate.observe(delta("requests"), queries, hits)
        preempted = delta("preemptions")
        running = stats.num_running if stats is not None else 0
        waiting = (stats.num_waiting if stats is not None else 0) + queued
        active = bool(prompt or generated or running or waiting or preempted)
        was_active, self._active = self._active, active
        if not (active or was_active):
            return None
        seconds = max(totals.at - last.at, 1e-9)
        usage = stats.kv_usage if stats is not None else 0.0
        return (
            f"Engine {ENGINE_INDEX:0>3}: "
            f"Avg prompt throughput: {prompt / seconds:.1f} tokens/s, "
            f"Avg generation throughput: {generated / seconds:.1f} tokens/s, "
            f"Running: {running} reqs, Waiting: {waiting} reqs, "
            + f"Preemptions: {preempted}, "
            * bool(preempted)
            + f"GPU KV cache usage: {100 * usage:.1f}%, "
            f"Prefix cache hit rate: {100 * self.hit_rate.rate:.1f}%"
        )
