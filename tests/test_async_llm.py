"""AsyncLLM: one prompt's outputs as an async stream, equal to ``LLM.generate``'s and the dense
oracle's (token ids, exit depths, text, logprobs) in every output kind, alone and many at once;
refusing bad input and shutting down, with nothing left running; the trainer controls
(weights, sleep, pause), awaited with the loop left free. Aborts and request ids:
``test_async_llm_ids.py``."""

from __future__ import annotations

import asyncio

import pytest
from async_llm_util import (
    CUMULATIVE,
    DELTA,
    ENGINE,
    FINAL_ONLY,
    GREEDY,
    LONG,
    collect,
    samples,
    settle,
    wait_idle,
)
from engine_util import oracle_run
from reference import Reference

from rltserve import LLM, AsyncLLM, SamplingParams


@pytest.fixture(scope="module")
def engine(tiny):
    engine = AsyncLLM(str(tiny), **ENGINE)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def llm(tiny):
    with LLM(str(tiny), **ENGINE) as llm:
        yield llm


@pytest.fixture(scope="module")
def tiny_ref(tiny) -> Reference:
    return Reference.load(tiny)


def test_is_exported_and_shares_llms_defaults(engine, llm):
    import rltserve

    assert rltserve.AsyncLLM is AsyncLLM and "AsyncLLM" in rltserve.__all__
    assert engine.get_default_sampling_params() == llm.get_default_sampling_params()
    assert engine.tokenizer.encode_prompt("Hi there") == llm.tokenizer.encode_prompt("Hi there")
    assert engine.is_running and not engine.errored


async def test_greedy_streams_reproduce_the_oracle_and_llm(engine, llm, tiny_ref):
    params = GREEDY.replace(logprobs=2)
    for prompt in ("Hello there", {"prompt_token_ids": [5, 6, 7]}, [9, 10, 11, 12]):
        outs = await collect(engine, prompt, params)
        (want,) = llm.generate(prompt if not isinstance(prompt, list) else [prompt], params)
        last = outs[-1]
        assert samples(last) == samples(want)
        assert last.prompt_token_ids == want.prompt_token_ids and last.prompt == want.prompt
        oracle = oracle_run(tiny_ref, want.prompt_token_ids, params)
        assert last.token_ids == oracle.tokens and last.exit_depths == oracle.exit_depths
        # A yield per engine update (one token each here; updates that queued while the
        # consumer was busy come merged), each holding everything so far.
        lengths = [len(o.token_ids) for o in outs]
        assert lengths == sorted(set(lengths)) and lengths[-1] == 8
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        assert all(o.token_ids == last.token_ids[: len(o.token_ids)] for o in outs)
        assert all(o.text == last.text[: len(o.text)] for o in outs)


async def test_seeded_sampling_with_n_equals_llm(engine, llm):
    params = SamplingParams(temperature=0.9, max_tokens=6, ignore_eos=True, seed=11, n=2)
    (want,) = llm.generate(["Once upon"], params)
    outs = await collect(engine, "Once upon", params)
    assert samples(outs[-1]) == samples(want) and outs[-1].finished
    assert [c.index for c in outs[-1].outputs] == [0, 1]
    assert want.outputs[0].token_ids != want.outputs[1].token_ids  # two samples, not one twice
    # FINAL_ONLY: one yield, both samples; DELTA: each sample's pieces add up to its whole.
    (final,) = await collect(engine, "Once upon", params.replace(output_kind=FINAL_ONLY))
    assert samples(final) == samples(want) and final.finished
    deltas = await collect(engine, "Once upon", params.replace(output_kind=DELTA))
    for j, whole in enumerate(want.outputs):
        mine = [c for o in deltas for c in o.outputs if c.index == j]
        assert sum((c.token_ids for c in mine), []) == whole.token_ids
        assert sum((c.exit_depths for c in mine), []) == whole.exit_depths
        assert "".join(c.text for c in mine) == whole.text
        assert mine[-1].finish_reason == "length"
    assert [o.finished for o in deltas].index(True) == len(deltas) - 1


async def test_delta_pieces_add_up_to_the_cumulative_output(engine):
    params = GREEDY.replace(max_tokens=12, logprobs=1)
    cumulative = (await collect(engine, "The weather", params))[-1]
    deltas = await collect(engine, "The weather", params.replace(output_kind=DELTA))
    assert all(len(o.outputs) == 1 and o.outputs[0].token_ids for o in deltas)
    pieces = [o.outputs[0] for o in deltas]
    assert sum((c.token_ids for c in pieces), []) == cumulative.token_ids
    assert sum((c.exit_depths for c in pieces), []) == cumulative.exit_depths
    assert sum((c.logprobs for c in pieces), []) == cumulative.outputs[0].logprobs
    assert "".join(c.text for c in pieces) == cumulative.text
    assert pieces[-1].cumulative_logprob == cumulative.outputs[0].cumulative_logprob
    assert [c.finish_reason for c in pieces] == [None] * (len(pieces) - 1) + ["length"]
    (final,) = await collect(engine, "The weather", params.replace(output_kind=FINAL_ONLY))
    assert samples(final) == samples(cumulative) and final.finished
    # A consumer that falls behind gets what queued meanwhile as one output, not a backlog.
    stream = engine.generate("The weather", params.replace(output_kind=DELTA))
    first = await anext(stream)
    await wait_idle(engine)  # (the engine has made every token by now)
    await settle(engine)
    rest = [o async for o in stream]
    assert len(rest) == 1 and rest[0].finished
    merged = first.outputs[0].token_ids + rest[0].outputs[0].token_ids
    assert merged == cumulative.token_ids
    assert samples(final) == samples(cumulative) and final.finished


async def test_many_concurrent_requests_each_equal_their_solo_run(engine, tiny_ref):
    requests = [
        ([3 + i, 40 + 2 * i, 7], GREEDY.replace(max_tokens=3 + i, logprobs=1 if i % 2 else None))
        for i in range(6)
    ]
    requests += [("A story about", SamplingParams(temperature=0.8, max_tokens=5, seed=3, n=2))]
    requests += [("A story about", GREEDY.replace(output_kind=DELTA))]
    solo = [await collect(engine, p, sp) for p, sp in requests]
    together = await asyncio.gather(
        *(collect(engine, p, sp, f"r{i}") for i, (p, sp) in enumerate(requests))
    )
    for i, (alone, mixed) in enumerate(zip(solo, together)):
        # Exact but for logprobs: a batch's float32 sums may differ from one row's in the last
        # bits. (How many yields each got depends on the consumers' pace: updates merge.)
        assert [s[:6] for s in samples(mixed[-1])] == [s[:6] for s in samples(alone[-1])], i
        for a, b in zip(alone[-1].outputs, mixed[-1].outputs):
            assert (a.logprobs is None) == (b.logprobs is None)
            for x, y in zip(a.logprobs or (), b.logprobs or (), strict=True):
                assert list(x) == list(y)
                assert [v.logprob for v in y.values()] == pytest.approx(
                    [v.logprob for v in x.values()], abs=1e-4
                )
        assert {o.request_id for o in mixed} == {f"r{i}"} and mixed[-1].finished
    for (prompt, p), outs in zip(requests[:6], solo):
        oracle = oracle_run(tiny_ref, prompt, p)
        assert outs[-1].token_ids == oracle.tokens and outs[-1].exit_depths == oracle.exit_depths
    await wait_idle(engine)


async def test_a_stop_string_ends_the_stream_and_its_engine_request(engine, llm):
    (free,) = llm.generate(["Hello there"], LONG.replace(max_tokens=16))
    stop = free.text[len(free.text) // 2 :][:3]
    params = LONG.replace(stop=[stop])
    (want,) = llm.generate(["Hello there"], params)
    outs = await collect(engine, "Hello there", params)
    assert samples(outs[-1]) == samples(want)
    assert outs[-1].finish_reason == "stop" and outs[-1].outputs[0].stop_reason == stop
    assert len(outs[-1].token_ids) < 200
    await wait_idle(engine)  # the stage's request was aborted, not left to run 200 tokens


async def test_a_stop_string_in_forced_thinking_tokens_waits_for_their_scores(engine, llm):
    """Bounded thinking with logprobs: a stop string matching in the forced text ends the
    output before the engine scored them; the stream takes the request's next updates until
    they came (then aborts it), and its final output has every one, as ``LLM``'s has."""
    params = SamplingParams(
        temperature=0.0, max_thinking_tokens=2, logprobs=2, stop=["</think>"], max_tokens=20
    )
    (want,) = llm.chat(
        [{"role": "user", "content": "hi"}],
        params,
        use_tqdm=False,
        chat_template_kwargs={"enable_thinking": True},
    )
    assert want.finish_reason == "stop" and all(want.outputs[0].logprobs)
    prompt = {"prompt_token_ids": want.prompt_token_ids}
    for kind in (CUMULATIVE, FINAL_ONLY):
        outs = await collect(engine, prompt, params.replace(output_kind=kind))
        assert samples(outs[-1]) == samples(want) and outs[-1].finished
        assert all(not o.finished and o.finish_reason is None for o in outs[:-1])
    deltas = await collect(engine, prompt, params.replace(output_kind=DELTA))
    pieces = [o.outputs[0] for o in deltas]
    assert sum((c.token_ids for c in pieces), []) == want.token_ids
    assert sum((c.logprobs for c in pieces), []) == want.outputs[0].logprobs  # (none empty)
    assert pieces[-1].cumulative_logprob == want.outputs[0].cumulative_logprob
    assert [c.finish_reason for c in pieces] == [None] * (len(pieces) - 1) + ["stop"]
    await wait_idle(engine)  # the stage's request was aborted, not left to run


async def test_vllm_generate_keywords_asking_for_nothing_are_accepted(engine):
    want = await collect(engine, [5, 6, 7], GREEDY)
    outs = await collect_with(
        engine,
        [5, 6, 7],
        prompt_text="five six seven",
        tokenization_kwargs={},
        trace_headers=None,
        data_parallel_rank=0,
    )
    assert samples(outs[-1]) == samples(want[-1])
    assert outs[-1].prompt == "five six seven" and want[-1].prompt is None
    # A text prompt's own text wins, as in vLLM.
    text = [o async for o in engine.generate("Hi", GREEDY, prompt_text="other")]
    assert text[-1].prompt == "Hi"


async def collect_with(engine, prompt, **keywords) -> list:
    return [out async for out in engine.generate(prompt, GREEDY, **keywords)]


async def test_trainer_controls_are_llms_awaited(engine, llm, tiny):
    assert await engine.is_sleeping() is False and await engine.is_paused() is False
    assert await engine.reset_prefix_cache() is True
    assert [m.name for m in engine.get_metrics()] == [m.name for m in llm.get_metrics()]
    for refused, match in [
        (engine.collective_rpc("load_weights"), "collective_rpc: not supported"),
        (engine.start_profile(), "start_profile: not supported"),
        (engine.stop_profile(), "stop_profile: not supported"),
    ]:
        with pytest.raises(ValueError, match=match):
            await refused
    with pytest.raises(ValueError, match="encode: not supported"):
        engine.encode("Hi")
    with pytest.raises(ValueError, match="level=3: must be 1 or 2"):
        await engine.sleep(3)
    # An update waits for the running request, whose outputs keep coming through the loop.
    before = engine.weight_version
    stream = engine.generate([1, 2, 3], GREEDY.replace(max_tokens=30), "pre-update")
    first = await anext(stream)
    update = asyncio.create_task(engine.update_weights(str(tiny)))  # (the same weights)
    rest = [o async for o in stream]
    assert len(rest[-1].token_ids) == 30 and rest[-1].weight_version == before
    assert first.token_ids == rest[-1].token_ids[: len(first.token_ids)]
    assert await update == before + 1 == engine.weight_version
    (want,) = llm.generate([[1, 2, 3]], GREEDY)
    after = await collect(engine, [1, 2, 3], GREEDY)
    assert samples(after[-1]) == samples(want) and after[-1].weight_version == before + 1
    # Sleep mode: generate is refused until wake_up, as LLM's.
    await engine.sleep(level=1)
    assert await engine.is_sleeping()
    with pytest.raises(ValueError, match="asleep"):
        await collect(engine, [1, 2, 3], GREEDY)
    await engine.wake_up(["weights"])
    await engine.wake_up(tags=["kv_cache"])
    assert not await engine.is_sleeping()
    assert samples((await collect(engine, [1, 2, 3], GREEDY))[-1]) == samples(want)


async def test_pause_holds_new_generate_calls_until_resume(engine):
    running = engine.generate([1, 2], GREEDY, "running")
    await anext(running)
    await engine.pause_generation()
    assert await engine.is_paused() and engine._llm._paused
    held = asyncio.create_task(collect(engine, [3, 4], GREEDY, "held"))
    aborted = asyncio.create_task(collect(engine, [5, 6], LONG, "held-aborted"))
    await asyncio.sleep(0)  # (both reach the pause)
    assert not engine._streams["held"].submitted
    rest = [o async for o in running]  # a request already running continues
    assert rest[-1].finish_reason == "length" and len(rest[-1].token_ids) == 8
    await engine.abort("held-aborted")
    await engine.reset_prefix_cache()  # (the loop stays free while calls wait)
    assert not held.done() and not engine._streams["held"].submitted
    engine._llm.resume_generation()  # the LLM's own resume releases them too
    assert len((await held)[-1].token_ids) == 8
    out = (await aborted)[-1]
    assert out.finish_reason == "abort" and len(out.token_ids) < 200
    assert not await engine.is_paused()
    # A pause made on the LLM holds AsyncLLM.generate too.
    engine._llm.pause_generation()
    task = asyncio.create_task(collect(engine, [3, 4], GREEDY, "held-again"))
    await asyncio.sleep(0)
    assert not engine._streams["held-again"].submitted
    await engine.resume_generation()
    assert len((await task)[-1].token_ids) == 8
    await wait_idle(engine)


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda e: e.generate([1, 2], GREEDY, lora_request=object()), "lora_request"),
        (lambda e: e.generate([1, 2], [GREEDY]), "sampling_params"),
        (lambda e: e.generate([[1, 2], [3]], GREEDY), "one prompt per generate call"),
        (lambda e: e.generate(["a", "b"], GREEDY), "one prompt per generate call"),
        (lambda e: e.generate([], GREEDY), "at least one token"),
        (lambda e: e.generate([1, 999], GREEDY), "vocabulary"),
        (lambda e: e.generate([1, 2], GREEDY, 7), "request_id=7"),
        (lambda e: e.generate([1, 2], GREEDY, ""), "request_id='': must be a non-empty"),
        (lambda e: e.generate([1, 2], GREEDY, priority="high"), "priority"),
        (lambda e: e.generate([1, 2], GREEDY, priority=True), "priority=True: must be an int"),
        # (priority=0 leaves the params' own, which this fcfs engine refuses)
        (lambda e: e.generate([1, 2], GREEDY.replace(priority=3)), "priority=3: priority sch"),
        (
            lambda e: e.generate([1, 2], GREEDY, tokenization_kwargs={"truncation": True}),
            "tokenization_kwargs=.*not supported",
        ),
        (lambda e: e.generate([1, 2], GREEDY, trace_headers={"a": "b"}), "tracing"),
        (lambda e: e.generate([1, 2], GREEDY, data_parallel_rank=1), "one engine"),
        (lambda e: e.generate([1, 2], GREEDY, prompt_text=5), "prompt_text=5"),
        (lambda e: e.generate({"text": "hi"}, GREEDY), "unknown key 'text'"),
        (lambda e: e.generate("hi", GREEDY.replace(stop=["x"], detokenize=False)), "stop"),
        # (refused by the engine itself: the error comes through the stream)
        (lambda e: e.generate([1] * 300, GREEDY), "maximum context length"),
    ],
)
async def test_bad_input_is_a_value_error_before_any_output(engine, call, match):
    stream = call(engine)
    with pytest.raises(ValueError, match=match):
        await anext(stream)
    assert not engine._streams
    assert len((await collect(engine, [1, 2], GREEDY))[-1].token_ids) == 8


async def test_a_failed_stage_raises_from_the_stream(tiny):
    engine = AsyncLLM(str(tiny), **ENGINE)
    try:
        stream = engine.generate([1, 2, 3], LONG)
        await anext(stream)
        # The path a crashed worker takes: every open request fails.
        engine._llm._client._die("injected failure")
        with pytest.raises(RuntimeError, match="failed: stage died: injected failure"):
            async for _ in stream:
                pass
        assert engine.errored and not engine.is_running
        with pytest.raises(RuntimeError, match="injected failure"):
            await engine.check_health()
        with pytest.raises(RuntimeError, match="stage is not running"):
            await anext(engine.generate([1, 2], GREEDY))
    finally:
        engine.shutdown()


async def test_shutdown_ends_open_streams_and_refuses_new_ones(tiny):
    with pytest.raises(ValueError, match="engine_args=.*mapping of LLM's keyword arguments"):
        AsyncLLM.from_engine_args(str(tiny))
    async with AsyncLLM.from_engine_args({"model": str(tiny), **ENGINE}) as engine:
        stream = engine.generate([1, 2, 3], LONG)
        await anext(stream)
        # A call held by a pause ends too: it raises, as calls after the shutdown do.
        await engine.pause_generation()
        held = asyncio.create_task(collect(engine, [1, 2], GREEDY))
        await asyncio.sleep(0)  # (it reaches the pause)
        engine.shutdown()
        rest = [out async for out in stream]
        assert rest[-1].finished and rest[-1].finish_reason == "abort"
        assert len(rest[-1].token_ids) < 200
        with pytest.raises(RuntimeError, match="shut down"):
            await held
    assert not engine.is_running and not engine.errored
    with pytest.raises(RuntimeError, match="shut down"):
        await anext(engine.generate([1, 2], GREEDY))
    with pytest.raises(RuntimeError, match="shut down"):
        await engine.check_health()
    with pytest.raises(RuntimeError, match="AsyncLLM is shut down"):
        await engine.reset_prefix_cache()
    engine.close()  # (again: nothing to do)


async def test_detokenize_false_streams_token_ids_without_text(engine, llm):
    """No text, and no logprob token text either, as ``LLM.generate``'s."""
    params = GREEDY.replace(detokenize=False, logprobs=1)
    (last,) = (await collect(engine, [1, 2], params))[-1].outputs
    (want,) = llm.generate([[1, 2]], params, use_tqdm=False)[0].outputs
    assert last.text == want.text == "" and last.token_ids == want.token_ids
    assert len(last.logprobs) == len(last.token_ids) == 8

    def texts(logprobs):
        return [lp.decoded_token for step in logprobs for lp in step.values()]

    assert set(texts(last.logprobs)) == set(texts(want.logprobs)) == {None}


async def test_shutdown_ends_a_call_held_by_a_pause_with_nothing_running(tiny):
    """No other request's end wakes the pause's watcher here: the shutdown itself must."""
    engine = AsyncLLM(str(tiny), **ENGINE)
    try:
        await engine.pause_generation()
        held = asyncio.create_task(collect(engine, [1, 2], GREEDY))
        # Until the pause's watcher thread waits (started later, it would see the shutdown)
        for _ in range(1000):
            if engine._llm._running._waiters:
                break
            await asyncio.sleep(0.01)
    finally:
        engine.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        await asyncio.wait_for(held, 10)


async def test_a_worker_process_stage_streams_the_same(tiny, engine):
    """The default stage (a worker process): updates come on the client's reader thread."""
    params = GREEDY.replace(logprobs=1)
    want = await collect(engine, "Hello there", params)
    spawned = AsyncLLM(str(tiny), **{**ENGINE, "in_process": False})
    try:
        got = await collect(spawned, "Hello there", params)
        assert samples(got[-1]) == samples(want[-1])
        async for _ in spawned.generate([1, 2, 3], LONG):
            break
        await wait_idle(spawned)
        assert not spawned._streams
    finally:
        spawned.shutdown()
