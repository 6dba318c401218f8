"""Structured outputs over HTTP on the real engine (ouro-tiny): OpenAI's ``response_format``
(json_object, json_schema), vLLM's ``guided_json`` / ``guided_regex`` / ``guided_choice`` and
its ``structured_outputs`` object, streamed or not, with usage as for any request; each refusal
a 400 naming the field."""

from __future__ import annotations

import json
import re
import sys

import orjson
import pytest
from test_http_harness import error_of, running, sse_payloads, tiny_checkpoint

pytestmark = pytest.mark.asyncio(loop_scope="module")
SCHEMA = {
    "type": "object",
    "properties": {"age": {"type": "integer"}, "color": {"enum": ["red", "green"]}},
    "required": ["age", "color"],
}
CHAT = {"messages": [{"role": "user", "content": "Describe a cat."}], "max_tokens": 48}
CHOICES = ["yes", "no", "maybe so"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory)


async def test_each_field_constrains_the_output(ckpt):
    async with running(ckpt) as live:
        schema_format = {"type": "json_schema", "json_schema": {"name": "cat", "schema": SCHEMA}}
        body = {**CHAT, "seed": 1, "response_format": schema_format, "return_token_ids": True}
        status, _, raw = await live.post("/v1/chat/completions", body)
        assert status == 200, raw
        (choice,) = orjson.loads(raw)["choices"]
        if choice["finish_reason"] == "stop":
            value = json.loads(choice["message"]["content"])
            assert set(value) == {"age", "color"} and value["color"] in ("red", "green")
        usage = orjson.loads(raw)["usage"]
        assert usage["completion_tokens"] == len(choice["token_ids"])
        for field, value, check in [
            ("guided_choice", CHOICES, lambda t: t in CHOICES),
            ("guided_regex", "[0-9]{3}-[a-z]{2}", lambda t: re.fullmatch("[0-9]{3}-[a-z]{2}", t)),
            ("guided_json", json.dumps(SCHEMA), lambda t: set(json.loads(t)) == {"age", "color"}),
            ("structured_outputs", {"choice": CHOICES}, lambda t: t in CHOICES),
            ("response_format", {"type": "json_object"}, lambda t: t.startswith("{")),
        ]:
            body = {"prompt": "Hello", "max_tokens": 48, "seed": 2, "n": 2, field: value}
            status, _, raw = await live.post("/v1/completions", body)
            assert status == 200, raw
            for c in orjson.loads(raw)["choices"]:
                assert c["finish_reason"] == "stop" and check(c["text"]), (field, c)


async def test_a_streamed_choice_and_its_usage(ckpt):
    async with running(ckpt) as live:
        body = {
            **CHAT,
            "guided_choice": CHOICES,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        status, _, raw = await live.post("/v1/chat/completions", body)
        assert status == 200, raw
        chunks = sse_payloads(raw)
        assert chunks[-1] == "[DONE]"
        deltas = [c["choices"][0]["delta"].get("content", "") for c in chunks[:-1] if c["choices"]]
        assert "".join(deltas) in CHOICES
        usage = chunks[-2]["usage"]
        assert usage["completion_tokens"] >= 2  # (the choice's tokens and the end token)


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"guided_choice": CHOICES, "guided_regex": "a"}, "guided_choice", "give one of"),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "structured_outputs",
            "give one of",
        ),
        ({"guided_json": {"type": "nope"}}, "guided_json", "cannot use this schema"),
        ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
        ({"guided_regex": "("}, "guided_regex", "cannot compile this constraint"),
        ({"guided_choice": []}, "guided_choice", "non-empty list of strings"),
        ({"response_format": {"type": "xml"}}, "response_format", "must be one of"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 3}}}},
            "response_format",
            "cannot use this schema",
        ),
        (
            {"guided_json": {"type": "number", "exclusiveMinimum": 1, "maximum": 1}},
            "guided_json",
            "no number lies within the bounds",
        ),
        ({"structured_outputs": {"regexp": "a"}}, "structured_outputs", "unexpected keyword"),
        ({"structured_outputs": ["a"]}, "structured_outputs", "an object"),
    ],
)
async def test_refusals_name_the_field(ckpt, body, param, message):
    async with running(ckpt) as live:
        status, _, raw = await live.post("/v1/completions", {"prompt": "x", **body})
    assert status == 400, raw
    error = error_of(raw)
    assert error["param"] == param and message in error["message"], error


async def test_without_outlines_core_a_400_says_what_to_install(ckpt, monkeypatch):
    async with running(ckpt) as live:
        monkeypatch.setitem(sys.modules, "outlines_core", None)
        body = {"prompt": "x", "guided_regex": "[a-z]+"}
        status, _, raw = await live.post("/v1/completions", body)
    assert status == 400 and error_of(raw)["param"] == "guided_regex"
    assert "pip install 'rltserve[structured]'" in error_of(raw)["message"]


async def test_a_thinking_chat_is_constrained_after_its_span(ckpt):
    """A template that opens ``<think>``: the answer after ``</think>`` is what the constraint
    shapes (vLLM's under a reasoning parser), not the span, which would hold the whole match
    and leave ``content`` null. A bias makes the model close the span at once; it then
    cannot sample ``</think>`` again (the constraint masks it)."""
    from rltserve.models.tokenizer import load_tokenizer

    think_end = load_tokenizer(ckpt).get_vocab()["</think>"]
    body = {
        **CHAT,
        "seed": 1,
        "chat_template_kwargs": {"enable_thinking": True},
        "guided_choice": CHOICES,
        "logit_bias": {str(think_end): 100},
    }
    async with running(ckpt) as live:
        status, _, raw = await live.post("/v1/chat/completions", body)
        assert status == 200, raw
        (choice,) = orjson.loads(raw)["choices"]
        assert choice["finish_reason"] == "stop", choice
        assert choice["message"]["content"] in CHOICES and choice["message"]["reasoning"] == ""
        del body["logit_bias"]  # (free thinking, never closed in 48 tokens: all reasoning)
        status, _, raw = await live.post("/v1/chat/completions", body)
        (choice,) = orjson.loads(raw)["choices"]
        assert choice["finish_reason"] == "length" and choice["message"]["content"] is None
        assert len(choice["message"]["reasoning"]) > max(map(len, CHOICES)), choice


@pytest.mark.parametrize("budget", [0, 8])
async def test_a_thinking_budget_then_the_schema(ckpt, budget):
    """vLLM's ``thinking_token_budget`` with ``response_format`` on a chat whose template
    opens ``<think>``: ``reasoning`` is the bounded thinking and the forced interruption,
    ``content`` the JSON the schema asks for; streamed, the same text. On completions (no span
    open) the budget never spends: the whole text is the constrained answer."""
    schema_format = {"type": "json_schema", "json_schema": {"name": "cat", "schema": SCHEMA}}
    body = {
        **CHAT,
        "max_tokens": 120,
        "seed": 3,
        "chat_template_kwargs": {"enable_thinking": True},
        "response_format": schema_format,
        "thinking_token_budget": budget,
        "thinking_interruption": " Time is up.",
        "return_token_ids": True,
    }
    async with running(ckpt) as live:
        status, _, raw = await live.post("/v1/chat/completions", body)
        assert status == 200, raw
        (choice,) = orjson.loads(raw)["choices"]
        message = choice["message"]
        assert choice["finish_reason"] == "stop", choice
        thinking, interruption = message["reasoning"].rsplit(" Time is up.", 1)
        assert not interruption and bool(thinking) == bool(budget), message
        value = json.loads(message["content"])
        assert set(value) == {"age", "color"} and value["color"] in ("red", "green")
        status, _, raw = await live.post("/v1/chat/completions", {**body, "stream": True})
        assert status == 200, raw
        deltas = [c["choices"][0]["delta"] for c in sse_payloads(raw)[:-1] if c["choices"]]
        assert "".join(d.get("reasoning") or "" for d in deltas) == message["reasoning"]
        assert "".join(d.get("content") or "" for d in deltas) == message["content"]
        plain = {"prompt": "Hello", "max_tokens": 120, "seed": 3, "guided_json": SCHEMA}
        plain.update(thinking_token_budget=budget, thinking_interruption=" Time is up.")
        status, _, raw = await live.post("/v1/completions", plain)
        assert status == 200, raw
        (choice,) = orjson.loads(raw)["choices"]
        assert set(json.loads(choice["text"])) == {"age", "color"}, choice


async def test_what_each_field_asks_for():
    """The constraint each field gives, as parsed (nothing compiled): ``text`` asks for none,
    a json_schema without a schema is any object (OpenAI's), vLLM's ``json_schema`` key is
    read too, and ``guided_whitespace_pattern`` goes with each ``guided_*`` field."""
    from test_http_request_rules import parsed, schema_error

    from rltserve.http.schemas import CompletionRequest
    from rltserve.http.structured_fields import requested
    from rltserve.structured import StructuredOutputsParams

    def asked(**body):
        got = requested(parsed(CompletionRequest, {"prompt": "x", **body}))
        return got and got[0]

    assert asked(response_format={"type": "text"}) is None
    named = {"type": "json_schema", "json_schema": {"name": "cat"}}
    assert asked(response_format=named) == StructuredOutputsParams(json_object=True)
    vllms = {"type": "json_schema", "json_schema": {"name": "cat", "json_schema": SCHEMA}}
    assert asked(response_format=vllms) == StructuredOutputsParams(json=SCHEMA)
    for field, value in (("guided_json", SCHEMA), ("guided_regex", "[a-z]+"),
                         ("guided_choice", CHOICES)):  # fmt: skip
        got = asked(**{field: value, "guided_whitespace_pattern": "\n?"})
        assert got.whitespace_pattern == "\n?", field
    body = {"prompt": "x", "guided_whitespace_pattern": 3}
    assert schema_error(CompletionRequest, body)[0] == "guided_whitespace_pattern"
