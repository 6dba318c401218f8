"""``rltserve bench serve``: a serving benchmark client in the manner of ``vllm bench serve``.

Every request streams ``/v1/completions`` with a random token-id prompt of ``input_len`` tokens
(after ``prefix_len`` tokens every prompt shares; ids drawn from the vocabulary less the special
ids of ``tokenizer``, where given: the server tells none) and ``max_tokens=output_len`` (with
``range_ratio``, lengths drawn around those per conversation: ``serve_datasets``); with
``ignore_eos`` (vLLM's --ignore-eos) each produces exactly that many tokens, else it may stop at
its end token. ``dataset`` sharegpt or custom sends a file's text prompts instead
(``serve_text_datasets``). Every body adds the sampling fields given, then ``extra_body``.
Requests are sent all at once (rate inf) or at gamma-distributed arrival times (``burstiness``
1 = Poisson; recent vLLM's schedule, ``arrival_offsets``: each request's delay drawn at its own
rate, which a ramp-up moves from the start to the end rate over the requests; a fixed rate's
times rescaled to end at ``num_prompts / request_rate``), optionally capped at
``max_concurrency`` in flight, after ``num_warmups`` unmeasured requests of the first prompt
(vLLM's).

Multi-turn chat (``num_turns > 1``): each of the ``num_prompts`` conversations sends its turns one
after another; turn t's prompt is turn t-1's prompt + its answer (token ids; from a server that
streams text alone, its ``/tokenize`` of the text) + a new ``input_len``-token user message; a
conversation stops at a failed turn (``skipped_turns`` counts the turns it did not send). It
also stops before a turn whose prompt and ``max_tokens`` would exceed the server's context (its
model card's ``max_model_len``), which the server would refuse: ``context_skipped_turns``
counts those turns among the skipped ones. A completion prompt's length is its token ids; a
chat's is the server's ``/tokenize`` of the messages (a server whose ``/tokenize`` takes no
messages gets the turn unchecked). The report adds the prefix cache hit rate: prompt tokens the
server reports as cached (``usage.prompt_tokens_details.cached_tokens``) over all prompt
tokens.

Definitions (as vLLM's): TTFT = send -> first streamed chunk with output; ITL = gaps between
consecutive streamed chunks; TPOT = (E2EL - TTFT) / (output tokens - 1) per request; E2EL = send
-> last byte. Output tokens are the server's ``usage.completion_tokens`` (without usage: the
token ids streamed, else the output chunks). Throughputs divide by the benchmark's wall time.
A request that streams no output fails with an error saying so; one whose only chunk closes
it (a first token that was an end or stop token, which has no text) succeeds, timed at that
chunk. The report (``serve_report``: its statistics, goodput and per-request arrays) starts
with the run's settings (URL, endpoint, model, seed, ...) and its ``date``; ``serve_config``
checks the settings.

``endpoint="chat"`` streams ``/v1/chat/completions`` instead (vLLM's ``openai-chat`` backend):
each random prompt is sent as the text the server decodes it to (``/detokenize``), as one user
message, and a multi-turn chat sends the conversation as messages (the answers as text). The
prompt lengths are the server's ``usage.prompt_tokens`` (the template adds its tokens, and
decoded text may re-encode to other ids), output chunks those that carry token ids or text (the
role's and a closing one's carry neither). A server without ``/detokenize`` is named as such
before the run. A stream without ``usage`` leaves a prompt its own token count (a chat's without
the template's tokens): stderr warns, and the report counts ``requests_without_usage``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import random
import sys
import time

# (BenchConfig, ENDPOINTS and format_report are imported from here too, where they once lived)
from rltserve.bench.serve_config import ENDPOINTS as ENDPOINTS
from rltserve.bench.serve_config import BenchConfig
from rltserve.bench.serve_datasets import random_prompts, request_lengths, token_pool
from rltserve.bench.serve_report import RequestResult, summarize
from rltserve.bench.serve_report import format_report as format_report
from rltserve.bench.serve_text_datasets import TokenCounter, local_tokenizer, text_requests
from rltserve.client import APIError, AsyncClient
from rltserve.client_errors import NotFoundError
from rltserve.progress import progress_bar

_FALLBACK_VOCAB = 1000  # servers whose model card has no vocab_size
_FIRST_PROBE_S = 5.0  # the first readiness probe; a longer wait is announced on stderr
# finish reasons of a request the server ended without its answer (vLLM's abort; an error)
_ABNORMAL_FINISH = ("abort", "error")


class ServerNotReadyError(ConnectionError):
    """No server answered ready at the URL within the wait."""


class MissingRouteError(RuntimeError):
    """The server lacks a route the run needs (``/detokenize`` for random chat prompts)."""


def request_rates(config: BenchConfig) -> list[float]:
    """The rate each request's delay is drawn at: ``request_rate``, or vLLM's ramp-up from the
    start rate (first request) to the end rate (last), linear or geometric in the index."""
    n = config.num_prompts
    if config.ramp_up_strategy is None:
        return [config.request_rate] * n
    start, end = config.ramp_up_start_rps, config.ramp_up_end_rps
    progress = [i / max(n - 1, 1) for i in range(n)]
    if config.ramp_up_strategy == "linear":
        return [start + (end - start) * p for p in progress]
    return [start * (end / start) ** p for p in progress]


def arrival_offsets(config: BenchConfig) -> list[float]:
    """Seconds after the benchmark's start at which each request is sent, as recent vLLM's
    ``get_request``: request i's delay is a gamma draw at its own rate (the first request's
    too), the offsets their running sums; at a fixed rate they are rescaled so that the last
    is ``num_prompts / request_rate`` (a ramp-up's are not). All zero at rate inf."""
    rates = request_rates(config)
    if math.isinf(rates[0]):  # (a ramp-up's rates are finite)
        return [0.0] * config.num_prompts
    rng = random.Random(config.seed + 1)
    shape = config.burstiness
    delays = [rng.gammavariate(shape, 1.0 / (rate * shape)) for rate in rates]
    offsets = list(itertools.accumulate(delays))
    if config.ramp_up_strategy is None and offsets[-1] > 0:
        # (vLLM's: the draws' sum strays from N / rate by ~1/sqrt(N * burstiness); rescaled,
        # runs of different seeds offer the same load)
        scale = config.num_prompts / config.request_rate / offsets[-1]
        offsets = [offset * scale for offset in offsets]
    return offsets


async def send_at(origin: float, offset: float) -> None:
    """Waits until ``origin + offset`` (perf_counter seconds): each request's wait is counted
    from the start, not from the previous send, so time lost sending does not add up."""
    wait = origin + offset - time.perf_counter()
    if wait > 0:
        await asyncio.sleep(wait)


def request_body(config: BenchConfig, max_tokens: int | None = None) -> dict:
    """A request's fields besides its prompt: vLLM's, then ``extra_body`` over them."""
    body: dict = {
        "max_tokens": max_tokens or config.output_len,
        "temperature": config.temperature,
        "stream_options": {"include_usage": True},
    }
    if config.ignore_eos:
        body["ignore_eos"] = True
    for name in ("top_p", "top_k", "min_p", "exit_threshold"):
        if getattr(config, name) is not None:
            body[name] = getattr(config, name)
    if config.model is not None:
        body["model"] = config.model
    if config.num_turns > 1 or config.endpoint == "chat":
        body["return_token_ids"] = True
    return {**body, **config.extra_body}


async def _one(
    client: AsyncClient,
    config: BenchConfig,
    prompt: list[int] | list[dict],
    max_tokens: int | None = None,
    prompt_len: int | None = None,
    origin: float | None = None,
    request_id: str | None = None,
) -> RequestResult:
    """One streamed request: ``prompt`` is token ids (completions) or messages (chat);
    ``max_tokens`` (default: ``output_len``) the conversation's output length; ``prompt_len``
    its tokens where the server reports no usage (default: the ids'; a chat's: 0);
    ``origin``: the benchmark's start, from which ``result.start`` counts; ``request_id``: its
    X-Request-Id (``--request-id-prefix``)."""
    chat = config.endpoint == "chat"
    result = RequestResult(prompt_len if prompt_len is not None else 0 if chat else len(prompt))
    body = request_body(config, max_tokens)
    if request_id is not None:
        body["extra_headers"] = {"X-Request-Id": request_id}
    start = time.perf_counter()
    result.start = start - (origin if origin is not None else start)
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
                    # A reasoning server's thinking deltas are output too (its first token is
                    # the TTFT), though not the answer's text a next turn sends back.
                    thought = chat and (delta.get("reasoning_content") or delta.get("reasoning"))
                    # Output is token ids or, from servers that send none per chunk (vLLM
                    # without return_token_ids, SGLang, proxies), text. A chat's role chunk and
                    # a closing chunk (the finish reason alone) carry neither; a completion
                    # chunk without text otherwise holds a token whose text is held back. A
                    # closing chunk before any output ends a request whose first token was an
                    # end or stop token (no text, counted in usage): that chunk is its output,
                    # as vLLM's bench times it, not a failure.
                    finish = choice.get("finish_reason")
                    first_ends = outputs == 0 and finish and finish not in _ABNORMAL_FINISH
                    if not (ids or text or thought) and (chat or finish) and not first_ends:
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
                    result.usage = True
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


async def _detokenized(client: AsyncClient, ids: list[int]) -> str:
    """The text of random prompt ids, naming the route a server without it lacks."""
    try:
        return await client.detokenize(ids)
    except NotFoundError as exc:
        raise MissingRouteError(
            f"POST /detokenize: {exc} - --endpoint chat sends random prompts as their text, "
            "which needs the server's /detokenize (rltserve's and vLLM's have one); use "
            "--endpoint completions or a text dataset (--dataset-name sharegpt|custom)"
        ) from None


def _special_ids(config: BenchConfig) -> frozenset[int]:
    """The special token ids of ``tokenizer`` (none without it: the server does not say)."""
    if config.tokenizer is None or config.dataset != "random":
        return frozenset()
    return local_tokenizer(config.tokenizer).special_ids


async def run_bench(config: BenchConfig) -> dict:
    # No retries: a benchmark counts failures, and a retried stream would skew its TTFT.
    client = AsyncClient(
        config.url, config.api_key, timeout=None, max_connections=0, max_retries=0,
        default_headers=dict(config.headers),  # (vLLM's --header: every request's)
    )  # fmt: skip
    async with client:
        await _wait_for_server(client, config)
        cards = await client.models()
        vocab = int(cards[0].get("vocab_size") or _FALLBACK_VOCAB) if cards else _FALLBACK_VOCAB
        context = cards[0].get("max_model_len") if cards else None
        pool = token_pool(vocab, _special_ids(config))
        chat = config.endpoint == "chat"
        if config.dataset == "random":
            prompts = random_prompts(config, vocab, pool)
            lengths = request_lengths(config)
            counted = [len(p) for p in prompts]
            texts = [await _detokenized(client, p) for p in prompts] if chat else []
        else:
            requests = await text_requests(config, TokenCounter(client, config.tokenizer))
            prompts = [r.prompt for r in requests]
            texts = prompts if chat else []
            lengths = [(r.prompt_len, r.output_len) for r in requests]
            counted = [r.prompt_len for r in requests]
        offsets = arrival_offsets(config)
        limit = asyncio.Semaphore(config.max_concurrency or config.num_prompts)
        total = config.num_prompts * config.num_turns
        past_context = 0  # turns not sent: the context would not hold them

        async def fits(prompt: list[int], messages: list[dict], output_len: int) -> bool:
            """Whether the server's context holds the next turn's prompt and output."""
            if context is None:
                return True
            if config.endpoint != "chat":
                return len(prompt) + output_len <= context
            try:
                ids = await client.tokenize(messages=messages, add_generation_prompt=True)
            except APIError:  # (a /tokenize of prompts alone: the server decides)
                return True
            return len(ids) + output_len <= context

        def request_id(index: int, turn: int) -> str | None:
            prefix = config.request_id_prefix
            if prefix is None:
                return None
            return f"{prefix}{index}" if config.num_turns == 1 else f"{prefix}{index}-{turn}"

        async def conversation(index: int, prompt: list[int]) -> list[RequestResult]:
            """One request, or the turns of one chat, each turn extending the last."""
            nonlocal past_context
            rng = random.Random(config.seed * 7919 + index + 2)
            input_len, output_len = lengths[index]
            messages = [{"role": "user", "content": texts[index]}] if chat else []
            prompt_len = counted[index]
            results = []
            for turn in range(config.num_turns):
                async with limit:
                    result = await _one(
                        client, config, messages if chat else prompt, output_len,
                        prompt_len, origin, request_id(index, turn),
                    )  # fmt: skip
                progress.update()
                results.append(result)
                if not result.success or turn + 1 == config.num_turns:
                    break
                user = [pool[rng.randrange(len(pool))] for _ in range(input_len)]
                answer = result.output_ids
                if not (chat or answer) and result.output_text:  # (a server that sends no ids)
                    answer = await client.tokenize(result.output_text, add_special_tokens=False)
                prompt = prompt + answer + user
                prompt_len = len(prompt)  # (a chat's: no better count without usage)
                if chat:
                    messages += [
                        {"role": "assistant", "content": result.output_text},
                        {"role": "user", "content": await _detokenized(client, user)},
                    ]
                if not await fits(prompt, messages, output_len):
                    past_context += config.num_turns - turn - 1
                    break
            return results

        if config.num_warmups:  # (vLLM's: the first request, unmeasured, bounded alike)
            first = [{"role": "user", "content": texts[0]}] if chat else prompts[0]
            await asyncio.gather(*[
                _bounded(limit, _one(client, config, first, lengths[0][1]))
                for _ in range(config.num_warmups)
            ])  # fmt: skip
        progress = progress_bar(total, "requests", config.progress, unit="req")
        start = origin = time.perf_counter()
        tasks = []
        with progress:
            for index, (prompt, offset) in enumerate(zip(prompts, offsets)):
                await send_at(start, offset)
                tasks.append(asyncio.create_task(conversation(index, prompt)))
            results = [r for turns in await asyncio.gather(*tasks) for r in turns]
        duration = time.perf_counter() - start
    served = cards[0].get("id") if cards else None
    report = summarize(config, results, duration, served, context, past_context)
    if report["requests_without_usage"]:
        print(
            f"warning: {report['requests_without_usage']} of {report['completed']} streams "
            "carried no usage: their input tokens are the prompts' own counts"
            + (" (without the chat template's tokens)" if chat else "")
            + " and their output tokens the chunks' (or token ids')",
            file=sys.stderr,
        )
    return report


async def _bounded(limit: asyncio.Semaphore, request) -> RequestResult:
    async with limit:
        return await request
