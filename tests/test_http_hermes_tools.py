"""The Hermes tool-call format read from an answer's text (``http.hermes_tools``): blocks as
calls, the text around them as content, blocks that are no call left as text, answers cut
short, and a stream that reads as the whole answer whatever its pieces (hypothesis on the split
points), never sending a tag's text as content."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from rltserve.http.auto_tools import tool_tag_ids
from rltserve.http.hermes_tools import HermesCalls, hermes_calls


def block(name: str, arguments: object = None, raw: str | None = None) -> str:
    body = raw if raw is not None else json.dumps({"name": name, "arguments": arguments or {}})
    return f"<tool_call>\n{body}\n</tool_call>"


def summary(text: str, max_calls: int | None = None) -> tuple[str | None, list[list[str]]]:
    content, calls = hermes_calls(text, max_calls)
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
        assert len(call["id"]) == 46 and list(call) == ["id", "type", "function"]
    return content, [[c["function"]["name"], c["function"]["arguments"]] for c in calls]


WEATHER = block("get_weather", {"city": "Paris", "unit": "celsius"})
CLOCK = block("get_time", {"hour": 7})


def test_blocks_are_calls_and_the_text_before_them_content():
    called = [
        ["get_weather", '{"city": "Paris", "unit": "celsius"}'],
        ["get_time", '{"hour": 7}'],
    ]
    assert summary(f"Let me look.\n{WEATHER}\n{CLOCK}") == ("Let me look.\n", called)
    assert summary(f"{WEATHER}{CLOCK}\n") == (None, called)  # (only whitespace: null)
    assert summary(f" \n{WEATHER}\n\n") == (None, called[:1])
    # text after the calls is content too (vLLM's stream sends it); whitespace between is not
    assert summary(f"A\n{WEATHER}\n{CLOCK}\nDone.") == ("A\n\nDone.", called)
    # arguments as vLLM writes them: json.dumps, non-ASCII kept; a JSON string of them taken;
    # none: {}; a function the request's tools lack is still a call (vLLM's)
    raw = '{"name": "f", "arguments": "{\\"x\\":\\"é\\"}"}'
    assert summary(block("", raw=raw) + block("g", raw='{"name": "g"}')) == (
        None,
        [["f", '{"x": "é"}'], ["g", "{}"]],
    )
    # parallel_tool_calls false: the first call only
    assert summary(f"A{WEATHER}{CLOCK}", max_calls=1) == ("A", called[:1])


def test_an_answer_without_calls_is_kept_as_it_is():
    for text in ("", "  \n", "Hello <tool", "a < b and </tool_call> is a tag", "x\n\n"):
        assert summary(text) == (text, [])


def test_a_block_that_is_no_call_stays_text():
    """Not JSON, no name, arguments that are not an object: the block's text is content,
    tags and all (vLLM's), beside the calls of the other blocks."""
    bad = [
        block("", raw='{"name": "f", "arguments": {'),
        block("", raw='{"arguments": {}}'),
        block("", raw='{"name": "", "arguments": {}}'),
        block("", raw='["get_time"]'),
        block("", raw='{"name": "f", "arguments": [1]}'),
        block("", raw='{"name": "f", "arguments": "nope"}'),
    ]
    for text in bad:
        assert summary(text) == (text, [])
        assert summary(f"Hi {text}{CLOCK}") == (f"Hi {text}", [["get_time", '{"hour": 7}']])
        assert summary(f"{CLOCK}\n{text}") == (f"\n{text}", [["get_time", '{"hour": 7}']])


def test_an_answer_cut_inside_a_block():
    """The block left open is a call where its JSON is whole (a stop token or string in place
    of the end tag, or the cut fell in it), else text."""
    head = 'Sure <tool_call>\n{"name": "get_time", "arguments": {"hour": 7}}'
    for tail in ("", "\n", "\n</tool", "</tool_call"):
        assert summary(head + tail) == ("Sure ", [["get_time", '{"hour": 7}']]), tail
    cut = 'Sure <tool_call>\n{"name": "get_time", "argu'
    assert summary(cut) == (cut, [])
    assert summary(f"{WEATHER}\n<tool_call>") == ("\n<tool_call>", [summary(WEATHER)[1][0]])


def test_an_end_tag_inside_a_json_string_does_not_end_the_block():
    """A call's arguments are any text: a file it writes may hold the tag (an escaped quote
    does not end the string it is in). A string that never closes ends the block at its first
    tag after all, as if it had not been skipped: the blocks after it are read as ever."""
    text = 'Writing. <tool_call>\n{"name": "write", "arguments": {"text": "a \\" </tool_call>"}}'
    text += "\n</tool_call>\nDone."
    assert summary(text) == ("Writing. \nDone.", [["write", '{"text": "a \\" </tool_call>"}']])
    contents, calls = streamed(list(text))
    assert "".join(contents) == "Writing. \nDone." and calls == summary(text)[1]
    unclosed = '<tool_call>{"name": "f", "arguments": {"a": "x}}</tool_call>'
    assert summary(f"{unclosed} then{CLOCK}") == (f"{unclosed} then", [["get_time", '{"hour": 7}']])
    assert summary(f"{unclosed}\n") == (f"{unclosed}\n", [])
    # (text that is no JSON object is not read for strings: its first tag ends it)
    assert summary('<tool_call>say "</tool_call>"') == ('<tool_call>say "</tool_call>"', [])


def test_arguments_named_parameters_or_null():
    """Some models write the arguments under ``parameters`` (the Llama 3 JSON format's name):
    the call has them, never "{}" in their place; null arguments are none."""
    raw = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert summary(block("", raw=raw)) == (None, [["get_weather", '{"city": "Paris"}']])
    raw = '{"name": "get_time", "arguments": null}'
    assert summary(block("", raw=raw)) == (None, [["get_time", "{}"]])
    raw = '{"name": "f", "arguments": {"a": 1}, "parameters": {"b": 2}}'
    assert summary(block("", raw=raw)) == (None, [["f", '{"a": 1}']])


def streamed(pieces: list[str], max_calls: int | None = None) -> tuple[list[str], list[list]]:
    """The content pieces and the calls a stream of ``pieces`` sends."""
    reader, contents, calls = HermesCalls(max_calls), [], []
    for i, piece in enumerate(pieces + [None]):
        for kind, value in reader.feed(piece) if piece is not None else reader.flush():
            if kind == "content":
                assert value, i  # (nothing empty is sent)
                contents.append(value)
            else:
                calls.append([value["function"]["name"], value["function"]["arguments"]])
    return contents, calls


SEGMENTS = [
    "Let me look.",
    "\n",
    "  ",
    "x",
    WEATHER,
    CLOCK,
    block("", raw='{"name": "f", "arguments": {'),  # (not JSON: text)
    block("", raw='{"arguments": {}}'),  # (no name: text)
    '<tool_call>{"name": "cut", "arguments": {"a": "<b>"',  # (left open: text at the end)
    "a < b",
    "</tool_call>",
    "<tool_ca",
    block("write", {"text": 'a "</tool_call>" {'}),  # (the end tag inside a string)
    '<tool_call>{"name": "f", "arguments": {"a": "x</tool_call>',  # (a string never closed)
]


@settings(max_examples=400, deadline=None)
@given(
    parts=st.lists(st.sampled_from(SEGMENTS), max_size=7),
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=12),
    max_calls=st.sampled_from([None, 1]),
)
def test_a_stream_reads_as_the_whole_answer_wherever_it_is_split(parts, cuts, max_calls):
    text = "".join(parts)
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    contents, calls = streamed(pieces, max_calls)
    content, whole = summary(text, max_calls)
    assert calls == whole
    assert "".join(contents) == (content or "")
    if all(part in SEGMENTS[:6] for part in parts):  # (calls and plain text only)
        # no piece of a tag's text ever goes out as content
        assert not any("<" in piece or ">" in piece for piece in contents), contents


@settings(max_examples=200, deadline=None)
@given(split=st.integers(min_value=0, max_value=len("Hi" + WEATHER)))
def test_a_tag_split_at_any_point_is_never_content(split):
    text = "Hi" + WEATHER + "\nok"
    for pieces in ([text[:split], text[split:]], list(text)):
        contents, calls = streamed(pieces)
        assert "".join(contents) == "Hi\nok" and len(calls) == 1
        assert not any("<" in piece for piece in contents)


class _Tokenizer:
    """What ``tool_tag_ids`` reads of a tokenizer."""

    def __init__(self, vocab: dict[str, int], special: set[int]) -> None:
        self.vocab, self.special_ids = vocab, special

    def get_vocab(self) -> dict[str, int]:
        return self.vocab


def test_tags_that_are_special_tokens_are_kept_for_the_parser():
    vocab = {"<tool_call>": 7, "</tool_call>": 8, "a": 1}
    assert tool_tag_ids(_Tokenizer(vocab, {7, 8, 0}), "hermes") == {7, 8}
    assert tool_tag_ids(_Tokenizer(vocab, {0}), "hermes") == frozenset()
    assert tool_tag_ids(_Tokenizer({"a": 1}, {0}), "hermes") == frozenset()
    assert tool_tag_ids(None, "hermes") == frozenset()
