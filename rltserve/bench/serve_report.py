"""The report of ``rltserve bench serve``: what each request measured, the statistics over them
(vLLM's keys: ``mean_ttft_ms``, ``p99_ttft_ms``, ``request_goodput``, ...), the text printed for
people and the name of the result file.

Latencies are reported in ms as mean, median, std and each of ``metric_percentiles`` (numpy's
std and linear percentile, as vLLM's), for the metrics in ``percentile_metrics`` alone (vLLM
leaves the others out too). ``request_goodput`` (req/s, None without ``goodput``) counts the
successful requests within every bound given, as vLLM's: a request of one output token has a
TPOT of 0. With ``detailed`` (vLLM's ``--save-detailed``) the report adds vLLM's per-request
arrays, in the order the requests were sent: ``input_lens``, ``output_lens`` (0 for a failed
request), ``ttfts``, ``itls``, ``latencies`` (s), ``generated_texts`` and ``errors`` (``""`` for
a success; this replaces the list of the first five distinct errors).

The peaks are vLLM's: ``max_output_tokens_per_s`` the most output chunks (tokens, one per
chunk) that arrived within one 1-second bucket of the run (counted from the first request's
send), ``max_concurrent_requests`` the most successful requests in flight within one such
bucket (a request counts in each bucket from its send's to its end's).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from datetime import datetime

import numpy as np

from rltserve.bench.serve_config import ENDPOINT_BACKENDS, BenchConfig, percentile_word

_SECTIONS = (
    ("ttft", "Time to First Token"),
    ("tpot", "Time per Output Token (excl. 1st token)"),
    ("itl", "Inter-token Latency"),
    ("e2el", "End-to-end Latency"),
)


@dataclass
class RequestResult:
    """What one benchmark request measured (seconds)."""

    prompt_len: int
    success: bool = False
    output_tokens: int = 0
    ttft: float = 0.0
    e2el: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str | None = None
    cached_tokens: int = 0  # prompt tokens the server reused (usage.prompt_tokens_details)
    output_ids: list[int] = field(default_factory=list)  # multi-turn: the answer's token ids
    output_text: str = ""  # chat: the answer's text
    start: float = 0.0  # when it was sent, seconds after the benchmark's start
    usage: bool = False  # whether the stream carried the server's usage

    @property
    def tpot(self) -> float:
        """(E2EL - TTFT) / (output tokens - 1); 0 for one token (as vLLM's goodput takes it)."""
        if self.output_tokens < 2:
            return 0.0
        return (self.e2el - self.ttft) / (self.output_tokens - 1)


def _stats(metric: str, values_s: list[float], percentiles: tuple[float, ...]) -> dict:
    ms = np.asarray(values_s, dtype=float) * 1000.0 if values_s else np.zeros(1)
    stats = {
        f"mean_{metric}_ms": float(ms.mean()),
        f"median_{metric}_ms": float(np.median(ms)),
        f"std_{metric}_ms": float(np.std(ms)),
    }
    for p in percentiles:
        stats[f"p{percentile_word(p)}_{metric}_ms"] = float(np.percentile(ms, p))
    return stats


def good_requests(config: BenchConfig, ok: list[RequestResult]) -> int:
    """The successful requests within every ``goodput`` bound."""
    bounds_s = [(name, bound / 1000) for name, bound in config.goodput]
    return sum(all(bound >= getattr(r, name) for name, bound in bounds_s) for r in ok)


def peaks(results: list[RequestResult]) -> tuple[float, int]:
    """(max_output_tokens_per_s, max_concurrent_requests) of the successful ``results``, as
    vLLM computes them."""
    ok = [r for r in results if r.success]
    if not ok:
        return 0.0, 0
    first = min(r.start for r in ok)
    seconds = int(math.ceil(max(r.start + r.e2el for r in ok) - first)) + 1
    tokens, concurrent = np.zeros(seconds), np.zeros(seconds)
    for r in ok:
        concurrent[int(r.start - first) : int(r.start + r.e2el - first) + 1] += 1
        times = r.start + r.ttft + np.cumsum([0.0, *r.itl])
        for t in times:
            tokens[int(t - first)] += 1
    return float(tokens.max()), int(concurrent.max())  # (vLLM's types: a count is an int)


def summarize(
    config: BenchConfig,
    results: list[RequestResult],
    duration: float,
    served: str | None = None,
    max_model_len: int | None = None,
    context_skipped: int = 0,
) -> dict:
    """The report: the run's settings (``model``: the one sent, else ``served``, the server's
    first; ``temperature`` and ``exit_threshold`` as sent, ``extra_body``'s over the flags';
    ``max_model_len``: its context, where its model card gives it), then what it
    measured. ``context_skipped``: the turns not sent because the context would not hold
    them."""
    ok = [r for r in results if r.success]
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    peak_tokens, peak_requests = peaks(ok)
    backend = config.backend or ENDPOINT_BACKENDS[config.endpoint]
    # What each request sent: ``extra_body`` goes over the flags (``serve.request_body``), so
    # the settings recorded are those the server got.
    sent = {"temperature": config.temperature, "exit_threshold": config.exit_threshold}
    sent.update(config.extra_body)
    report: dict = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),  # (vLLM's format)
        "url": config.url,
        "endpoint": config.endpoint,
        "backend": backend,
        "endpoint_type": backend,  # (vLLM's name of the backend in newer reports)
        "label": config.label,
        "model": config.model or served,
        "model_id": config.model_id or config.model or served,
        "tokenizer_id": config.tokenizer or config.model_id or config.model or served,
        "dataset_name": config.dataset,
        "dataset_path": config.dataset_path,
        "ignore_eos": config.ignore_eos,
        "num_warmups": config.num_warmups,
        "seed": config.seed,
        "temperature": sent["temperature"],
        "exit_threshold": sent["exit_threshold"],
        "extra_body": dict(config.extra_body),  # (rltserve's loop fields: max_loops, ...)
        "num_prompts": config.num_prompts,
        "request_rate": "inf" if math.isinf(config.request_rate) else config.request_rate,
        "burstiness": config.burstiness,
        "ramp_up_strategy": config.ramp_up_strategy,
        "ramp_up_start_rps": config.ramp_up_start_rps,
        "ramp_up_end_rps": config.ramp_up_end_rps,
        "max_concurrency": config.max_concurrency,
        # (a text dataset's lengths are its prompts' and replies', not these)
        "input_len": config.input_len if config.dataset == "random" else None,
        "prefix_len": config.prefix_len,
        "output_len": config.output_len if config.dataset == "random" else None,
        "range_ratio": config.range_ratio,
        "goodput": dict(config.goodput) or None,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "max_model_len": max_model_len,
        # Multi-turn: the turns a conversation never sent, after one of its turns failed or
        # where the context would not hold the next one (``context_skipped_turns`` of them).
        "skipped_turns": config.num_prompts * config.num_turns - len(results),
        "context_skipped_turns": context_skipped,
        "duration": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration,
        "request_goodput": good_requests(config, ok) / duration if config.goodput else None,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        "max_output_tokens_per_s": peak_tokens,
        "max_concurrent_requests": peak_requests,
        "requests_without_usage": sum(not r.usage for r in ok),
        "num_turns": config.num_turns,
        "total_cached_tokens": sum(r.cached_tokens for r in ok),
        "prefix_cache_hit_rate": sum(r.cached_tokens for r in ok) / max(input_tokens, 1),
    }
    values = {
        "ttft": [r.ttft for r in ok],
        "tpot": [r.tpot for r in ok if r.output_tokens > 1],
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.e2el for r in ok],
    }
    for metric, _ in _SECTIONS:
        if metric in config.percentile_metrics:
            report.update(_stats(metric, values[metric], config.metric_percentiles))
    report["errors"] = sorted({r.error for r in results if r.error})[:5]
    if config.detailed:
        report.update(
            input_lens=[r.prompt_len for r in results],
            output_lens=[r.output_tokens if r.success else 0 for r in results],
            ttfts=[r.ttft for r in results],
            itls=[r.itl for r in results],
            latencies=[r.e2el for r in results],
            generated_texts=[r.output_text for r in results],
            errors=[r.error or "" for r in results],
        )
    return report


def format_report(report: dict) -> str:
    context_skipped = report.get("context_skipped_turns", 0)  # (a report saved before it)
    rows = [
        ("Successful requests", report["completed"]),
        ("Failed requests", report["failed"]),
        ("Maximum request concurrency", report["max_concurrency"]),
        ("Request rate (req/s)", report["request_rate"]),
        ("Benchmark duration (s)", f"{report['duration']:.2f}"),
        ("Total input tokens", report["total_input_tokens"]),
        ("Total generated tokens", report["total_output_tokens"]),
        ("Request throughput (req/s)", f"{report['request_throughput']:.2f}"),
    ]
    if report.get("request_goodput") is not None:
        rows.append(("Request goodput (req/s)", f"{report['request_goodput']:.2f}"))
    rows += [
        ("Output token throughput (tok/s)", f"{report['output_throughput']:.2f}"),
    ]
    if "max_output_tokens_per_s" in report:  # (a report saved before the peaks)
        rows += [
            ("Peak output token throughput (tok/s)", f"{report['max_output_tokens_per_s']:.2f}"),
            ("Peak concurrent requests", f"{report['max_concurrent_requests']:.2f}"),
        ]
    rows.append(("Total token throughput (tok/s)", f"{report['total_token_throughput']:.2f}"))
    if report["num_turns"] > 1:
        rows += [
            ("Turns per conversation", report["num_turns"]),
            ("Turns not sent (after a failed turn)", report["skipped_turns"] - context_skipped),
        ]
        if (context := report.get("max_model_len")) is not None:
            rows.append((f"Turns not sent (past max_model_len {context})", context_skipped))
    # (meaningful where prompts share tokens or the server reports a cache hit)
    if report["num_turns"] > 1 or report.get("prefix_len") or report["total_cached_tokens"]:
        rows.append(("Prefix cache hit rate", f"{report['prefix_cache_hit_rate']:.3f}"))
    lines = ["{:=^60}".format(" Serving Benchmark Result ")]
    lines += [f"{name + ':':<45}{value!s:>15}" for name, value in rows]
    for metric, title in _SECTIONS:
        if f"mean_{metric}_ms" not in report:  # (not in --percentile-metrics)
            continue
        lines.append(f"{' ' + title + ' ':-^60}")
        keys = [f"mean_{metric}_ms", f"median_{metric}_ms"]
        keys += [k for k in report if re.fullmatch(rf"p[\d.]+_{metric}_ms", k)]
        for key in keys:
            stat = key.split("_")[0]
            name = f"{stat.capitalize() if stat[0] != 'p' else stat.upper()} {metric.upper()}"
            lines.append(f"{name + ' (ms):':<45}{report[key]:>15.2f}")
    # (a detailed report's errors are per request, "" for a success)
    for error in sorted({e for e in report["errors"] if e})[:5]:
        lines.append(f"error: {error}")
    lines.append("=" * 60)
    return "\n".join(lines)


def result_filename(report: dict, label: str) -> str:
    """vLLM's name of the result file: ``{label}-{rate}[-concurrency{max_concurrency}]-{model}-
    {date}.json``; ``rate``: ``{request_rate}qps``, or a ramp-up's
    ``ramp-up-{strategy}-{start}qps-{end}qps``; ``model``: the last part of ``model_id`` (vLLM's
    ``--model``, not the name sent)."""
    concurrency = report["max_concurrency"]
    model = (report["model_id"] or "unknown").rstrip("/").split("/")[-1]
    bound = f"-concurrency{concurrency}" if concurrency is not None else ""
    if report.get("ramp_up_strategy") is not None:
        start, end = _rps(report["ramp_up_start_rps"]), _rps(report["ramp_up_end_rps"])
        rate = f"ramp-up-{report['ramp_up_strategy']}-{start}qps-{end}qps"
    else:
        rate = f"{report['request_rate']}qps"
    return f"{label}-{rate}{bound}-{model}-{report['date']}.json"


def _rps(rate: float) -> float | int:
    """A ramp-up bound as vLLM's name writes it: its flags take ints (1, not 1.0); the rates
    here may be fractions, which keep their digits."""
    return int(rate) if rate == int(rate) else rate
