"""``rltserve bench serve``: metric definitions on synthetic timings, the arrival process, a
short run against a live (scripted) server, and the CLI parsers of serve and bench serve."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import re
import statistics

import pytest
from aiohttp import web
from test_client_sse import serve
from test_http_harness import (
    Script,
    ScriptedStage,
    running,
    scripted_factory,
    scripted_info,
    tiny_checkpoint,
)

from rltserve.bench import serve as serve_bench
from rltserve.bench.serve import (
    BenchConfig,
    RequestResult,
    _one,
    arrival_gaps,
    format_report,
    random_prompts,
    run_bench,
    summarize,
)
from rltserve.client import APIConnectionError, APIError
from rltserve.http.cli import (
    add_bench_serve_parser,
    add_serve_parser,
    cmd_bench_serve,
    dataclass_kwargs,
    serve_configs,
)
from rltserve.http.config import ServerConfig


def test_summary_follows_the_serving_definitions():
    config = BenchConfig(url="http://x", num_prompts=3, input_len=4, output_len=5)
    results = [
        RequestResult(4, True, 5, ttft=0.1, e2el=0.5, itl=[0.1, 0.1, 0.1, 0.1]),
        RequestResult(4, True, 5, ttft=0.3, e2el=1.1, itl=[0.2, 0.2, 0.2, 0.2]),
        RequestResult(4, False, error="APIError: 503"),
    ]
    report = summarize(config, results, duration=2.0)
    assert (report["completed"], report["failed"]) == (2, 1)
    assert report["request_throughput"] == 1.0
    assert report["output_throughput"] == 5.0  # 10 tokens / 2 s
    assert report["total_token_throughput"] == 9.0  # (8 + 10) / 2 s
    assert report["mean_ttft_ms"] == pytest.approx(200.0)
    assert report["median_ttft_ms"] == pytest.approx(200.0)
    # TPOT = (E2EL - TTFT) / (tokens - 1): 100 ms and 200 ms
    assert report["mean_tpot_ms"] == pytest.approx(150.0)
    assert report["p99_tpot_ms"] == pytest.approx(199.0)
    assert report["mean_itl_ms"] == pytest.approx(150.0)
    assert report["mean_e2el_ms"] == pytest.approx(800.0)
    assert report["errors"] == ["APIError: 503"]
    assert report["skipped_turns"] == 0
    assert "Output token throughput (tok/s):" in format_report(report)
    # numpy's (population) std, as vLLM's: TTFT 100 and 300 ms, E2EL 500 and 1100 ms, ...
    assert report["std_ttft_ms"] == pytest.approx(100.0)
    assert report["std_e2el_ms"] == pytest.approx(300.0)
    assert report["std_tpot_ms"] == pytest.approx(50.0)
    assert report["std_itl_ms"] == pytest.approx(50.0)


def test_summary_records_the_settings_of_the_run():
    config = BenchConfig(
        url="http://x:1", endpoint="chat", seed=4, temperature=0.5, exit_threshold=0.7,
        input_len=6, output_len=7, num_turns=2,
    )  # fmt: skip
    report = summarize(config, [], duration=1.0, served="served-name")
    settings = {key: report[key] for key in (
        "url", "endpoint", "model", "seed", "temperature", "exit_threshold", "input_len",
        "output_len", "num_turns",
    )}  # fmt: skip
    assert settings == {
        "url": "http://x:1", "endpoint": "chat", "model": "served-name", "seed": 4,
        "temperature": 0.5, "exit_threshold": 0.7, "input_len": 6, "output_len": 7,
        "num_turns": 2,
    }  # fmt: skip
    assert re.fullmatch(r"\d{8}-\d{6}", report["date"])
    assert summarize(BenchConfig(url="http://x", model="m"), [], 1.0, "other")["model"] == "m"


def test_summary_counts_the_turns_a_failed_conversation_did_not_send():
    config = BenchConfig(url="http://x", num_prompts=2, num_turns=3)
    ok = RequestResult(4, True, 2, ttft=0.1, e2el=0.2, itl=[0.1])
    # conversation 1: all three turns; conversation 2: its first turn failed
    results = [ok, ok, ok, RequestResult(4, False, error="APIError: 503")]
    report = summarize(config, results, duration=1.0)
    assert (report["completed"], report["failed"], report["skipped_turns"]) == (3, 1, 2)
    assert "Turns not sent (after a failed turn):" in format_report(report)


def test_arrivals_and_prompts_are_seeded():
    config = BenchConfig(url="http://x", num_prompts=2000, request_rate=50.0, seed=3, input_len=8)
    gaps = arrival_gaps(config)
    assert gaps == arrival_gaps(config) and gaps[0] == 0.0
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 50, rel=0.1)  # Poisson at 50 req/s
    assert arrival_gaps(BenchConfig(url="http://x", num_prompts=3)) == [0.0, 0.0, 0.0]
    prompts = random_prompts(config, 512)
    assert prompts == random_prompts(config, 512)
    assert all(len(p) == 8 and all(0 <= t < 512 for t in p) for p in prompts)
    with pytest.raises(ValueError, match="request_rate"):
        BenchConfig(url="http://x", request_rate=0)


def test_summary_percentiles_pool_the_successful_requests():
    config = BenchConfig(url="http://x", num_prompts=10, request_rate=4.0, max_concurrency=2)
    results = [
        RequestResult(4, True, 3, ttft=0.1, e2el=0.5, itl=[0.1, 0.3]),
        RequestResult(4, True, 3, ttft=0.2, e2el=0.4, itl=[0.1, 0.1]),
        RequestResult(4, True, 1, ttft=0.6, e2el=0.6),  # one token: no TPOT
    ] + [RequestResult(4, False, itl=[0.5], error=f"OSError: {i}") for i in range(7)]
    report = summarize(config, results, duration=1.0)
    assert (report["completed"], report["failed"]) == (3, 7)
    assert (report["request_rate"], report["max_concurrency"]) == (4.0, 2)
    assert report["mean_ttft_ms"] == pytest.approx(300.0)
    assert report["median_ttft_ms"] == pytest.approx(200.0)
    assert report["mean_tpot_ms"] == pytest.approx(150.0)  # 200 and 100 ms
    # Every gap of every successful request (a failed one's are left out).
    assert report["mean_itl_ms"] == pytest.approx(150.0)
    assert report["median_itl_ms"] == pytest.approx(100.0)
    assert report["errors"] == [f"OSError: {i}" for i in range(5)]  # the first five, sorted
    empty = summarize(BenchConfig(url="http://x"), [], duration=1.0)
    assert empty["request_rate"] == "inf" and empty["completed"] == 0
    assert empty["mean_ttft_ms"] == empty["p99_e2el_ms"] == 0.0


@pytest.mark.parametrize(
    ("name", "value"),
    [("num_prompts", 0), ("input_len", 0), ("output_len", 0), ("num_turns", 0),
     ("burstiness", 0.0), ("burstiness", math.inf), ("max_concurrency", 0),
     ("ready_timeout_s", 0.0), ("url", "http://:8000")],
)  # fmt: skip
def test_config_rejects_values_out_of_range(name, value):
    with pytest.raises(ValueError, match=f"^{name}="):
        BenchConfig(**{"url": "http://x", name: value})


def test_config_takes_a_base_url_ending_in_v1():
    for url in ("http://x:8000/v1", "http://x:8000/v1/", "http://x:8000/"):
        assert BenchConfig(url=url).url == "http://x:8000"


def test_config_accepts_the_smallest_values():
    config = BenchConfig(
        url="https://x", num_prompts=1, input_len=1, output_len=1, num_turns=1,
        max_concurrency=1, burstiness=0.1, ready_timeout_s=0.1,
    )  # fmt: skip
    assert config.max_concurrency == 1


def test_burstiness_shapes_the_gaps_at_the_same_rate():
    config = BenchConfig(url="http://x", num_prompts=4000, request_rate=50.0, burstiness=4.0)
    gaps = arrival_gaps(config)[1:]
    mean = statistics.fmean(gaps)
    assert mean == pytest.approx(1 / 50, rel=0.05)
    # Gamma gaps of shape 4: a coefficient of variation of 1/2 (Poisson's is 1).
    assert statistics.pstdev(gaps) / mean == pytest.approx(0.5, rel=0.1)


class _Clock:
    """The bench module's ``time``: a fake stream sets ``now`` to each chunk's arrival."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


class _Stream:
    """A streamed response: ``(arrival, chunk)`` pairs, then ``error`` raised or the end."""

    def __init__(self, clock: _Clock, chunks: list, end: float, error=None) -> None:
        self.clock, self.chunks, self.end, self.error = clock, chunks, end, error

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc) -> None:
        return None

    async def __aiter__(self):
        for at, chunk in self.chunks:
            self.clock.now = at
            yield chunk
        if self.error is not None:
            raise self.error
        self.clock.now = self.end


class _OneStreamClient:
    def __init__(self, stream: _Stream) -> None:
        self.response, self.calls = stream, []

    def stream(self, prompt, **body):
        self.calls.append(("completions", prompt, body))
        return self.response

    def chat_stream(self, messages, **body):
        self.calls.append(("chat", messages, body))
        return self.response


def _usage(completion: int, prompt: int, cached: int = 0) -> dict:
    details = {"cached_tokens": cached}
    return {"choices": [], "usage": {"completion_tokens": completion, "prompt_tokens": prompt,
                                     "prompt_tokens_details": details}}  # fmt: skip


async def test_one_request_times_ttft_and_each_gap_between_chunks(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(serve_bench, "time", clock)
    chunks = [
        (t, {"choices": [{"text": "x", "token_ids": [i]}]}) for i, t in enumerate((0.1, 0.3, 0.6))
    ]
    client = _OneStreamClient(_Stream(clock, [*chunks, (0.65, _usage(3, 4, cached=2))], 0.7))
    config = BenchConfig(
        url="http://x", output_len=3, model="m", temperature=0.5, exit_threshold=0.7
    )
    result = await _one(client, config, [1, 2, 3, 4])
    assert result.success and result.error is None
    assert result.ttft == pytest.approx(0.1) and result.e2el == pytest.approx(0.7)
    assert result.itl == pytest.approx([0.2, 0.3])
    assert (result.output_tokens, result.prompt_len, result.cached_tokens) == (3, 4, 2)
    [(endpoint, prompt, body)] = client.calls
    assert (endpoint, prompt) == ("completions", [1, 2, 3, 4])
    assert body == {
        "max_tokens": 3, "temperature": 0.5, "ignore_eos": True, "model": "m",
        "exit_threshold": 0.7, "stream_options": {"include_usage": True},
    }  # fmt: skip


async def test_chat_ttft_starts_at_the_first_chunk_with_tokens(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(serve_bench, "time", clock)
    chunks = [
        (0.05, {"choices": [{"delta": {"role": "assistant"}}]}),
        (0.1, {"choices": [{"delta": {"content": "he"}, "token_ids": [5]}]}),
        (0.25, {"choices": [{"delta": {"content": "llo"}, "token_ids": [6]}]}),
        (0.3, _usage(2, 11)),
    ]
    client = _OneStreamClient(_Stream(clock, chunks, 0.3))
    config = BenchConfig(url="http://x", output_len=2, endpoint="chat")
    messages = [{"role": "user", "content": "hi"}]
    result = await _one(client, config, messages)
    assert result.ttft == pytest.approx(0.1) and result.itl == pytest.approx([0.15])
    assert (result.output_text, result.output_ids, result.prompt_len) == ("hello", [5, 6], 11)
    [(endpoint, sent, body)] = client.calls
    assert (endpoint, sent, body["return_token_ids"]) == ("chat", messages, True)


async def test_a_stream_that_breaks_after_a_token_fails_with_its_error(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(serve_bench, "time", clock)
    for error in (OSError("reset"), asyncio.TimeoutError()):
        token = (0.1, {"choices": [{"text": "x", "token_ids": [1]}]})
        client = _OneStreamClient(_Stream(clock, [token], 0.3, error))
        result = await _one(client, BenchConfig(url="http://x"), [1, 2, 3, 4])
        assert not result.success
        assert result.error == f"{type(error).__name__}: {error}"


async def test_a_request_that_streams_no_output_fails_saying_so(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(serve_bench, "time", clock)
    for endpoint, chunks in (
        ("completions", [(0.2, _usage(0, 4))]),
        ("chat", [(0.1, {"choices": [{"delta": {"role": "assistant", "content": ""}}]})]),
    ):
        client = _OneStreamClient(_Stream(clock, chunks, 0.3))
        result = await _one(client, BenchConfig(url="http://x", endpoint=endpoint), [1, 2])
        assert not result.success
        assert result.error == "no output: the stream carried no chunk with text or token_ids"


async def test_chat_without_token_ids_is_timed_by_its_text(monkeypatch):
    """Servers that send no per-chunk token_ids (older vLLM, SGLang, proxies): output chunks
    are those with content; without usage, each counts one token."""
    clock = _Clock()
    monkeypatch.setattr(serve_bench, "time", clock)
    chunks = [
        (0.05, {"choices": [{"delta": {"role": "assistant", "content": ""}}]}),
        (0.1, {"choices": [{"delta": {"content": "he"}}]}),
        (0.25, {"choices": [{"delta": {"content": "llo"}}]}),
        (0.3, {"choices": [{"delta": {}, "finish_reason": "length"}]}),
    ]
    client = _OneStreamClient(_Stream(clock, chunks, 0.4))
    result = await _one(client, BenchConfig(url="http://x", endpoint="chat"), [])
    assert result.success and result.error is None
    assert result.ttft == pytest.approx(0.1) and result.itl == pytest.approx([0.15])
    assert (result.output_text, result.output_ids, result.output_tokens) == ("hello", [], 2)


async def test_a_wait_timeout_below_the_first_probe_bounds_that_probe(monkeypatch, capsys):
    bounds, real_wait_for = [], asyncio.wait_for

    async def wait_for(awaitable, timeout):
        bounds.append(timeout)
        return await real_wait_for(awaitable, timeout)

    class Silent:  # a host that never answers
        async def health(self) -> bool:
            await asyncio.Event().wait()
            return True

        async def wait_ready(self, timeout: float, interval: float) -> None:
            raise APIConnectionError(None, "not ready")

    monkeypatch.setattr(asyncio, "wait_for", wait_for)
    config = BenchConfig(url="http://x", ready_timeout_s=0.05)
    with pytest.raises(serve_bench.ServerNotReadyError, match="after 0.05 s"):
        await serve_bench._wait_for_server(Silent(), config)
    assert bounds == [0.05, 0.05]
    assert "waiting up to 0.05 s for the server at http://x" in capsys.readouterr().err


class _FakeServer:
    """``AsyncClient`` for ``run_bench``: every stream answers ``tokens`` token chunks (handing
    the loop over between them) and its usage; records the prompts and the most streams open
    at once. A prompt longer than ``fail_above`` tokens breaks its stream; ``context``: the
    model card's max_model_len."""

    def __init__(self, tokens: int, fail_above: int | None = None, context: int | None = None):
        self.tokens, self.fail_above, self.context = tokens, fail_above, context
        self.prompts: list[list[int]] = []
        self.open = self.peak = 0

    def __call__(self, url, api_key=None, **kwargs):  # (stands in for the class)
        return self

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc) -> None:
        return None

    async def health(self) -> bool:
        return True

    async def models(self) -> list[dict]:
        card = {"id": "m", "vocab_size": 50}
        return [card if self.context is None else {**card, "max_model_len": self.context}]

    @contextlib.asynccontextmanager
    async def _opened(self):
        self.open += 1
        self.peak = max(self.peak, self.open)
        try:
            yield
        finally:
            self.open -= 1

    def stream(self, prompt, **body):
        self.prompts.append(list(prompt))
        server = self

        class Response:
            async def __aenter__(self):
                self._cm = server._opened()
                await self._cm.__aenter__()
                return self

            async def __aexit__(self, *exc):
                await self._cm.__aexit__(*exc)

            async def __aiter__(self):
                if server.fail_above is not None and len(prompt) > server.fail_above:
                    raise OSError("broken")
                for i in range(server.tokens):
                    await asyncio.sleep(0)
                    yield {"choices": [{"text": "x", "token_ids": [i]}]}
                yield _usage(server.tokens, len(prompt))

        return Response()


async def test_run_bench_keeps_at_most_max_concurrency_requests_in_flight(monkeypatch):
    server = _FakeServer(tokens=4)
    monkeypatch.setattr(serve_bench, "AsyncClient", server)
    config = BenchConfig(
        url="http://x", num_prompts=6, input_len=3, output_len=4, max_concurrency=2
    )
    report = await run_bench(config)
    assert report["completed"] == 6 and report["total_output_tokens"] == 24
    assert server.peak == 2
    # The seeded prompts, drawn from the vocabulary the model card gives.
    assert sorted(server.prompts) == sorted(random_prompts(config, 50))


async def test_run_bench_sends_at_the_seeded_arrival_gaps(monkeypatch):
    server = _FakeServer(tokens=2)
    monkeypatch.setattr(serve_bench, "AsyncClient", server)
    real_sleep, slept = asyncio.sleep, []

    async def sleep(seconds, *args):
        slept.append(seconds)
        await real_sleep(0)

    monkeypatch.setattr(asyncio, "sleep", sleep)
    config = BenchConfig(
        url="http://x", num_prompts=5, input_len=3, output_len=2, request_rate=20.0
    )
    report = await run_bench(config)
    assert report["completed"] == 5
    assert [s for s in slept if s > 0] == [g for g in arrival_gaps(config) if g > 0]


async def test_a_conversation_ends_at_its_first_failed_turn(monkeypatch):
    server = _FakeServer(tokens=2, fail_above=3)  # turn 2's prompt is longer: it fails
    monkeypatch.setattr(serve_bench, "AsyncClient", server)
    config = BenchConfig(url="http://x", num_prompts=2, input_len=3, output_len=2, num_turns=3)
    report = await run_bench(config)
    assert (report["completed"], report["failed"]) == (2, 2)
    assert report["errors"] == ["OSError: broken"]
    assert sorted(len(p) for p in server.prompts) == [3, 3, 3 + 2 + 3, 3 + 2 + 3]


async def test_a_conversation_stops_before_a_turn_past_the_servers_context(monkeypatch):
    server = _FakeServer(tokens=2, context=10)
    monkeypatch.setattr(serve_bench, "AsyncClient", server)
    config = BenchConfig(url="http://x", num_prompts=2, input_len=3, output_len=2, num_turns=3)
    report = await run_bench(config)
    # Turn prompts of 3 and 3 + 2 + 3 = 8 tokens (and 2 output tokens: 10, the context); turn
    # 3's 13 would not fit: not sent, nor counted as failed.
    assert sorted(len(p) for p in server.prompts) == [3, 3, 8, 8]
    counts = ("completed", "failed", "skipped_turns", "context_skipped_turns", "max_model_len")
    assert [report[key] for key in counts] == [4, 0, 2, 2, 10]
    lines = format_report(report).splitlines()
    assert f"{'Turns not sent (after a failed turn):':<45}{0:>15}" in lines
    assert f"{'Turns not sent (past max_model_len 10):':<45}{2:>15}" in lines
    # A server whose card gives no context: every turn is sent, and the line is left out.
    unbounded = _FakeServer(tokens=2)
    monkeypatch.setattr(serve_bench, "AsyncClient", unbounded)
    report = await run_bench(config)
    assert (report["completed"], report["max_model_len"]) == (6, None)
    assert "past max_model_len" not in format_report(report)


async def test_short_run_against_a_server(tmp_path_factory):
    ckpt = tiny_checkpoint(tmp_path_factory)
    stage = ScriptedStage(scripted_info(ckpt), Script([44, 77], interval_s=0.001))
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        config = BenchConfig(
            url=live.url, num_prompts=6, input_len=5, output_len=4, max_concurrency=2,
            request_rate=200.0,
        )  # fmt: skip
        report = await run_bench(config)
    assert report["completed"] == 6 and report["failed"] == 0
    assert report["total_output_tokens"] == 24 and report["total_input_tokens"] == 30
    assert report["mean_ttft_ms"] > 0 and report["mean_tpot_ms"] > 0
    assert report["mean_e2el_ms"] >= report["mean_ttft_ms"]


async def test_multi_turn_chat_reports_the_cache_hit_rate(tmp_path_factory):
    ckpt = tiny_checkpoint(tmp_path_factory)
    engine = {"block_size": 4, "num_blocks": 256}
    async with running(ckpt, engine=engine) as live:
        config = BenchConfig(
            url=live.url, num_prompts=2, input_len=5, output_len=3, num_turns=3,
        )  # fmt: skip
        report = await run_bench(config)
    assert report["completed"] == 6 and report["num_turns"] == 3
    # Turn prompts: 5, 5+3+5 = 13, 13+3+5 = 21 tokens; turns 2 and 3 reuse the full blocks
    # before their last token that the previous turn cached (its prompt: 1 and 3 blocks).
    assert report["total_input_tokens"] == 2 * (5 + 13 + 21)
    assert report["total_cached_tokens"] == 2 * (4 + 12)
    assert report["prefix_cache_hit_rate"] == pytest.approx(32 / 78)


async def test_a_chat_stops_before_a_turn_the_context_would_not_hold(tmp_path_factory):
    """Chat turns grow by the template's tokens too: the server's /tokenize of the messages
    says whether the next turn fits, so no turn is refused (a 400, counted as failed)."""
    ckpt = tiny_checkpoint(tmp_path_factory)
    engine = {"block_size": 4, "num_blocks": 256, "max_model_len": 64}
    async with running(ckpt, engine=engine) as live:
        config = BenchConfig(
            url=live.url, num_prompts=2, input_len=5, output_len=3, num_turns=8, endpoint="chat"
        )
        report = await run_bench(config)
    assert (report["failed"], report["errors"], report["max_model_len"]) == (0, [], 64)
    assert report["completed"] > 2 and report["context_skipped_turns"] > 0
    assert report["completed"] + report["context_skipped_turns"] == 2 * 8
    assert report["skipped_turns"] == report["context_skipped_turns"]


async def test_chat_endpoint_streams_messages(tmp_path_factory):
    """``endpoint="chat"``: the prompts as text in user messages, a conversation's answers as
    assistant messages; prompt lengths are the server's (the template's tokens included), and
    later turns hit the cache."""
    ckpt = tiny_checkpoint(tmp_path_factory)
    engine = {"block_size": 4, "num_blocks": 256}
    async with running(ckpt, engine=engine) as live:
        config = BenchConfig(
            url=live.url, num_prompts=2, input_len=5, output_len=3, num_turns=2, endpoint="chat"
        )
        report = await run_bench(config)
    assert report["completed"] == 4 and report["failed"] == 0
    assert report["total_output_tokens"] == 4 * 3
    assert report["total_input_tokens"] > 2 * (5 + 13)  # (the chat template's tokens)
    assert report["total_cached_tokens"] > 0 and report["mean_ttft_ms"] > 0
    with pytest.raises(ValueError, match="endpoint='rest'"):
        BenchConfig(url="http://x", endpoint="rest")


def _vllm_like(usage: bool, bodies: list[dict]) -> web.Application:
    """A stand-in shaped like vLLM's OpenAI server without per-chunk token ids: completion
    chunks carry ``text``, chat chunks ``delta.content`` (after a role chunk, before a finish
    chunk), usage last when asked for (``usage``); the model card has no vocab_size. Token id
    i is the text ``w{i} ``; every answer is ids 1, 2, ... ``max_tokens``."""

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "stand-in", "max_model_len": 4096}]})

    async def tokenize(request: web.Request) -> web.Response:
        tokens = [int(word[1:]) for word in (await request.json())["prompt"].split()]
        return web.json_response({"tokens": tokens, "count": len(tokens)})

    async def detokenize(request: web.Request) -> web.Response:
        text = "".join(f"w{i} " for i in (await request.json())["tokens"])
        return web.json_response({"prompt": text})

    async def generate(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        bodies.append(body)
        chat = "messages" in body
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)

        async def send(chunk: dict) -> None:
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await asyncio.sleep(0)

        if chat:
            await send({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        for i in range(1, body["max_tokens"] + 1):
            part = {"delta": {"content": f"w{i} "}} if chat else {"text": f"w{i} "}
            await send({"choices": [{"index": 0, **part, "finish_reason": None}]})
        await send({"choices": [{"index": 0, "delta": {}, "text": "", "finish_reason": "length"}]})
        if usage and body["stream_options"]["include_usage"]:
            prompt = body["messages"] if chat else body["prompt"]
            counts = {"prompt_tokens": len(prompt), "completion_tokens": body["max_tokens"]}
            await send({"choices": [], "usage": counts})
        await response.write(b"data: [DONE]\n\n")
        return response

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_post("/v1/completions", generate)
    app.router.add_post("/v1/chat/completions", generate)
    return app


@pytest.mark.parametrize("usage", [True, False], ids=["usage", "no-usage"])
async def test_multi_turn_completions_against_a_server_that_sends_no_token_ids(usage):
    bodies: list[dict] = []
    async with serve(_vllm_like(usage, bodies)) as url:
        config = BenchConfig(url=f"{url}/v1", num_prompts=2, input_len=3, output_len=2, num_turns=2)
        report = await run_bench(config)
    assert (report["completed"], report["failed"], report["errors"]) == (4, 0, [])
    assert report["total_output_tokens"] == 4 * 2
    assert (report["url"], report["model"]) == (url, "stand-in")
    second = [b["prompt"] for b in bodies if len(b["prompt"]) > 3]
    # Turn 2: turn 1's prompt + the answer's ids (the server's /tokenize of its text) + 3 new.
    assert len(second) == 2 and all(len(p) == 3 + 2 + 3 and p[3:5] == [1, 2] for p in second)
    firsts = [b["prompt"] for b in bodies if len(b["prompt"]) == 3]
    assert sorted(p[:3] for p in second) == sorted(firsts)


async def test_multi_turn_chat_against_a_server_that_sends_no_token_ids():
    bodies: list[dict] = []
    async with serve(_vllm_like(True, bodies)) as url:
        config = BenchConfig(
            url=url, num_prompts=2, input_len=3, output_len=2, num_turns=2, endpoint="chat"
        )
        report = await run_bench(config)
    assert (report["completed"], report["failed"], report["errors"]) == (4, 0, [])
    assert report["total_output_tokens"] == 4 * 2
    second = [b["messages"] for b in bodies if len(b["messages"]) > 1]
    assert len(second) == 2
    for messages in second:  # the answer's text goes back as the assistant's message
        assert [m["role"] for m in messages] == ["user", "assistant", "user"]
        assert messages[1]["content"] == "w1 w2 "


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rltserve")
    sub = parser.add_subparsers(dest="command")
    add_serve_parser(sub)
    bench = sub.add_parser("bench").add_subparsers(dest="bench_command")
    add_bench_serve_parser(bench)
    return parser


def test_serve_flags_come_from_server_config(monkeypatch):
    args = _parser().parse_args(
        ["serve", "--port", "0", "--max-concurrent", "8", "--served-model-name", "m",
         "--max-num-seqs", "4"]
    )  # fmt: skip
    config = ServerConfig(**dataclass_kwargs(args, ServerConfig))
    assert (config.port, config.max_concurrent, config.served_model_name) == (0, 8, "m")
    assert config.max_queued == ServerConfig().max_queued  # unset flags keep the defaults
    assert args.max_num_seqs == 4  # engine flags ride along
    monkeypatch.setenv("RLTSERVE_API_KEY", "from-env")
    assert config.with_env().api_key == "from-env"
    with pytest.raises(ValueError, match="ssl_certfile"):
        ServerConfig(ssl_certfile="cert.pem")
    with pytest.raises(ValueError, match="max_concurrent"):
        ServerConfig(max_concurrent=0)


def test_bench_serve_flags():
    args = _parser().parse_args(
        ["bench", "serve", "--num-prompts", "5", "--request-rate", "inf", "--json"]
    )
    assert args.num_prompts == 5 and math.isinf(args.request_rate) and args.json
    assert args.endpoint == "completions"
    from rltserve.bench.serve import ENDPOINTS

    for endpoint in ENDPOINTS:  # (the flag spells out the config's choices)
        assert _parser().parse_args(["bench", "serve", "--endpoint", endpoint]).endpoint == endpoint
    with pytest.raises(SystemExit):
        _parser().parse_args(["bench", "serve", "--endpoint", "rest"])


def test_serve_takes_the_api_key_from_the_environment_unless_a_flag_gives_one(monkeypatch):
    monkeypatch.setenv("RLTSERVE_API_KEY", "from-env")
    server, engine = serve_configs(_parser().parse_args(["serve", "--max-num-seqs", "4"]))
    assert server.api_key == "from-env" and engine.scheduler.max_num_seqs == 4
    server, _ = serve_configs(_parser().parse_args(["serve", "--api-key", "flag"]))
    assert server.api_key == "flag"


def test_serve_takes_default_template_variables_as_vllm_spells_the_flag():
    flags = ["serve", "--default-chat-template-kwargs", '{"enable_thinking": true}']
    server, _ = serve_configs(_parser().parse_args(flags))
    assert server.template_defaults == {"enable_thinking": True}
    with pytest.raises(ValueError, match="^default_chat_template_kwargs: not JSON"):
        serve_configs(_parser().parse_args(["serve", "--default-chat-template-kwargs", "x"]))


def test_serve_on_a_reachable_host_without_a_key_warns(monkeypatch, caplog):
    """Anyone who reaches such a server may load weights or put it to sleep: say so once."""
    import rltserve.http.server
    from rltserve.http.cli import cmd_serve

    monkeypatch.delenv("RLTSERVE_API_KEY", raising=False)
    monkeypatch.setattr(rltserve.http.server, "run_server", lambda *a: 0)
    monkeypatch.setattr("rltserve.preflight.check_listen_address", lambda *a: None)
    for flags, warned in (
        (["--host", "0.0.0.0"], True),
        (["--host", "0.0.0.0", "--api-key", "k"], False),
        ([], False),  # (127.0.0.1: this machine only)
    ):
        caplog.clear()
        assert cmd_serve(_parser().parse_args(["serve", "--port", "0", *flags])) == 0
        said = [r for r in caplog.records if "without an API key" in r.getMessage()]
        assert len(said) == int(warned), flags


def test_bench_serve_targets_where_serve_listens_by_default():
    args = _parser().parse_args(["bench", "serve"])
    server = ServerConfig()
    assert args.url == f"http://{server.host}:{server.port}"
    assert math.isinf(args.request_rate) and args.num_turns == 1
    assert _parser().parse_args(["serve"]).log_level == "info"


def _bench_args(*flags: str) -> argparse.Namespace:
    return _parser().parse_args(["bench", "serve", "--json", "--quiet", *flags])


def test_bench_serve_flags_reach_the_benchmark(monkeypatch, capsys):
    seen = []

    async def fake_run_bench(config):
        seen.append(config)
        return {"completed": 3}

    monkeypatch.setattr("rltserve.bench.serve.run_bench", fake_run_bench)
    monkeypatch.setenv("RLTSERVE_API_KEY", "from-env")
    flags = ["--input-len", "3", "--output-len", "5", "--num-turns", "2", "--wait-timeout", "7",
             "--seed", "9", "--max-concurrency", "2"]  # fmt: skip
    assert cmd_bench_serve(_bench_args(*flags)) == 0
    [config] = seen
    assert (config.input_len, config.output_len, config.num_turns) == (3, 5, 2)
    assert (config.ready_timeout_s, config.seed, config.max_concurrency) == (7.0, 9, 2)
    assert config.api_key == "from-env" and math.isinf(config.request_rate)
    assert config.progress is False
    assert capsys.readouterr().out.strip() == '{\n  "completed": 3\n}'
    assert cmd_bench_serve(_bench_args("--api-key", "flag")) == 0
    assert seen[-1].api_key == "flag"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--num-prompts", "0"], "--num-prompts 0: must be >= 1"),
        (["--output-len", "0"], "--output-len 0: must be >= 1"),
        (["--max-concurrency", "0"], "--max-concurrency 0: must be >= 1"),
        (["--request-rate", "0"], "--request-rate 0: must be > 0 (or inf)"),
        (["--burstiness", "inf"], "--burstiness inf: must be a finite number > 0"),
        (["--wait-timeout", "0"], "--wait-timeout 0: must be > 0"),
    ],
)
def test_bench_serve_names_the_flag_of_a_bad_value_before_connecting(monkeypatch, flags, message):
    async def connects(config):
        raise AssertionError("the benchmark started")

    monkeypatch.setattr("rltserve.bench.serve.run_bench", connects)
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        cmd_bench_serve(_bench_args(*flags))


def test_bench_serve_fails_when_nothing_completed_or_the_server_refuses(monkeypatch):
    async def nothing_completed(config):
        return {"completed": 0}

    monkeypatch.setattr("rltserve.bench.serve.run_bench", nothing_completed)
    assert cmd_bench_serve(_bench_args()) == 1

    async def refused(config):
        raise APIError(401, "invalid API key")

    monkeypatch.setattr("rltserve.bench.serve.run_bench", refused)
    with pytest.raises(RuntimeError, match=r"^http://127.0.0.1:8000: .*invalid API key"):
        cmd_bench_serve(_bench_args())
