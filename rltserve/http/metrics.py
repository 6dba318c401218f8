"""The server's Prometheus metrics: vLLM V1 names under ``rltserve:`` plus looped-model ones.

Latencies use ``time.monotonic()`` in the front-end process. TTFT runs from the HTTP request's
arrival (before tokenization), as vLLM measures it. ``request_queue_time_seconds`` is the time a
request waited in the server's admission queue (``--max-queued``) before reaching the stage;
the stage's own waiting queue shows in ``num_requests_waiting``. Every sample carries a
``model_name`` label. Engine-side numbers (running/waiting, KV usage, steps and rows) come from
the latest ``EngineStats`` the stage sent.

Looped-model metrics: ``token_exit_depth`` (the loop at which each generated token exited),
``loops_per_token`` (its mean), ``rows_per_step`` (mean core-batch rows per engine step) and the
step/row counters behind it.
"""

from __future__ import annotations

from dataclasses import dataclass

from rltserve.core.engine import EngineStats
from rltserve.http.prometheus import Counter, Gauge, Histogram, Labels

P = "rltserve:"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)  # fmt: skip
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)


@dataclass
class RequestTimeline:
    """``time.monotonic()`` stamps of one engine request (one choice of an HTTP request)."""

    arrival: float  # the HTTP request arrived
    admitted: float  # the admission gate let it through
    first_token: float | None = None
    last_token: float | None = None
    num_tokens: int = 0


class ServingMetrics:
    def __init__(self) -> None:
        self._labels: Labels = (("model_name", ""),)
        self.prompt_tokens = Counter(P + "prompt_tokens_total", "Prompt tokens processed.")
        self.generation_tokens = Counter(P + "generation_tokens_total", "Tokens generated.")
        self.success = Counter(P + "request_success_total", "Finished requests by finished_reason.")
        self.http_requests = Counter(
            P + "http_requests_total", "HTTP responses by handler, method and status."
        )
        self.ttft = Histogram(
            P + "time_to_first_token_seconds", "Request arrival to first token.", TTFT_BUCKETS
        )
        self.itl = Histogram(
            P + "inter_token_latency_seconds", "Gap between streamed token updates.", ITL_BUCKETS
        )
        self.e2e = Histogram(
            P + "e2e_request_latency_seconds", "Request arrival to finish.", REQUEST_BUCKETS
        )
        self.queue = Histogram(
            P + "request_queue_time_seconds",
            "Time waiting in the server's admission queue.",
            REQUEST_BUCKETS,
        )
        self.request_prompt = Histogram(
            P + "request_prompt_tokens", "Prompt tokens per request.", TOKEN_BUCKETS
        )
        self.request_generation = Histogram(
            P + "request_generation_tokens", "Generated tokens per request.", TOKEN_BUCKETS
        )
        self.exit_depth = Histogram(
            P + "token_exit_depth", "Loop at which each generated token exited.", (1,)
        )

    def configure(self, model_name: str, max_loops: int) -> None:
        """Sets the model label and the exit-depth buckets (1..max_loops) once the engine is up."""
        self._labels = (("model_name", model_name),)
        self.exit_depth = Histogram(
            self.exit_depth.name, self.exit_depth.help, range(1, max_loops + 1)
        )

    # ------------------------------------------------------------------ events

    def on_start(self, timeline: RequestTimeline, num_prompt_tokens: int) -> None:
        self.prompt_tokens.inc(num_prompt_tokens)
        self.request_prompt.observe(num_prompt_tokens)
        self.queue.observe(timeline.admitted - timeline.arrival)

    def on_tokens(self, timeline: RequestTimeline, now: float, exit_depths: list[int]) -> None:
        if not exit_depths:
            return
        if timeline.first_token is None:
            timeline.first_token = now
            self.ttft.observe(now - timeline.arrival)
        elif timeline.last_token is not None:
            self.itl.observe(now - timeline.last_token)
        timeline.last_token = now
        timeline.num_tokens += len(exit_depths)
        self.generation_tokens.inc(len(exit_depths))
        for depth in exit_depths:
            self.exit_depth.observe(depth)

    def on_finish(self, timeline: RequestTimeline, now: float, finish_reason: str) -> None:
        self.success.inc(1, (("finished_reason", finish_reason),))
        self.e2e.observe(now - timeline.arrival)
        self.request_generation.observe(timeline.num_tokens)

    def on_http(self, handler: str, method: str, status: int) -> None:
        labels = (("handler", handler), ("method", method), ("status", str(status)))
        self.http_requests.inc(1, labels)

    # ------------------------------------------------------------------ exposition

    def render(self, stats: EngineStats | None, queued: int) -> str:
        const = self._labels

        def stat(name: str) -> float:  # before the first update there are no stats
            return float(getattr(stats, name, 0) or 0) if stats is not None else 0.0

        gauge = _gauges(const)
        lines = [
            *gauge("num_requests_running", "Requests running in the engine.", stat("num_running")),
            *gauge(
                "num_requests_waiting",
                "Requests waiting: the engine's queue plus the server's admission queue.",
                stat("num_waiting") + queued,
            ),
            *gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).", stat("kv_usage")),
        ]
        for counter in (self.prompt_tokens, self.generation_tokens, self.success):
            lines += counter.render(const)
        for hist in (self.ttft, self.itl, self.e2e, self.queue):
            lines += hist.render(const)
        for hist in (self.request_prompt, self.request_generation, self.exit_depth):
            lines += hist.render(const)
        depth = self.exit_depth
        steps, rows = stat("num_steps"), stat("num_rows")
        lines += gauge(
            "loops_per_token",
            "Mean loops run per generated token.",
            depth.sum / depth.count if depth.count else 0.0,
        )
        lines += gauge(
            "rows_per_step",
            "Mean rows in the core batch per engine step.",
            rows / steps if steps else 0.0,
        )
        for name, help_text, field_name in _ENGINE_COUNTERS:
            lines += _counter_value(P + name, help_text, stat(field_name), const)
        lines += self.http_requests.render(())
        return "\n".join(lines) + "\n"


_ENGINE_COUNTERS = (
    ("engine_steps_total", "Engine steps run.", "num_steps"),
    ("engine_rows_total", "Rows run through the core loop.", "num_rows"),
    ("engine_coda_rows_total", "Rows that reached the coda.", "num_coda_rows"),
    ("engine_busy_seconds_total", "Seconds the engine spent executing steps.", "busy_seconds"),
)


def _gauges(const: Labels):
    def gauge(name: str, help_text: str, value: float) -> list[str]:
        return Gauge(P + name, help_text).render_value(value, const)

    return gauge


def _counter_value(name: str, help_text: str, value: float, const: Labels) -> list[str]:
    counter = Counter(name, help_text)
    counter.inc(value)
    return counter.render(const)
