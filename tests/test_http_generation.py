"""An HTTP request's engine requests (``http/generation.py``) on a scripted stage: a stop string
that ends a choice in bounded thinking's forced tokens, before the engine scored them, keeps the
engine request until their scores came, then aborts it; a client that leaves meanwhile, or a
shutdown, ends it with the scores it has."""

from __future__ import annotations

import asyncio
import threading

import pytest
from test_http_harness import (
    RewritingStage,
    Script,
    body_of,
    running,
    scripted_factory,
    scripted_info,
    tiny_checkpoint,
    wait_for,
)

from rltserve.updates import RequestUpdate

pytestmark = pytest.mark.asyncio(loop_scope="module")
END = 4  # ouro-tiny's </think> (a plain added token)
H_ID, I_ID = 44, 77  # "H", "i"
FORCED_LOGPROB = -2.25
BODY = {
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 40,
    "logprobs": True,
    "thinking_token_budget": 1,
    "stop": ["</think>"],
    "chat_template_kwargs": {"enable_thinking": True},
}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory)


class ForcedEnd:
    """Rewrites a scripted stage's updates as the engine sends bounded thinking's: ``</think>``
    (the 2nd token) forced, with no logprob, and scored by the next update; ``gate``, when
    given, holds that next update back until set."""

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.gate = gate
        self.seen: dict[str, int] = {}

    def __call__(self, update: RequestUpdate) -> RequestUpdate:
        k = self.seen[update.request_id] = self.seen.get(update.request_id, 0) + 1
        if k == 2:
            update.new_logprobs = [None]
            update.new_top_logprobs = [None]
        elif k == 3:
            if self.gate is not None:
                self.gate.wait(10)
            update.forced_logprobs = [(1, FORCED_LOGPROB, [(END, FORCED_LOGPROB)], 1)]
        return update


def forced_stage(ckpt, gate: threading.Event | None = None) -> RewritingStage:
    return RewritingStage(scripted_info(ckpt), Script([H_ID, END, I_ID], 0.02), ForcedEnd(gate))


async def test_a_stop_in_forced_tokens_waits_for_their_scores_then_aborts(ckpt):
    """The response has the forced ``</think>``'s logprob (it came after the stop string ended
    the choice), and the engine request ends there: aborted, not run on to max_tokens."""
    stage = forced_stage(ckpt)
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        status, _, raw = await live.post("/v1/chat/completions", BODY)
        assert status == 200, raw
        (choice,) = body_of(raw)["choices"]
        assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", "</think>")
        entries = choice["logprobs"]["content"]
        assert [e["token"] for e in entries] == ["H", "</think>"]
        assert [e["logprob"] for e in entries] == [-0.5, FORCED_LOGPROB]
        await wait_for(lambda: stage.stats is not None and stage.stats.num_running == 0)
        assert stage.aborted == stage.added  # (at its 3rd update: 37 tokens not played)
        assert stage.rewrite.seen[stage.added[0]] <= 4


async def test_a_client_that_leaves_while_scores_are_awaited_aborts_the_request(ckpt):
    """The stream's finish went out; the request waits in the engine for the forced token's
    score, which does not come before the client leaves: the engine request is aborted."""
    gate = threading.Event()
    stage = forced_stage(ckpt, gate)
    try:
        async with running(ckpt, client_factory=scripted_factory(stage)) as live:
            async with live.stream("/v1/chat/completions", {**BODY, "stream": True}) as r:
                assert r.status == 200
                async for line in r.content:
                    if b'"finish_reason":"stop"' in line:
                        break
                assert not stage.aborted  # (still awaiting the score)
            await wait_for(lambda: stage.aborted == stage.added)
    finally:
        gate.set()


async def test_a_shutdown_ends_a_choice_that_awaits_its_scores(ckpt):
    """A drain past its timeout interrupts every open generation, one whose choice a stop
    string ended while its scores are awaited included: the response goes out with what it
    has (chat lists no entry for the unscored forced token) and the engine request is aborted."""
    gate = threading.Event()
    stage = forced_stage(ckpt, gate)
    try:
        async with running(
            ckpt, client_factory=scripted_factory(stage), drain_timeout_s=0.1
        ) as live:
            task = asyncio.create_task(live.post("/v1/chat/completions", BODY))
            await wait_for(lambda: 3 in stage.rewrite.seen.values())  # (held at the gate)
            await live.state.drain()
            status, _, raw = await asyncio.wait_for(task, 5)
            assert status == 200, raw
            (choice,) = body_of(raw)["choices"]
            assert choice["finish_reason"] == "stop"
            assert [e["logprob"] for e in choice["logprobs"]["content"]] == [-0.5]
            assert stage.aborted == stage.added
    finally:
        gate.set()
