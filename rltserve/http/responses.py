"""OpenAI response bodies and stream chunks for completions and chat completions.

Key order is OpenAI's (``id, object, created, model, choices, usage``; a choice is ``index,
text|message|delta, logprobs, finish_reason``) since streams are compared byte for byte. The
opt-in extensions ``exit_depths`` and ``token_ids`` follow ``finish_reason`` in a choice.
Stream chunks carry a ``usage`` key only when the client asked for usage (null until the last,
``choices: []`` chunk; or, with ``continuous_usage_stats``, each chunk's choice so far: its
prompt and its tokens, as vLLM counts them).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, NamedTuple

from rltserve.http.chat_messages import answer_role
from rltserve.http.frontend import Frontend
from rltserve.http.generation import ChoiceEvent
from rltserve.http.schemas import ChatCompletionRequest, CompletionRequest
from rltserve.outputs import Completion, vllm_logprobs
from rltserve.thinking import THINK_START, ReasoningStream, split_reasoning

_MIN_LOGPROB = -9999.0  # JSON has no -inf; vLLM clamps the same way


@dataclass(frozen=True)
class ResponseHeader:
    """The fields every chunk of one response repeats."""

    id: str
    created: int
    model: str


def usage(
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int = 0,
    reasoning_tokens: int | None = None,
) -> dict[str, Any]:
    """OpenAI's usage object; ``prompt_tokens_details.cached_tokens`` (prompt tokens whose KV
    was reused, not computed) only when some were; ``completion_tokens_details.
    reasoning_tokens`` only where a chat answer was split into reasoning and content
    (``ChatFormat.reasoning_tokens``)."""
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    if reasoning_tokens is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return out


def _logprob(value: float | None) -> float | None:
    if value is None:
        return None
    return value if math.isfinite(value) else _MIN_LOGPROB


class StreamEntries(NamedTuple):
    """The chunk entries of one stream event: ``opening`` ones (a chat's role chunk and echo,
    which carry none of the event's tokens, so a running usage counts them before it), then
    those of its tokens."""

    opening: list[dict]
    tokens: list[dict]


def _as_id(token_id: int) -> str:
    return f"token_id:{token_id}"


def _as_id_bytes(token_id: int) -> list[int]:
    return list(_as_id(token_id).encode())


class _Format(ABC):
    object_name = ""
    chunk_object_name = ""

    def __init__(
        self,
        header: ResponseHeader,
        req: CompletionRequest | ChatCompletionRequest,
        frontend: Frontend,
    ) -> None:
        self.header = header
        self.frontend = frontend
        self.want_depths = req.return_exit_depths
        self.want_ids = req.return_token_ids
        as_ids = req.return_tokens_as_token_ids
        as_ids = frontend.tokens_as_ids if as_ids is None else as_ids
        # How logprobs name a token: its text and bytes, or vLLM's "token_id:N" and its bytes.
        self.token_text = _as_id if as_ids else frontend.token_text
        self.token_bytes = _as_id_bytes if as_ids else frontend.token_bytes
        self._started: set[int] = set()

    def _envelope(self, object_name: str) -> dict[str, Any]:
        h = self.header
        return {"id": h.id, "object": object_name, "created": h.created, "model": h.model}

    def chunk(self, choices: list[dict]) -> dict[str, Any]:
        return {**self._envelope(self.chunk_object_name), "choices": choices}

    def response(self, choices: list[dict], usage_: dict) -> dict[str, Any]:
        return {**self._envelope(self.object_name), "choices": choices, "usage": usage_}

    def _extensions(
        self,
        entry: dict,
        token_ids: list[int],
        exit_depths: list[int],
        prompt_token_ids: list[int] | None = None,
    ) -> dict:
        """``prompt_token_ids``: given where a choice lists its prompt's ids (completions: in
        its first chunk), vLLM's ``return_token_ids``."""
        if self.want_depths:
            entry["exit_depths"] = exit_depths
        if self.want_ids:
            if prompt_token_ids is not None:
                entry["prompt_token_ids"] = prompt_token_ids
            entry["token_ids"] = token_ids
        return entry

    def stream_choices(self, event: ChoiceEvent) -> StreamEntries:
        """The choice entries (one per chunk) that one event turns into."""
        first = event.index not in self._started
        self._started.add(event.index)
        opening = self._opening(event) if first else []
        return StreamEntries(opening, self._stream_choices(event, first))

    def _opening(self, event: ChoiceEvent) -> list[dict]:
        """The entries that open a choice's stream, ahead of its first event's tokens."""
        return []

    @abstractmethod
    def _stream_choices(self, event: ChoiceEvent, first: bool) -> list[dict]:
        """The chunk entries of one event (the first event of a choice has ``first``)."""

    @abstractmethod
    def final_choice(self, index: int, output: Completion) -> dict:
        """The choice entry of a non-streaming response."""

    def reasoning_tokens(self, outputs: dict[int, Completion]) -> int | None:
        """``usage``'s reasoning tokens of the choices; None: no answer was split."""
        return None


class CompletionFormat(_Format):
    object_name = chunk_object_name = "text_completion"

    def __init__(self, header, req: CompletionRequest, frontend, echo_texts: dict[int, str]):
        super().__init__(header, req, frontend)
        self.echo_texts = echo_texts  # choice index -> prompt text, when echo is on
        self.prompt_only = req.prompt_only  # (echo with max_tokens=0: the sampled token goes)
        self.want_prompt_logprobs = req.prompt_logprobs is not None
        self.echo = req.echo  # (prompt logprobs asked for alone stay out of ``logprobs``)
        self.top_k = req.logprobs or 0  # (echoed prompt entries carry prompt_logprobs' count)
        self._offsets: dict[int, int] = {}  # choice index -> text_offset of its next token

    def _stream_choices(self, event: ChoiceEvent, first: bool) -> list[dict]:
        delta, output = event.delta, event.output
        text, ids, depths, entries = delta.text, delta.token_ids, delta.exit_depths, delta.logprobs
        if self.prompt_only:
            text, ids, depths, entries = "", [], [], []
        if first:
            text = self._echo(event.index, output) + text
        elif not (text or ids or delta.finish_reason):
            # An update that only scores forced thinking tokens sent before (their logprobs
            # stay null in a stream): no chunk, as none is sent for nothing new.
            return []
        logprobs = None
        if output.logprobs is not None:  # the request asked for logprobs
            logprobs = self._logprobs(event.index, self._prompt_entries(output, first) + entries)
        finish = delta.finish_reason
        entry = {
            "index": event.index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": "length" if self.prompt_only and finish else finish,
        }
        if finish is not None:
            entry["stop_reason"] = None if self.prompt_only else delta.stop_reason
        if first:
            self._add_prompt_logprobs(entry, output)
        prompt_ids = output.prompt_token_ids if first else None
        return [self._extensions(entry, ids, depths, prompt_ids)]

    def final_choice(self, index: int, output: Completion) -> dict:
        echo = self._echo(index, output)
        text, ids, depths = output.text, output.token_ids, output.exit_depths
        entries, finish = output.logprobs, output.finish_reason
        if self.prompt_only:
            text, ids, depths = "", [], []
            entries = None if entries is None else []
            finish = finish and "length"
        logprobs = None
        if entries is not None:
            logprobs = self._logprobs(index, self._prompt_entries(output, True) + entries)
        entry = {
            "index": index,
            "text": echo + text,
            "logprobs": logprobs,
            "finish_reason": finish,
            "stop_reason": None if self.prompt_only else output.stop_reason,
        }
        self._add_prompt_logprobs(entry, output)
        return self._extensions(entry, ids, depths, output.prompt_token_ids)

    def _add_prompt_logprobs(self, entry: dict, output: Completion) -> None:
        """vLLM's ``prompt_logprobs`` of a choice (in its first chunk when streamed)."""
        if not self.want_prompt_logprobs or output.prompt_logprobs is None:
            return
        positions = vllm_logprobs(output.prompt_logprobs, self.frontend.tokenizer) or []
        entry["prompt_logprobs"] = [None] + [
            {
                str(token): {
                    "logprob": _logprob(lp.logprob),
                    "rank": lp.rank,
                    "decoded_token": lp.decoded_token,
                }
                for token, lp in position.items()
            }
            for position in positions
        ]

    def _echo(self, index: int, output: Completion) -> str:
        """The echoed prompt's text; sets where the next token's ``text_offset`` is: after it,
        or at 0 when the prompt's tokens are listed (with their logprobs) from there."""
        echo = self.echo_texts.get(index, "")
        listed = self.echo and output.prompt_logprobs is not None
        self._offsets[index] = 0 if listed else len(echo)
        return echo

    def _prompt_entries(self, output: Completion, first: bool) -> list[dict]:
        """Echo with logprobs: the prompt's tokens as logprob entries (the first has none),
        before the output's, in a choice's first chunk."""
        if not first or not self.echo or output.prompt_logprobs is None:
            return []
        head = {"token_id": output.prompt_token_ids[0], "logprob": None, "top_logprobs": None}
        return [head, *output.prompt_logprobs]

    def _logprobs(self, index: int, entries: list[dict]) -> dict:
        tokens, values, tops, offsets = [], [], [], []
        offset = self._offsets.get(index, 0)
        text_of = self.token_text
        for entry in entries:
            token = text_of(entry["token_id"])
            tokens.append(token)
            values.append(_logprob(entry["logprob"]))
            top = entry["top_logprobs"]
            if top is not None and entry["logprob"] is not None:
                # The token itself is listed too, first (OpenAI's "up to logprobs+1"; vLLM's).
                top = [(entry["token_id"], entry["logprob"]), *top[: self.top_k]]
            tops.append(None if top is None else {text_of(t): _logprob(lp) for t, lp in top})
            offsets.append(offset)
            offset += len(token)
        self._offsets[index] = offset
        return {
            "tokens": tokens,
            "token_logprobs": values,
            "top_logprobs": tops,
            "text_offset": offsets,
        }


class OwnSpanStream:
    """``ReasoningStream`` for an answer that opens its own thinking span (its first token is
    ``<think>``): the tag's text, at the start, is dropped (held until it is whole), the rest
    split as the prompt had opened the span."""

    def __init__(self) -> None:
        self._inner = ReasoningStream()
        self._head: str | None = ""  # the text so far while it may still be the tag; then None

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) of one delta."""
        if self._head is not None:
            head = self._head + text
            if len(head) < len(THINK_START) and THINK_START.startswith(head):
                self._head = head
                return "", ""
            self._head = None
            text = head.removeprefix(THINK_START)  # (a special <think> skipped: no tag text)
        return self._inner.feed(text)

    def flush(self) -> tuple[str, str]:
        held, self._head = self._head or "", None
        reasoning, content = self._inner.feed(held) if held else ("", "")
        more = self._inner.flush()
        return reasoning + more[0], content + more[1]


class ChatFormat(_Format):
    """An answer with a thinking span is split: its text up to ``</think>`` is ``reasoning``
    (vLLM's field) and ``reasoning_content`` (its earlier name, the same text), in messages and
    stream deltas; the rest is ``content``; the tags are neither. The span is the prompt's where
    it left one open (``reasoning``: ``<think>`` with no ``</think>`` after it, as
    ``enable_thinking`` renders), else the answer's own where its first token is ``<think>``
    (as vLLM's deepseek_r1 and qwen3 parsers split it; only where the tokenizer has both tags
    as tokens and the text keeps ``</think>``). An answer still thinking is all reasoning.
    A split answer with nothing after its span has null ``content`` (vLLM's parsers return
    ``content or None``); an answer with no span keeps its text, "" included.
    ``include_reasoning`` false (vLLM's) leaves the reasoning out; ``usage`` counts its tokens
    either way.

    The answer's ``role`` is the server's ``response_role`` (``assistant``), or the last
    message's where the answer continues it (``chat_messages.answer_role``).

    ``echo`` (vLLM's chat ``echo``): the text of the request's last message, where its role
    is the answer's, is put before each choice's content (in a stream: a chunk of its own after
    the role chunk); it is content even beside a reasoning split and has no logprobs."""

    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def __init__(self, header, req, frontend, reasoning: bool = False, echo: str = "") -> None:
        super().__init__(header, req, frontend)
        self.role = answer_role(
            req.add_generation_prompt, req.messages[-1].role, frontend.response_role
        )
        self.reasoning = reasoning
        self.echo = echo  # (``chat_messages.echoed_text``: "" where nothing is echoed)
        self.include_reasoning = req.include_reasoning
        self._start_id, self._end_id = frontend.think_ids
        # (where skip_special_tokens drops a special </think>, the split would find no end)
        kept = self._end_id not in getattr(frontend.tokenizer, "special_ids", ())
        kept = kept or not req.skip_special_tokens
        self._own_spans = not reasoning and None not in frontend.think_ids and kept
        # choice index -> its splitter, or None where its answer has no thinking span
        self._splitters: dict[int, ReasoningStream | OwnSpanStream | None] = {}
        # With return_token_ids, the (one) prompt's ids go top-level, as vLLM puts them: in the
        # response, or in the stream's first chunk only (``_prompt_ids_sent`` after it); None
        # when not asked for.
        self._prompt_ids: list[int] | None = None
        self._prompt_ids_sent = False

    def _has_span(self, token_ids: list[int]) -> bool:
        """Whether an answer (its first tokens will do) has a thinking span to split off."""
        if self.reasoning:
            return True
        return self._own_spans and bool(token_ids) and token_ids[0] == self._start_id

    def reasoning_tokens(self, outputs: dict[int, Completion]) -> int | None:
        """The completion tokens of the choices' thinking spans: of each split answer, its
        tokens up to and including the first ``</think>`` token (the opening ``<think>`` of an
        answer that opened its own span too; all of them while it is still thinking)."""
        counts = [
            self._span_tokens(output.token_ids)
            for output in outputs.values()
            if self._has_span(output.token_ids)
        ]
        return sum(counts) if counts else None

    def _span_tokens(self, token_ids: list[int]) -> int:
        if self._end_id in token_ids:
            return token_ids.index(self._end_id) + 1
        return len(token_ids)

    def _note_prompt(self, output: Completion) -> None:
        if self.want_ids and not self._prompt_ids_sent:
            self._prompt_ids = output.prompt_token_ids

    def chunk(self, choices: list[dict]) -> dict[str, Any]:
        out = super().chunk(choices)
        if self._prompt_ids is not None and not self._prompt_ids_sent:
            out["prompt_token_ids"] = self._prompt_ids
            self._prompt_ids_sent = True
        return out

    def response(self, choices: list[dict], usage_: dict) -> dict[str, Any]:
        out = super().response(choices, usage_)
        if self._prompt_ids is not None:
            out["prompt_token_ids"] = self._prompt_ids
        return out

    def _splitter(self, index: int, token_ids: list[int]) -> ReasoningStream | OwnSpanStream | None:
        """The choice's splitter, chosen when its first token is known (None: no span)."""
        if index not in self._splitters:
            if not (self.reasoning or token_ids):
                return None  # (not known yet: no token so far)
            if not self._has_span(token_ids):
                self._splitters[index] = None
            else:
                self._splitters[index] = ReasoningStream() if self.reasoning else OwnSpanStream()
        return self._splitters[index]

    def _delta(self, index: int, text: str, final: bool, token_ids: list[int]) -> dict:
        splitter = self._splitter(index, token_ids)
        if splitter is None:
            return {} if final and not text else {"content": text}
        reasoning, content = splitter.feed(text)
        if final:
            more = splitter.flush()
            reasoning, content = reasoning + more[0], content + more[1]
        out = {}
        if reasoning and self.include_reasoning:
            out["reasoning"] = out["reasoning_content"] = reasoning
        if content:
            out["content"] = content
        return out

    def _opening(self, event: ChoiceEvent) -> list[dict]:
        self._note_prompt(event.output)
        deltas = [{"role": self.role, "content": ""}]
        if self.echo:
            deltas.append({"content": self.echo})
        return [
            {"index": event.index, "delta": delta, "logprobs": None, "finish_reason": None}
            for delta in deltas
        ]

    def _stream_choices(self, event: ChoiceEvent, first: bool) -> list[dict]:
        """A chunk per delta the event shows (``_stream_deltas``: one here); the last carries
        the event's logprobs and finish_reason (a chunk of its own where it shows nothing)."""
        delta = event.delta
        final = delta.finish_reason is not None
        shown = self._delta(event.index, delta.text, final, event.output.token_ids)
        deltas = self._stream_deltas(event.index, shown, final)
        logprobs = self._logprobs(delta.logprobs) if event.output.logprobs is not None else None
        listed = logprobs is not None and logprobs["content"]  # (forced tokens list none)
        if not (deltas or final or listed or self.want_ids or self.want_depths):
            # Tokens that show nothing (a </think>, forced or sampled without logprobs, and
            # reasoning left out by include_reasoning): no chunk, as vLLM's reasoning parsers
            # send none, so no client reads one as output.
            return []
        entries = [
            {"index": event.index, "delta": d, "logprobs": None, "finish_reason": None}
            for d in deltas or [{}]
        ]
        last = entries[-1]
        last["logprobs"] = logprobs
        last["finish_reason"] = self._stream_finish(event.index, delta.finish_reason)
        if final:
            last["stop_reason"] = delta.stop_reason
        self._extensions(last, delta.token_ids, delta.exit_depths)
        return entries

    def _stream_deltas(self, index: int, shown: dict, final: bool) -> list[dict]:
        """The chunk deltas of what choice ``index``'s event shows (its reasoning and content:
        one delta, none where it shows nothing)."""
        return [shown] if shown else []

    def _stream_finish(self, index: int, reason: str | None) -> str | None:
        """Choice ``index``'s finish_reason as its stream sends it."""
        return reason

    def final_choice(self, index: int, output: Completion) -> dict:
        self._note_prompt(output)
        logprobs = None if output.logprobs is None else self._logprobs(output.logprobs)
        message: dict[str, Any] = {"role": self.role, "content": output.text}
        if self._has_span(output.token_ids):
            text = output.text if self.reasoning else output.text.removeprefix(THINK_START)
            reasoning, content = split_reasoning(text, prompt_open=True)
            message["content"] = content or None
            if self.include_reasoning:
                message["reasoning"] = message["reasoning_content"] = reasoning
        if self.echo:
            message["content"] = self.echo + (message["content"] or "")
        entry = {
            "index": index,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": output.finish_reason,
            "stop_reason": output.stop_reason,
        }
        return self._extensions(entry, output.token_ids, output.exit_depths)

    def _logprobs(self, entries: list[dict]) -> dict:
        text_of, bytes_of = self.token_text, self.token_bytes

        def item(token_id: int, value: float | None) -> dict:
            token = text_of(token_id)
            return {"token": token, "logprob": _logprob(value), "bytes": bytes_of(token_id)}

        content = []
        for entry in entries:
            if entry["logprob"] is None:  # a forced token (bounded thinking): nothing sampled
                continue
            record = item(entry["token_id"], entry["logprob"])
            record["top_logprobs"] = [item(t, lp) for t, lp in entry["top_logprobs"]]
            content.append(record)
        return {"content": content}
