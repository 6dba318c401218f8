"""vLLM's ``LLM`` methods beyond generation: a clear ValueError for those a generative looped LM
has no counterpart of (pooling, beam search, the profiler, swapping the tokenizer), and
``get_metrics`` (``Refusals``, a base of ``LLM``), as ``collective_rpc`` refuses in
``llm_controls``.
"""

from __future__ import annotations

from typing import Any

from rltserve.core.engine_info import EngineStats
from rltserve.llm_metrics import RequestCounts, vllm_labels
from rltserve.metrics_reader import Counter, Gauge, Metric

_POOLING = (
    "rltserve runs generative models, with no pooling head; for a prompt's token logprobs use "
    "generate with SamplingParams(prompt_logprobs=k, max_tokens=1)"
)


def engine_metrics(stats: EngineStats | None, model_name: str) -> list[Metric]:
    """vLLM's metrics that ``stats`` (the engine's latest counters; None before its first
    step: zeros) holds, labelled as vLLM labels them."""
    labels = vllm_labels(model_name)
    s = stats or EngineStats(0, 0, 0.0, 0, 0, 0, 0.0)
    return [
        Gauge("vllm:num_requests_running", dict(labels), float(s.num_running)),
        Gauge("vllm:num_requests_waiting", dict(labels), float(s.num_waiting)),
        Gauge("vllm:kv_cache_usage_perc", dict(labels), float(s.kv_usage)),
        Counter("vllm:num_preemptions", dict(labels), s.num_preemptions),
        Counter("vllm:prefix_cache_queries", dict(labels), s.prefix_cache_queries),
        Counter("vllm:prefix_cache_hits", dict(labels), s.prefix_cache_hits),
    ]


class Refusals:
    """vLLM's ``LLM`` methods a generative looped LM does not have, each a ValueError saying
    what to use instead, and ``get_metrics``."""

    _client: Any
    _model_name: str
    _request_counts: RequestCounts

    def encode(self, *args: Any, **kwargs: Any) -> list:
        raise ValueError(f"encode: not supported: {_POOLING}")

    def embed(self, *args: Any, **kwargs: Any) -> list:
        raise ValueError(f"embed: not supported: {_POOLING}")

    def classify(self, *args: Any, **kwargs: Any) -> list:
        raise ValueError(f"classify: not supported: {_POOLING}")

    def reward(self, *args: Any, **kwargs: Any) -> list:
        raise ValueError(f"reward: not supported: {_POOLING}")

    def score(self, *args: Any, **kwargs: Any) -> list:
        raise ValueError(f"score: not supported: {_POOLING}")

    def beam_search(self, *args: Any, **kwargs: Any) -> list:
        raise ValueError(
            "beam_search: not supported: no beam search; sample several with "
            "SamplingParams(n=k, logprobs=0) and rank them by cumulative_logprob"
        )

    def start_profile(self, *args: Any, **kwargs: Any) -> None:
        raise ValueError(
            "start_profile: not supported: no built-in profiler; run torch.profiler around "
            "generate with LLM(..., in_process=True) (the model then runs in this process)"
        )

    def stop_profile(self, *args: Any, **kwargs: Any) -> None:
        raise ValueError("stop_profile: not supported (see start_profile)")

    def set_tokenizer(self, tokenizer: Any) -> None:
        # The stage and the front end both use the tokenizer read from the checkpoint's files
        # (bounded thinking, stop strings, detokenizing): another object cannot replace it.
        raise ValueError(
            "set_tokenizer: not supported: the tokenizer is read from files when the LLM is "
            "made; pass LLM(model, tokenizer=folder) instead"
        )

    def get_metrics(self) -> list[Metric]:
        """vLLM's: the metrics as ``Gauge``, ``Counter`` and ``Histogram`` objects
        (``metrics_reader``, vLLM's names): running and waiting requests, KV cache usage (a
        fraction), preemptions, prefix cache queries and hits, from the latest counters the
        engine sent; then the requests this ``LLM`` (and an ``AsyncLLM`` over it) ran:
        prompt and generated tokens, finished requests by ``finished_reason``, time to first
        token and end-to-end latency, and the server's exit-depth histogram and its mean
        (``rltserve:token_exit_depth``, ``rltserve:loops_per_token``; ``llm_metrics``)."""
        return [
            *engine_metrics(self._client.stats, self._model_name),
            *self._request_counts.metrics(self._model_name),
        ]
