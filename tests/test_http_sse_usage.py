"""Streams' running usage and failures across batches of updates, with a stage that plays
hand-made turns of updates (``TurnStage``): usage per chunk, cached prompt tokens for every
sample, echo alone, and a choice failing mid-stream. Exact bytes: ``test_http_sse.py``."""

from __future__ import annotations

import asyncio

import pytest
from test_http_harness import (
    RewritingStage,
    Script,
    ScriptedStage,
    first_updates,
    hi_token_ids,
    running,
    scripted_factory,
    scripted_info,
    sse_payloads,
    stage_for,
    tiny_checkpoint,
)

from rltserve.core.request import FinishReason
from rltserve.updates import RequestUpdate


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def hi_tokens(ckpt) -> list[int]:
    return hi_token_ids(ckpt)


async def test_stream_usage_reports_cached_prompt_tokens(ckpt, hi_tokens):
    """Prompt tokens the engine reused (``num_cached_tokens``, on a request's first update) are
    in every usage object of a stream, the running totals and the final chunk alike; the stream
    is marked uncacheable and unbuffered for proxies."""

    def cached(update: RequestUpdate) -> None:
        update.num_cached_tokens = 2

    stage = RewritingStage(scripted_info(ckpt), Script(hi_tokens), first_updates(cached))
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = {"prompt": [5, 6, 7], "max_tokens": 2, "stream": True, "stream_options": options}
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        status, headers, raw = await live.post("/v1/completions", body)
    assert status == 200
    assert headers["Cache-Control"] == "no-cache" and headers["X-Accel-Buffering"] == "no"
    head = b'data: {"id":"cmpl-test","object":"text_completion","created":1730000000,'
    details = b'"prompt_tokens_details":{"cached_tokens":2}}}\n\n'
    assert raw == (
        head + b'"model":"tiny","choices":[{"index":0,"text":" ","logprobs":null,'
        b'"finish_reason":null}],'
        b'"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4,' + details
        + head + b'"model":"tiny","choices":[{"index":0,"text":"H","logprobs":null,'
        b'"finish_reason":"length","stop_reason":null}],'
        b'"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5,'
        b'"prompt_tokens_details":{"cached_tokens":2}},"metadata":{"weight_version":"0"}}\n\n'
        + head + b'"model":"tiny","choices":[],'
        b'"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5,' + details
        + b"data: [DONE]\n\n"
    )  # fmt: skip


class TurnStage(ScriptedStage):
    """Plays ``turns`` of updates once ``count`` requests are in: turn 0 at once, the others
    when the test calls ``play``. A turn is ``(k, RequestUpdate fields)`` pairs for the k-th
    request added; its updates reach the server in one event-loop turn, hence one batch."""

    def __init__(self, info, count: int, turns: list[list[tuple[int, dict]]]) -> None:
        super().__init__(info, Script([0]))
        self.count, self.turns = count, turns
        self.sinks: dict = {}

    def add_request(self, request_id, prompt_token_ids, params, sink, group=None) -> None:
        self.added.append(request_id)  # (on the event loop: the frontend adds from there)
        self.sinks[request_id] = sink
        if len(self.sinks) == self.count:
            self.play(0)

    def play(self, turn: int) -> None:
        ids = list(self.sinks)
        for k, fields in self.turns[turn]:
            self.sinks[ids[k]](RequestUpdate(ids[k], **fields))


def token(token_id: int, depth: int, **fields) -> dict:
    return {"new_token_ids": [token_id], "new_exit_depths": [depth], "new_logprobs": [-0.5],
            "new_top_logprobs": [[]], **fields}  # fmt: skip


async def test_a_failure_mid_stream_keeps_the_tokens_of_its_batch(ckpt, hi_tokens):
    """A choice failing after the stream started: the other choice's text that arrived with
    the failure is still sent, then the error event and [DONE]; the unfinished choice is
    aborted."""
    h, i = hi_tokens[1:3]
    failed = {"finish_reason": FinishReason.ERROR, "error": "RuntimeError: step failed"}
    stage = TurnStage(scripted_info(ckpt), 2, [[(0, token(h, 1))], [(0, token(i, 2)), (1, failed)]])
    body = {"prompt": [5], "n": 2, "max_tokens": 4, "stream": True}
    async with (
        running(ckpt, client_factory=scripted_factory(stage)) as live,
        live.stream("/v1/completions", body) as r,
    ):
        assert r.status == 200
        first = await asyncio.wait_for(r.content.readuntil(b"\n\n"), 10)
        stage.play(1)
        events = sse_payloads(first + await asyncio.wait_for(r.content.read(), 10))
    assert [(e["choices"][0]["index"], e["choices"][0]["text"]) for e in events[:-2]] == [
        (0, "H"),
        (0, "i"),
    ]
    assert events[-2]["error"]["message"] == "RuntimeError: step failed"
    assert events[-1] == "[DONE]"
    assert stage.aborted == stage.added[:1]


async def test_echo_alone_running_usage_counts_no_tokens(ckpt, hi_tokens):
    """echo with max_tokens=0 and n=2, both choices' (dropped) tokens in one batch: every
    running usage counts 0 completion tokens."""
    done = token(hi_tokens[1], 1, finish_reason=FinishReason.LENGTH)
    stage = TurnStage(scripted_info(ckpt), 2, [[(0, done), (1, done)]])
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = {"prompt": [5], "n": 2, "max_tokens": 0, "echo": True, "stream": True,
            "stream_options": options}  # fmt: skip
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        status, _, raw = await live.post("/v1/completions", body)
    assert status == 200
    events = sse_payloads(raw)[:-1]
    assert [len(e["choices"]) for e in events] == [1, 1, 0]
    assert all(e["usage"]["completion_tokens"] == 0 for e in events), events


async def test_running_usage_is_each_chunks_choice_so_far(ckpt, hi_tokens):
    """``continuous_usage_stats`` counts, as vLLM does, the chunk's own choice: its prompt and
    its tokens so far (not the request's running total); a chat's role chunk has none yet."""
    stage = stage_for(ckpt, hi_tokens)
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = {"prompt": [[5], [6, 7]], "max_tokens": 2, "stream": True, "stream_options": options}
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "n": 2,
            "stream": True, "stream_options": options}  # fmt: skip
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        _, _, raw = await live.post("/v1/completions", body)
        _, _, chat_raw = await live.post("/v1/chat/completions", chat)
    events = sse_payloads(raw)[:-1]
    seen = sorted(
        (e["choices"][0]["index"], e["usage"]["prompt_tokens"], e["usage"]["completion_tokens"])
        for e in events[:-1]
    )
    assert seen == [(0, 1, 1), (0, 1, 2), (1, 2, 1), (1, 2, 2)]
    assert events[-1]["usage"]["prompt_tokens"] == 3  # the final chunk: the whole request
    assert events[-1]["usage"]["completion_tokens"] == 4
    chunks = sse_payloads(chat_raw)[:-1]
    prompt = chunks[-1]["usage"]["prompt_tokens"]
    per_choice: dict[int, list] = {}
    for c in chunks[:-1]:
        (choice,) = c["choices"]
        assert c["usage"]["prompt_tokens"] == prompt
        per_choice.setdefault(choice["index"], []).append(c["usage"]["completion_tokens"])
    assert per_choice == {0: [0, 1, 2], 1: [0, 1, 2]}  # role chunk, then each token
    assert chunks[-1]["usage"]["completion_tokens"] == 4


async def test_running_usage_reports_the_prompts_cached_tokens_for_every_sample(ckpt, hi_tokens):
    """With n > 1 a later sample reuses blocks an earlier one computed; the running usage of
    every chunk reports the request's figure for the prompt (the fewest its samples found
    cached, as the final usage), not each sample's own."""
    seen: list[str] = []

    def cached(update: RequestUpdate) -> None:
        seen.append(update.request_id)
        update.num_cached_tokens = 2 if len(seen) == 1 else 3

    stage = RewritingStage(scripted_info(ckpt), Script(hi_tokens), first_updates(cached))
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = {"prompt": [5, 6, 7], "n": 2, "max_tokens": 2, "stream": True,
            "stream_options": options}  # fmt: skip
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        status, _, raw = await live.post("/v1/completions", body)
    assert status == 200
    events = sse_payloads(raw)[:-1]  # ([DONE])
    assert len(seen) == 2 and [len(e["choices"]) for e in events] == [1, 1, 1, 1, 0]
    details = [e["usage"]["prompt_tokens_details"] for e in events]
    assert details == [{"cached_tokens": 2}] * 5


async def test_force_include_usage_ends_every_stream_with_usage(ckpt, hi_tokens):
    """``enable_force_include_usage`` (vLLM's): a stream that sent no stream_options ends with
    the usage chunk as if it had asked for it (its other chunks carry ``usage: null``, as
    with include_usage); one that asks for continuous usage gets that too."""
    stage = stage_for(ckpt, hi_tokens)
    body = {"prompt": [5, 6], "max_tokens": 2, "stream": True}
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "stream": True}
    continuous = {**body, "stream_options": {"continuous_usage_stats": True}}
    async with running(
        ckpt, client_factory=scripted_factory(stage), enable_force_include_usage=True
    ) as live:
        _, _, raw = await live.post("/v1/completions", body)
        _, _, chat_raw = await live.post("/v1/chat/completions", chat)
        _, _, continuous_raw = await live.post("/v1/completions", continuous)
    for events in (sse_payloads(raw), sse_payloads(chat_raw)):
        assert events[-1] == "[DONE]"
        final = events[-2]
        assert final["choices"] == [] and final["usage"]["completion_tokens"] == 2
        assert all(e["usage"] is None for e in events[:-2])
    assert sse_payloads(raw)[-2]["usage"] == {
        "prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4
    }  # fmt: skip
    events = sse_payloads(continuous_raw)[:-1]
    assert [e["usage"]["completion_tokens"] for e in events] == [1, 2, 2]
    async with running(ckpt, client_factory=scripted_factory(stage_for(ckpt, hi_tokens))) as live:
        _, _, raw = await live.post("/v1/completions", body)
    assert all("usage" not in e for e in sse_payloads(raw)[:-1])  # (without the flag)


async def test_a_stream_ends_with_the_weight_version_of_its_tokens(ckpt, hi_tokens):
    """The chunk that ends a stream's last choice carries ``metadata.weight_version``, as a
    non-streaming body does: the latest weights any choice's tokens came from (a choice that
    straddled an update counts its last token's; here the choice that ends first), whether
    or not a usage chunk follows; no other chunk has it."""
    h, i = hi_tokens[1:3]
    length = {"finish_reason": FinishReason.LENGTH}
    turn = [
        (0, token(h, 1, weight_version=1)),
        (1, token(h, 1, weight_version=1)),
        (1, token(i, 2, weight_version=3, **length)),  # (an update applied mid-choice)
        (0, token(i, 2, weight_version=2, **length)),  # (an older one's: held behind it)
    ]
    body = {"prompt": [5], "n": 2, "max_tokens": 2}
    usage = {"stream_options": {"include_usage": True}}
    raws = []
    for extra in ({}, {"stream": True}, {"stream": True, **usage}):
        stage = TurnStage(scripted_info(ckpt), 2, [turn])
        async with running(ckpt, client_factory=scripted_factory(stage)) as live:
            status, _, raw = await live.post("/v1/completions", {**body, **extra})
        assert status == 200, raw
        raws.append(raw)
    (whole,) = sse_payloads(b"data: " + raws[0] + b"\n\n")
    assert whole["metadata"] == {"weight_version": "3"}
    for raw, tail in ((raws[1], 0), (raws[2], 1)):
        events = sse_payloads(raw)[:-1]
        assert [c["index"] for e in events for c in e["choices"]] == [0, 1, 1, 0]
        assert ["metadata" in e for e in events] == [False] * 3 + [True] + [False] * tail
        assert events[3]["metadata"] == whole["metadata"]
