"""AsyncLLM: the in-process asyncio API over a stage worker, shaped as vLLM's ``AsyncLLM``
(``vllm.v1.engine.async_llm``): ``async for`` over one prompt's outputs as the engine makes them,
and as many concurrent ``generate`` calls as the event loop holds, without an HTTP server.

from rltserve import AsyncLLM, SamplingParams
async with AsyncLLM("path/to/checkpoint") as engine:
    async for out in engine.generate("Hello", SamplingParams(max_tokens=32), "r1"):
        print(out.outputs[0].text)
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import uuid
import weakref
from collections.abc import AsyncGenerator, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from rltserve.async_controls import (
    SHUT_DOWN,
    AsyncTrainerControls,
    PauseGate,
    check_vllm_keywords,
)
from rltserve.caller_values import plain_number
from rltserve.core.stage import StageError
from rltserve.llm import LLM
from rltserve.llm_args import EngineArgs
from rltserve.output_stream import OutputStream
from rltserve.outputs import RequestOutput
from rltserve.prompt_inputs import PromptInput
from rltserve.prompt_inputs import prompt_text as text_of
from rltserve.samples import expand_samples, sample_ids
from rltserve.sampling import SamplingParams


@dataclass(eq=False)
class _Call:
    """One ``generate`` call from its first iteration: its stream, and its generator held weakly
    (dead once nobody can iterate it any more: a ``break`` out of ``async for`` drops it)."""

    generator: weakref.ref[AsyncGenerator[RequestOutput, None]] | None = None
    stream: OutputStream | None = None
    submitted: bool = False  # its samples are in the stage
    aborted: bool = False  # abort() reached it (before its submission too)


class AsyncLLM(AsyncTrainerControls):
    """Asynchronous generation over the same stage as ``LLM``: it takes ``LLM``'s arguments
    (``AsyncLLM(model, **kwargs)``), checks prompts and params as ``LLM.generate`` does and
    gives the same outputs (token ids, exit depths, text; logprobs but for the last float32
    digits, which depend on the batch a request ran in) for the same requests.

    Construction is synchronous, as vLLM's ``AsyncLLM.from_engine_args`` (``from_engine_args``
    here takes a mapping of ``LLM``'s keyword arguments), and waits for the stage to load the
    model, as ``LLM()`` does: called in a running event loop (a notebook cell) it holds that loop
    for the start-up (seconds for a small checkpoint; longer for large ones). Everything after
    that leaves the loop free: the stage runs in its worker process (or on a thread with
    ``in_process=True``), its updates reach each ``generate`` through the loop, and the trainer
    controls (``update_weights``, ``sleep``, ``wake_up``, ``reset_prefix_cache``, ...:
    ``AsyncTrainerControls``) run ``LLM``'s on a thread. Stop it with ``shutdown()`` (or
    ``async with``); requests still streaming then end as aborted."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        """``model`` and ``kwargs``: ``LLM``'s, checked as it checks them."""
        self._llm = LLM(model, **kwargs)
        self._streams: dict[str, _Call] = {}  # request id -> its call, while it runs
        self._ids = itertools.count()  # the stage ids of samples (request ids are the caller's)
        self._closed = False
        self._gate = PauseGate(self._llm)

    @classmethod
    def from_engine_args(
        cls,
        engine_args: EngineArgs | Mapping[str, Any],
        start_engine_loop: bool = True,
        usage_context: object = None,
        stat_loggers: None = None,
    ) -> AsyncLLM:
        """vLLM's constructor from ``AsyncEngineArgs`` (``rltserve.AsyncEngineArgs``, or a
        mapping of ``LLM``'s keyword arguments: ``{"model": path, "max_model_len": 4096}``),
        checked as ``LLM`` checks them. vLLM's ``start_engine_loop`` and ``usage_context``
        change nothing (the engine always runs); ``stat_loggers`` must be None (no stat
        logger plug-ins: ``get_metrics`` reads the metrics)."""
        del start_engine_loop, usage_context
        if stat_loggers is not None:
            raise ValueError("stat_loggers: not supported (get_metrics() reads the metrics)")
        if isinstance(engine_args, EngineArgs):
            return cls(**vars(engine_args))
        if not isinstance(engine_args, Mapping):
            raise ValueError(
                f"engine_args={engine_args!r:.80}: must be an AsyncEngineArgs or a mapping of "
                "LLM's keyword arguments"
            )
        return cls(**dict(engine_args))

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> AsyncLLM:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.shutdown()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stops the stage (``LLM.close``); open ``generate`` streams end with a final output
        whose ``finish_reason`` is "abort". Later ``generate`` calls raise RuntimeError.
        Idempotent."""
        self._closed = True
        self._llm.close(timeout)
        self._gate.wake()  # calls held by a pause end too (they raise, as later calls do)

    def close(self, timeout: float = 10.0) -> None:
        """``shutdown()`` (``LLM``'s name for it)."""
        self.shutdown(timeout)

    @property
    def is_running(self) -> bool:
        """vLLM's: the engine serves requests (not shut down, its stage alive)."""
        return not self._closed and self._llm._client.alive

    @property
    def is_stopped(self) -> bool:
        return not self.is_running

    @property
    def errored(self) -> bool:
        """vLLM's: the stage died (not a ``shutdown``)."""
        return not self._closed and not self._llm._client.alive

    async def check_health(self) -> None:
        """vLLM's: raises (RuntimeError, the stage's failure) unless the engine is running."""
        if self._closed:
            raise RuntimeError(SHUT_DOWN)
        if not self._llm._client.alive:
            raise StageError(f"stage is not running: {self._llm._client.error}")

    # ------------------------------------------------------------------ what LLM has too

    @property
    def tokenizer(self) -> Any:
        """rltserve's reading of the checkpoint's tokenizer (``LLM.tokenizer``); None without."""
        return self._llm.tokenizer

    @property
    def info(self) -> Any:
        """The engine's ``EngineInfo`` (vocabulary size, context limit, ...)."""
        return self._llm.info

    def get_tokenizer(self) -> Any:
        """``LLM.get_tokenizer``: the Hugging Face tokenizer (synchronous, as vLLM V1's)."""
        return self._llm.get_tokenizer()

    def get_default_sampling_params(self) -> SamplingParams:
        """``LLM.get_default_sampling_params``: what ``generate`` uses when given none."""
        return self._llm.get_default_sampling_params()

    @property
    def model_config(self) -> Any:
        """vLLM's: the engine's model settings (``max_model_len``, ``model``, ``dtype``, ...),
        ``LLM.llm_engine.model_config``."""
        return self._llm.llm_engine.model_config

    async def get_model_config(self) -> Any:
        """``model_config``, awaited (older vLLM's engine clients have it so)."""
        return self.model_config

    # ------------------------------------------------------------------ generation

    def generate(
        self,
        prompt: PromptInput,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        prompt_text: str | None = None,
        lora_request: None = None,
        tokenization_kwargs: Mapping[str, Any] | None = None,
        trace_headers: Mapping[str, str] | None = None,
        priority: int = 0,
        data_parallel_rank: int | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Generates for one prompt (text, ``{"prompt": text}``, ``{"prompt_token_ids": ids}``
        or a list of ids) and yields its ``RequestOutput`` as the engine makes tokens;
        the last has ``finished`` True. ``sampling_params.output_kind`` (vLLM's) decides what
        a yield holds: CUMULATIVE (the default) every sample's tokens and text so far,
        DELTA only what is new since the previous yield (only the samples with something
        new, each with its ``index``), FINAL_ONLY one yield at the end. With ``n > 1``,
        CUMULATIVE and FINAL_ONLY list all samples in index order, so the last yield equals
        ``LLM.generate``'s output (vLLM V1's CUMULATIVE yields the changed sample only).
        A consumer slower than the engine gets the updates in between merged into one yield.

        ``request_id``: the caller's (default: a fresh one). A second ``generate`` with the id
        of one still running is a ValueError while anything still holds the first's generator
        (a task iterating it); one whose generator was dropped (a ``break`` out of
        ``async for``) is aborted then, so the id is free at once, as in vLLM. A bad prompt or
        params is a ValueError too, raised on the first iteration before anything is
        submitted. ``priority`` replaces the params' unless 0. vLLM's other keywords are
        accepted when they ask for nothing rltserve lacks: ``prompt_text`` is the outputs'
        ``prompt`` for a token-id prompt (a text prompt's own text wins, as in vLLM);
        ``lora_request`` must be None, ``tokenization_kwargs`` and ``trace_headers`` None or
        empty, ``data_parallel_rank`` None or 0 (one engine), else a ValueError.

        While generation is paused (``pause_generation``) the call waits, off the loop, for
        ``resume_generation``, as ``LLM.generate`` does. Leaving the iteration early
        (``break``, an exception, cancelling its task) aborts the request in the engine, at
        once inside ``contextlib.aclosing(...)``, else when asyncio finalizes the dropped
        generator; ``abort(request_id)`` ends it with a final "abort" output. A request the
        engine refuses raises ValueError, one that fails RuntimeError, as ``LLM.generate``'s."""
        call = _Call()
        generator = self._generate(
            call,
            prompt,
            sampling_params,
            request_id,
            prompt_text,
            lora_request,
            tokenization_kwargs,
            trace_headers,
            priority,
            data_parallel_rank,
        )
        call.generator = weakref.ref(generator)
        return generator

    async def _generate(
        self,
        call: _Call,
        prompt: PromptInput,
        sampling_params: SamplingParams | None,
        request_id: str | None,
        prompt_text: str | None,
        lora_request: None,
        tokenization_kwargs: Mapping[str, Any] | None,
        trace_headers: Mapping[str, str] | None,
        priority: int,
        data_parallel_rank: int | None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """``generate``'s body (``generate`` makes it and holds its generator weakly)."""
        if self._closed:
            raise RuntimeError(SHUT_DOWN)
        check_vllm_keywords(
            lora_request, tokenization_kwargs, trace_headers, data_parallel_rank, prompt_text
        )
        if sampling_params is not None and not isinstance(sampling_params, SamplingParams):
            raise ValueError(f"sampling_params={sampling_params!r:.80}: must be SamplingParams")
        request_id = _request_id(request_id)
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str, dict)):
            raise ValueError("prompt: one prompt per generate call (a text, dict or token ids)")
        priority = plain_number(priority)
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority={priority!r}: must be an int")
        (ids,), (params,) = self._llm._prepare(
            [prompt], sampling_params, [priority] if priority else None
        )
        self._claim(request_id)
        # Stage ids of our own: a caller's id may come back while its aborted samples still
        # wind down in the stage.
        prompt_id = f"async-{next(self._ids)}"
        text = text_of(prompt)
        text = prompt_text if text is None else text
        stream = call.stream = self._stream(request_id, text, ids, params, prompt_id)
        self._streams[request_id] = call
        try:
            # (registered first: abort() reaches a call held here; it ends after the resume)
            await self._gate.wait()
            if self._closed:
                raise RuntimeError(SHUT_DOWN)
            call.submitted = True  # (before: a submission that fails part way is undone too)
            self._submit(stream, params, prompt_id)
            if call.aborted:
                self._abort_stream(stream)
            async for output in stream.outputs():
                yield output
        finally:
            # Whatever ended the iteration: nothing of it may keep running in the stage.
            if self._streams.get(request_id) is call:
                del self._streams[request_id]
            if call.submitted:
                stream.abandon()
                self._abort_stream(stream)

    async def abort(self, request_id: str | Iterable[str], internal: bool = False) -> None:
        """vLLM's: ends the running request(s) ``request_id``; each ``generate`` yields a final
        output with ``finish_reason`` "abort" (tokens made before it stay). An id that is not
        running is ignored. ``internal`` (vLLM's: the ids are its internal ones) changes
        nothing: the ids are the caller's either way.

        A ``generate`` registers its id on its first iteration. So that a sweep right after
        ``asyncio.create_task(...)`` reaches the tasks it just made, this first lets every
        ready task run a step (one loop turn); a ``generate`` not iterated by then (its task
        still awaits something else first) is not reached, as in vLLM. One held by
        ``pause_generation`` ends as aborted after the resume. An aborted id is free for a new
        ``generate`` once this returns, as in vLLM, while the old stream still ends with its
        abort output."""
        del internal
        ids = (request_id,) if isinstance(request_id, str) else tuple(request_id)
        await asyncio.sleep(0)
        for rid in ids:
            call = self._streams.pop(rid, None)
            if call is None:
                continue
            call.aborted = True
            if call.submitted and call.stream is not None:
                self._abort_stream(call.stream)

    # ------------------------------------------------------------------ internals

    def _claim(self, request_id: str) -> None:
        """Takes ``request_id`` for a new call. A running call with it keeps it while its
        generator is alive; a dropped one (its weak reference dead: nobody can iterate it again,
        asyncio has yet to close it) is aborted now, and its own clean-up later leaves the new
        call's registration alone. A finished call's id is free, its generator held or not."""
        held = self._streams.get(request_id)
        if held is None:
            return
        # (a finished request's generator may still be held, suspended at its last yield)
        running = held.stream is None or not held.stream.finished
        if running and held.generator is not None and held.generator() is not None:
            raise ValueError(f"request_id={request_id!r}: a request with this id is running")
        del self._streams[request_id]
        if held.submitted and held.stream is not None:
            self._abort_stream(held.stream)

    def _stream(
        self,
        request_id: str,
        prompt: str | None,
        ids: list[int],
        params: SamplingParams,
        prompt_id: str,
    ) -> OutputStream:
        """The stream of one prompt: an assembler per sample, as ``LLM.generate`` makes them,
        with its ids in the stage (LLM's form: ``prompt_id``, or "j_<prompt_id>" when n > 1)."""
        llm = self._llm
        stream = OutputStream(
            request_id,
            prompt,
            ids,
            params.output_kind,
            llm.tokenizer if params.detokenize else None,
            llm._client.abort,
        )
        for stage_id in sample_ids(prompt_id, params.n)[0]:
            stream.add_sample(stage_id, llm._assembler(stage_id, ids, params))
        return stream

    def _submit(self, stream: OutputStream, params: SamplingParams, prompt_id: str) -> None:
        """Adds the stream's samples to the stage; their updates go to the running loop."""
        loop = asyncio.get_running_loop()
        samples = expand_samples(params)
        group = sample_ids(prompt_id, params.n)[1]
        with self._llm._stage():
            for j, (sample, p) in enumerate(zip(stream.samples, samples)):
                self._llm._client.add_request(
                    sample.stage_id, stream.prompt_token_ids, p, stream.sink(loop, j), group
                )

    def _abort_stream(self, stream: OutputStream) -> None:
        """Aborts the stream's samples still running in the stage (none: nothing to do)."""
        for stage_id in stream.unfinished():
            with contextlib.suppress(StageError):
                self._llm._client.abort(stage_id)


def _request_id(request_id: object) -> str:
    """The caller's request id, or a fresh one (vLLM's are random hex too)."""
    if request_id is None:
        return uuid.uuid4().hex
    if not isinstance(request_id, str) or not request_id:
        raise ValueError(f"request_id={request_id!r:.80}: must be a non-empty string")
    return request_id


# vLLM's name of the same class (``vllm.AsyncLLMEngine`` is its V1 ``AsyncLLM``).
AsyncLLMEngine = AsyncLLM
