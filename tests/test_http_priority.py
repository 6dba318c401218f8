"""Request priority and preemption over HTTP.

- ``priority`` on /v1/completions and /v1/chat/completions: a value that is not a JSON integer
  is a 400 naming the field (and the server keeps serving); ``null`` is the default, 0; an
  integer reaches the engine's SamplingParams.
- End to end on the real engine (ouro-tiny, one seat): a later, better-priority request is
  served before an earlier waiting one under ``scheduling_policy="priority"``; ``"fcfs"``
  refuses a priority other than 0 (a 400 naming the field).
- ``/metrics`` after real KV-pressure preemption (recompute and swap): the preemption counter
  moved, the running/waiting/KV/swap gauges are back to 0, and the outputs equal unpressured
  ones.
"""

from __future__ import annotations

import asyncio

import orjson
import pytest
from test_http_harness import (
    Script,
    ScriptedStage,
    metric,
    running,
    scripted_factory,
    scripted_info,
    tiny_checkpoint,
    wait_for,
)

from rltserve.core.stage import InProcessStageClient
from rltserve.http.schemas import ChatCompletionRequest, sampling_params
from rltserve.http.validation import parse_object

ENDPOINTS = {
    "/v1/completions": {"prompt": [5, 6], "max_tokens": 2},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
}
NUM_LOOPS = 4  # ouro-tiny's; with kv_policy last_exited a request's KV has one plane per loop


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory)


class StatsHistory(InProcessStageClient):
    """The real in-process stage; keeps every EngineStats snapshot it sends, not just the last."""

    def __init__(self, config) -> None:
        self.history = []
        super().__init__(config)

    @property
    def stats(self):
        return self.history[-1] if self.history else None

    @stats.setter
    def stats(self, value) -> None:
        if value is not None:
            self.history.append(value)


# ---------------------------------------------------------------- the request field


@pytest.mark.parametrize("path", list(ENDPOINTS))
async def test_priority_field_is_validated_and_reaches_the_engine(ckpt, path):
    stage = ScriptedStage(scripted_info(ckpt), Script([44]))
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        for bad in ("1", 1.5, True, [1], {"p": 1}):
            status, _, raw = await live.post(path, {**ENDPOINTS[path], "priority": bad})
            assert status == 400, (bad, raw)
            error = orjson.loads(raw)["error"]
            assert error["param"] == "priority" and "priority" in error["message"], error
            assert error["type"] == "invalid_request_error" and error["code"] == 400
        assert stage.added_params == []  # nothing reached the engine
        for value, want in ((None, 0), (-3, -3), (0, 0), (7, 7)):  # null: the default
            status, _, raw = await live.post(path, {**ENDPOINTS[path], "priority": value})
            assert status == 200, raw
            assert stage.added_params[-1].priority == want
        status, _, raw = await live.post(path, ENDPOINTS[path])  # absent: the default too
        assert status == 200 and stage.added_params[-1].priority == 0


def test_chat_request_to_sampling_params_keeps_priority():
    body = {**ENDPOINTS["/v1/chat/completions"], "priority": -2, "seed": 3}
    req = parse_object(ChatCompletionRequest, body)
    params = sampling_params(req, max_tokens=4, logprobs=None, sample_index=1)
    assert params.priority == -2 and params.seed == 4 and params.max_tokens == 4
    default = parse_object(ChatCompletionRequest, {**body, "priority": None})
    assert sampling_params(default, max_tokens=4, logprobs=None, sample_index=0).priority == 0


async def test_fcfs_refuses_a_priority_it_would_ignore(ckpt):
    async with running(ckpt, engine={"scheduling_policy": "fcfs"}) as live:
        for path in ENDPOINTS:
            status, _, raw = await live.post(path, {**ENDPOINTS[path], "priority": 5})
            assert status == 400, raw
            assert orjson.loads(raw)["error"] == {
                "message": "priority=5: priority scheduling is not enabled (this engine runs "
                "scheduling_policy='fcfs'; start it with scheduling_policy='priority')",
                "type": "invalid_request_error",
                "param": "priority",
                "code": 400,
            }
            status, _, raw = await live.post(path, {**ENDPOINTS[path], "priority": 0})
            assert status == 200, raw
        assert live.state.client.stats.num_running == live.state.client.stats.num_waiting == 0


# ---------------------------------------------------------------- priority orders work


async def test_better_priority_overtakes_an_earlier_waiting_request(ckpt):
    """One seat. A (priority 0, long) runs; B (priority 5, completions) and then C (priority 1,
    chat) queue behind it, neither better than A, so nothing is preempted. Once both wait in
    the engine A's client goes away: the freed seat goes to C first. Every step is gated on
    engine state, none on timing."""
    engine = {"scheduling_policy": "priority", "max_num_seqs": 1}
    async with running(ckpt, engine=engine) as live:
        stats = lambda: live.state.client.stats  # noqa: E731
        done: list[str] = []

        async def send(name: str, path: str, priority: int) -> dict:
            body = {**ENDPOINTS[path], "priority": priority, "ignore_eos": True}
            status, _, raw = await live.post(path, body)
            assert status == 200, raw
            done.append(name)
            return orjson.loads(raw)

        long = {"prompt": [7, 8], "max_tokens": 1500, "ignore_eos": True, "stream": True}
        async with live.stream("/v1/completions", {**long, "priority": 0}) as a:
            await a.content.readuntil(b"\n\n")  # A has produced a token: it holds the seat
            b = asyncio.create_task(send("B", "/v1/completions", 5))
            await wait_for(lambda: stats().num_waiting == 1)
            c = asyncio.create_task(send("C", "/v1/chat/completions", 1))
            await wait_for(lambda: stats().num_waiting == 2)
            assert stats().num_running == 1 and not done
            a.close()  # the client goes away: A is aborted and frees its seat
        results = await asyncio.gather(b, c)
        assert "".join(done) == "CB"
        assert [r["usage"]["completion_tokens"] for r in results] == [2, 2]
        text = (await live.get("/metrics"))[2].decode()
        assert metric(text, "rltserve:num_preemptions_total") == 0


async def test_better_priority_arrival_preempts_the_running_request(ckpt):
    """One seat, priority policy: C (priority 0) arrives while A (priority 5, 1500 tokens:
    minutes on CPU) runs; A is preempted, not ended, and C is served. (Under fcfs C would
    wait for A's end: the timeout.)"""
    engine = {"scheduling_policy": "priority", "max_num_seqs": 1}
    async with running(ckpt, engine=engine) as live:
        client = live.state.client
        long = {"prompt": [7, 8], "max_tokens": 1500, "ignore_eos": True, "stream": True}
        async with live.stream("/v1/completions", {**long, "priority": 5}) as a:
            await a.content.readuntil(b"\n\n")
            body = {**ENDPOINTS["/v1/completions"], "priority": 0, "ignore_eos": True}
            status, _, raw = await asyncio.wait_for(live.post("/v1/completions", body), 10)
            assert status == 200 and orjson.loads(raw)["usage"]["completion_tokens"] == 2
            assert client.stats.num_running + client.stats.num_waiting == 1  # A is still on
            text = (await live.get("/metrics"))[2].decode()
            assert metric(text, "rltserve:num_preemptions_total") >= 1
            a.close()
        await wait_for(lambda: client.stats.num_running == client.stats.num_waiting == 0)
        assert client.stats.kv_usage == 0


# ---------------------------------------------------------------- metrics under preemption

PROMPTS = [[11, 12, 13], [40, 41, 42, 43, 44], [300, 301], [7, 8, 9, 10]]
MAX_TOKENS = 10
IDLE_GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
               "num_requests_swapped", "num_requests_recomputing", "swapped_bytes")  # fmt: skip


def tight_blocks(block_size: int = 4) -> int:
    """The blocks the largest request needs alone, plus two (``test_preemption._tight_blocks``):
    every request fits by itself, together they are preempted again and again."""
    tokens = max(len(p) for p in PROMPTS) + MAX_TOKENS - 1  # the last token writes no KV
    return -(-tokens // block_size) * NUM_LOOPS + 2


@pytest.mark.parametrize("mode", ["recompute", "swap"])
async def test_metrics_after_preemption(ckpt, mode):
    engine = {
        "block_size": 4,
        "num_blocks": tight_blocks(),
        "kv_watermark": 0.0,
        "preemption_mode": mode,
    }
    stages: list[StatsHistory] = []

    def factory(config) -> StatsHistory:
        stages.append(StatsHistory(config))
        return stages[-1]

    async with running(ckpt, client_factory=factory, engine=engine) as live:

        async def complete(prompt: list[int]) -> dict:
            body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "min_tokens": MAX_TOKENS,
                    "temperature": 0, "return_token_ids": True}  # fmt: skip
            status, _, raw = await live.post("/v1/completions", body)
            assert status == 200, raw
            (choice,) = orjson.loads(raw)["choices"]
            assert choice["finish_reason"] == "length"
            return choice

        together = await asyncio.gather(*(complete(p) for p in PROMPTS))
        client = live.state.client
        await wait_for(lambda: client.stats.num_running == client.stats.num_waiting == 0)
        text = (await live.get("/metrics"))[2].decode()
        assert metric(text, "rltserve:num_preemptions_total") > 0
        for gauge in IDLE_GAUGES:
            assert metric(text, f"rltserve:{gauge}") == 0, gauge
        # Every snapshot the stage sent: the mode's own kind of preemption happened.
        (stage,) = stages
        history = stage.history
        assert metric(text, "rltserve:num_preemptions_total") == history[-1].num_preemptions
        swapped = max(s.swapped_bytes for s in history)
        recomputing = max(s.num_recomputing for s in history)
        if mode == "swap":
            assert swapped > 0 and max(s.num_swapped for s in history) > 0
            assert metric(text, "rltserve:swap_fallbacks_total") == 0  # (4 GiB of swap space)
        else:
            assert swapped == 0 and recomputing > 0
        # One at a time nothing is preempted: the same tokens.
        alone = [await complete(p) for p in PROMPTS]
        assert [c["token_ids"] for c in together] == [c["token_ids"] for c in alone]
