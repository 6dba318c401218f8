"""The outputs of one ``AsyncLLM.generate`` call (one prompt, ``n`` samples) as an asyncio stream.

Updates come on the stage client's delivering thread; its sinks only hand them to the event loop
(``call_soon_threadsafe``) onto this stream's own queue, so that thread never waits on a consumer
and everything else (assembling text, stop strings, building outputs) runs on the loop, as the
HTTP layer's ``Generation`` does.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass

from rltserve.core.stage import Sink
from rltserve.outputs import (
    CompletionOutput,
    Logprob,
    OutputAssembler,
    RequestOutput,
    vllm_logprobs,
)
from rltserve.sampling import RequestOutputKind
from rltserve.updates import RequestUpdate


@dataclass
class _Sample:
    """One sample's assembler and what of it the consumer has been given."""

    stage_id: str  # its id in the stage (unique there: the AsyncLLM's counter)
    asm: OutputAssembler
    logprobs: list[dict[int, Logprob]] | None  # vLLM's form of every token's, built as they come
    cumulative_logprob: float = 0
    finished: bool = False
    weight_version: int = 0
    sent_tokens: int = 0  # tokens (and their depths, logprobs) already yielded: DELTA's start
    sent_text: int = 0  # characters of text already yielded
    changed: bool = False  # an update arrived since the last yield


@dataclass
class _Failure:
    """Why a sample ended abnormally: ``rejected`` (the engine refused its arguments) or not."""

    error: str
    rejected: bool


class OutputStream:
    """The samples of one request, read by ``outputs()``. ``kind`` decides what each yield
    holds (``RequestOutputKind``); ``abort`` stops a stage request (a stop string ended it);
    ``tokenizer`` decodes logprob tokens (None: ``detokenize=False`` or no tokenizer)."""

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        kind: RequestOutputKind,
        tokenizer: object,
        abort: Callable[[str], None],
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.kind = kind
        self.tokenizer = tokenizer
        self.abort = abort
        self.samples: list[_Sample] = []
        self._queue: asyncio.Queue[tuple[int, RequestUpdate]] = asyncio.Queue()
        self._failure: _Failure | None = None  # the first sample that failed: why
        self._prompt_logprobs: list[dict[int, Logprob] | None] | None = None
        self._prompt_logprobs_sent = False  # (DELTA gives them once)

    def add_sample(self, stage_id: str, asm: OutputAssembler) -> None:
        want = asm.output.logprobs is not None
        self.samples.append(_Sample(stage_id, asm, [] if want else None))

    def sink(self, loop: asyncio.AbstractEventLoop, index: int) -> Sink:
        """The stage callback of sample ``index``: runs on the delivering thread."""
        put = self._queue.put_nowait

        def sink(update: RequestUpdate) -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody is listening
                loop.call_soon_threadsafe(put, (index, update))

        return sink

    def unfinished(self) -> list[str]:
        """The stage ids of the samples that have not ended."""
        return [s.stage_id for s in self.samples if not s.finished]

    def abandon(self) -> None:
        """The consumer left before every sample ended: each unfinished one ends as aborted
        for its assembler's observer (``OutputAssembler.abandon``)."""
        for s in self.samples:
            if not s.finished:
                s.asm.abandon()

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.samples)

    async def outputs(self):
        """Yields ``RequestOutput``s until every sample has finished. Each wait takes every
        update queued by then, so a consumer slower than the engine gets merged outputs (DELTA:
        the new tokens of all of them), never a backlog. A sample that failed raises as
        ``LLM.generate`` does: ValueError when the engine refused it, else RuntimeError."""
        while True:
            self._apply(*await self._queue.get())
            while not self._queue.empty():
                self._apply(*self._queue.get_nowait())
            if self._failure is not None:
                if self._failure.rejected:
                    raise ValueError(self._failure.error)
                raise RuntimeError(f"request {self.request_id} failed: {self._failure.error}")
            done = self.finished
            if self.kind is RequestOutputKind.FINAL_ONLY and not done:
                continue
            out = self._output()
            if out.outputs or done:
                yield out
            if done:
                return

    def _apply(self, index: int, update: RequestUpdate) -> None:
        sample = self.samples[index]
        if sample.finished:  # (the stage's abort update after a stop string ended it)
            return
        asm = sample.asm
        # A stop string ended it before its forced tokens' scores came: it finishes, and is
        # aborted in the stage, once later updates have brought them.
        if asm.scoring:
            done = asm.add_late(update)
            self._add_scores(sample, update)
            if done:
                sample.finished = sample.changed = True
                if update.finish_reason is None:
                    self.abort(sample.stage_id)
            return
        try:
            delta = asm.add(update)
            finish = delta.finish_reason
        except Exception as exc:  # fail this request rather than the loop's other work
            asm.fail(exc)
            finish = "error"
            delta = None
        sample.changed = True
        sample.weight_version = update.weight_version
        if delta is not None and sample.logprobs is not None:
            for entry in delta.logprobs:  # (summed one by one: LLM's cumulative_logprob's sum)
                if entry["logprob"] is not None:
                    sample.cumulative_logprob += entry["logprob"]
            sample.logprobs.extend(vllm_logprobs(delta.logprobs, self.tokenizer) or ())
            self._add_scores(sample, update)
        if index == 0 and self._prompt_logprobs is None and asm.output.prompt_logprobs is not None:
            lps = vllm_logprobs(asm.output.prompt_logprobs, self.tokenizer) or []
            self._prompt_logprobs = [None, *lps]
        if finish is None:
            return
        if asm.stopped_awaiting_scores(update):
            return  # (not finished, nor aborted, until the scores come)
        sample.finished = True
        if asm.rejected or finish == "error":
            if self._failure is None:
                error = asm.output.error or "the request failed"
                self._failure = _Failure(error, asm.rejected)
        elif update.finish_reason is None:  # a stop string: stop the stage's work too
            self.abort(sample.stage_id)

    def _add_scores(self, sample: _Sample, update: RequestUpdate) -> None:
        """The vLLM form of the forced tokens' entries ``update`` scored (in the kept output;
        yielded ones keep theirs), and the sum again (in token order: ``LLM``'s sum)."""
        entries = sample.asm.output.logprobs or ()
        scored = False
        for j, *_ in update.forced_logprobs or ():
            if j < len(sample.logprobs) and j < len(entries):
                sample.logprobs[j] = vllm_logprobs([entries[j]], self.tokenizer)[0]
                scored = True
        if scored:
            lps = (e["logprob"] for e in entries[: len(sample.logprobs)])
            sample.cumulative_logprob = sum(lp for lp in lps if lp is not None)

    def _output(self) -> RequestOutput:
        """What this yield holds: every sample so far (CUMULATIVE, FINAL_ONLY), or the new part
        of each sample that changed since the last yield (DELTA)."""
        delta = self.kind is RequestOutputKind.DELTA
        # (DELTA holds back a sample awaiting its forced tokens' scores: its new part goes
        # out whole, scores included, once they came.)
        # (nor a sample whose update only scored tokens already yielded: vLLM's DELTA yields
        # no empty parts.)
        outputs = [
            self._completion(j, s, delta)
            for j, s in enumerate(self.samples)
            if not delta or (s.changed and not s.asm.scoring and self._has_news(s))
        ]
        for s in self.samples:
            s.changed = s.changed and s.asm.scoring
        first = self.samples[0].asm.output
        prompt_logprobs = self._prompt_logprobs
        if delta and prompt_logprobs is not None:
            if self._prompt_logprobs_sent:
                prompt_logprobs = None
            # (sent with the first yield: one with no part is not yielded)
            yielded = bool(outputs) or self.finished
            self._prompt_logprobs_sent = self._prompt_logprobs_sent or yielded
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=list(self.prompt_token_ids),
            outputs=outputs,
            finished=self.finished,
            weight_version=max(s.weight_version for s in self.samples),
            prompt_logprobs=prompt_logprobs,
            num_cached_tokens=first.num_cached_tokens,
        )

    @staticmethod
    def _has_news(sample: _Sample) -> bool:
        """Whether ``sample`` has tokens or text not yielded yet, or has finished."""
        out = sample.asm.output
        grown = len(out.token_ids) > sample.sent_tokens or len(out.text) > sample.sent_text
        return grown or sample.finished

    def _completion(self, index: int, sample: _Sample, delta: bool) -> CompletionOutput:
        """Sample ``index`` as yielded now: copies, since the assembler keeps extending its
        lists after the consumer has them."""
        out = sample.asm.output
        ended = not sample.asm.scoring  # (one awaiting scores has not finished yet)
        start = sample.sent_tokens if delta else 0
        text_start = sample.sent_text if delta else 0
        sample.sent_tokens, sample.sent_text = len(out.token_ids), len(out.text)
        return CompletionOutput(
            index=index,
            text=out.text[text_start:],
            token_ids=out.token_ids[start:],
            cumulative_logprob=(
                None if sample.logprobs is None else float(sample.cumulative_logprob)
            ),
            logprobs=None if sample.logprobs is None else sample.logprobs[start:],
            finish_reason=out.finish_reason if ended else None,
            stop_reason=out.stop_reason if ended else None,
            exit_depths=out.exit_depths[start:],
        )
