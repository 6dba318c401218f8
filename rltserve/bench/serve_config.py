"""``BenchConfig``: the settings of one ``rltserve bench serve`` run, checked as it is built
(a ValueError naming the field; the command line names its flags instead)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from rltserve.client_request import check_url, server_root

ENDPOINTS = ("completions", "chat")
# vLLM's ``--backend`` names of the endpoints streamed here (its ``vllm`` backend streams
# /v1/completions too).
BACKENDS = {"openai": "completions", "vllm": "completions", "openai-chat": "chat"}
# The report's backend without --backend, and so the result file's label without --label.
ENDPOINT_BACKENDS = {"completions": "openai", "chat": "openai-chat"}
PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")  # (vLLM's: ITL is per gap, not per request)
DATASETS = ("random", "sharegpt", "custom")  # vLLM's --dataset-name values taken here
RAMP_UP_STRATEGIES = ("linear", "exponential")


@dataclass(frozen=True)
class BenchConfig:
    url: str
    api_key: str | None = None
    model: str | None = None  # the name sent (vLLM's --served-model-name, else --model)
    model_id: str | None = None  # vLLM's --model, as the report names it (default: model)
    tokenizer: str | None = None  # a local tokenizer directory (vLLM's --tokenizer)
    label: str | None = None  # vLLM's --label (the report's and the result file name's)
    backend: str | None = None  # vLLM's --backend (default: the endpoint's, see BACKENDS)
    num_prompts: int = 100
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    input_len: int = 128
    output_len: int = 128
    # vLLM's --random-range-ratio r: each conversation's prompt and output lengths drawn
    # uniformly from [floor(len * (1 - r)), ceil(len * (1 + r))] (outputs at least 1 token).
    range_ratio: float = 0.0
    # vLLM's --random-prefix-len: every prompt starts with the same prefix_len random tokens
    # (a long shared system prompt), before its input_len own ones.
    prefix_len: int = 0
    seed: int = 0
    temperature: float = 0.0
    # vLLM's sampling flags; None: not sent (the server's default)
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    # vLLM's --ignore-eos: sent only when asked for, so a request may stop at its end token
    ignore_eos: bool = False
    exit_threshold: float | None = None
    # vLLM's --extra-body: merged into every request body last (rltserve's loop fields too)
    extra_body: dict = field(default_factory=dict)
    headers: tuple[tuple[str, str], ...] = ()  # vLLM's --header KEY=VALUE: on every request
    # vLLM's --request-id-prefix: request i sends X-Request-Id PREFIX{i} (None: the server's ids)
    request_id_prefix: str | None = None
    # vLLM's --dataset-name and --dataset-path: text prompts from a file (serve_text_datasets)
    dataset: str = "random"
    dataset_path: str | None = None
    sharegpt_output_len: int | None = None  # None: each reply's own token count
    custom_output_len: int = 256
    skip_chat_template: bool = False
    # vLLM's --num-warmups: requests of the first prompt before the run, not measured; sent at
    # once, at most max_concurrency of them in flight (as the run's)
    num_warmups: int = 0
    # vLLM's --ramp-up-strategy: the rate goes from ramp_up_start_rps to ramp_up_end_rps over
    # the run (linearly or geometrically, by request index), in place of request_rate
    ramp_up_strategy: str | None = None
    ramp_up_start_rps: float | None = None
    ramp_up_end_rps: float | None = None
    num_turns: int = 1  # > 1: multi-turn chat conversations (see rltserve.bench.serve)
    endpoint: str = "completions"  # or "chat" (see rltserve.bench.serve)
    progress: bool = False
    ready_timeout_s: float = 600.0  # how long to wait for a server that is still loading
    # vLLM's --goodput: (metric, bound in ms) pairs; a request counts towards request_goodput
    # when each named metric is at most its bound.
    goodput: tuple[tuple[str, float], ...] = ()
    # vLLM's --percentile-metrics (default here: all four, the report's sections before the
    # flag existed; vLLM's leaves out e2el) and --metric-percentiles.
    percentile_metrics: tuple[str, ...] = PERCENTILE_METRICS
    metric_percentiles: tuple[float, ...] = (99.0,)
    detailed: bool = False  # vLLM's --save-detailed: the report adds per-request arrays

    def __post_init__(self) -> None:
        object.__setattr__(self, "url", server_root(self.url))
        check_url(self.url)
        for name in ("num_prompts", "input_len", "output_len", "num_turns"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate={self.request_rate}: must be > 0 (or inf)")
        if not 0 < self.burstiness < math.inf:
            raise ValueError(f"burstiness={self.burstiness}: must be a finite number > 0")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency={self.max_concurrency}: must be >= 1")
        if not self.ready_timeout_s > 0:
            raise ValueError(f"ready_timeout_s={self.ready_timeout_s}: must be > 0")
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint={self.endpoint!r}: must be one of {ENDPOINTS}")
        if self.prefix_len < 0:
            raise ValueError(f"prefix_len={self.prefix_len}: must be >= 0")
        if not 0 <= self.range_ratio < 1:
            raise ValueError(f"range_ratio={self.range_ratio}: must be in [0, 1)")
        if math.floor(self.input_len * (1 - self.range_ratio)) < 1:
            raise ValueError(
                f"range_ratio={self.range_ratio}: the shortest prompt of input_len="
                f"{self.input_len} would have no tokens"
            )
        _check_goodput(self.goodput)
        _check_percentiles(self.percentile_metrics, self.metric_percentiles)
        self._check_dataset()
        self._check_ramp_up()
        if self.num_warmups < 0:
            raise ValueError(f"num_warmups={self.num_warmups}: must be >= 0")
        if not isinstance(self.extra_body, dict):
            raise ValueError(f"extra_body={self.extra_body!r}: must be a dict (a JSON object)")
        if self.extra_body.get("n", 1) != 1:  # (its choices would be timed as one answer)
            raise ValueError(f"extra_body={self.extra_body!r}: one choice per request (n 1)")

    def _check_dataset(self) -> None:
        if self.dataset not in DATASETS:
            raise ValueError(f"dataset={self.dataset!r}: must be one of {DATASETS}")
        if (self.dataset == "random") != (self.dataset_path is None):
            raise ValueError(
                f"dataset_path={self.dataset_path!r}: the {self.dataset} dataset "
                + ("reads no file" if self.dataset == "random" else "needs one")
            )
        if self.dataset != "random" and self.num_turns > 1:
            raise ValueError(f"num_turns={self.num_turns}: multi-turn runs random prompts only")
        for name in ("sharegpt_output_len", "custom_output_len"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name}={value}: must be >= 1")

    def _check_ramp_up(self) -> None:
        bounds = (self.ramp_up_start_rps, self.ramp_up_end_rps)
        if self.ramp_up_strategy is None:
            if bounds != (None, None):
                raise ValueError("ramp_up_start_rps/ramp_up_end_rps: need ramp_up_strategy")
            return
        if self.ramp_up_strategy not in RAMP_UP_STRATEGIES:
            raise ValueError(
                f"ramp_up_strategy={self.ramp_up_strategy!r}: must be one of {RAMP_UP_STRATEGIES}"
            )
        if None in bounds or not all(0 < b < math.inf for b in bounds):
            raise ValueError(f"ramp_up rps {bounds}: give both, finite and > 0")
        if not math.isinf(self.request_rate):
            raise ValueError(f"request_rate={self.request_rate}: not with ramp_up_strategy")


def _check_goodput(goodput: tuple[tuple[str, float], ...]) -> None:
    names = [name for name, _ in goodput]
    for name, bound in goodput:
        if name not in GOODPUT_METRICS:
            raise ValueError(f"goodput={goodput}: {name!r} is not one of {GOODPUT_METRICS}")
        if not bound >= 0:  # (NaN too)
            raise ValueError(f"goodput={goodput}: the bound of {name} must be >= 0 ms")
        if names.count(name) > 1:
            raise ValueError(f"goodput={goodput}: {name} is bounded twice")


def _check_percentiles(metrics: tuple[str, ...], percentiles: tuple[float, ...]) -> None:
    if not metrics or any(m not in PERCENTILE_METRICS for m in metrics):
        raise ValueError(f"percentile_metrics={metrics}: must be some of {PERCENTILE_METRICS}")
    if len(set(metrics)) < len(metrics):
        raise ValueError(f"percentile_metrics={metrics}: a metric is named twice")
    if not percentiles or not all(0 <= p <= 100 for p in percentiles):
        raise ValueError(f"metric_percentiles={percentiles}: each must be in [0, 100]")
    words = [percentile_word(p) for p in percentiles]
    if len(set(words)) < len(words):
        raise ValueError(f"metric_percentiles={percentiles}: a percentile is named twice")


def percentile_word(p: float) -> str:
    """The percentile as vLLM names it in report keys: 99 -> "99", 99.9 -> "99.9"."""
    return str(int(p)) if int(p) == p else str(p)
