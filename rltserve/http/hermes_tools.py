"""The Hermes tool-call format (Hermes', Qwen's and most open chat models' templates; vLLM's
``hermes`` tool parser): an answer calls tools by writing blocks

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one or more, possibly after some text. ``HermesCalls`` reads them from an answer's text as it
arrives, so that a stream and a whole answer read alike:

- a block is a call when its text is a JSON object with a non-empty string ``name`` and
  ``arguments`` an object (or a JSON string of one; left out or null: ``{}``). Its arguments are
  that object as vLLM writes it (``json.dumps``, ``ensure_ascii=False``); a block that names
  them ``parameters`` (as models trained on the Llama 3 JSON format write them) has them there
  (never a call without the arguments it was given). A call of a function the
  request's ``tools`` lack is returned as any other, as vLLM's parser returns it: the client's
  tool dispatch is where an unknown name is answered.
- a block that is not a call (not JSON, no name) stays text, tags and all (as vLLM's parser
  leaves an answer whose blocks do not parse);
- a ``</tool_call>`` inside one of a block's JSON strings (arguments are any text: a file a
  call writes may hold the tag) does not end it; where the string never closes, the block ends
  at that first tag after all (judged at the answer's end);
- the answer's content is its text outside the calls: all of it where no call was made (the
  answer as any other); else the text before the first call and any text after one that holds
  more than whitespace (the line breaks between blocks are not content); null where that leaves
  only whitespace.
- a block the answer leaves open (cut short by ``max_tokens``, or ended by a stop token or
  string in place of ``</tool_call>``) is a call if its text is one, else text.

Streamed, text goes out as it comes except what may be the start of a ``<tool_call>`` tag (held
until the next text tells), whitespace that may turn out to be no content (held until text
follows it), and a block (held until it closes, then sent as a call or as text).
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

START, END = "<tool_call>", "</tool_call>"
# (The tags' ids where the tokenizer has them as tokens: ``tool_tag_ids``.)
TAGS = (START, END)


def tool_call_id() -> str:
    """A call's id, as vLLM makes them (forced calls' too, ``tool_calls``)."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def held_prefix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that ``tag`` starts with (but is not all of
    ``tag``): the characters that may be a tag's beginning."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


def call_of(block: str) -> tuple[str, str] | None:
    """(name, arguments JSON text) of a block's text, or None where it is no call."""
    try:
        value = json.loads(block)
    except ValueError:
        return None
    if not isinstance(value, dict):
        return None
    name, arguments = value.get("name"), value.get("arguments", value.get("parameters"))
    if arguments is None:  # (left out or null: a function that takes none)
        arguments = {}
    if isinstance(arguments, str):  # (some models write the arguments as a JSON string)
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        return None
    return name, json.dumps(arguments, ensure_ascii=False)


class HermesCalls:
    """One answer's calls and content as its text arrives: ``feed`` each piece, ``flush`` at
    its end; each gives the pieces to send, in order: ``("content", text)`` and ``("call",
    entry)`` (a ``message.tool_calls`` entry, ``id``, ``type``, ``function``). ``calls`` holds
    the calls so far; ``max_calls`` (1 for ``parallel_tool_calls`` false) drops later ones."""

    def __init__(self, max_calls: int | None = None) -> None:
        self.calls: list[dict[str, Any]] = []
        self.max_calls = max_calls
        self._pending = ""  # text not judged yet: a possible tag's start, or an open block
        self._in_block = False
        self._strings = JsonStrings()  # (the open block's JSON strings, read as far as needed)
        self._skipped: int | None = None  # the first end tag the open block went past, if any
        self._space = ""  # whitespace held: it is content only if text follows it
        self._sent = False  # (content sent since the last call, or before any)

    def feed(self, text: str) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        # (an open block's text was searched before: only its end can join the new text's start)
        searched = max(0, len(self._pending) - len(END) + 1) if self._in_block else 0
        self._pending += text
        while self._pending:
            if self._in_block:
                end = self._pending.find(END, searched)
                if end < 0:
                    break
                if self._strings.open_at(self._pending, end):
                    if self._skipped is None:
                        self._skipped = end
                    searched = end + 1
                    continue
                block, self._pending = self._pending[:end], self._pending[end + len(END) :]
                self._close()
                self._block(block, closed=True, out=out)
                searched = 0
                continue
            start = self._pending.find(START)
            if start < 0:
                cut = len(self._pending) - held_prefix(self._pending, START)
                self._text(self._pending[:cut], out)
                self._pending = self._pending[cut:]
                break
            self._text(self._pending[:start], out)
            self._pending, self._in_block = self._pending[start + len(START) :], True
        return _merged(out)

    def _close(self) -> None:
        self._in_block, self._strings, self._skipped = False, JsonStrings(), None

    def flush(self) -> list[tuple[str, Any]]:
        """The end of the answer: an open block judged as it stands, held text sent where it
        is content (whitespace only where no call was made: the answer as it is)."""
        out: list[tuple[str, Any]] = []
        while True:
            pending, self._pending = self._pending, ""
            if not self._in_block:
                self._text(pending, out)
                break
            skipped = self._skipped
            self._close()
            # (an answer cut short inside "</tool_call>": its JSON may be whole before it)
            whole = pending[: len(pending) - held_prefix(pending, END)]
            if call_of(whole) is not None:
                self._block(whole, closed=False, out=out)
                break
            if skipped is None:
                self._block(pending, closed=False, out=out)
                break
            # (a string that never closed: the first tag it went past ended the block after
            # all; the text after it is read again, as it would have been)
            self._block(pending[:skipped], closed=True, out=out)
            out += self.feed(pending[skipped + len(END) :])
        if self._space and not self.calls:
            out.append(("content", self._space))
        self._space = ""
        return _merged(out)

    def _text(self, text: str, out: list[tuple[str, Any]]) -> None:
        """Text outside the blocks: whitespace that opens the answer or follows a call is held
        until text follows it."""
        if not text:
            return
        if not self._sent and not text.strip():
            self._space += text
            return
        out.append(("content", self._space + text))
        self._space, self._sent = "", True

    def _block(self, block: str, closed: bool, out: list[tuple[str, Any]]) -> None:
        call = call_of(block)
        if call is None:
            self._text(START + block + (END if closed else ""), out)
            return
        self._space, self._sent = "", False  # (whitespace before a call: not content)
        if self.max_calls is not None and len(self.calls) >= self.max_calls:
            return
        name, arguments = call
        entry = {
            "id": tool_call_id(),
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        }
        self.calls.append(entry)
        out.append(("call", entry))

    def read(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """A whole answer's (content, calls): content None where calls were made and no text
        is left; the answer's text as it is where none were."""
        pieces = self.feed(text) + self.flush()
        content = "".join(value for kind, value in pieces if kind == "content")
        if self.calls:
            return (content if content.strip() else None), self.calls
        return content, []


class JsonStrings:
    """Whether a point of an open block's text falls inside one of its JSON strings, read once
    however often it is asked (each text read from where the last question left off)."""

    _MARKS = re.compile(r'["\\]')
    _OBJECT = re.compile(r"\s*\{")

    def __init__(self) -> None:
        self._read = 0  # (the block's text read so far, in characters)
        self._quoted = False
        self._object: bool | None = None  # (whether the block's text opens a JSON object)

    def open_at(self, text: str, end: int) -> bool:
        """Whether ``text[end]`` is inside a string of the JSON object ``text`` opens."""
        if self._object is None:
            self._object = self._OBJECT.match(text) is not None
        if not self._object:
            return False
        pos = self._read
        while (mark := self._MARKS.search(text, pos, end)) is not None:
            if mark.group() == '"':
                self._quoted = not self._quoted
                pos = mark.end()
            else:  # (an escape: the next character is the string's, whatever it is)
                pos = mark.end() + (1 if self._quoted else 0)
        self._read = max(pos, end)
        return self._quoted


def _merged(pieces: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """Consecutive content pieces as one."""
    out: list[tuple[str, Any]] = []
    for kind, value in pieces:
        if kind == "content" and out and out[-1][0] == "content":
            out[-1] = ("content", out[-1][1] + value)
        else:
            out.append((kind, value))
    return out


def hermes_calls(text: str, max_calls: int | None = None) -> tuple[str | None, list[dict]]:
    """A whole answer's (content, calls) (``HermesCalls.read``)."""
    return HermesCalls(max_calls).read(text)
