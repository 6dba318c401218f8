"""The engine as HTTP handlers see it: prompt preparation and per-request event streams.

``Frontend`` tokenizes and checks prompts (so that bad input is a 400 before anything streams;
long texts are encoded off the event loop, see ``encoding``) and opens ``Generation``s. A
``Generation`` is the set of engine requests behind one HTTP request (prompts x n choices),
bridged from the stage client's reader thread into the event loop with
``call_soon_threadsafe``; it detokenizes and applies stop strings through ``OutputAssembler``.
Leaving its ``async with`` block aborts every choice that has not finished, which is how a client
disconnect (the handler is cancelled) frees the engine's KV within a step.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Protocol

from rltserve.core.engine_info import EngineInfo, EngineStats
from rltserve.core.stage import Sink, StageError
from rltserve.core.thinking import check_thinking
from rltserve.http.encoding import TextCodec
from rltserve.http.errors import HTTPError, bad_request, unavailable
from rltserve.http.metrics import RequestTimeline, ServingMetrics
from rltserve.http.validation import param_of
from rltserve.models.tokenizer import Tokenizer, TokenizerError
from rltserve.outputs import Completion, OutputAssembler, TextDelta, reported_stop_ids
from rltserve.sampling import SamplingParams, outside_vocab, truncated_prompt
from rltserve.thinking import (
    THINK_END,
    THINK_START,
    ChatPrompt,
    bound_thinking,
    ids_open_thinking,
    resolve_thinking,
)
from rltserve.updates import ASLEEP, FinishReason, RequestUpdate


class StageClientLike(Protocol):
    """What the server needs of a stage client (``StageClient``, ``InProcessStageClient``,
    ``ReplicaSetClient``)."""

    info: EngineInfo | None
    stats: EngineStats | None

    @property
    def alive(self) -> bool: ...

    def wait_ready(self, timeout: float | None = None) -> EngineInfo: ...
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        sink: Sink,
        group: str | None = None,
    ) -> None: ...
    def abort(self, request_id: str) -> None: ...
    def close(self) -> None: ...


class SessionRoutedClient(StageClientLike, Protocol):
    """A stage client whose ``add_request`` also takes the request's session key, for replica
    affinity: ``ReplicaSetClient``, and ``SupervisedStage`` (what the frontend talks to), which
    hands the key on only to a client whose ``routes_by_session`` is true. Clients without that
    attribute keep the plain ``StageClientLike.add_request``."""

    @property
    def routes_by_session(self) -> bool: ...

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        sink: Sink,
        group: str | None = None,
        session: str | None = None,
    ) -> None: ...


@dataclass(frozen=True)
class PromptInput:
    """One prompt of a request: its token ids and, when it came as text, that text (echo)."""

    token_ids: list[int]
    text: str | None = None
    # Whether the prompt leaves a thinking span open, where a chat rendering decided it
    # (``thinking.ChatPrompt``: a <think> in a message's words opens none). None: judged from
    # ``token_ids``, as a raw prompt is (its caller wrote every tag in it).
    thinking: bool | None = None


@dataclass(frozen=True)
class ChoiceRequest:
    """One engine request behind an HTTP request: choice ``index`` samples prompt
    ``prompt_index``."""

    index: int
    prompt_index: int
    prompt: PromptInput
    params: SamplingParams
    group: str | None = None  # shared by the samples of one prompt: the stage prefills it once
    session: str | None = None  # the HTTP request's session key: its replica, under affinity
    # Special tokens whose text the choice's text keeps with skip_special_tokens (the
    # </think> that splits reasoning from content, where the tokenizer makes it special).
    kept_special_ids: frozenset[int] = frozenset()


@dataclass(frozen=True)
class ChoiceEvent:
    """One engine update of one choice, turned into text. ``output`` is the choice so far."""

    index: int
    delta: TextDelta
    output: Completion
    rejected: bool


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
    cached_tokens: int = 0  # prompt tokens the stage reused instead of computing


class Frontend:
    def __init__(
        self,
        client: SessionRoutedClient,
        info: EngineInfo,
        tokenizer: Tokenizer | None,
        metrics: ServingMetrics,
        executor: Executor | None = None,
        token_chars: int | None = None,
        template_defaults: dict | None = None,
    ) -> None:
        """``template_defaults``: the operator's template variables
        (``ServerConfig.default_chat_template_kwargs``), under each request's."""
        self.client = client
        self.info = info
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.template_defaults = dict(template_defaults or {})
        vocab = tokenizer.get_vocab() if tokenizer is not None else {}
        # The thinking span's tags as token ids (None: not in the vocabulary), read once.
        self.think_ids: tuple[int | None, int | None] = (
            vocab.get(THINK_START),
            vocab.get(THINK_END),
        )
        self.codec = (
            TextCodec(tokenizer, info.max_model_len, executor, token_chars)
            if tokenizer is not None
            else None
        )
        self._ids = itertools.count()
        self._generations: set[Generation] = set()

    # ------------------------------------------------------------------ prompts

    def require_codec(self, param: str) -> TextCodec:
        if self.codec is None:
            raise bad_request(f"{param}: this model has no tokenizer; send token ids", param)
        return self.codec

    async def completion_prompts(
        self, items: list, keep: int | None = None, add_special_tokens: bool = True
    ) -> list[PromptInput]:
        """``items``: a request's prompts (``CompletionRequest.prompts``), texts or token ids;
        ``keep``: ``truncate_prompt_tokens`` (a truncated text echoes what was run)."""
        if not items:
            raise bad_request("prompt: must not be empty", "prompt")
        out = []
        for item in items:
            if not isinstance(item, str):
                ids = self.truncated(list(item), keep)
                out.append(PromptInput(self.check_prompt(ids, "prompt")))
                continue
            codec = self.require_codec("prompt")
            if keep is None:
                ids = await codec.encode(item, "prompt", add_special_tokens)
            else:  # (a text too long for the context is what truncation is for)
                ids = await codec.encode_any(item, add_special_tokens)
            kept = self.truncated(ids, keep)
            out.append(
                PromptInput(self.check_prompt(kept, "prompt"), item if kept is ids else None)
            )
        return out

    def truncated(self, ids: list[int], keep: int | None) -> list[int]:
        """``ids`` as ``truncate_prompt_tokens=keep`` runs them (``sampling.truncated_prompt``);
        ``ids`` itself when nothing is cut."""
        try:
            return truncated_prompt(ids, keep, self.info.max_model_len)
        except ValueError as exc:
            raise bad_request(str(exc), "truncate_prompt_tokens") from exc

    async def chat_prompt(
        self,
        messages: list[dict],
        add_generation_prompt: bool,
        template_kwargs: dict | None,
        continue_final_message: bool = False,
        keep: int | None = None,
        add_special_tokens: bool = False,
    ) -> PromptInput:
        """``keep``: ``truncate_prompt_tokens``."""
        chat = await self._render_chat(
            messages, add_generation_prompt, template_kwargs, continue_final_message
        )
        ids = await self._encode_chat(chat.text, keep is None, add_special_tokens)
        kept = self.truncated(ids, keep)
        thinking = chat.thinking
        if thinking and kept is not ids:  # (the cut may have taken the span's <think> too)
            thinking = ids_open_thinking(kept, self.tokenizer)
        return PromptInput(self.check_prompt(kept, "messages"), thinking=thinking)

    async def render_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool,
        template_kwargs: dict | None,
        check_length: bool = True,
        continue_final_message: bool = False,
        add_special_tokens: bool = False,
    ) -> list[int]:
        """The conversation's prompt ids; with ``check_length`` a rendering too long to fit the
        context is a 400 before it is encoded. ``continue_final_message``: the last message
        left open (``Tokenizer.apply_chat_template``); ``add_special_tokens``: the tokenizer's
        special tokens on top of the template's."""
        chat = await self._render_chat(
            messages, add_generation_prompt, template_kwargs, continue_final_message
        )
        return await self._encode_chat(chat.text, check_length, add_special_tokens)

    async def _render_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool,
        template_kwargs: dict | None,
        continue_final_message: bool,
    ) -> ChatPrompt:
        codec = self.require_codec("messages")
        template_kwargs = {**self.template_defaults, **(template_kwargs or {})}
        try:
            return await codec.chat(
                messages, add_generation_prompt, template_kwargs, continue_final_message
            )
        except TokenizerError as exc:
            raise bad_request(f"messages: {exc}", "messages") from exc
        except Exception as exc:  # noqa: BLE001 - template code raising on its input (jinja)
            raise bad_request(
                f"messages: the chat template failed: {type(exc).__name__}: {exc}", "messages"
            ) from exc

    async def _encode_chat(
        self, text: str, check_length: bool, add_special_tokens: bool
    ) -> list[int]:
        codec = self.require_codec("messages")
        if check_length:
            return await codec.encode(text, "messages", add_special_tokens)
        return await codec.encode_any(text, add_special_tokens)

    def check_prompt(self, ids: list[int], param: str) -> list[int]:
        """The engine's own admission checks, run here so they are a 400 before streaming."""
        info = self.info
        if not ids:
            raise bad_request(f"{param}: must contain at least one token", param)
        if len(ids) >= info.max_model_len:  # first: it is cheap, a long scan is not
            raise bad_request(
                f"{param}: {len(ids)} tokens leave no room to generate within this model's "
                f"maximum context length of {info.max_model_len} tokens",
                param,
            )
        self._check_vocab(ids, param)
        return ids

    def _check_vocab(self, ids: Sequence[int], param: str) -> None:
        if message := outside_vocab(param, ids, self.info.vocab_size):
            raise bad_request(message, param)

    def check_params(
        self, params: SamplingParams, prompt_ids: list[int], thinking: bool | None = None
    ) -> SamplingParams:
        """``params`` checked against the model, as ``prompt_ids`` run with them (bounded
        thinking in token ids, and only where the prompt leaves a thinking span open;
        ``thinking``: ``PromptInput.thinking``)."""
        cap = self.info.max_loops
        if params.max_loops is not None and params.max_loops > cap:
            raise bad_request(
                f"max_loops={params.max_loops}: this model allows at most {cap}", "max_loops"
            )
        if params.max_thinking_tokens is not None:
            try:
                params = resolve_thinking(params, self.tokenizer)
            except ValueError as exc:
                raise bad_request(str(exc), param_of(str(exc))) from exc
        for name, ids in params.vocab_token_ids():  # (the engine's own check)
            self._check_vocab(ids, name)
        params = bound_thinking(params, prompt_ids, self.tokenizer, thinking)
        try:
            check_thinking(params)  # (a 400 before a stream starts; the engine checks again)
        except ValueError as exc:
            raise bad_request(str(exc), param_of(str(exc))) from exc
        return params

    def token_text(self, token_id: int) -> str:
        """A token as logprobs show it: its text, or ``token_id:N`` without a tokenizer."""
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    async def prompt_text(self, prompt: PromptInput) -> str:
        if prompt.text is not None:
            return prompt.text
        return await self.codec.decode(prompt.token_ids) if self.codec is not None else ""

    # ------------------------------------------------------------------ generation

    def open(self, choices: list[ChoiceRequest], arrival: float) -> Generation:
        return Generation(self, choices, arrival)

    def next_stage_id(self) -> str:
        return f"http-{next(self._ids)}"

    def interrupt_all(self) -> None:
        """Ends every open generation with abort events (server shutdown)."""
        for generation in list(self._generations):
            generation.interrupt()

    @property
    def num_open(self) -> int:
        return len(self._generations)


class Generation:
    """The choices of one HTTP request as one stream of ``ChoiceEvent`` batches. Enter it with
    ``async with`` (adds the requests to the stage); leaving aborts unfinished choices."""

    def __init__(self, frontend: Frontend, choices: list[ChoiceRequest], arrival: float) -> None:
        self._frontend = frontend
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
                    reported_stop_ids(c.params, frontend.info.stop_reason_ids),
                    skip_special_tokens=c.params.skip_special_tokens,
                    include_stop_str_in_output=c.params.include_stop_str_in_output,
                    min_tokens=c.params.min_tokens,
                    kept_special_ids=c.kept_special_ids,
                ),
                RequestTimeline(arrival, arrival),
            )
            for c in choices
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
            if choice.open:
                choice.open = False
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
            if choice.open:
                with contextlib.suppress(StageError):
                    self._frontend.client.abort(choice.stage_id)
                ended = RequestUpdate(choice.stage_id, finish_reason=FinishReason.ABORT)
                self._queue.put_nowait((index, ended))

    @property
    def finished(self) -> bool:
        return not any(c.open for c in self._choices.values())

    def outputs(self) -> dict[int, Completion]:
        return {i: c.assembler.output for i, c in self._choices.items()}

    def weight_version(self) -> int:
        """The version of the weights that produced the choices' tokens (the latest)."""
        return max((c.assembler.weight_version for c in self._choices.values()), default=0)

    def num_completion_tokens(self) -> int:
        return sum(len(c.assembler.output.token_ids) for c in self._choices.values())

    def num_cached_tokens(self) -> int:
        """Prompt tokens reused, each prompt counted once (as in ``prompt_tokens``): those
        that none of its choices computed."""
        per_prompt: dict[int, int] = {}
        for c in self._choices.values():
            p = c.request.prompt_index
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
        if not choice.open:
            return None  # late updates after a stop string ended the choice, or after abort
        now = time.monotonic()
        if update.num_cached_tokens is not None:
            choice.cached_tokens = update.num_cached_tokens
        delta = choice.assembler.add(update)
        if update.new_token_ids:
            choice.assembler.weight_version = update.weight_version
        metrics = self._frontend.metrics
        if not update.rejected:
            self._started(choice)
        metrics.on_tokens(choice.timeline, now, delta.exit_depths)
        if delta.finish_reason is not None:
            choice.open = False
            if update.finish_reason is None:  # a stop string: stop the engine's work too
                with contextlib.suppress(StageError):
                    self._frontend.client.abort(choice.stage_id)
            if not update.rejected:  # (a request the engine refused is a 400, not a finish)
                metrics.on_finish(choice.timeline, now, delta.finish_reason)
        return ChoiceEvent(index, delta, choice.assembler.output, update.rejected)


def failure(
    event: ChoiceEvent, closing: bool, retry_after_s: int | None = None
) -> HTTPError | None:
    """The error response an event stands for, if it ended its choice abnormally (a 503 with
    ``Retry-After: retry_after_s`` where another try may succeed)."""
    delta = event.delta
    if delta.finish_reason == "error":
        message = delta.error or "the engine failed"
        if event.rejected and message.startswith(ASLEEP):  # (sent as /sleep came)
            return unavailable("the model is sleeping: POST /wake_up first")
        if event.rejected:
            return bad_request(message, param_of(message))
        if message.startswith("stage died"):
            return unavailable(message, retry_after_s)
        return HTTPError(500, message)
    if delta.finish_reason == "abort":
        why = "the server is shutting down" if closing else "the request was aborted"
        return unavailable(why, retry_after_s)
    return None
