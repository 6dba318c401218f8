"""Shared pieces of the AsyncLLM tests (no tests here): the engine arguments, parameters, what
an output says of its samples, and waits that guard against hangs."""

from __future__ import annotations

import asyncio

from rltserve import RequestOutputKind, SamplingParams

ENGINE = {"in_process": True, "num_blocks": 128, "max_model_len": 256}
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
CUMULATIVE, DELTA, FINAL_ONLY = RequestOutputKind


def samples(out) -> list[tuple]:
    """What a RequestOutput says of each sample (everything LLM.generate's says)."""
    return [
        (
            c.index,
            c.token_ids,
            c.exit_depths,
            c.text,
            c.finish_reason,
            c.stop_reason,
            c.logprobs,
            c.cumulative_logprob,
        )
        for c in out.outputs
    ]


async def collect(engine, prompt, params, request_id=None) -> list:
    return [out async for out in engine.generate(prompt, params, request_id)]


async def wait_idle(engine) -> None:
    """Until the engine's latest stats show nothing running, waiting or holding KV (a hang
    guard, not a timing assertion)."""
    for _ in range(3000):
        stats = engine._llm._client.stats
        if stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_usage == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"the engine did not become idle: {stats}")


async def settle(engine) -> None:
    """Until every update the stage sent so far is on its stream's queue: a command's reply
    comes on the same delivering thread after them, and its own hand-over to the loop after
    theirs."""
    await asyncio.to_thread(engine._llm._client.reset_prefix_cache)
