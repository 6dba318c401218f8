"""``tool_choice: "auto"``, as vLLM serves it with ``--enable-auto-tool-choice
--tool-call-parser NAME``: the model answers freely, and the calls it writes in its model's
format are read from the answer (after its thinking span, where it has one) by the parser the
operator named (``PARSERS``; ``hermes_tools``).

An answer that calls tools has ``message.tool_calls`` and ``finish_reason`` "tool_calls" (its
own where it did not stop by itself: "length" says the calls may be cut short); one that calls
none is the ordinary message, ``tool_calls`` absent. Streamed, a call goes out once its block
has closed: a delta of its ``index``, ``id``, ``type`` and ``function.name`` (``arguments``
""), then one of its ``arguments``, each in a chunk of its own, as ``tool_calls`` streams
forced calls; the content deltas and calls add up to the message of a whole answer.
"""

from __future__ import annotations

from typing import Any

from rltserve.http.hermes_tools import TAGS, HermesCalls
from rltserve.http.responses import ChatFormat
from rltserve.outputs import Completion
from rltserve.thinking import tag_id

# ``--tool-call-parser`` names -> the reader of that call format (``tool_choice``'s
# ``TOOL_CALL_PARSERS`` lists the names for the config, which must not import this).
PARSERS = {"hermes": HermesCalls}


def tool_tag_ids(tokenizer, parser: str) -> frozenset[int]:
    """The ids of the parser's tags where the tokenizer makes them special tokens: the parser
    needs their text, which ``skip_special_tokens`` would drop (vLLM's hermes parser turns
    ``skip_special_tokens`` off for the same reason)."""
    if tokenizer is None or parser != "hermes":
        return frozenset()
    special = getattr(tokenizer, "special_ids", ())
    ids = (tag_id(tokenizer, tag) for tag in TAGS)  # (not the whole vocabulary per request)
    return frozenset(i for i in ids if i is not None and i in special)


def finish_reason(called: bool, reason: str | None) -> str | None:
    return "tool_calls" if called and reason == "stop" else reason


class AutoToolFormat(ChatFormat):
    """``ChatFormat`` of a chat request whose model may call ``tools`` (``tool_choice``
    "auto"): the content of each answer goes through the parser's reader."""

    def __init__(self, header, req, frontend, parser: str, reasoning=False, echo="") -> None:
        super().__init__(header, req, frontend, reasoning=reasoning, echo=echo)
        self._reader = PARSERS[parser]
        # (OpenAI's parallel_tool_calls false: one call at most, the first)
        self._max_calls = 1 if req.parallel_tool_calls is False else None
        self._readers: dict[int, HermesCalls] = {}  # choice index -> its reader

    def final_choice(self, index: int, output: Completion) -> dict:
        entry = super().final_choice(index, output)
        message = entry["message"]
        if message["content"] is None:  # (still thinking, or nothing after the span)
            return entry
        answer = message["content"][len(self.echo) :]  # (an echoed prefill is no answer's)
        content, calls = self._reader(self._max_calls).read(answer)
        if calls:
            message["content"] = (self.echo + (content or "")) or None
            message["tool_calls"] = calls
            entry["finish_reason"] = finish_reason(True, output.finish_reason)
        return entry

    def _stream_deltas(self, index: int, shown: dict, final: bool) -> list[dict]:
        """The event's reasoning and content, and two deltas for each call it closed (its
        opening, then its arguments)."""
        reader = self._readers.setdefault(index, self._reader(self._max_calls))
        pieces = reader.feed(shown.pop("content", ""))
        if final:
            pieces += reader.flush()
        deltas: list[dict[str, Any]] = [shown] if shown else []
        for kind, value in pieces:
            if kind == "content":
                if deltas and set(deltas[-1]) <= {"reasoning", "reasoning_content"}:
                    deltas[-1]["content"] = value
                else:
                    deltas.append({"content": value})
                continue
            call = next(i for i, c in enumerate(reader.calls) if c is value)
            function = value["function"]
            opening = {**value, "function": {"name": function["name"], "arguments": ""}}
            deltas.append({"tool_calls": [{"index": call, **opening}]})
            arguments = {"arguments": function["arguments"]}
            deltas.append({"tool_calls": [{"index": call, "function": arguments}]})
        return deltas

    def _stream_finish(self, index: int, reason: str | None) -> str | None:
        return finish_reason(bool(self._readers[index].calls), reason)
