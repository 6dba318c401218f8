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
from collections.abc import AsyncIterator, Iterable
from typing import Any

from rltserve.caller_values import plain_number
from rltserve.core.stage import StageError
from rltserve.llm import LLM
from rltserve.output_stream import OutputStream
from rltserve.outputs import RequestOutput
from rltserve.prompt_inputs import PromptInput, prompt_text
from rltserve.samples import expand_samples
from rltserve.sampling import SamplingParams

_SHUT_DOWN = "this AsyncLLM is shut down (shutdown() was called)"


class AsyncLLM:
    """Asynchronous generation over the same stage as ``LLM``: it takes ``LLM``'s arguments
    (``AsyncLLM(model, **kwargs)``), checks prompts and params as ``LLM.generate`` does and
    gives the same outputs (token ids, exit depths, text, logprobs) for the same requests.

    Construction is synchronous, as vLLM's ``AsyncLLM.from_engine_args``, and waits for the
    stage to load the model, as ``LLM()`` does: called in a running event loop (a notebook cell)
    it holds that loop for the start-up (seconds for a small checkpoint; longer for large ones).
    Everything after that leaves the loop free: the stage runs in its worker process (or on a
    thread with ``in_process=True``) and its updates reach each ``generate`` through the loop.
    Stop it with ``shutdown()`` (or ``async with``); requests still streaming then end as
    aborted."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        """``model`` and ``kwargs``: ``LLM``'s, checked as it checks them."""
        self._llm = LLM(model, **kwargs)
        self._streams: dict[str, OutputStream] = {}  # request id -> its stream, while it runs
        self._ids = itertools.count()  # the stage ids of samples (request ids are the caller's)
        self._closed = False

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
            raise RuntimeError(_SHUT_DOWN)
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

    # ------------------------------------------------------------------ generation

    async def generate(
        self,
        prompt: PromptInput,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        priority: int = 0,
        lora_request: None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Generates for one prompt (text, ``{"prompt": text}``, ``{"prompt_token_ids": ids}``
        or a list of ids) and yields its ``RequestOutput`` as the engine makes tokens;
        the last has ``finished`` True. ``sampling_params.output_kind`` (vLLM's) decides what
        a yield holds: CUMULATIVE (the default) every sample's tokens and text so far,
        DELTA only what is new since the previous yield (only the samples with something
        new, each with its ``index``), FINAL_ONLY one yield at the end. With ``n > 1``,
        CUMULATIVE and FINAL_ONLY list all samples in index order, so the last yield equals
        ``LLM.generate``'s output (vLLM V1's CUMULATIVE yields the changed sample only).
        A consumer slower than the engine gets the updates in between merged into one yield.

        ``request_id``: the caller's (default: a fresh one); a second ``generate`` with the id
        of one still running is a ValueError, as is ``lora_request``, a bad prompt or bad
        params, raised on the first iteration before anything is submitted. ``priority``
        replaces the params' unless 0. Leaving the iteration early (``break``, an exception,
        cancelling its task) aborts the request in the engine, at once inside
        ``contextlib.aclosing(...)``, else when asyncio finalizes the dropped generator;
        ``abort(request_id)`` ends it with a final "abort" output. A request the engine
        refuses raises ValueError, one that fails RuntimeError, as ``LLM.generate``'s."""
        if self._closed:
            raise RuntimeError(_SHUT_DOWN)
        if lora_request is not None:
            raise ValueError("lora_request: LoRA adapters are not supported")
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
        if request_id in self._streams:
            raise ValueError(f"request_id={request_id!r}: a request with this id is running")
        # Stage ids of our own: a caller's id may come back while its aborted samples still
        # wind down in the stage.
        prompt_id = f"async-{next(self._ids)}"
        stream = self._stream(request_id, prompt, ids, params, prompt_id)
        self._streams[request_id] = stream
        try:
            self._submit(stream, params, prompt_id)
            async for output in stream.outputs():
                yield output
        finally:
            # Whatever ended the iteration: nothing of it may keep running in the stage.
            if self._streams.get(request_id) is stream:
                del self._streams[request_id]
            self._abort_stream(stream)

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """vLLM's: ends the running request(s) ``request_id``; each ``generate`` yields a final
        output with ``finish_reason`` "abort" (tokens made before it stay). An id that is not
        running is ignored."""
        ids = (request_id,) if isinstance(request_id, str) else tuple(request_id)
        for rid in ids:
            stream = self._streams.get(rid)
            if stream is not None:
                self._abort_stream(stream)

    # ------------------------------------------------------------------ internals

    def _stream(
        self,
        request_id: str,
        prompt: PromptInput,
        ids: list[int],
        params: SamplingParams,
        prompt_id: str,
    ) -> OutputStream:
        """The stream of one prompt: an assembler per sample, as ``LLM.generate`` makes them,
        with its ids in the stage (LLM's form: ``prompt_id``, or "j_<prompt_id>" when n > 1)."""
        llm = self._llm
        stream = OutputStream(
            request_id,
            prompt_text(prompt),
            ids,
            params.output_kind,
            llm.tokenizer if params.detokenize else None,
            llm._client.abort,
        )
        for j in range(params.n):
            stage_id = prompt_id if params.n == 1 else f"{j}_{prompt_id}"
            stream.add_sample(stage_id, llm._assembler(stage_id, ids, params))
        return stream

    def _submit(self, stream: OutputStream, params: SamplingParams, prompt_id: str) -> None:
        """Adds the stream's samples to the stage; their updates go to the running loop."""
        loop = asyncio.get_running_loop()
        samples = expand_samples(params)
        # The samples of one prompt share its prefill: the stage computes it once.
        group = prompt_id if len(samples) > 1 else None
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
