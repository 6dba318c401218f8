"""``rltserve bench serve``: a serving benchmark client in the manner of ``vllm bench serve``.

Every request streams ``/v1/completions`` with a random token-id prompt of ``input_len`` tokens,
``max_tokens=output_len`` and ``ignore_eos``, so each produces exactly ``output_len`` tokens.
Requests are sent all at once (rate inf) or with gamma-distributed gaps (``burstiness`` 1 =
Poisson), optionally capped at ``max_concurrency`` in flight.

Multi-turn chat (``num_turns > 1``): each of the ``num_prompts`` conversations sends its turns one
after another; turn t's prompt is turn t-1's prompt + its answer (token ids; from a server that
streams text alone, its ``/tokenize`` of the text) + a new ``input_len``-token user message; a
conversation stops at a failed turn (``skipped_turns`` counts the turns it did not send). The
report adds the prefix cache hit rate: prompt tokens the server reports as cached
(``usage.prompt_tokens_details.cached_tokens``) over all prompt tokens.

Definitions (as vLLM's): TTFT = send -> first streamed chunk with output; ITL = gaps between
consecutive streamed chunks; TPOT = (E2EL - TTFT) / (output tokens - 1) per request; E2EL = send
-> last byte. Output tokens are the server's ``usage.completion_tokens`` (without usage: the
token ids streamed, else the output chunks). Throughputs divide by the benchmark's wall time.
Latencies are reported in ms as mean, median, std and p99 (numpy's std and linear percentile).
A request that streams no output fails with an error saying so. The report starts with the
run's settings (URL, endpoint, model, seed, ...) and its ``date``.

``endpoint="chat"`` streams ``/v1/chat/completions`` instead (vLLM's ``openai-chat`` backend):
each random prompt is sent as the text the server decodes it to (``/detokenize``), as one user
message, and a multi-turn chat sends the conversation as messages (the answers as text). The
prompt lengths are the server's ``usage.prompt_tokens`` (the template adds its tokens, and
decoded text may re-encode to other ids), output chunks those that carry token ids or text (the
role's and a closing one's carry neither).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from urllib.parse import urlsplit

import numpy as np

from rltserve.client import APIError, AsyncClient, server_root
from rltserve.progress import progress_bar

ENDPOINTS = ("completions", "chat")
_FALLBACK_VOCAB = 1000  # servers whose model card has no vocab_size
_FIRST_PROBE_S = 5.0  # the first readiness probe; a longer wait is announced on stderr
_SECTIONS = (
    ("ttft", "Time to First Token"),
    ("tpot", "Time per Output Token (excl. 1st token)"),
    ("itl", "Inter-token Latency"),
    ("e2el", "End-to-end Latency"),
)


@dataclass(frozen=True)
class BenchConfig:
    url: str
    api_key: str | None = None
    model: str | None = None
    num_prompts: int = 100
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    input_len: int = 128
    output_len: int = 128
    seed: int = 0
    temperature: float = 0.0
    exit_threshold: float | None = None
    num_turns: int = 1  # > 1: multi-turn chat conversations (see the module doc)
    endpoint: str = "completions"  # or "chat" (see the module doc)
    progress: bool = False
    ready_timeout_s: float = 600.0  # how long to wait for a server that is still loading

    def __post_init__(self) -> None:
        object.__setattr__(self, "url", server_root(self.url))
        _check_url(self.url)
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


def _check_url(url: str) -> None:
    why = "must be an http(s) URL with a host, e.g. http://127.0.0.1:8000"
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError on a port that is not a number in range
    except ValueError as exc:
        raise ValueError(f"url={url!r}: {why} ({exc})") from exc
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"url={url!r}: {why}")


class ServerNotReadyError(ConnectionError):
    """No server answered ready at the URL within the wait."""


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


def random_prompts(config: BenchConfig, vocab_size: int) -> list[list[int]]:
    rng = random.Random(config.seed)
    return [
        [rng.randrange(vocab_size) for _ in range(config.input_len)]
        for _ in range(config.num_prompts)
    ]


def arrival_gaps(config: BenchConfig) -> list[float]:
    """Seconds to wait before sending each request (gamma gaps; all zero at rate inf)."""
    if math.isinf(config.request_rate):
        return [0.0] * config.num_prompts
    rng = random.Random(config.seed + 1)
    theta = 1.0 / (config.request_rate * config.burstiness)
    return [0.0] + [
        rng.gammavariate(config.burstiness, theta) for _ in range(config.num_prompts - 1)
    ]


async def _one(
    client: AsyncClient, config: BenchConfig, prompt: list[int] | list[dict]
) -> RequestResult:
    """One streamed request: ``prompt`` is token ids (completions) or messages (chat)."""
    chat = config.endpoint == "chat"
    result = RequestResult(0 if chat else len(prompt))
    body: dict = {
        "max_tokens": config.output_len,
        "temperature": config.temperature,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    if config.model is not None:
        body["model"] = config.model
    if config.exit_threshold is not None:
        body["exit_threshold"] = config.exit_threshold
    if config.num_turns > 1 or chat:
        body["return_token_ids"] = True
    start = time.perf_counter()
    last = start
    outputs = 0  # chunks that carried output
    usage = None
    stream = client.chat_stream(prompt, **body) if chat else client.stream(prompt, **body)
    try:
        async with stream as chunks:
            async for chunk in chunks:
                now = time.perf_counter()
                choice = chunk["choices"][0] if chunk.get("choices") else None
                if choice is not None:
                    ids = choice.get("token_ids") or ()
                    delta = choice.get("delta") or {}
                    text = delta.get("content") if chat else choice.get("text")
                    # Output is token ids or, from servers that send none per chunk (vLLM
                    # without return_token_ids, SGLang, proxies), text. A chat's role chunk and
                    # a closing chunk (the finish reason alone) carry neither; a completion
                    # chunk without text otherwise holds a token whose text is held back.
                    if not (ids or text) and (chat or choice.get("finish_reason")):
                        continue
                    result.output_ids.extend(ids)
                    result.output_text += text or ""
                    if outputs == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    outputs += 1
                    last = now
                if chunk.get("usage"):
                    usage = chunk["usage"]
                    result.prompt_len = usage["prompt_tokens"]
                    details = usage.get("prompt_tokens_details") or {}
                    result.cached_tokens = int(details.get("cached_tokens") or 0)
        result.e2el = time.perf_counter() - start
        # The server's count; without usage, the ids it sent, else one token per chunk.
        counted = len(result.output_ids) or outputs
        result.output_tokens = usage["completion_tokens"] if usage else counted
        result.success = outputs > 0
        if not result.success:
            result.error = "no output: the stream carried no chunk with text or token_ids"
    except (APIError, OSError, asyncio.TimeoutError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def _wait_for_server(client: AsyncClient, config: BenchConfig) -> None:
    """Returns once the server is ready; says on stderr that it waits when it is not at once."""
    with contextlib.suppress(asyncio.TimeoutError):
        # Bounded: the client has no timeout, and a host that drops packets never answers.
        if await asyncio.wait_for(client.health(), min(_FIRST_PROBE_S, config.ready_timeout_s)):
            return
    print(
        f"waiting up to {config.ready_timeout_s:g} s for the server at {config.url} "
        "(--wait-timeout) ...",
        file=sys.stderr,
        flush=True,
    )
    wait = config.ready_timeout_s
    try:
        await asyncio.wait_for(client.wait_ready(timeout=wait, interval=0.25), wait)
    except (APIError, asyncio.TimeoutError) as exc:
        raise ServerNotReadyError(
            f"no server ready at {config.url} after {config.ready_timeout_s:g} s "
            "(is `rltserve serve` running there?)"
        ) from exc


async def run_bench(config: BenchConfig) -> dict:
    async with AsyncClient(config.url, config.api_key, timeout=None, max_connections=0) as client:
        await _wait_for_server(client, config)
        cards = await client.models()
        vocab = int(cards[0].get("vocab_size") or _FALLBACK_VOCAB) if cards else _FALLBACK_VOCAB
        prompts = random_prompts(config, vocab)
        gaps = arrival_gaps(config)
        limit = asyncio.Semaphore(config.max_concurrency or config.num_prompts)
        total = config.num_prompts * config.num_turns
        progress = progress_bar(total, "requests", config.progress, unit="req")

        async def conversation(index: int, prompt: list[int]) -> list[RequestResult]:
            """One request, or the turns of one chat, each turn extending the last."""
            rng = random.Random(config.seed * 7919 + index + 2)
            chat = config.endpoint == "chat"
            messages = []
            if chat:
                messages = [{"role": "user", "content": await client.detokenize(prompt)}]
            results = []
            for turn in range(config.num_turns):
                async with limit:
                    result = await _one(client, config, messages if chat else prompt)
                progress.update()
                results.append(result)
                if not result.success or turn + 1 == config.num_turns:
                    break
                user = [rng.randrange(vocab) for _ in range(config.input_len)]
                answer = result.output_ids
                if not (chat or answer) and result.output_text:  # (a server that sends no ids)
                    answer = await client.tokenize(result.output_text, add_special_tokens=False)
                prompt = prompt + answer + user
                if chat:
                    messages += [
                        {"role": "assistant", "content": result.output_text},
                        {"role": "user", "content": await client.detokenize(user)},
                    ]
            return results

        start = time.perf_counter()
        tasks = []
        with progress:
            for index, (prompt, gap) in enumerate(zip(prompts, gaps)):
                if gap > 0:
                    await asyncio.sleep(gap)
                tasks.append(asyncio.create_task(conversation(index, prompt)))
            results = [r for turns in await asyncio.gather(*tasks) for r in turns]
        duration = time.perf_counter() - start
    return summarize(config, results, duration, cards[0].get("id") if cards else None)


def _stats(prefix: str, values_s: list[float]) -> dict[str, float]:
    ms = np.asarray(values_s, dtype=float) * 1000.0 if values_s else np.zeros(1)
    return {
        f"mean_{prefix}_ms": float(ms.mean()),
        f"median_{prefix}_ms": float(np.median(ms)),
        f"std_{prefix}_ms": float(np.std(ms)),
        f"p99_{prefix}_ms": float(np.percentile(ms, 99)),
    }


def summarize(
    config: BenchConfig, results: list[RequestResult], duration: float, served: str | None = None
) -> dict:
    """The report: the run's settings (``model``: the one sent, else ``served``, the server's
    first), then what it measured."""
    ok = [r for r in results if r.success]
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    tpots = [(r.e2el - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    report: dict = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),  # (vLLM's format)
        "url": config.url,
        "endpoint": config.endpoint,
        "model": config.model or served,
        "seed": config.seed,
        "temperature": config.temperature,
        "exit_threshold": config.exit_threshold,
        "num_prompts": config.num_prompts,
        "request_rate": "inf" if math.isinf(config.request_rate) else config.request_rate,
        "burstiness": config.burstiness,
        "max_concurrency": config.max_concurrency,
        "input_len": config.input_len,
        "output_len": config.output_len,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        # Multi-turn: the turns a conversation never sent after one of its turns failed.
        "skipped_turns": config.num_prompts * config.num_turns - len(results),
        "duration": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        "num_turns": config.num_turns,
        "total_cached_tokens": sum(r.cached_tokens for r in ok),
        "prefix_cache_hit_rate": sum(r.cached_tokens for r in ok) / max(input_tokens, 1),
    }
    report.update(_stats("ttft", [r.ttft for r in ok]))
    report.update(_stats("tpot", tpots))
    report.update(_stats("itl", [gap for r in ok for gap in r.itl]))
    report.update(_stats("e2el", [r.e2el for r in ok]))
    report["errors"] = sorted({r.error for r in results if r.error})[:5]
    return report


def format_report(report: dict) -> str:
    rows = [
        ("Successful requests", report["completed"]),
        ("Failed requests", report["failed"]),
        ("Maximum request concurrency", report["max_concurrency"]),
        ("Request rate (req/s)", report["request_rate"]),
        ("Benchmark duration (s)", f"{report['duration']:.2f}"),
        ("Total input tokens", report["total_input_tokens"]),
        ("Total generated tokens", report["total_output_tokens"]),
        ("Request throughput (req/s)", f"{report['request_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{report['output_throughput']:.2f}"),
        ("Total token throughput (tok/s)", f"{report['total_token_throughput']:.2f}"),
        ("Turns per conversation", report["num_turns"]),
        ("Turns not sent (after a failed turn)", report["skipped_turns"]),
        ("Prefix cache hit rate", f"{report['prefix_cache_hit_rate']:.3f}"),
    ]
    lines = ["{:=^60}".format(" Serving Benchmark Result ")]
    lines += [f"{name + ':':<45}{value!s:>15}" for name, value in rows]
    for key, title in _SECTIONS:
        lines.append(f"{' ' + title + ' ':-^60}")
        for stat in ("mean", "median", "p99"):
            name = f"{stat.capitalize() if stat != 'p99' else 'P99'} {key.upper()} (ms):"
            lines.append(f"{name:<45}{report[f'{stat}_{key}_ms']:>15.2f}")
    for error in report["errors"]:
        lines.append(f"error: {error}")
    lines.append("=" * 60)
    return "\n".join(lines)
