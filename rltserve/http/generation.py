"""The engine requests behind one HTTP request (prompts x n choices) as one stream of events.

A ``Generation`` is bridged from the stage client's reader thread into the event loop with
``call_soon_threadsafe``; it detokenizes and applies stop strings through ``OutputAssembler``.
Leaving its ``async with`` block aborts every choice that has not finished, which is how a client
disconnect (the handler is cancelled) frees the engine's KV within a step. ``failure`` is the
error response an event that ended its choice abnormally stands for.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rltserve.core.request_checks import POOL_ADVICE
from rltserve.core.stage import Sink, StageError
from rltserve.http.errors import HTTPError, bad_request, unavailable
from rltserve.http.metrics import RequestTimeline, SampleGroup, per_request_metrics
from rltserve.http.validation import param_of
from rltserve.outputs import Completion, OutputAssembler, TextDelta, reported_stop_ids
from rltserve.updates import ASLEEP, WEIGHTS_DROPPED, FinishReason, RequestUpdate

if TYPE_CHECKING:
    from rltserve.http.frontend import ChoiceRequest, Frontend


@dataclass(frozen=True)
class ChoiceEvent:
    """One engine update of one choice, turned into text. ``output`` is the choice so far."""

    index: int
    delta: TextDelta
    output: Completion
    rejected: bool
    default_max_tokens: str | None = None  # (``ChoiceRequest``'s)
    loops_param: str | None = None  # (``ChoiceRequest``'s)


@dataclass
class _Choice:
    request: ChoiceRequest
    stage_id: str
    assembler: OutputAssembler
    timeline: RequestTimeline
    open: bool = False  # in the stage and not finished yet
    # The engine took it (an update other than a rejection came, or it was aborted first): its
    # start is counted then, so a request the engine refuses (a 400) counts neither a start
    # nor a finish.
    started: bool = False
    cached_tokens: int | None = None  # prompt tokens the stage reused (its first update says)


class Generation:
    """The choices of one HTTP request as one stream of ``ChoiceEvent`` batches. Enter it with
    ``async with`` (adds the requests to the stage); leaving aborts unfinished choices."""

    def __init__(
        self,
        frontend: Frontend,
        choices: list[ChoiceRequest],
        arrival: float,
        request_id: str = "",
    ) -> None:
        """``request_id``: the HTTP request's (its response id), which log lines name."""
        self._frontend = frontend
        self.request_id = request_id
        self.aborted = False  # a choice was cut short: abort() or interrupt() found it open
        self._queue: asyncio.Queue[tuple[int, RequestUpdate]] = asyncio.Queue()
        self._arrival = arrival
        self._choices = {
            c.index: _Choice(
                c,
                frontend.next_stage_id(),
                OutputAssembler(
                    "",
                    c.prompt.token_ids,
                    frontend.tokenizer,
                    c.params.stop,
                    c.params.logprobs is not None,
                    reported_stop_ids(
                        c.params,
                        frontend.info.stop_reason_ids,
                        getattr(frontend.tokenizer, "eos_token_id", None),
                    ),
                    skip_special_tokens=c.params.skip_special_tokens,
                    include_stop_str_in_output=c.params.include_stop_str_in_output,
                    min_tokens=c.params.min_tokens,
                    kept_special_ids=c.kept_special_ids,
                ),
                timeline,
            )
            for c, timeline in zip(choices, request_timelines(choices, arrival))
        }

    async def __aenter__(self) -> Generation:
        loop = asyncio.get_running_loop()
        admitted = time.monotonic()
        client = self._frontend.client
        self._frontend._generations.add(self)
        try:
            for index, choice in self._choices.items():
                choice.timeline.admitted = admitted
                req = choice.request
                client.add_request(
                    choice.stage_id,
                    req.prompt.token_ids,
                    req.params,
                    self._sink(loop, index),
                    req.group,
                    session=req.session,
                )
                choice.open = True
        except StageError as exc:
            await self.__aexit__(None, None, None)
            raise unavailable(f"the engine is not running: {exc}") from exc
        except BaseException:
            # Any other failure (a 500) must not leave this generation registered: shutdown
            # would wait the whole drain timeout for it, and added choices would keep running.
            await self.__aexit__(None, None, None)
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.abort()
        self._frontend._generations.discard(self)

    def _sink(self, loop: asyncio.AbstractEventLoop, index: int) -> Sink:
        put = self._queue.put_nowait

        def sink(update: RequestUpdate) -> None:  # the stage client's reader thread
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody is listening
                loop.call_soon_threadsafe(put, (index, update))

        return sink

    def abort(self) -> None:
        """Aborts every unfinished choice in the stage (idempotent)."""
        now = time.monotonic()
        for choice in self._choices.values():
            if choice.assembler.scoring:  # (finished for the client: only its scores are missing)
                choice.assembler.scoring = False
                with contextlib.suppress(StageError):
                    self._frontend.client.abort(choice.stage_id)
            if choice.open:
                choice.open = False
                self.aborted = True
                with contextlib.suppress(StageError):
                    self._frontend.client.abort(choice.stage_id)
                self._started(choice)
                self._frontend.metrics.on_finish(choice.timeline, now, "abort")

    def _started(self, choice: _Choice) -> None:
        if not choice.started:
            choice.started = True
            self._frontend.metrics.on_start(choice.timeline, len(choice.request.prompt.token_ids))

    def interrupt(self) -> None:
        """Aborts unfinished choices and ends each with an abort event, so that its handler
        still writes a proper ending (the stage's own abort update may never come)."""
        for index, choice in self._choices.items():
            if choice.open or choice.assembler.scoring:
                self.aborted = self.aborted or choice.open
                with contextlib.suppress(StageError):
                    self._frontend.client.abort(choice.stage_id)
                ended = RequestUpdate(choice.stage_id, finish_reason=FinishReason.ABORT)
                self._queue.put_nowait((index, ended))

    @property
    def stage_ids(self) -> set[str]:
        """The ids its choices have in the stage."""
        return {c.stage_id for c in self._choices.values()}

    @property
    def finished(self) -> bool:
        return not any(c.open or c.assembler.scoring for c in self._choices.values())

    def outputs(self) -> dict[int, Completion]:
        return {i: c.assembler.output for i, c in self._choices.items()}

    def weight_version(self) -> int:
        """The version of the weights that produced the choices' tokens (the latest)."""
        return max((c.assembler.weight_version for c in self._choices.values()), default=0)

    def request_metrics(self) -> dict[str, float | None] | None:
        """vLLM's per-request ``metrics`` body field (``per_request_metrics``); None where no
        one generation stream stands for the request (n > 1, several prompts), as vLLM."""
        if len(self._choices) != 1:
            return None
        (choice,) = self._choices.values()
        return per_request_metrics(choice.timeline)

    def num_completion_tokens(self) -> int:
        return sum(len(c.assembler.output.token_ids) for c in self._choices.values())

    def num_cached_tokens(self, index: int | None = None) -> int:
        """Prompt tokens reused, each prompt counted once (as in ``prompt_tokens``): those
        that none of its choices computed (of the choices whose engine said so yet). With
        ``index``, those of choice ``index``'s prompt alone: the request-level figure its
        running usage reports (vLLM's), whichever sample of the prompt the chunk carries
        (a later sample reuses what an earlier one computed)."""
        prompt = None if index is None else self._choices[index].request.prompt_index
        per_prompt: dict[int, int] = {}
        for c in self._choices.values():
            p = c.request.prompt_index
            if c.cached_tokens is not None and prompt in (None, p):
                per_prompt[p] = min(per_prompt.get(p, c.cached_tokens), c.cached_tokens)
        return sum(per_prompt.values())

    async def batches(self) -> AsyncIterator[list[ChoiceEvent]]:
        """Yields the events available at each wake-up until every choice has finished."""
        while not self.finished:
            items = [await self._queue.get()]
            while not self._queue.empty():
                items.append(self._queue.get_nowait())
            events = [e for index, update in items if (e := self._apply(index, update))]
            if events:
                yield events

    def _apply(self, index: int, update: RequestUpdate) -> ChoiceEvent | None:
        choice = self._choices[index]
        # A stop string ended it (its event went out) before its forced tokens' scores came: it
        # stays in the stage until its later updates have brought them, so that the final
        # outputs have them.
        if choice.assembler.scoring:
            if choice.assembler.add_late(update) and update.finish_reason is None:
                with contextlib.suppress(StageError):
                    self._frontend.client.abort(choice.stage_id)
            return None
        if not choice.open:
            return None  # late updates after a stop string ended the choice, or after abort
        now = time.monotonic()
        if update.num_cached_tokens is not None:
            choice.cached_tokens = choice.timeline.num_cached_tokens = update.num_cached_tokens
        if update.queued_s is not None:
            choice.timeline.engine_queued = update.queued_s
        delta = choice.assembler.add(update)
        if update.new_token_ids:
            choice.assembler.weight_version = update.weight_version
        metrics = self._frontend.metrics
        if not update.rejected:
            self._started(choice)
        metrics.on_tokens(
            choice.timeline, now, delta.exit_depths, generated=not choice.request.prompt_only
        )
        if delta.finish_reason is not None:
            choice.open = False
            # A stop string: stop the engine's work too, now or, while forced tokens it kept
            # await their scores, once they have come (above).
            stopped = update.finish_reason is None
            if stopped and not choice.assembler.stopped_awaiting_scores(update):
                with contextlib.suppress(StageError):
                    self._frontend.client.abort(choice.stage_id)
            if not update.rejected:  # (a request the engine refused is a 400, not a finish)
                metrics.on_finish(choice.timeline, now, delta.finish_reason)
        return ChoiceEvent(
            index,
            delta,
            choice.assembler.output,
            update.rejected,
            choice.request.default_max_tokens,
            choice.request.loops_param,
        )


def request_timelines(choices: list[ChoiceRequest], arrival: float) -> list[RequestTimeline]:
    """The metrics' timelines of a request's choices (in order), the samples of one prompt
    sharing a ``SampleGroup``."""
    per_prompt: dict[int, int] = {}
    for c in choices:
        per_prompt[c.prompt_index] = per_prompt.get(c.prompt_index, 0) + 1
    groups = {p: SampleGroup(n, n) for p, n in per_prompt.items()}
    return [
        RequestTimeline(
            arrival, arrival, max_tokens=c.params.max_tokens, group=groups[c.prompt_index]
        )
        for c in choices
    ]


def failure(
    event: ChoiceEvent, closing: bool, retry_after_s: int | None = None
) -> HTTPError | None:
    """The error response an event stands for, if it ended its choice abnormally (a 503 with
    ``Retry-After: retry_after_s`` where another try may succeed)."""
    delta = event.delta
    if delta.finish_reason == "error":
        message = delta.error or "the engine failed"
        if event.rejected and message.startswith(ASLEEP):  # (sent as /sleep came)
            return unavailable("the model is sleeping: POST /wake_up first", retry_after_s)
        if event.rejected and message.startswith(WEIGHTS_DROPPED):
            return unavailable(
                f"{WEIGHTS_DROPPED} and none were loaded since: POST /v1/update_weights first",
                retry_after_s,
            )
        if event.rejected:
            return bad_request(*_refusal(message, event.default_max_tokens, event.loops_param))
        if message.startswith("stage died"):
            return unavailable(message, retry_after_s)
        return HTTPError(500, message)
    if delta.finish_reason == "abort":
        # (an abort that says why, such as a weight update's, passes its reason on)
        why = "the server is shutting down" if closing else delta.error or "the request was aborted"
        return unavailable(why, retry_after_s)
    return None


def _refusal(
    message: str, default_max_tokens: str | None, loops_param: str | None = None
) -> tuple[str, str | None]:
    """The message and param of the 400 for a request the engine refused. One larger than the
    whole KV pool names the depth field the client sent (``loops_param``: max_loops or
    num_steps), the pool holding a whole context at the model's own depth (``kv_sizing``): a
    deeper max_loops (or a kv_policy of more planes) made it too large. Where the server chose
    max_tokens (``default_max_tokens``) it says so, and names max_loops even unsent: that
    default is held to what the pool holds at the request's depth (``plans._token_limit``), so
    only its prompt can be too large there, which no max_tokens would help."""
    if not message.endswith(POOL_ADVICE):
        return message, param_of(message)
    if default_max_tokens is None:
        return message, loops_param
    head = message[: -len(POOL_ADVICE)]
    why = "max_tokens not set: the prompt alone is more than the pool holds at this depth"
    return f"{head} ({why}); lower max_loops, or raise num_blocks", loops_param or "max_loops"
