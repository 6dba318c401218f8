"""What users get back and how it is built.

``RequestOutput`` / ``CompletionOutput`` / ``Logprob`` are the offline API's results, shaped as
vLLM's (``outputs[i].token_ids`` and so on) plus rltserve's ``exit_depths`` and
``weight_version``. ``Completion`` is one sequence as it is being assembled; ``OutputAssembler``
turns a request's token updates into text deltas and applies stop strings (shared by the LLM API
and the server).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import repeat
from typing import TYPE_CHECKING

from rltserve.updates import RequestUpdate

if TYPE_CHECKING:
    from rltserve.sampling import SamplingParams


@dataclass
class Logprob:
    """vLLM's per-token logprob entry. ``rank``: 1-based rank of the token under the model's
    distribution; None where it is unknown (a sampled token outside the returned top-k)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One sample of a prompt (vLLM's shape). ``logprobs``: with ``SamplingParams.logprobs=k``,
    per token a dict ``{token_id: Logprob}`` holding the sampled token and the top ``k`` (a
    token forced by bounded thinking has an empty dict until a later update scores it);
    None when not asked for. ``cumulative_logprob`` sums the tokens' logprobs (None without
    logprobs)."""

    index: int
    text: str | None
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    exit_depths: list[int] = field(default_factory=list)  # loop each token exited at
    lora_request: None = None  # (vLLM's: no adapters here)

    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def mean_exit_depth(self) -> float:
        return sum(self.exit_depths) / len(self.exit_depths) if self.exit_depths else 0.0


@dataclass
class RequestOutput:
    """All samples of one prompt (vLLM's shape); ``weight_version`` is the version of the
    weights that produced them (``LLM.update_weights`` increments it). ``text``,
    ``token_ids``, ``exit_depths``, ``finish_reason`` and ``mean_exit_depth`` read the first
    sample, for the common ``n=1`` case."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    weight_version: int = 0
    # With ``SamplingParams.prompt_logprobs=k`` (vLLM's shape): per prompt token a dict
    # ``{token_id: Logprob}`` of the token and the top ``k`` at its position, None for the
    # first; None when not asked for.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # vLLM's: prompt tokens of the first sample whose KV came from the prefix cache (or from
    # the sample that computed the shared prompt).
    num_cached_tokens: int | None = None
    # vLLM's, for code that reads them: no per-request metrics object (``EngineStats`` and
    # the server's /metrics have the figures), adapters, encoder prompts, images or KV
    # transfer parameters here.
    metrics: None = None
    lora_request: None = None
    encoder_prompt: None = None
    encoder_prompt_token_ids: None = None
    multi_modal_placeholders: dict = field(default_factory=dict)
    kv_transfer_params: None = None

    @property
    def text(self) -> str | None:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def exit_depths(self) -> list[int]:
        return self.outputs[0].exit_depths

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def mean_exit_depth(self) -> float:
        return self.outputs[0].mean_exit_depth


@dataclass
class Completion:
    """One sequence as the assembler builds it. ``logprobs`` is the engine's form: per token
    ``{"token_id", "logprob", "top_logprobs"}`` (``logprob`` None for a forced token until a
    later update's ``forced_logprobs`` gives it: ``core/thinking.py``)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    exit_depths: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None  # the stop string or token id that ended generation
    logprobs: list[dict] | None = None
    error: str | None = None
    # With prompt_logprobs: entries as ``logprobs``' for prompt tokens 1.. (the first has no
    # prediction), from the update with the first output token.
    prompt_logprobs: list[dict] | None = None
    num_cached_tokens: int | None = None  # prompt tokens whose KV was reused, not computed

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def mean_exit_depth(self) -> float:
        return sum(self.exit_depths) / len(self.exit_depths) if self.exit_depths else 0.0


@dataclass
class TextDelta:
    """One update turned into text: what a stream emits for it."""

    text: str
    token_ids: list[int]
    exit_depths: list[int]
    logprobs: list[dict]
    finish_reason: str | None
    stop_reason: str | int | None = None
    error: str | None = None


def reported_stop_ids(
    params: SamplingParams, stop_reason_ids: tuple[int, ...], eos_token_id: int | None = None
) -> tuple[int, ...]:
    """The ids a stop on which an output reports as its ``stop_reason``: the request's
    ``stop_token_ids`` and, unless it ignores end ids, the generation config's beyond the
    model's own (``EngineInfo.stop_reason_ids``), as vLLM adds those to ``stop_token_ids``.
    Unless the request ignores end ids, the tokenizer's EOS (``eos_token_id``) is not among
    them even when listed in ``stop_token_ids``: vLLM checks that one id first, and a stop
    there reports None. The other ids the engine stops on by default (Ouro's ``<|im_end|>``,
    Huginn's chat ends) report themselves when listed, as any stop token does in vLLM."""
    if params.ignore_eos:
        return tuple(params.stop_token_ids)
    return (*(t for t in params.stop_token_ids if t != eos_token_id), *stop_reason_ids)


class OutputAssembler:
    """Accumulates one request's updates. Detokenizes incrementally (when a tokenizer is given)
    and ends the text at the first stop string, which it leaves out of the text (kept with
    ``include_stop_str_in_output``), as it leaves out the text of a stop token (EOS or one of
    ``stop_token_ids``) that ended the request (vLLM's rule). A stop string
    may span token boundaries: text that could be the start of a stop string is held back until
    it is known not to be one. As in vLLM, stop strings count only once more than
    ``min_tokens`` tokens exist: a match must end in the text of a later token.
    ``kept_special_ids``: special tokens whose text stays with ``skip_special_tokens``.
    ``observer`` is called with every delta ``add`` makes (not a refused request's) and with
    the end ``fail`` or ``abandon`` makes (the offline front ends' request metrics:
    ``llm_metrics``)."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        tokenizer=None,
        stop: tuple[str, ...] | None = None,
        want_logprobs: bool = False,
        stop_token_ids: tuple[int, ...] = (),
        *,
        skip_special_tokens: bool = True,
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
        kept_special_ids: frozenset[int] = frozenset(),
        observer: Callable[[TextDelta], None] | None = None,
    ) -> None:
        self.output = Completion(request_id, list(prompt_token_ids))
        self._observer = observer
        if want_logprobs:
            self.output.logprobs = []
        self._detok = (
            tokenizer.detokenizer(prompt_token_ids, skip_special_tokens, kept_special_ids)
            if tokenizer is not None
            else None
        )
        self._include_stop = include_stop_str_in_output
        self._stop = tuple(stop or ())
        self._stop_token_ids = frozenset(stop_token_ids)
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._text = ""  # all text decoded so far (may run past what was emitted)
        self._emitted = 0  # characters of _text already handed out
        self._min_tokens = min_tokens
        self._stop_from = 0  # the text of the first min_tokens tokens ends here
        self.rejected = False  # the engine refused the request (invalid arguments)
        self.weight_version = 0  # of the weights that produced the tokens (latest update)
        # A stop string ended the output while forced tokens' scores were still to come
        # (``stopped_awaiting_scores``): its later updates go to ``add_late`` until they have.
        self.scoring = False

    def add(self, update: RequestUpdate) -> TextDelta:
        out = self.output
        before = (len(out.token_ids), len(out.exit_depths), len(out.logprobs or ()))
        out.token_ids.extend(update.new_token_ids)
        out.exit_depths.extend(update.new_exit_depths)
        lps = []
        if out.logprobs is not None:
            ranks = update.new_ranks or repeat(None)
            for tok, lp, top, rank in zip(
                update.new_token_ids, update.new_logprobs, update.new_top_logprobs, ranks
            ):
                lps.append(
                    {"token_id": tok, "logprob": lp, "top_logprobs": top or [], "rank": rank}
                )
            out.logprobs.extend(lps)
            self._add_scores(update)
            # A score may come with its token (a thinking budget of 0: the prompt's last chunk
            # scores the first forced id as the withheld forced ids go out): the delta has it.
            lps = out.logprobs[before[2] :]
        if update.num_cached_tokens is not None:
            out.num_cached_tokens = update.num_cached_tokens
        if update.prompt_logprobs is not None:
            out.prompt_logprobs = [
                {"token_id": tok, "logprob": lp, "top_logprobs": top, "rank": rank}
                for tok, (lp, top, rank) in zip(out.prompt_token_ids[1:], update.prompt_logprobs)
            ]
        finish = update.finish_reason.value if update.finish_reason is not None else None
        stop_reason: str | int | None = None
        if finish == "stop" and update.new_token_ids:
            last = update.new_token_ids[-1]
            stop_reason = last if last in self._stop_token_ids else None
        ends: list[int] = []  # where the text of each of the update's tokens ends
        # A rejected request has no text; its prompt may hold ids the tokenizer cannot decode.
        if self._detok is not None and not update.rejected:
            ids = update.new_token_ids
            if finish == "stop" and ids and not self._include_stop:
                ids = ids[:-1]  # (the engine stops only on a stop token)
            ends = self._add_text(ids, len(out.token_ids) - len(update.new_token_ids))
            if finish is not None:
                self._text += self._detok.flush()
        new_ids, new_depths = update.new_token_ids, update.new_exit_depths
        hit = self._find_stop(ends) if len(out.token_ids) > self._min_tokens else None
        if hit is not None:
            cut, stop_reason, token = hit
            self._text = self._text[: cut + (len(stop_reason) if self._include_stop else 0)]
            finish = "stop"
            # An update of several tokens (the forced end of a bounded thinking span, drafts)
            # ends with the token whose text completes the stop string, as vLLM's outputs do.
            keep = token + 1
            if keep < len(new_ids):
                new_ids, new_depths, lps = new_ids[:keep], new_depths[:keep], lps[:keep]
                del out.token_ids[before[0] + keep :], out.exit_depths[before[1] + keep :]
                if out.logprobs is not None:
                    del out.logprobs[before[2] + keep :]
        end = len(self._text)
        if finish is None and self._stop:
            end = max(self._emitted, end - self._hold)
        delta = self._text[self._emitted : end]
        self._emitted = end
        out.text += delta
        if update.rejected:
            self.rejected = True
        if finish is not None:
            out.finish_reason = finish
            out.stop_reason = stop_reason
            out.error = update.error
        made = TextDelta(
            delta,
            list(new_ids),
            list(new_depths),
            lps,
            finish,
            stop_reason,
            update.error,
        )
        if self._observer is not None and not update.rejected:
            self._observer(made)
        return made

    def abandon(self) -> None:
        """The front end stops reading the request before it ended (a dropped ``AsyncLLM``
        stream, whose engine request it aborts): the observer sees it end as aborted, as
        the engine's abort update, which nobody will assemble, would have ended it."""
        if self.output.finish_reason is None and self._observer is not None:
            self._observer(TextDelta("", [], [], [], "abort"))

    def fail(self, exc: Exception) -> None:
        """Ends the output as failed by ``exc``, raised while assembling an update (a front
        end fails the request rather than the thread or loop it runs on)."""
        self.output.finish_reason = "error"
        self.output.error = f"{type(exc).__name__} while assembling output: {exc}"
        if self._observer is not None:
            self._observer(TextDelta("", [], [], [], "error", error=self.output.error))

    @property
    def awaiting_scores(self) -> bool:
        """Whether the output kept so far holds a token forced by bounded thinking whose
        logprob a later update has yet to give (``core/thinking.py``). A front end whose stop
        string ended the output (the engine does not know) keeps the engine request until it
        is False (``add_late``), so that the result has every score."""
        entries = self.output.logprobs
        return entries is not None and any(e["logprob"] is None for e in entries)

    def stopped_awaiting_scores(self, update: RequestUpdate) -> bool:
        """After ``add(update)``: True, and ``scoring`` set, when a stop string ended the output
        at ``update`` (the engine has not ended the request) while ``awaiting_scores``: the
        front end then gives the request's later updates to ``add_late``, and aborts it and
        delivers the result only once that returns True."""
        out = self.output
        stopped = out.finish_reason == "stop" and update.finish_reason is None
        self.scoring = stopped and self.awaiting_scores
        return self.scoring

    def add_late(self, update: RequestUpdate) -> bool:
        """An update of a request whose output a stop string ended while ``awaiting_scores``:
        writes its ``forced_logprobs`` into the kept output's entries and takes nothing else
        (no tokens, text or finish). True once nothing more is to come from the request: no
        forced entry lacks its score, or the engine ended the request (the output keeps what
        it has); ``scoring`` is cleared then."""
        self._add_scores(update)
        self.scoring = update.finish_reason is None and self.awaiting_scores
        return not self.scoring

    def _add_scores(self, update: RequestUpdate) -> None:
        """Forced tokens scored since they went out (a stop string may have cut them off)."""
        entries = self.output.logprobs
        if entries is None:
            return
        for index, lp, top, rank in update.forced_logprobs or ():
            if index < len(entries):
                entry = {"token_id": self.output.token_ids[index], "logprob": lp, "rank": rank}
                entries[index] = {**entry, "top_logprobs": top or []}

    def _add_text(self, ids: list[int], before: int) -> list[int]:
        """Decodes ``ids``, which follow ``before`` tokens, noting where the text of the
        first ``min_tokens`` tokens ends; returns where each id's text ends."""
        pieces, ends, end = [], [], len(self._text)
        for k, token_id in enumerate(ids):
            piece = self._detok.add(token_id)
            pieces.append(piece)
            end += len(piece)
            ends.append(end)
            if before + k < self._min_tokens:
                self._stop_from = end
        self._text += "".join(pieces)
        return ends

    def _find_stop(self, ends: list[int]) -> tuple[int, str, int] | None:
        """The stop string that ends the output, where it starts and the update's token that
        completes it (``len(ends)``: text after them): the one completed by the earliest of the
        update's tokens (``ends``: where each token's text ends), so the choice does not depend
        on how many tokens an update brings; among those, the first in the ``stop`` list, as
        vLLM checks them token by token in list order."""
        if not self._stop:
            return None
        # Only text not yet emitted or after the first min_tokens tokens' (plus what a stop
        # string could reach back into: less than its length) can hold a new match; emitted
        # text was checked when it arrived.
        base = max(self._emitted, self._stop_from)
        best = None
        for s in self._stop:
            i = self._text.find(s, max(0, base - len(s) + 1))
            if i < 0:
                continue
            token = next((k for k, end in enumerate(ends) if end >= i + len(s)), len(ends))
            if best is None or token < best[2]:
                best = (i, s, token)
        return best


def request_output(
    assemblers: list[OutputAssembler],
    prompt: str | None,
    tokenizer=None,
    request_id: str | None = None,
) -> RequestOutput:
    """The vLLM-shaped result of one prompt's finished samples (``assemblers``, in sample
    order), with ``request_id`` (default: the first sample's). Text is "" where none was made
    (no tokenizer, ``detokenize=False``)."""
    first = assemblers[0].output
    outputs = [
        CompletionOutput(
            index=j,
            text=asm.output.text,
            token_ids=asm.output.token_ids,
            cumulative_logprob=_cumulative(asm.output.logprobs),
            logprobs=vllm_logprobs(asm.output.logprobs, tokenizer),
            finish_reason=asm.output.finish_reason,
            stop_reason=asm.output.stop_reason,
            exit_depths=asm.output.exit_depths,
        )
        for j, asm in enumerate(assemblers)
    ]
    return RequestOutput(
        request_id=first.request_id if request_id is None else request_id,
        prompt=prompt,
        prompt_token_ids=first.prompt_token_ids,
        outputs=outputs,
        finished=all(o.finish_reason is not None for o in outputs),
        weight_version=max(a.weight_version for a in assemblers),
        num_cached_tokens=first.num_cached_tokens,
        prompt_logprobs=(
            None
            if first.prompt_logprobs is None
            else [None, *vllm_logprobs(first.prompt_logprobs, tokenizer)]
        ),
    )


def _cumulative(entries: list[dict] | None) -> float | None:
    if entries is None:
        return None
    return float(sum(e["logprob"] for e in entries if e["logprob"] is not None))


def vllm_logprobs(entries: list[dict] | None, tokenizer) -> list[dict[int, Logprob]] | None:
    """Engine entries -> vLLM's ``{token_id: Logprob}`` per token, the sampled (or prompt)
    token first: the top-k are ranked 1..k, and the token, when not among them, has the rank
    the engine computed (vLLM's dict: a token among the top k keeps its place's rank)."""
    if entries is None:
        return None

    cached = getattr(tokenizer, "token_text", None)  # (rltserve's tokenizer caches them)

    def decoded(token: int) -> str | None:
        if cached is not None:
            return cached(token)
        return tokenizer.decode([token], skip_special_tokens=False) if tokenizer else None

    out = []
    for e in entries:
        if e["logprob"] is None:  # a forced token: nothing was sampled
            out.append({})
            continue
        top = e["top_logprobs"] or []
        d = {tok: Logprob(lp, rank, decoded(tok)) for rank, (tok, lp) in enumerate(top, 1)}
        token = e["token_id"]  # (listed first, as vLLM lists it)
        if token in d:
            d = {token: d[token], **d}
        else:
            d = {token: Logprob(e["logprob"], e.get("rank"), decoded(token)), **d}
        out.append(d)
    return out
