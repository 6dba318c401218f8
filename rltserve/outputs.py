"""What users get back: ``RequestOutput`` (offline) and the per-request text assembler that turns
token updates into text deltas, applying stop strings (shared by the LLM API and the server)."""

from __future__ import annotations

from dataclasses import dataclass, field

from rltserve.updates import RequestUpdate


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    exit_depths: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None  # the stop string or token id that ended generation
    logprobs: list[dict] | None = None  # per token: {"token_id", "logprob", "top_logprobs"}
    error: str | None = None

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


class OutputAssembler:
    """Accumulates one request's updates. Detokenizes incrementally (when a tokenizer is given)
    and ends the text at the first stop string, which it leaves out of the text. A stop string
    may span token boundaries: text that could be the start of a stop string is held back until
    it is known not to be one."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        tokenizer=None,
        stop: tuple[str, ...] | None = None,
        want_logprobs: bool = False,
        stop_token_ids: tuple[int, ...] = (),
    ) -> None:
        self.output = RequestOutput(request_id, list(prompt_token_ids))
        if want_logprobs:
            self.output.logprobs = []
        self._detok = tokenizer.detokenizer(prompt_token_ids) if tokenizer is not None else None
        self._stop = tuple(stop or ())
        self._stop_token_ids = frozenset(stop_token_ids)
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._text = ""  # all text decoded so far (may run past what was emitted)
        self._emitted = 0  # characters of _text already handed out
        self.rejected = False  # the engine refused the request (invalid arguments)

    def add(self, update: RequestUpdate) -> TextDelta:
        out = self.output
        out.token_ids.extend(update.new_token_ids)
        out.exit_depths.extend(update.new_exit_depths)
        lps = []
        if out.logprobs is not None:
            for tok, lp, top in zip(
                update.new_token_ids, update.new_logprobs, update.new_top_logprobs
            ):
                lps.append({"token_id": tok, "logprob": lp, "top_logprobs": top or []})
            out.logprobs.extend(lps)
        finish = update.finish_reason.value if update.finish_reason is not None else None
        stop_reason: str | int | None = None
        if finish == "stop" and update.new_token_ids:
            last = update.new_token_ids[-1]
            stop_reason = last if last in self._stop_token_ids else None
        # A rejected request has no text; its prompt may hold ids the tokenizer cannot decode.
        if self._detok is not None and not update.rejected:
            self._text += self._detok.add_many(update.new_token_ids)
            if finish is not None:
                self._text += self._detok.flush()
        hit = self._find_stop()
        if hit is not None:
            cut, stop_reason = hit
            self._text = self._text[:cut]
            finish = "stop"
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
        return TextDelta(
            delta,
            list(update.new_token_ids),
            list(update.new_exit_depths),
            lps,
            finish,
            stop_reason,
            update.error,
        )

    def _find_stop(self) -> tuple[int, str] | None:
        if not self._stop:
            return None
        # Only text not yet emitted (plus what a stop string could reach back into) can hold a
        # new match; emitted text was checked when it arrived.
        begin = max(0, self._emitted - self._hold)
        best: tuple[int, str] | None = None
        for s in self._stop:
            i = self._text.find(s, begin)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        return best
