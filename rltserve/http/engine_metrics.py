"""The engine's side of the server's Prometheus metrics, read at each scrape from the latest
``EngineStats`` the stage sent: running/waiting, KV usage and the prefix cache, preemption and
swap, steps, their tokens (vLLM's ``iteration_tokens_total``) and rows, the sleep state, a
disaggregated prefill stage's numbers, ``cache_config_info`` and the hidden vLLM series shown
(``hidden_metrics``). Every series has vLLM's labels ``model_name`` and ``engine``. The front
end's own series (requests, latencies, HTTP) are ``metrics.ServingMetrics``'."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from rltserve.core.engine_info import STEP_ROW_BUCKETS, EngineStats
from rltserve.http.hidden_metrics import (
    GPU_CACHE_USAGE,
    GPU_PREFIX_CACHE_HITS,
    GPU_PREFIX_CACHE_QUERIES,
)
from rltserve.llm_metrics import ENGINE_INDEX, LOOPS_PER_TOKEN_HELP

if TYPE_CHECKING:
    from rltserve.http.metrics import ServingMetrics, StatsSource

# vLLM's engine_sleep_state labels: awake, or asleep at level 1 or 2.
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")
LABELS = ["model_name", "engine"]  # (vLLM's, on every engine series)
# The hidden vLLM series (``hidden_metrics``) and the fields they read.
_HIDDEN_GAUGES = (
    (GPU_CACHE_USAGE, "GPU KV-cache usage. 1 means 100 percent usage. DEPRECATED: use "
     "kv_cache_usage_perc.", "kv_usage"),
)  # fmt: skip
_HIDDEN_COUNTERS = (
    (GPU_PREFIX_CACHE_QUERIES, "GPU prefix cache queries, in tokens. DEPRECATED: use "
     "prefix_cache_queries.", "prefix_cache_queries"),
    (GPU_PREFIX_CACHE_HITS, "GPU prefix cache hits, in tokens. DEPRECATED: use "
     "prefix_cache_hits.", "prefix_cache_hits"),
)  # fmt: skip

_ENGINE_COUNTERS = (
    ("engine_steps", "Engine steps run.", "num_steps"),
    ("engine_rows", "Rows run through the core loop.", "num_rows"),
    ("engine_coda_rows", "Rows that reached the coda.", "num_coda_rows"),
    ("engine_busy_seconds", "Seconds the engine spent executing steps.", "busy_seconds"),
    ("num_preemptions", "Requests preempted (KV pressure or priority).", "num_preemptions"),
    ("swap_fallbacks", "Swap preemptions recomputed because swap space was full.",
     "swap_fallbacks"),
    ("prefix_cache_queries",
     "Prompt tokens looked up in the prefix cache (first admissions, not re-admissions).",
     "prefix_cache_queries"),
    ("prefix_cache_hits", "Prompt tokens found in the prefix cache (or shared by n samples).",
     "prefix_cache_hits"),
    ("kv_transfer_hits",
     "Disaggregation: prompt tokens the decode stage took from KV the prefill stage computed.",
     "kv_transfer_hits"),
    ("kv_transfer_unused",
     "Disaggregation: prompt tokens the prefill stage moved that the decode stage did not use.",
     "kv_transfer_unused"),
    ("kv_transfer_skipped",
     "Disaggregation: prompt tokens the decode stage computed because the transfer files' "
     "bound (--kv-transfer-gb) was reached.", "kv_transfer_skipped"),
    ("prefix_cache_evictions", "Cached prompt blocks evicted to make room.",
     "prefix_cache_evictions"),
)  # fmt: skip
_ENGINE_GAUGES = (
    ("num_requests_swapped", "Preempted requests whose KV is in host swap space.", "num_swapped"),
    ("num_requests_recomputing", "Preempted requests that recompute their KV.",
     "num_recomputing"),
    ("swapped_bytes", "Host swap space in use, in bytes.", "swapped_bytes"),
    ("prefix_cache_blocks", "KV blocks the prefix cache holds, all planes.",
     "prefix_cache_blocks"),
)  # fmt: skip


class EngineCollector(Collector):
    """Engine-side numbers, read from the latest ``EngineStats`` at each scrape."""

    def __init__(self, model_name: str, metrics: ServingMetrics) -> None:
        self.model_name = model_name
        self.metrics = metrics
        self.stats: StatsSource = lambda: (None, 0, 0)
        self.prefill_stats: Callable[[], EngineStats | None] = lambda: None
        self.cache_info: dict[str, str] | None = None  # (known once the engine is up)
        self.asleep: Callable[[], bool] = lambda: False
        self.disaggregated = False  # (a prefill stage's series from the start)

    def collect(self) -> Iterator[Metric]:
        stats, queued, version = self.stats()
        labels = [self.model_name, ENGINE_INDEX]
        P = self.metrics.prefix
        hidden = self.metrics.hidden

        def stat(name: str) -> float:  # before the first update there are no stats
            return float(getattr(stats, name, 0) or 0) if stats is not None else 0.0

        def gauge(name: str, help_text: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(P + name, help_text, labels=LABELS)
            family.add_metric(labels, value)
            return family

        def counter(name: str, help_text: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(P + name, help_text, labels=LABELS)
            family.add_metric(labels, value)
            return family

        yield gauge("num_requests_running", "Requests running in the engine.", stat("num_running"))
        yield gauge(
            "num_requests_waiting",
            "Requests waiting: the engine's queue plus the server's admission queue (under "
            "--disaggregate also the requests on the prefill stage, which "
            "prefill_stage_num_requests_running and _waiting count too).",
            stat("num_waiting") + queued,
        )
        yield gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).", stat("kv_usage"))
        for name, help_text, field_name in _HIDDEN_GAUGES:
            if name in hidden:
                yield gauge(name, help_text, stat(field_name))
        for name, help_text, field_name in _HIDDEN_COUNTERS:
            if name in hidden:
                yield counter(name, help_text, stat(field_name))
        for name, help_text, field_name in _ENGINE_GAUGES:
            yield gauge(name, help_text, stat(field_name))
        yield gauge("weight_version", "Weight updates applied since start (serving now).", version)
        m = self.metrics
        yield _sleep_state(P, labels, m.sleep_level if self.asleep() else 0)
        yield gauge(
            "loops_per_token",
            LOOPS_PER_TOKEN_HELP,
            m.sum_depths / m.num_tokens if m.num_tokens else 0.0,
        )
        steps, rows = stat("num_steps"), stat("num_rows")
        yield gauge(
            "rows_per_step",
            "Mean rows in the core batch per engine step.",
            rows / steps if steps else 0.0,
        )
        for name, help_text, field_name in _ENGINE_COUNTERS:
            yield counter(name, help_text, stat(field_name))
        yield _per_step(
            P + "iteration_tokens_total",
            "Tokens per engine step: prompt tokens of the requests it gave their first token "
            "plus the tokens it output (vLLM's).",
            labels,
            getattr(stats, "step_tokens_counts", None),
            stat("num_step_tokens"),
        )
        yield _per_step(
            P + "iteration_rows",
            "Rows (tokens at one loop) per engine step.",
            labels,
            getattr(stats, "step_rows_counts", None),
            stat("num_rows"),
        )
        prefill = self.prefill_stats()
        if prefill is not None or self.disaggregated:
            yield from _prefill_stage(P, labels, prefill)
        if self.cache_info is not None:
            info = GaugeMetricFamily(
                P + "cache_config_info",
                "Information of the KV cache config (the value is 1).",
                labels=[*LABELS, *self.cache_info],
            )
            info.add_metric([*labels, *self.cache_info.values()], 1.0)
            yield info


_PREFILL_STAGE = (
    (GaugeMetricFamily, "num_requests_running", "Requests in the prefill stage's engine.",
     "num_running"),
    (GaugeMetricFamily, "num_requests_waiting", "Requests waiting in the prefill stage.",
     "num_waiting"),
    (GaugeMetricFamily, "kv_cache_usage_perc", "Fraction of the prefill stage's KV blocks in use.",
     "kv_usage"),
    (GaugeMetricFamily, "prefix_cache_blocks", "KV blocks the prefill stage's prefix cache holds.",
     "prefix_cache_blocks"),
    (CounterMetricFamily, "engine_steps", "Prefill stage steps run.", "num_steps"),
    (CounterMetricFamily, "prefix_cache_queries", "Prompt tokens the prefill stage looked up.",
     "prefix_cache_queries"),
    (CounterMetricFamily, "prefix_cache_hits", "Prompt tokens the prefill stage reused.",
     "prefix_cache_hits"),
)  # fmt: skip


def _sleep_state(prefix: str, labels: list[str], level: int) -> GaugeMetricFamily:
    """vLLM's ``engine_sleep_state``: 1 on ``awake``, or on the label of the sleep level."""
    family = GaugeMetricFamily(
        prefix + "engine_sleep_state",
        "Engine sleep state: awake = 1 while awake; weights_offloaded = 1 asleep at level 1; "
        "discard_all = 1 asleep at level 2.",
        labels=[*LABELS, "sleep_state"],
    )
    for k, state in enumerate(SLEEP_STATES):
        family.add_metric([*labels, state], float(k == level))
    return family


def _prefill_stage(prefix: str, labels: list[str], stats: EngineStats | None) -> Iterator[Metric]:
    """A disaggregated engine's prefill stage (the unprefixed series are the decode stage's);
    zeros before it first reports, so that dashboards and ``absent()`` alerts see the series
    from the start."""
    for kind, name, help_text, field_name in _PREFILL_STAGE:
        family = kind(prefix + "prefill_stage_" + name, help_text, labels=LABELS)
        family.add_metric(labels, float(getattr(stats, field_name)) if stats is not None else 0.0)
        yield family


def _per_step(
    name: str, help_text: str, labels: list[str], counts: tuple[int, ...] | None, total: float
) -> HistogramMetricFamily:
    """Engine steps by a count (``EngineStats.step_tokens_counts``, ``step_rows_counts``: the
    steps in each of ``STEP_ROW_BUCKETS``, vLLM's ``iteration_tokens_total`` buckets), with
    ``total`` as its sum."""
    family = HistogramMetricFamily(name, help_text, labels=LABELS)
    cumulative, buckets = 0, []
    counts = counts or (0,) * (len(STEP_ROW_BUCKETS) + 1)
    for bound, count in zip([*map(floatToGoString, STEP_ROW_BUCKETS), "+Inf"], counts):
        cumulative += count
        buckets.append((bound, cumulative))
    family.add_metric(labels, buckets, sum_value=total)
    return family
