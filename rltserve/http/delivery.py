"""Delivering a generating request: admission, then an SSE stream or one JSON body.

An error that ends a choice before anything was streamed becomes a plain error response (a 400
for a request the engine rejected); once the stream has started it becomes an error event and
``[DONE]`` inside the 200 stream. Leaving ``deliver`` by any path (cancellation on client
disconnect included) aborts the unfinished choices in the engine.
"""

from __future__ import annotations

import asyncio
import logging
import time

import orjson
from aiohttp import web

from rltserve.http.admission import Overloaded
from rltserve.http.errors import unavailable
from rltserve.http.frontend import Frontend
from rltserve.http.generation import ChoiceEvent, Generation, failure, request_timelines
from rltserve.http.plans import GenerationPlan
from rltserve.http.responses import usage
from rltserve.http.sse import BoundedResponse, SSEWriter
from rltserve.http.state import ServingState

log = logging.getLogger("rltserve.http")


async def deliver(
    request: web.Request, state: ServingState, plan: GenerationPlan
) -> web.StreamResponse:
    gate = state.gate  # (plans refused requests of more sequences than it holds)
    admitted = False
    try:
        _refuse_while_sleeping(state)  # (not after a wait for a seat the sleep frees)
        # (The engine's order, so that a better priority is not queued behind worse ones.)
        async with gate.slots(len(plan.choices), plan.choices[0].params.priority):
            admitted = True
            frontend = _refuse_while_sleeping(state)
            state.request_log.received(plan.request_id, plan.choices[0].params, plan.prompts())
            generation = frontend.open(plan.choices, plan.arrival, plan.request_id)
            try:
                async with generation:
                    if plan.stream:
                        return await _stream(request, state, plan, generation)
                    return await _collect(request, state, plan, generation)
            finally:  # (after the generation's exit, which aborts what a cancellation left)
                _log_end(state, plan, generation)
    except Overloaded as exc:
        raise unavailable(f"{exc}; retry later", state.config.retry_after_s) from exc
    except asyncio.CancelledError:
        if not admitted:
            # The client left while it waited for a seat: an abort, as one that left the
            # engine's queue is (each choice; its e2e latency is the wait).
            now = time.monotonic()
            for timeline in request_timelines(plan.choices, plan.arrival):
                state.metrics.on_finish(timeline, now, "abort")
        raise


def _refuse_while_sleeping(state: ServingState) -> Frontend:
    """The frontend, or a 503 while the model sleeps (vLLM's answer) or a sleep waits for the
    running requests: the engine would hold a request until then, to refuse it once asleep (a
    trainer's sleep wants the server drained; a load balancer tries elsewhere)."""
    frontend = state.require_frontend()
    retry = state.config.retry_after_s  # (as every 503's: a hint, not a promise)
    if frontend.client.sleeping:
        raise unavailable("the model is sleeping: POST /wake_up first", retry)
    if state.sleeps_pending:
        raise unavailable("a sleep is in progress (waiting for running requests)", retry)
    return frontend


def _log_end(state: ServingState, plan: GenerationPlan, generation: Generation) -> None:
    if generation.aborted:
        state.request_log.aborted(plan.request_id)
    else:
        outputs = generation.outputs()
        state.request_log.finished(
            plan.request_id, [outputs[i] for i in sorted(outputs)], plan.stream
        )


async def _stream(
    request: web.Request, state: ServingState, plan: GenerationPlan, generation: Generation
) -> web.StreamResponse:
    writer = SSEWriter(
        request, state.passthrough_headers(request), state.config.stream_stall_timeout_s
    )
    fmt = plan.format
    try:
        counted: dict[int, int] = {}  # choice index -> its tokens in the chunks made so far
        unfinished = len(plan.choices)
        async for events in generation.batches():
            chunks = []
            for event in events:
                before = counted.get(event.index, 0)
                counted[event.index] = before + len(event.delta.token_ids)
                error = failure(event, state.closing, state.config.retry_after_s)
                if error is not None:
                    if not writer.started:
                        raise error
                    generation.abort()
                    await writer.send(*chunks)
                    return await writer.finish((error.status, error.message))
                opening, entries = fmt.stream_choices(event)
                for k, choice in enumerate(opening + entries):
                    chunk = fmt.chunk([choice])
                    if plan.include_usage:
                        done = before if k < len(opening) else counted[event.index]
                        chunk["usage"] = (
                            _choice_usage(
                                plan, event, done, generation.num_cached_tokens(event.index)
                            )
                            if plan.continuous_usage
                            else None
                        )
                    chunks.append(chunk)
                if event.delta.finish_reason is not None:
                    unfinished -= 1
                    if not unfinished:  # (its one entry, with the finish_reason, is the last)
                        chunks[-1]["metadata"] = weight_metadata(generation)
            await writer.send(*chunks)
        if plan.include_usage:
            final = fmt.chunk([])
            final["usage"] = usage(
                plan.prompt_tokens,
                plan.completion_tokens(generation),
                generation.num_cached_tokens(),
                fmt.reasoning_tokens(generation.outputs()),
            )
            if state.config.enable_per_request_metrics:
                _add_request_metrics(final, generation)
            await writer.send(final)
        return await writer.finish()
    except ConnectionError:
        # The client went away mid-write (aiohttp raises ConnectionResetError, or a plain
        # ConnectionError from a drain), or stalled (StreamStalled); leaving the generation
        # aborts its choices.
        return writer.response or web.Response(status=499)
    except Exception:
        if not writer.started:
            raise  # (the errors middleware's 500)
        # The 200 status line is out: a new 500 response could not reach the client, which
        # would wait for the stream's end. It gets an error event and [DONE] instead.
        log.exception("unhandled error while streaming %s", request.path)
        generation.abort()
        try:
            return await writer.finish((500, "internal server error"))
        except ConnectionError:
            return writer.response


def _choice_usage(plan: GenerationPlan, event: ChoiceEvent, done: int, cached: int) -> dict:
    """``continuous_usage_stats``: the chunk's choice so far, as vLLM counts it: its prompt and
    the ``done`` tokens its chunks carried up to this one (a chat's role and echo chunks:
    before the event's tokens; a batch's events arrive before it is written, so
    ``event.output`` may hold later ones), and its prompt's ``cached`` tokens."""
    done = 0 if plan.prompt_only else done
    return usage(len(event.output.prompt_token_ids), done, cached)


async def _collect(
    request: web.Request, state: ServingState, plan: GenerationPlan, generation: Generation
) -> web.Response:
    async for events in generation.batches():
        for event in events:
            error = failure(event, state.closing, state.config.retry_after_s)
            if error is not None:
                raise error
    outputs = generation.outputs()
    fmt = plan.format
    choices = [fmt.final_choice(i, outputs[i]) for i in sorted(outputs)]
    body = fmt.response(
        choices,
        usage(
            plan.prompt_tokens,
            plan.completion_tokens(generation),
            generation.num_cached_tokens(),
            fmt.reasoning_tokens(outputs),
        ),
    )
    if state.config.enable_per_request_metrics:
        _add_request_metrics(body, generation)
    body["metadata"] = weight_metadata(generation)
    # (n, echo and prompt_logprobs make a body of megabytes from a small request: a client that
    # stops reading it is dropped as a stalled stream is)
    return BoundedResponse(
        request,
        state.config.stream_stall_timeout_s,
        body=orjson.dumps(body),
        content_type="application/json",
    )


def weight_metadata(generation: Generation) -> dict[str, str]:
    """SGLang's ``metadata``: the weights that produced the answer (the latest any of its
    choices' tokens came from), for an RL trainer's staleness bookkeeping. A string, as SGLang
    sends it: OpenAI's ``metadata`` maps strings to strings (its SDK's type), so a number would
    warn on every ``model_dump``.

    A stream carries it on the chunk that ends its last choice: every stream has that one (the
    usage chunk only where asked for), and every choice's tokens are in by then, so the version
    is the one a non-streaming body of the same tokens says."""
    return {"weight_version": str(generation.weight_version())}


def _add_request_metrics(body: dict, generation: Generation) -> None:
    """vLLM's ``--enable-per-request-metrics``: ``metrics`` after ``usage`` (a stream's: in its
    final usage chunk), where one generation stream stands for the request."""
    timings = generation.request_metrics()
    if timings is not None:
        body["metrics"] = timings
