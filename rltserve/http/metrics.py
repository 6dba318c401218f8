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
included, counts as prefill.) Every request and engine sample carries vLLM's labels
``model_name`` and ``engine="0"`` (vLLM's one engine), rltserve's own too, so that PromQL
joins them with vLLM's series without ``ignoring(engine)``; the HTTP series have neither
(vLLM's instrumentator's): ``http_requests_total`` carries ``handler, method, status`` (under
``vllm``, as prometheus-fastapi-instrumentator's that vLLM uses: unprefixed, status classes
``2xx``). The per-request token histograms have vLLM's buckets, 1-2-5 up to
``max_model_len`` (known once the engine is up: ``configure`` makes them).
``request_params_n`` and ``request_max_num_generation_tokens`` are observed once per prompt,
as its last sample finishes (vLLM's parent request). Engine-side numbers
(running/waiting, KV usage, steps and rows) come from the latest ``EngineStats`` the stage sent.

``iteration_tokens_total`` is vLLM's histogram of each engine step's tokens: the prompt tokens
of the requests it gave their first token plus the tokens it output (its sum is the engine's
prompt plus generated tokens, as vLLM's; its count ``engine_steps_total``).
``iteration_rows`` is the same steps by their rows (a row is a token at one loop, the unit of a
step's work; its sum is ``engine_rows_total``). ``--show-hidden-metrics-for-version``
(``hidden_metrics.py``) brings back series vLLM hid: ``time_per_output_token_seconds`` observes
what ``inter_token_latency_seconds`` does (vLLM's rename), ``gpu_cache_usage_perc`` is
``kv_cache_usage_perc`` and ``gpu_prefix_cache_*`` are ``prefix_cache_*``.
``cache_config_info`` (vLLM's, value 1) has the KV pool's facts as labels: with
``kv_cache_usage_perc`` it gives the blocks in use; ``kv_planes`` (a token takes a block slot
on each of its planes) and ``kv_capacity_tokens`` turn them into tokens.

Looped-model metrics: ``token_exit_depth`` (the loop at which each generated token exited),
``loops_per_token`` (its mean: exit depth, not loops run, which differ under ``kv_policy=full``,
where every token loops to ``max_loops``; ``engine_rows_total`` counts the rows run),
``rows_per_step`` (mean core-batch rows per engine step) and the step/row counters behind it.
Only tokens a response holds count as generated: a scoring request's (completions' echo with
``max_tokens=0``) one internal token does not (``on_tokens``).

Exposition is ``prometheus_client``'s, from a registry per app (two apps in one process do not
mix their numbers) that also holds the standard process, platform and GC collectors. Events
update the client's counters and histograms; the engine-side gauges and counters are read from
the latest ``EngineStats`` at scrape time by a collector (``engine_metrics.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector
from prometheus_client.core import (
    Metric,
)
from prometheus_client.exposition import choose_encoder
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector

from rltserve.core.engine_info import EngineStats
from rltserve.http.engine_metrics import EngineCollector
from rltserve.http.hidden_metrics import TIME_PER_OUTPUT_TOKEN
from rltserve.llm_metrics import (  # (vLLM's buckets, and the exit-depth series', as offline)
    ENGINE_INDEX,
    EXIT_DEPTH_HELP,
    REQUEST_BUCKETS,
    TTFT_BUCKETS,
    depth_buckets,
)
from rltserve.updates import FinishReason

ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)  # fmt: skip
N_BUCKETS = (1, 2, 5, 10, 20)  # vLLM's request_params_n
# prometheus-fastapi-instrumentator's (vLLM's HTTP metrics): few buckets for the labelled
# histogram, many for the unlabelled one.
HTTP_BUCKETS = (0.1, 0.5, 1.0)
# The routes vLLM's instrumentator leaves out (probes and scrapes would swamp request rates).
INSTRUMENTATOR_EXCLUDED = frozenset({"/metrics", "/metrics/", "/health", "/ping", "/version"})
HTTP_HIGHR_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 3.0,
                      3.5, 4.0, 4.5, 5.0, 7.5, 10.0, 30.0, 60.0)  # fmt: skip


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """vLLM's buckets of the per-request token histograms: 1, 2, 5, 10, 20, 50, ... up to
    ``max_value`` (its ``max_model_len``)."""
    out, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return out
            out.append(mantissa * scale)
        scale *= 10


@dataclass
class SampleGroup:
    """The ``n`` samples of one prompt (vLLM's parent request): ``request_params_n`` and
    ``request_max_num_generation_tokens`` are observed once, as the last of them finishes."""

    n: int
    unfinished: int
    max_generated: int = 0  # the most tokens a finished sample generated


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
    num_cached_tokens: int = 0  # prompt tokens the engine reused (counted at the first token)
    max_tokens: int | None = None  # the request's max_tokens (None: the rest of the context)
    group: SampleGroup | None = None  # None: a prompt sampled once

    @property
    def scheduled(self) -> float | None:
        """When the engine first scheduled it (None before its first token). The engine's wait
        is measured on its own clock: clamped into the interval this clock saw, from going to
        the stage to the first token."""
        if self.first_token is None:
            return None
        return min(self.admitted + max(0.0, self.engine_queued), self.first_token)


def per_request_metrics(timeline: RequestTimeline) -> dict[str, float | None]:
    """vLLM's ``--enable-per-request-metrics`` body field, as vLLM computes it: TTFT from the
    first scheduling (the queue is ``queue_time_ms``), generation time from the first token to
    the last, tokens per second over scheduling to the last token; None where undefined (no
    token yet; ``mean_itl_ms`` needs two tokens)."""
    scheduled, first, last = timeline.scheduled, timeline.first_token, timeline.last_token
    n = timeline.num_tokens
    out: dict[str, float | None] = dict.fromkeys(
        ("time_to_first_token_ms", "generation_time_ms", "queue_time_ms", "mean_itl_ms",
         "tokens_per_second")
    )  # fmt: skip
    if scheduled is None or first is None or last is None:
        return out
    out["time_to_first_token_ms"] = (first - scheduled) * 1000
    out["generation_time_ms"] = (last - first) * 1000
    out["queue_time_ms"] = (scheduled - timeline.arrival) * 1000
    if n > 1:
        out["mean_itl_ms"] = (last - first) / (n - 1) * 1000
    if last > scheduled:
        out["tokens_per_second"] = n / (last - scheduled)
    return out


# What the engine collector reads at scrape time: the latest stats and the admission queue length.
# (the engine's latest stats, requests in the server's admission queue, the weight version)
StatsSource = Callable[[], tuple[EngineStats | None, int, int]]


class ServingMetrics:
    """The serving metrics of one app, in their own registry (``render`` exposes it)."""

    def __init__(
        self, model_name: str, prefix: str = "rltserve", hidden: frozenset[str] = frozenset()
    ) -> None:
        """``prefix``: every series' name before the colon (``ServerConfig.metrics_prefix``).
        Under ``vllm`` the HTTP series are prometheus-fastapi-instrumentator's, as vLLM's:
        unprefixed, status classes (``2xx``) and unmatched routes as ``none``. ``hidden``: the
        hidden vLLM series shown (``hidden_metrics.shown_hidden_metrics``)."""
        self.model_name = model_name
        self.hidden = hidden
        self.prefix = P = prefix + ":"
        self.registry = CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        reg, model, engine = self.registry, ("model_name", "engine"), (model_name, ENGINE_INDEX)

        def histogram(name: str, help_text: str, buckets) -> Histogram:
            return Histogram(P + name, help_text, model, registry=reg, buckets=buckets)

        def counter(name: str, help_text: str) -> Counter:
            return Counter(P + name, help_text, model, registry=reg)

        self._histogram = histogram  # (``configure`` makes those whose buckets need the engine)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed.").labels(*engine)
        self.prompt_tokens_cached = counter(
            "prompt_tokens_cached",
            "Prompt tokens reused from the prefix cache (or shared by n "
            "samples) instead of computed.",
        ).labels(*engine)
        self.generation_tokens = counter("generation_tokens", "Tokens generated.").labels(*engine)
        success = Counter(
            P + "request_success",
            "Finished requests by finished_reason.",
            (*model, "finished_reason"),
            registry=reg,
        )
        # Every reason's series from the start, as vLLM's: increase() on a fresh server is 0,
        # not no data.
        self.success = {r.value: success.labels(*engine, r.value) for r in FinishReason}
        self.vllm_http = prefix == "vllm"
        http = "" if self.vllm_http else P
        self.http_requests = Counter(
            http + "http_requests",
            "HTTP responses by handler, method and status" + (" class." if self.vllm_http else "."),
            ("handler", "method", "status"),
            registry=reg,
        )
        self.http_duration = Histogram(
            http + "http_request_duration_seconds",
            "HTTP request duration (to the end of its body) by handler and method.",
            ("handler", "method"),
            registry=reg,
            buckets=HTTP_BUCKETS,
        )
        self.http_duration_highr = (
            Histogram(
                "http_request_duration_highr_seconds",
                "HTTP request duration, many buckets and no labels.",
                registry=reg,
                buckets=HTTP_HIGHR_BUCKETS,
            )
            if self.vllm_http
            else None
        )
        self.ttft = histogram(
            "time_to_first_token_seconds", "Request arrival to first token.", TTFT_BUCKETS
        ).labels(*engine)
        self.itl = histogram(
            "inter_token_latency_seconds", "Gap between streamed token updates.", ITL_BUCKETS
        ).labels(*engine)
        self.tpot = histogram(
            "request_time_per_output_token_seconds",
            "Per request: decode time over its generated tokens but the first.",
            ITL_BUCKETS,
        ).labels(*engine)
        self.e2e = histogram(
            "e2e_request_latency_seconds", "Request arrival to finish.", REQUEST_BUCKETS
        ).labels(*engine)
        self.queue = histogram(
            "request_queue_time_seconds",
            "Time from arrival until the engine first scheduled the request (the server's "
            "admission queue plus the engine's waiting queue).",
            REQUEST_BUCKETS,
        ).labels(*engine)
        self.inference = histogram(
            "request_inference_time_seconds",
            "Time from the engine first scheduling the request to its finish (prefill + decode).",
            REQUEST_BUCKETS,
        ).labels(*engine)
        self.prefill = histogram(
            "request_prefill_time_seconds",
            "Time from the engine first scheduling the request to its first token.",
            REQUEST_BUCKETS,
        ).labels(*engine)
        self.decode = histogram(
            "request_decode_time_seconds", "Time from the first token to finish.", REQUEST_BUCKETS
        ).labels(*engine)
        # (tokens per request: buckets up to max_model_len, made by ``configure``)
        self.request_prompt: Histogram | None = None
        self.request_generation: Histogram | None = None
        self.request_max_generation: Histogram | None = None
        self.params_max_tokens: Histogram | None = None
        self.params_n = histogram(
            "request_params_n", "The n request parameter, per prompt.", N_BUCKETS
        ).labels(*engine)
        self.tpot_hidden = (  # (vLLM's name before inter_token_latency_seconds)
            histogram(
                TIME_PER_OUTPUT_TOKEN,
                "Gap between streamed token updates. DEPRECATED: use inter_token_latency_seconds.",
                ITL_BUCKETS,
            ).labels(*engine)
            if TIME_PER_OUTPUT_TOKEN in hidden
            else None
        )
        self.stage_restarts = Counter(
            P + "stage_restarts", "Stage restarts after a dead or hung stage.", model, registry=reg
        ).labels(*engine)
        self.exit_depth: Histogram | None = None  # buckets 1..max_loops: known once loaded
        self.num_tokens = 0  # generated tokens and the sum of their exit depths, for
        self.sum_depths = 0  # loops_per_token
        self.num_prefilled = 0  # prompt tokens of requests that got their first token
        self.num_prefilled_requests = 0  # and those requests (the stats line's hit-rate window)
        self.sleep_level = 0  # the level of the latest /sleep (engine_sleep_state's label)
        self._engine = EngineCollector(model_name, self)
        reg.register(self._engine)
        # (prometheus_client can turn ``_created`` off only for the whole process)
        self._exposed = _WithoutCreated(self.registry)

    def configure(
        self,
        max_loops: int,
        stats: StatsSource,
        prefill_stats: Callable[[], EngineStats | None] = lambda: None,
        cache_info: dict[str, str] | None = None,
        asleep: Callable[[], bool] = lambda: False,
        *,
        max_model_len: int,
        disaggregated: bool = False,
    ) -> None:
        """Once the engine is up: the exit-depth buckets (``depth_buckets``), the per-request
        token histograms' (vLLM's: ``build_1_2_5_buckets(max_model_len)``), where engine-side
        numbers come from (``prefill_stats``: a disaggregated engine's prefill stage, whose
        series are ``<prefix>:prefill_stage_*``, zeros until it reports, from the start when
        ``disaggregated``), ``cache_config_info``'s labels (``cache_info``) and whether the
        engine sleeps (``asleep``)."""
        if self.exit_depth is None:
            engine, tokens = (self.model_name, ENGINE_INDEX), build_1_2_5_buckets(max_model_len)

            def histogram(name: str, help_text: str, buckets) -> Histogram:
                return self._histogram(name, help_text, buckets).labels(*engine)

            self.exit_depth = histogram(
                "token_exit_depth", EXIT_DEPTH_HELP, depth_buckets(max_loops)
            )
            self.request_prompt = histogram(
                "request_prompt_tokens", "Prompt tokens per request.", tokens
            )
            self.request_generation = histogram(
                "request_generation_tokens", "Generated tokens per request.", tokens
            )
            self.request_max_generation = histogram(
                "request_max_num_generation_tokens",
                "Per prompt: the most tokens any of its n samples generated.",
                tokens,
            )
            self.params_max_tokens = histogram(
                "request_params_max_tokens", "The max_tokens request parameter.", tokens
            )
        self._engine.stats = stats
        self._engine.prefill_stats = prefill_stats
        self._engine.cache_info = cache_info
        self._engine.asleep = asleep
        self._engine.disaggregated = disaggregated

    # ------------------------------------------------------------------ events

    def on_start(self, timeline: RequestTimeline, num_prompt_tokens: int) -> None:
        timeline.num_prompt_tokens = num_prompt_tokens
        self.prompt_tokens.inc(num_prompt_tokens)
        _observe(self.request_prompt, num_prompt_tokens)

    def on_tokens(
        self,
        timeline: RequestTimeline,
        now: float,
        exit_depths: list[int],
        generated: bool = True,
    ) -> None:
        """An update's new tokens (``exit_depths``: one per token). ``generated=False``: those
        of a scoring request (completions' echo with ``max_tokens=0``), whose one token the
        engine samples to finish the prompt is left out of the response: it marks the request's
        first-token moment (its prompt scored: TTFT, queue, prefill, as vLLM observes such a
        request) but counts as no generated token, exit depth or ITL gap."""
        if not exit_depths:
            return
        if timeline.first_token is None:
            timeline.first_token = now
            self.ttft.observe(now - timeline.arrival)
            self.num_prefilled += timeline.num_prompt_tokens
            self.num_prefilled_requests += 1
            self.prompt_tokens_cached.inc(timeline.num_cached_tokens)
        elif timeline.last_token is not None and generated:
            self.itl.observe(now - timeline.last_token)
            _observe(self.tpot_hidden, now - timeline.last_token)
        timeline.last_token = now
        if not generated:
            return
        timeline.num_tokens += len(exit_depths)
        self.generation_tokens.inc(len(exit_depths))
        self.num_tokens += len(exit_depths)
        self.sum_depths += sum(exit_depths)
        if self.exit_depth is not None:
            for depth in exit_depths:
                self.exit_depth.observe(depth)

    def on_finish(self, timeline: RequestTimeline, now: float, finish_reason: str) -> None:
        """Once per engine request, however it ended (an abort in the server's admission
        queue too: then it has no first token, and only the request's own series count it)."""
        self.success[finish_reason].inc()
        self.e2e.observe(now - timeline.arrival)
        scheduled = timeline.scheduled
        if scheduled is not None:
            first = timeline.first_token
            self.queue.observe(scheduled - timeline.arrival)
            self.prefill.observe(first - scheduled)
            self.decode.observe(now - first)
            self.inference.observe(now - scheduled)
            # (vLLM's: every finished request, 0 for one of a single token)
            n = timeline.num_tokens
            self.tpot.observe((now - first) / (n - 1) if n > 1 else 0.0)
        _observe(self.request_generation, timeline.num_tokens)
        if timeline.max_tokens:  # (vLLM's: a request without one is not observed)
            _observe(self.params_max_tokens, timeline.max_tokens)
        group = timeline.group or SampleGroup(1, 1)
        group.unfinished -= 1
        group.max_generated = max(group.max_generated, timeline.num_tokens)
        if group.unfinished == 0:
            self.params_n.observe(group.n)
            _observe(self.request_max_generation, group.max_generated)

    def on_http(self, handler: str, method: str, status: int, seconds: float | None = None) -> None:
        """One HTTP response; ``seconds``: from its arrival to the end of its body (None: no
        duration observed, as for the interim answer to ``Expect``)."""
        if self.vllm_http:
            if handler in INSTRUMENTATOR_EXCLUDED:
                return
            handler = "none" if handler == "unmatched" else handler
            self.http_requests.labels(handler, method, f"{status // 100}xx").inc()
        else:
            self.http_requests.labels(handler, method, str(status)).inc()
        if seconds is not None:
            self.http_duration.labels(handler, method).observe(seconds)
            if self.http_duration_highr is not None:
                self.http_duration_highr.observe(seconds)

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
        return encoder(self._exposed), content_type


def _observe(histogram: Histogram | None, value: float) -> None:
    """Observes ``value`` on a histogram ``configure`` makes (none before: no engine, and so no
    request, yet)."""
    if histogram is not None:
        histogram.observe(value)


class _WithoutCreated:
    """The registry as exposed: without the ``_created`` samples of counters and histograms
    (a gauge family each in the text format, which vLLM turns off too)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        for metric in self.registry.collect():
            kept = [s for s in metric.samples if not s.name.endswith("_created")]
            yield metric if len(kept) == len(metric.samples) else _with_samples(metric, kept)


def _with_samples(metric: Metric, samples: list) -> Metric:
    copy = Metric(metric.name, metric.documentation, metric.type, metric.unit)
    copy.samples = samples
    return copy
