"""``rltserve bench serve``: its requests and conversations against fake servers (timing,
concurrency, offsets, failures). Metric definitions and arrivals: test_bench_serve_summary;
runs against live servers: test_bench_serve_live; the parsers: test_http_cli."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from rltserve.bench import serve as serve_bench
from rltserve.bench.serve import (
    BenchConfig,
    _one,
    arrival_offsets,
    format_report,
    random_prompts,
    run_bench,
)
from rltserve.client import APIConnectionError


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
    assert body == {  # (no ignore_eos: vLLM's sends it with --ignore-eos alone)
        "max_tokens": 3, "temperature": 0.5, "model": "m",
        "exit_threshold": 0.7, "stream_options": {"include_usage": True},
    }  # fmt: skip


def test_a_body_adds_the_sampling_fields_given_then_the_extra_body():
    config = BenchConfig(
        url="http://x", output_len=3, ignore_eos=True, top_p=0.9, top_k=5, min_p=0.1,
        extra_body={"max_loops": 4, "temperature": 1.0, "seed": 7},
    )  # fmt: skip
    assert serve_bench.request_body(config, 9) == {
        "max_tokens": 9, "temperature": 1.0, "stream_options": {"include_usage": True},
        "ignore_eos": True, "top_p": 0.9, "top_k": 5, "min_p": 0.1, "max_loops": 4, "seed": 7,
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


async def test_a_first_token_that_ends_the_request_is_its_output_not_a_failure(monkeypatch):
    """A first token that is an end or stop token streams one closing chunk without text
    (usage counts the token): vLLM's bench times it as a success; it was a failure here, so
    the completed and output token counts fell short of the server's."""
    clock = _Clock()
    monkeypatch.setattr(serve_bench, "time", clock)
    for endpoint, closing in (
        ("completions", {"choices": [{"text": "", "finish_reason": "stop"}]}),
        ("chat", {"choices": [{"delta": {}, "finish_reason": "stop"}]}),
    ):
        clock.now = 0.0
        role = (0.05, {"choices": [{"delta": {"role": "assistant", "content": ""}}]})
        chunks = [role] * (endpoint == "chat") + [(0.2, closing), (0.25, _usage(1, 4))]
        client = _OneStreamClient(_Stream(clock, chunks, 0.3))
        result = await _one(client, BenchConfig(url="http://x", endpoint=endpoint), [1, 2])
        assert result.success and result.error is None, endpoint
        assert result.ttft == pytest.approx(0.2) and result.itl == []
        assert (result.output_tokens, result.output_text) == (1, "")
    # ... but a request the server aborted before any output failed
    clock.now = 0.0
    chunks = [(0.2, {"choices": [{"text": "", "finish_reason": "abort"}]})]
    result = await _one(
        _OneStreamClient(_Stream(clock, chunks, 0.3)), BenchConfig(url="http://x"), [1]
    )
    assert not result.success and result.error.startswith("no output")


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


async def test_run_bench_sends_each_request_at_its_offset_from_the_start(monkeypatch):
    """Each wait counts from the start, so a late wake-up delays one request, not the rest."""
    server, clock = _FakeServer(tokens=2), _Clock()
    sent: list[float] = []
    stream = server.stream

    def timed_stream(prompt, **body):
        sent.append(clock.now)
        return stream(prompt, **body)

    server.stream = timed_stream
    real_sleep = asyncio.sleep

    async def sleep(seconds, *args):
        await real_sleep(0)  # (the requests sent so far start, at the clock's time)
        if seconds > 0:
            clock.now += seconds + 0.01  # every wait wakes 10 ms late

    monkeypatch.setattr(serve_bench, "AsyncClient", server)
    monkeypatch.setattr(serve_bench, "time", clock)
    monkeypatch.setattr(asyncio, "sleep", sleep)
    config = BenchConfig(
        url="http://x", num_prompts=5, input_len=3, output_len=2, request_rate=20.0
    )
    report = await run_bench(config)
    assert report["completed"] == 5
    assert sent == pytest.approx([offset + 0.01 for offset in arrival_offsets(config)])


async def test_send_at_waits_for_the_rest_of_the_offset_or_not_at_all(monkeypatch):
    clock, slept = _Clock(), []

    async def sleep(seconds, *args):
        slept.append(seconds)

    monkeypatch.setattr(serve_bench, "time", clock)
    monkeypatch.setattr(asyncio, "sleep", sleep)
    clock.now = 5.0
    await serve_bench.send_at(2.0, 4.0)  # due at 6.0
    await serve_bench.send_at(2.0, 2.5)  # past due
    assert slept == [1.0]


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
