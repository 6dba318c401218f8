"""The server's Prometheus metrics: vLLM V1 names plus looped-model ones, under ``rltserve:``
or, with ``--metrics-prefix vllm``, under ``vllm:`` (every series: dashboards and autoscalers
built for vLLM then find theirs; the looped-model ones keep the chosen prefix too).

Latencies use ``time.monotonic()`` in the front-end process. TTFT runs from the HTTP request's
arrival (before tokenization), as vLLM measures it. A request's time splits as vLLM's does:
``request_queue_time_seconds`` from its arrival until the engine first scheduled it (the
server's admission queue, ``--max-concurrent``/``--max-queued``, plus the engine's waiting
queue, where it waits for a seat or KV blocks), ``request_prefill_time_seconds`` from there to
the first token, ``request_decode_time_seconds`` from there to the finish. The engine's part of
the queue time comes as a duration (``RequestUpdate.queued_s``: the engine may be another
process or a Ray actor, whose clock is not this one's). The three are observed as a request
finishes that got a first token (as vLLM observes them for finished requests), and add up to
its ``e2e_request_latency_seconds``. (Under disaggregation the first token comes from the
decode stage, whose wait is the engine's part; the prefill stage's time, its wait there
included, counts as prefill.) Every request and engine sample carries a ``model_name``
label; ``http_requests_total`` carries ``handler, method, status``. Engine-side numbers
(running/waiting, KV usage, steps and rows) come from the latest ``EngineStats`` the stage sent.

``iteration_tokens_total`` (vLLM's name) is a histogram of the rows of each engine step (a
row is a token at one loop, the unit of a step's work; its sum is ``engine_rows_total``).
``cache_config_info`` (vLLM's, value 1) has the KV pool's facts as labels: with
``kv_cache_usage_perc`` it gives the blocks in use; ``kv_planes`` (a token takes a block slot
on each of its planes) and ``kv_capacity_tokens`` turn them into tokens.

Looped-model metrics: ``token_exit_depth`` (the loop at which each generated token exited),
``loops_per_token`` (its mean), ``rows_per_step`` (mean core-batch rows per engine step) and the
step/row counters behind it.

Exposition is ``prometheus_client``'s, from a registry per app (two apps in one process do not
mix their numbers) that also holds the standard process, platform and GC collectors. Events
update the client's counters and histograms; the engine-side gauges and counters are read from
the latest ``EngineStats`` at scrape time by a collector.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import choose_encoder
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from rltserve.core.engine_info import STEP_ROW_BUCKETS, EngineStats

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)  # fmt: skip
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)

DEPTH_BUCKETS = 32  # every loop up to here has its bucket; past it, powers of two


def depth_buckets(max_loops: int) -> list[int]:
    """The exit-depth histogram's bucket bounds: every loop up to 32 (Ouro's 4, Nanbeige's),
    then doubling up to ``max_loops`` (Huginn's 256: 35 buckets, not 256 series)."""
    out = list(range(1, min(max_loops, DEPTH_BUCKETS) + 1))
    while out[-1] < max_loops:
        out.append(min(out[-1] * 2, max_loops))
    return out


@dataclass
class RequestTimeline:
    """``time.monotonic()`` stamps of one engine request (one choice of an HTTP request)."""

    arrival: float  # the HTTP request arrived
    admitted: float  # the admission gate let it through (it went to the stage)
    first_token: float | None = None
    last_token: float | None = None
    num_tokens: int = 0
    num_prompt_tokens: int = 0
    # Seconds it then waited in the engine before its first scheduling (from the update with
    # its first token: ``RequestUpdate.queued_s``).
    engine_queued: float = 0.0


# What the engine collector reads at scrape time: the latest stats and the admission queue length.
# (the engine's latest stats, requests in the server's admission queue, the weight version)
StatsSource = Callable[[], tuple[EngineStats | None, int, int]]


class ServingMetrics:
    """The serving metrics of one app, in their own registry (``render`` exposes it)."""

    def __init__(self, model_name: str, prefix: str = "rltserve") -> None:
        """``prefix``: every series' name before the colon (``ServerConfig.metrics_prefix``)."""
        self.model_name = model_name
        self.prefix = P = prefix + ":"
        self.registry = CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        reg, model = self.registry, ("model_name",)

        def histogram(name: str, help_text: str, buckets) -> Histogram:
            return Histogram(P + name, help_text, model, registry=reg, buckets=buckets)

        self.prompt_tokens = Counter(
            P + "prompt_tokens", "Prompt tokens processed.", model, registry=reg
        ).labels(model_name)
        self.generation_tokens = Counter(
            P + "generation_tokens", "Tokens generated.", model, registry=reg
        ).labels(model_name)
        self.success = Counter(
            P + "request_success",
            "Finished requests by finished_reason.",
            ("model_name", "finished_reason"),
            registry=reg,
        )
        self.http_requests = Counter(
            P + "http_requests",
            "HTTP responses by handler, method and status.",
            ("handler", "method", "status"),
            registry=reg,
        )
        self.ttft = histogram(
            "time_to_first_token_seconds", "Request arrival to first token.", TTFT_BUCKETS
        ).labels(model_name)
        self.itl = histogram(
            "inter_token_latency_seconds", "Gap between streamed token updates.", ITL_BUCKETS
        ).labels(model_name)
        self.e2e = histogram(
            "e2e_request_latency_seconds", "Request arrival to finish.", REQUEST_BUCKETS
        ).labels(model_name)
        self.queue = histogram(
            "request_queue_time_seconds",
            "Time from arrival until the engine first scheduled the request (the server's "
            "admission queue plus the engine's waiting queue).",
            REQUEST_BUCKETS,
        ).labels(model_name)
        self.prefill = histogram(
            "request_prefill_time_seconds",
            "Time from the engine first scheduling the request to its first token.",
            REQUEST_BUCKETS,
        ).labels(model_name)
        self.decode = histogram(
            "request_decode_time_seconds", "Time from the first token to finish.", REQUEST_BUCKETS
        ).labels(model_name)
        self.request_prompt = histogram(
            "request_prompt_tokens", "Prompt tokens per request.", TOKEN_BUCKETS
        ).labels(model_name)
        self.request_generation = histogram(
            "request_generation_tokens", "Generated tokens per request.", TOKEN_BUCKETS
        ).labels(model_name)
        self.stage_restarts = Counter(
            P + "stage_restarts", "Stage restarts after a dead or hung stage.", model, registry=reg
        ).labels(model_name)
        self.exit_depth: Histogram | None = None  # buckets 1..max_loops: known once loaded
        self.num_tokens = 0  # generated tokens and the sum of their exit depths, for
        self.sum_depths = 0  # loops_per_token
        self.num_prefilled = 0  # prompt tokens of requests that got their first token
        self._engine = _EngineCollector(model_name, self)
        reg.register(self._engine)

    def configure(
        self,
        max_loops: int,
        stats: StatsSource,
        prefill_stats: Callable[[], EngineStats | None] = lambda: None,
        cache_info: dict[str, str] | None = None,
    ) -> None:
        """Once the engine is up: the exit-depth buckets (``depth_buckets``), where
        engine-side numbers come from (``prefill_stats``: a disaggregated engine's prefill
        stage, whose series are ``<prefix>:prefill_stage_*``) and ``cache_config_info``'s
        labels (``cache_info``)."""
        if self.exit_depth is None:
            self.exit_depth = Histogram(
                self.prefix + "token_exit_depth",
                "Loop at which each generated token exited.",
                ("model_name",),
                registry=self.registry,
                buckets=depth_buckets(max_loops),
            ).labels(self.model_name)
        self._engine.stats = stats
        self._engine.prefill_stats = prefill_stats
        self._engine.cache_info = cache_info

    # ------------------------------------------------------------------ events

    def on_start(self, timeline: RequestTimeline, num_prompt_tokens: int) -> None:
        timeline.num_prompt_tokens = num_prompt_tokens
        self.prompt_tokens.inc(num_prompt_tokens)
        self.request_prompt.observe(num_prompt_tokens)

    def on_tokens(self, timeline: RequestTimeline, now: float, exit_depths: list[int]) -> None:
        if not exit_depths:
            return
        if timeline.first_token is None:
            timeline.first_token = now
            self.ttft.observe(now - timeline.arrival)
            self.num_prefilled += timeline.num_prompt_tokens
        elif timeline.last_token is not None:
            self.itl.observe(now - timeline.last_token)
        timeline.last_token = now
        timeline.num_tokens += len(exit_depths)
        self.generation_tokens.inc(len(exit_depths))
        self.num_tokens += len(exit_depths)
        self.sum_depths += sum(exit_depths)
        if self.exit_depth is not None:
            for depth in exit_depths:
                self.exit_depth.observe(depth)

    def on_finish(self, timeline: RequestTimeline, now: float, finish_reason: str) -> None:
        self.success.labels(self.model_name, finish_reason).inc()
        self.e2e.observe(now - timeline.arrival)
        if timeline.first_token is not None:
            # (The engine's wait is measured on its own clock: clamped into the interval
            # this clock saw, from going to the stage to the first token.)
            engine = max(0.0, timeline.engine_queued)
            scheduled = min(timeline.admitted + engine, timeline.first_token)
            self.queue.observe(scheduled - timeline.arrival)
            self.prefill.observe(timeline.first_token - scheduled)
            self.decode.observe(now - timeline.first_token)
        self.request_generation.observe(timeline.num_tokens)

    def on_http(self, handler: str, method: str, status: int) -> None:
        self.http_requests.labels(handler, method, str(status)).inc()

    # ------------------------------------------------------------------ exposition

    def render(self, accept: str | None = None) -> tuple[bytes, str]:
        """The exposition and its content type, in the format the scraper's Accept header asks
        for (Prometheus text 0.0.4 by default, OpenMetrics on request). Never with names
        escaped: prometheus_client's underscore escaping (what Prometheus 2.x's default Accept
        gets) renames ``rltserve:x`` to ``rltserve_x``, so dashboards written for the documented
        names would find nothing; such a scraper gets text 0.0.4, which it reads as well."""
        encoder, content_type = choose_encoder(accept or "")
        if "escaping=" in content_type and "escaping=allow-utf-8" not in content_type:
            encoder, content_type = choose_encoder("")
        return encoder(self.registry), content_type


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


class _EngineCollector(Collector):
    """Engine-side numbers, read from the latest ``EngineStats`` at each scrape."""

    def __init__(self, model_name: str, metrics: ServingMetrics) -> None:
        self.model_name = model_name
        self.metrics = metrics
        self.stats: StatsSource = lambda: (None, 0, 0)
        self.prefill_stats: Callable[[], EngineStats | None] = lambda: None
        self.cache_info: dict[str, str] | None = None  # (known once the engine is up)

    def collect(self) -> Iterator[Metric]:
        stats, queued, version = self.stats()
        labels = [self.model_name]
        P = self.metrics.prefix

        def stat(name: str) -> float:  # before the first update there are no stats
            return float(getattr(stats, name, 0) or 0) if stats is not None else 0.0

        def gauge(name: str, help_text: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(P + name, help_text, labels=["model_name"])
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
        for name, help_text, field_name in _ENGINE_GAUGES:
            yield gauge(name, help_text, stat(field_name))
        yield gauge("weight_version", "Weight updates applied since start (serving now).", version)
        m = self.metrics
        yield gauge(
            "loops_per_token",
            "Mean loops run per generated token.",
            m.sum_depths / m.num_tokens if m.num_tokens else 0.0,
        )
        steps, rows = stat("num_steps"), stat("num_rows")
        yield gauge(
            "rows_per_step",
            "Mean rows in the core batch per engine step.",
            rows / steps if steps else 0.0,
        )
        for name, help_text, field_name in _ENGINE_COUNTERS:
            family = CounterMetricFamily(P + name, help_text, labels=["model_name"])
            family.add_metric(labels, stat(field_name))
            yield family
        yield _step_rows(P, labels, stats)
        yield from _prefill_stage(P, labels, self.prefill_stats())
        if self.cache_info is not None:
            info = GaugeMetricFamily(
                P + "cache_config_info",
                "Information of the KV cache config (the value is 1).",
                labels=["model_name", *self.cache_info],
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


def _prefill_stage(prefix: str, labels: list[str], stats: EngineStats | None) -> Iterator[Metric]:
    """A disaggregated engine's prefill stage (the unprefixed series are the decode stage's)."""
    if stats is None:
        return
    for kind, name, help_text, field_name in _PREFILL_STAGE:
        family = kind(prefix + "prefill_stage_" + name, help_text, labels=["model_name"])
        family.add_metric(labels, float(getattr(stats, field_name)))
        yield family


def _step_rows(prefix: str, labels: list[str], stats: EngineStats | None) -> HistogramMetricFamily:
    """vLLM's ``iteration_tokens_total``: engine steps by their rows (a row is a token at one
    loop: a step's work), from ``EngineStats.step_rows_counts``."""
    help_text = "Rows (tokens at one loop) per engine step."
    name = prefix + "iteration_tokens_total"
    family = HistogramMetricFamily(name, help_text, labels=["model_name"])
    counts = getattr(stats, "step_rows_counts", None) or (0,) * (len(STEP_ROW_BUCKETS) + 1)
    cumulative, buckets = 0, []
    for bound, count in zip([*map(floatToGoString, STEP_ROW_BUCKETS), "+Inf"], counts):
        cumulative += count
        buckets.append((bound, cumulative))
    family.add_metric(labels, buckets, sum_value=float(getattr(stats, "num_rows", 0) or 0))
    return family
