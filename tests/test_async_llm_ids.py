"""AsyncLLM's request ids and ends: leaving or cancelling a stream aborts its request,
``abort`` ends a stream with an abort output, and when a request id may be used again."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from async_llm_util import ENGINE, FINAL_ONLY, GREEDY, LONG, collect, settle, wait_idle

from rltserve import AsyncLLM


@pytest.fixture(scope="module")
def engine(tiny):
    engine = AsyncLLM(str(tiny), **ENGINE)
    yield engine
    engine.shutdown()


async def test_leaving_the_stream_early_aborts_the_request(engine):
    async with contextlib.aclosing(engine.generate([1, 2, 3], LONG, "gone")) as stream:
        async for out in stream:
            if len(out.token_ids) >= 2:
                break
    assert not engine._streams
    await wait_idle(engine)
    # A plain break: asyncio closes the dropped generator, which aborts the same way.
    async for _ in engine.generate([1, 2, 3], LONG, "dropped"):
        break
    await wait_idle(engine)
    assert not engine._streams


async def test_a_stream_left_early_counts_as_aborted_in_the_metrics(engine):
    def read() -> dict:
        return {(m.name, m.labels.get("finished_reason")): m for m in engine.get_metrics()}

    before = read()
    async for out in engine.generate([1, 2, 3], LONG, "left"):
        if len(out.token_ids) >= 2:
            break
    await wait_idle(engine)
    after = read()

    def grew(name: str, reason: str | None = None) -> int:
        return after[name, reason].value - before[name, reason].value

    # (the tokens its outputs held: nobody assembles the updates after the break)
    assert grew("vllm:generation_tokens") == len(out.token_ids) and grew("vllm:prompt_tokens") == 3
    assert [grew("vllm:request_success", r) for r in ("abort", "length", "stop")] == [1, 0, 0]


async def test_cancelling_the_consumer_task_aborts_the_request(engine):
    started = asyncio.Event()

    async def consume() -> None:
        async for _ in engine.generate([4, 5], LONG, "cancelled"):
            started.set()

    task = asyncio.create_task(consume())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not engine._streams
    await wait_idle(engine)
    # Its id is free again at once; the new request runs from the start.
    outs = await collect(engine, [4, 5], GREEDY, "cancelled")
    assert outs[-1].finish_reason == "length" and len(outs[-1].token_ids) == 8


async def test_abort_ends_the_stream_with_an_abort_output(engine):
    outs = []
    async for out in engine.generate([6, 7, 8], LONG, "stop-me"):
        if not outs:
            await engine.abort("stop-me")
        outs.append(out)
    assert outs[-1].finished and outs[-1].finish_reason == "abort"
    assert len(outs[0].token_ids) <= len(outs[-1].token_ids) < 200
    assert outs[-1].token_ids[: len(outs[0].token_ids)] == outs[0].token_ids
    # FINAL_ONLY yields nothing before the end: aborted from another task, its one output.
    final_only = LONG.replace(output_kind=FINAL_ONLY)
    task = asyncio.create_task(collect(engine, [6, 7, 8], final_only, "stop-me"))
    while "stop-me" not in engine._streams:
        await asyncio.sleep(0)
    await engine.abort(["stop-me", "never-was"])  # (an id not running is ignored)
    (out,) = await task
    assert out.finished and out.finish_reason == "abort" and len(out.token_ids) < 200
    await wait_idle(engine)


async def test_a_running_request_id_cannot_be_reused(engine):
    first = engine.generate([1, 2], GREEDY, "dup")
    out = await anext(first)
    with pytest.raises(ValueError, match="request_id='dup': a request with this id is running"):
        await anext(engine.generate([3, 4], GREEDY, "dup"))
    rest = [o async for o in first]
    assert out.token_ids == rest[-1].token_ids[: len(out.token_ids)]
    assert len(rest[-1].token_ids) == 8 and rest[-1].finish_reason == "length"
    assert len((await collect(engine, [3, 4], GREEDY, "dup"))[-1].token_ids) == 8


async def test_a_dropped_streams_id_is_free_at_once(engine):
    """A break drops the generator; asyncio closes it loop turns later. A new generate with its
    id takes the id over at once (aborting the old request); abort then reaches the new one."""
    async for _ in engine.generate([1, 2, 3], LONG, "again"):
        break
    assert "again" in engine._streams  # (not closed yet: the id is still registered)
    outs = await collect(engine, [4, 5], GREEDY, "again")
    assert outs[-1].finish_reason == "length" and len(outs[-1].token_ids) == 8
    async for _ in engine.generate([1, 2, 3], LONG, "again"):
        break
    newest = engine.generate([4, 5], LONG, "again")
    first = await anext(newest)
    await settle(engine)  # (the dropped generator's own clean-up has run by now)
    assert engine._streams["again"].generator() is newest
    await engine.abort("again")
    rest = [o async for o in newest]
    assert rest[-1].finish_reason == "abort" and len(rest[-1].token_ids) < 200
    assert rest[-1].token_ids[: len(first.token_ids)] == first.token_ids
    await wait_idle(engine)  # the dropped requests were aborted, not left to run 200 tokens


async def test_a_dropped_streams_request_ends_before_its_ids_next_one_starts(engine):
    """Taking the id over aborts the dropped request then, not loop turns later when asyncio
    closes its generator: the two never run (and hold KV) side by side."""
    client, calls = engine._llm._client, []
    add, abort = client.add_request, client.abort
    async for _ in engine.generate([1, 2, 3], LONG, "over"):
        break
    (old,) = engine._streams["over"].stream.unfinished()
    try:
        client.add_request, client.abort = _spied("add", add, calls), _spied("abort", abort, calls)
        outs = await collect(engine, [4, 5], GREEDY, "over")
    finally:
        del client.add_request, client.abort
    assert outs[-1].finish_reason == "length"
    assert calls[0] == ("abort", old) and calls[1][0] == "add"
    await wait_idle(engine)


def _spied(name: str, call, calls: list):
    """``call`` (a stage client method taking a stage id first), noting its name and id."""

    def spied(stage_id, *args, **kwargs):
        calls.append((name, stage_id))
        return call(stage_id, *args, **kwargs)

    return spied


async def test_a_finished_requests_id_is_free_while_its_generator_is_held(engine):
    """A consumer that stops at the final output leaves the generator suspended at its last
    yield (held by a variable here): the request is over, so its id is free."""
    held = engine.generate([1, 2], GREEDY, "done")
    while not (out := await anext(held)).finished:
        pass
    outs = await collect(engine, [3, 4], GREEDY, "done")
    assert outs[-1].finish_reason == out.finish_reason == "length"
    assert held is not None  # (still held until here)


async def test_an_id_a_task_is_consuming_stays_refused(engine):
    started = asyncio.Event()

    async def consume() -> list:
        outs = []
        async for out in engine.generate([1, 2], GREEDY.replace(max_tokens=30), "busy"):
            outs.append(out)
            started.set()
        return outs

    task = asyncio.create_task(consume())
    await started.wait()
    with pytest.raises(ValueError, match="request_id='busy': a request with this id is running"):
        await anext(engine.generate([3, 4], GREEDY, "busy"))
    outs = await task
    assert outs[-1].finish_reason == "length" and len(outs[-1].token_ids) == 30


async def test_abort_reaches_a_task_created_just_before(engine):
    task = asyncio.create_task(collect(engine, [6, 7, 8], LONG, "swept"))
    await engine.abort(["swept"], internal=True)  # (before the task ran at all)
    outs = await task
    assert outs[-1].finished and outs[-1].finish_reason == "abort"
    assert len(outs[-1].token_ids) < 200
    await wait_idle(engine)


async def test_an_aborted_id_is_free_once_abort_returns(engine):
    """vLLM forgets an aborted request at once: a retry under the same id may follow the abort
    while the first stream's task has yet to read its abort output."""
    started = asyncio.Event()

    async def consume() -> list:
        outs = []
        async for out in engine.generate([1, 2, 3], LONG, "retried"):
            outs.append(out)
            started.set()
        return outs

    task = asyncio.create_task(consume())
    await started.wait()
    await engine.abort("retried")
    outs = await collect(engine, [4, 5], GREEDY, "retried")
    assert outs[-1].finish_reason == "length" and len(outs[-1].token_ids) == 8
    first = await task
    assert first[-1].finish_reason == "abort" and len(first[-1].token_ids) < 200
    assert not engine._streams
    await wait_idle(engine)
