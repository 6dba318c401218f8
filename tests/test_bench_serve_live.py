"""``rltserve bench serve`` against running servers: an rltserve server on a scripted stage
(a short run, multi-turn chat and its prefix cache hit rate, turns the context would not hold,
the chat endpoint) and a vLLM-like server that streams text without token ids."""

from __future__ import annotations

import asyncio
import json

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

from rltserve.bench.serve import BenchConfig, run_bench


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


def _vllm_like(usage: bool, bodies: list[dict], thinking: int = 0) -> web.Application:
    """A stand-in shaped like vLLM's OpenAI server without per-chunk token ids: completion
    chunks carry ``text``, chat chunks ``delta.content`` (after a role chunk, before a finish
    chunk; the first ``thinking`` as ``delta.reasoning_content``, a reasoning parser's),
    usage last when asked for (``usage``); the model card has no vocab_size. Token id i is the
    text ``w{i} ``; every answer is ids 1, 2, ... ``max_tokens``."""

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
            key = "reasoning_content" if i <= thinking else "content"
            part = {"delta": {key: f"w{i} "}} if chat else {"text": f"w{i} "}
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


async def test_chat_reasoning_deltas_are_output_but_not_the_answer():
    bodies: list[dict] = []
    async with serve(_vllm_like(False, bodies, thinking=2)) as url:
        config = BenchConfig(
            url=url, num_prompts=2, input_len=3, output_len=3, num_turns=2, endpoint="chat"
        )
        report = await run_bench(config)
    assert (report["completed"], report["failed"], report["errors"]) == (4, 0, [])
    # Without usage, one token per chunk with output: the thinking chunks count (and time the
    # first token); the next turn sends back the answer alone.
    assert report["total_output_tokens"] == 4 * 3
    second = [b["messages"] for b in bodies if len(b["messages"]) > 1]
    assert len(second) == 2 and all(m[1]["content"] == "w3 " for m in second)
