"""The offline front ends' request series for ``get_metrics`` (``LLM``'s and ``AsyncLLM``'s),
under vLLM's names: prompt and generated tokens, finished requests by reason, time to first
token and end-to-end latency; and the server's looped-model series of generated tokens,
``rltserve:token_exit_depth`` (the loop each exited at; the server's name, buckets and
labels) and its mean, ``rltserve:loops_per_token``. Counted where the outputs
are assembled (``OutputAssembler`` calls a request's ``RequestTimer`` with each update's
delta), so the tokens and exit depths are those the outputs hold (after a stop string cut
them) and the finish reason is the one they report; the engine's own series (running, KV
usage, prefix cache, ...) are ``llm_refusals``'. Every sample of a prompt (``n``) is a
request here, as vLLM's child requests are."""

from __future__ import annotations

import threading
import time
from bisect import bisect_left
from dataclasses import dataclass, field

from rltserve.metrics_reader import Counter, Gauge, Histogram, Metric
from rltserve.outputs import TextDelta
from rltserve.updates import FinishReason

# vLLM's bucket bounds (seconds) of time_to_first_token_seconds and of the per-request
# latencies (e2e_request_latency_seconds, ...); the server's /metrics uses them too.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
DEPTH_BUCKETS = 32  # every loop up to here has its bucket; past it, powers of two
# The exit-depth series' help texts (the server's /metrics and get_metrics name the same thing).
EXIT_DEPTH_HELP = "Loop at which each generated token exited."
LOOPS_PER_TOKEN_HELP = (
    "Mean exit depth of generated tokens (the mean of token_exit_depth), not the loops run: "
    "under kv_policy full every token loops to max_loops; engine_rows_total counts rows run."
)


def depth_buckets(max_loops: int) -> list[int]:
    """The exit-depth histogram's bucket bounds: every loop up to 32 (Ouro's 4, Nanbeige's),
    then doubling up to ``max_loops`` (Huginn's 256: 35 buckets, not 256 series)."""
    out = list(range(1, min(max_loops, DEPTH_BUCKETS) + 1))
    while out[-1] < max_loops:
        out.append(min(out[-1] * 2, max_loops))
    return out


ENGINE_INDEX = "0"  # vLLM's ``engine`` label of its one engine (its data-parallel rank)


def vllm_labels(model_name: str) -> dict[str, str]:
    """The labels vLLM gives every series of one engine (rltserve's own engine series too)."""
    return {"model_name": model_name, "engine": ENGINE_INDEX}


@dataclass
class _Buckets:
    """A histogram's observations: ``counts[i]`` those in bucket i alone (at or below
    ``bounds[i]``, above the bound before), the last those above every bound."""

    bounds: tuple[float, ...]
    counts: list[int] = field(init=False)
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    def read(self, name: str, labels: dict[str, str]) -> Histogram:
        les = [*(repr(float(b)) for b in self.bounds), "+Inf"]  # (Prometheus' ``le`` text)
        buckets, seen = {}, 0
        for le, count in zip(les, self.counts):
            seen += count
            buckets[le] = seen
        return Histogram(name, labels, seen, self.total, buckets)


class RequestCounts:
    """The request series of one ``LLM`` since it started; thread-safe (updates arrive on the
    stage client's thread or an event loop, ``metrics`` is read on the caller's)."""

    def __init__(self, max_loops: int) -> None:
        """``max_loops``: the engine's deepest loop (``EngineInfo.max_loops``), the exit-depth
        histogram's last bucket."""
        self.lock = threading.Lock()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        # Every reason from the start, as vLLM's series are.
        self.success = dict.fromkeys((r.value for r in FinishReason), 0)
        self.ttft = _Buckets(TTFT_BUCKETS)
        self.e2e = _Buckets(REQUEST_BUCKETS)
        self.exit_depth = _Buckets(tuple(depth_buckets(max_loops)))

    def request(self, num_prompt_tokens: int) -> RequestTimer:
        """The timer of one request (one sample), arriving now with its prompt's length."""
        return RequestTimer(self, num_prompt_tokens, time.monotonic())

    def metrics(self, model_name: str) -> list[Metric]:
        labels = vllm_labels(model_name)
        with self.lock:
            depths = self.exit_depth
            n = sum(depths.counts)
            loops_per_token = depths.total / n if n else 0.0
            return [
                Counter("vllm:prompt_tokens", dict(labels), self.prompt_tokens),
                Counter("vllm:generation_tokens", dict(labels), self.generation_tokens),
                *(
                    Counter("vllm:request_success", {**labels, "finished_reason": r}, n)
                    for r, n in self.success.items()
                ),
                self.ttft.read("vllm:time_to_first_token_seconds", dict(labels)),
                self.e2e.read("vllm:e2e_request_latency_seconds", dict(labels)),
                # (the server's series: its names and labels)
                self.exit_depth.read("rltserve:token_exit_depth", dict(labels)),
                Gauge("rltserve:loops_per_token", dict(labels), loops_per_token),
            ]


@dataclass(eq=False)
class RequestTimer:
    """One request's part of ``RequestCounts``: called with each delta its assembler makes
    (``OutputAssembler(observer=...)``). Its prompt tokens and time to first token count with
    its first token (vLLM's: once prefilled), its finish once (``finish``)."""

    counts: RequestCounts
    num_prompt_tokens: int
    arrival: float  # time.monotonic() when it was made
    first_token: float | None = None
    finished: bool = False

    def __call__(self, delta: TextDelta) -> None:
        now = time.monotonic()
        counts = self.counts
        with counts.lock:
            if self.finished:
                return
            if delta.token_ids:
                if self.first_token is None:
                    self.first_token = now
                    counts.prompt_tokens += self.num_prompt_tokens
                    counts.ttft.observe(now - self.arrival)
                counts.generation_tokens += len(delta.token_ids)
                for depth in delta.exit_depths:
                    counts.exit_depth.observe(depth)
        if delta.finish_reason is not None:
            self.finish(delta.finish_reason)

    def finish(self, reason: str) -> None:
        """Counts the request as finished for ``reason``, and its latency; once (later calls
        do nothing: a front end may end it itself, as ``AsyncLLM`` does a dropped stream)."""
        now = time.monotonic()
        with self.counts.lock:
            if self.finished:
                return
            self.finished = True
            self.counts.success[reason] += 1
            self.counts.e2e.observe(now - self.arrival)
