"""An answer's tool calls, read from the text a forced ``tool_choice`` constrained
(``tool_choice.ForcedTools``): OpenAI's ``message.tool_calls`` and, streamed, its
``delta.tool_calls`` pieces, as vLLM returns them.

A named function's output is its arguments: one call. ``"required"``'s output is a JSON array of
``{"name": ..., "parameters": {...}}`` objects: a call each, its arguments the ``parameters``
value's text as generated (whitespace included, so that the streamed pieces join to the
arguments of the whole answer). A stream opens each call with a delta of its ``index``, ``id``
(``chatcmpl-tool-<hex>``, vLLM's), ``type`` and ``function.name`` with ``arguments`` "", then
sends the arguments' text as it comes. An answer cut short (``max_tokens``) has the calls begun
so far, their arguments as far as they got.
"""

from __future__ import annotations

import json
from typing import Any

from rltserve.http.generation import ChoiceEvent
from rltserve.http.hermes_tools import tool_call_id
from rltserve.http.responses import ChatFormat
from rltserve.http.tool_choice import ForcedTools
from rltserve.outputs import Completion


def finish_reason(forced: ForcedTools, reason: str | None) -> str | None:
    """A choice's ``finish_reason``: "tool_calls" for "required"'s complete array (vLLM's);
    a named function's call keeps the output's ("stop"), as OpenAI's and vLLM's do."""
    return "tool_calls" if forced.name is None and reason == "stop" else reason


class ToolCallStream:
    """One choice's tool calls as its text arrives: ``feed`` each piece of text, which gives
    the ``delta.tool_calls`` entries it adds (a call's opening entry before its arguments)."""

    def __init__(self, forced: ForcedTools) -> None:
        self.name = forced.name
        self.calls: list[dict[str, Any]] = []  # as ``message.tool_calls`` has them
        self._array = _ArrayReader() if forced.name is None else None

    def feed(self, text: str) -> list[dict[str, Any]]:
        if self._array is None:  # (a named function: the text is its arguments)
            entries = [] if self.calls else [self._open(self.name or "")]
            return entries + self._arguments(0, text)
        entries = []
        for kind, value in self._array.feed(text):
            if kind == "name":
                entries.append(self._open(value))
            elif self.calls:  # (arguments: of the call opened last)
                entries.extend(self._arguments(len(self.calls) - 1, value))
        return _merged(entries)

    def _open(self, name: str) -> dict[str, Any]:
        call_id, index = tool_call_id(), len(self.calls)
        function = {"name": name, "arguments": ""}
        self.calls.append({"id": call_id, "type": "function", "function": dict(function)})
        return {"index": index, "id": call_id, "type": "function", "function": function}

    def _arguments(self, index: int, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        self.calls[index]["function"]["arguments"] += text
        return [{"index": index, "function": {"arguments": text}}]


def tool_calls(forced: ForcedTools, text: str) -> list[dict[str, Any]]:
    """The calls of a whole answer (``message.tool_calls``)."""
    stream = ToolCallStream(forced)
    stream.feed(text)
    return stream.calls


def _merged(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Consecutive argument pieces of one call as one entry."""
    out: list[dict[str, Any]] = []
    for entry in entries:
        last = out[-1] if out else None
        opening = last is None or "id" in last or "id" in entry
        if not opening and last["index"] == entry["index"]:
            last["function"]["arguments"] += entry["function"]["arguments"]
            continue
        out.append(entry)
    return out


class ToolCallFormat(ChatFormat):
    """``ChatFormat`` of a request whose ``tool_choice`` forces calls: each answer is its tool
    calls, ``content`` "" (vLLM's; the echoed prefill where ``echo`` asks for it). No thinking
    span is split off: the constraint holds from the answer's first token."""

    def __init__(self, header, req, frontend, forced: ForcedTools, echo: str = "") -> None:
        super().__init__(header, req, frontend, reasoning=False, echo=echo)
        self.forced = forced
        self._own_spans = False
        self._streams: dict[int, ToolCallStream] = {}  # choice index -> its calls so far

    def final_choice(self, index: int, output: Completion) -> dict:
        entry = super().final_choice(index, output)
        entry["message"]["content"] = self.echo
        entry["message"]["tool_calls"] = tool_calls(self.forced, output.text)
        entry["finish_reason"] = finish_reason(self.forced, output.finish_reason)
        return entry

    def _stream_choices(self, event: ChoiceEvent, first: bool) -> list[dict]:
        """A chunk per ``delta.tool_calls`` entry (a call's opening one apart from its
        arguments); the event's last chunk carries its logprobs and finish_reason (a chunk of
        its own where the event added no call text)."""
        delta = event.delta
        stream = self._streams.setdefault(event.index, ToolCallStream(self.forced))
        entries = [
            {"index": event.index, "delta": {"tool_calls": [piece]}, "logprobs": None}
            for piece in stream.feed(delta.text)
        ]
        for entry in entries:
            entry["finish_reason"] = None
        logprobs = self._logprobs(delta.logprobs) if event.output.logprobs is not None else None
        final = delta.finish_reason is not None
        listed = logprobs is not None and logprobs["content"]
        if not (final or listed or self.want_ids or self.want_depths):
            return entries
        if not entries:
            entries.append({"index": event.index, "delta": {}, "logprobs": None})
        last = entries[-1]
        last["logprobs"] = logprobs
        last["finish_reason"] = finish_reason(self.forced, delta.finish_reason)
        if final:
            last["stop_reason"] = delta.stop_reason
        self._extensions(last, delta.token_ids, delta.exit_depths)
        return entries


class _ArrayReader:
    """Reads "required"'s array a character at a time: each element's ``name`` once its
    string is whole (``("name", name)``), then its ``parameters`` value's text as it comes
    (``("arguments", text)``). The constraint made the text valid JSON so far, its keys in
    the schema's order (``name`` first: outlines-core keeps the properties' order); this only
    tracks nesting, strings and the element's keys."""

    def __init__(self) -> None:
        self._depth = 0  # (1: in the array; 2: in an element)
        self._string: list[str] | None = None  # the string being read, or None
        self._escape = False
        self._key: str | None = None  # the element's key whose value comes next, or None
        self._pending_key: str | None = None  # the key read last (its ":" not yet)
        self._reading_key = False
        self._nesting = 0  # (brackets open inside the parameters value)
        self._opener: str | None = None  # the parameters value's first character, once read
        self._capture: str | None = None  # "name" or "arguments" while reading that value
        self._captured: list[str] = []

    def feed(self, text: str) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        for char in text:
            self._char(char, out)
        if self._capture == "arguments" and self._captured:
            out.append(("arguments", "".join(self._captured)))
            self._captured = []
        return out

    def _char(self, char: str, out: list[tuple[str, str]]) -> None:
        if self._capture == "arguments":
            self._argument_char(char, out)
            return
        if self._string is not None:
            if self._escape:
                self._escape = False
            elif char == "\\":
                self._escape = True
            elif char == '"':
                self._end_string(out)
                return
            self._string.append(char)
            return
        if char == '"':
            self._string = []
            self._reading_key = self._depth == 2 and self._key is None
        elif char == "{" or char == "[":
            self._depth += 1
        elif char == "}" or char == "]":
            self._depth -= 1
        elif char == ":" and self._depth == 2:
            self._key = self._pending_key
            if self._key == "parameters":
                self._capture, self._nesting = "arguments", 0
        elif char == "," and self._depth == 2:
            self._key = None

    def _end_string(self, out: list[tuple[str, str]]) -> None:
        value = json.loads('"' + "".join(self._string or []) + '"')
        self._string = None
        if self._reading_key:
            self._pending_key, self._reading_key = value, False
        elif self._depth == 2 and self._key == "name":
            out.append(("name", value))

    def _argument_char(self, char: str, out: list[tuple[str, str]]) -> None:
        """A character of the parameters value (whitespace before it left out); its end,
        where the element's ``,`` or ``}`` follows it, goes back to reading the element."""
        if self._opener is None:
            if char.isspace():
                return
            self._opener = char
        if self._string is not None:  # (a string inside the value)
            if self._escape:
                self._escape = False
            elif char == "\\":
                self._escape = True
            elif char == '"':
                self._string = None
        elif char == '"':
            self._string = []
        elif char in "{[":
            self._nesting += 1
        elif char in "}]" or char == ",":
            if self._nesting == 0:  # (the element's own: the value ended before it)
                self._end_arguments(out)
                self._char(char, out)
                return
            if char != ",":
                self._nesting -= 1
        self._captured.append(char)
        if self._nesting == 0 and self._opener in "{[" and char in "}]":
            self._end_arguments(out)

    def _end_arguments(self, out: list[tuple[str, str]]) -> None:
        if self._captured:
            out.append(("arguments", "".join(self._captured)))
        self._captured, self._capture, self._key, self._opener = [], None, None, None
