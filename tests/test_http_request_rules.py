"""Request rules and documents of the HTTP front end that need no socket (found by mutation
testing): how bodies parse and validate (nested objects, bounds of n, logit_bias, temperature,
logprobs counts, suffix, /tokenize, assistant turns, message names), how a request
becomes sampling parameters (prompt logprobs, min_tokens against a chat limit, fields as sent),
the operator's chat template setting, the OpenAPI document, latency metrics and error types."""

from __future__ import annotations

import dataclasses

import pytest
from test_http_harness import metric

from rltserve.http.errors import error_body
from rltserve.http.metrics import RequestTimeline, ServingMetrics
from rltserve.http.openapi import object_schema, openapi_document
from rltserve.http.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    TokenizeRequest,
    sampling_params,
)
from rltserve.http.validation import SchemaError, parse_object

CHAT = {"messages": [{"role": "user", "content": "x"}]}


def parsed(cls, body: dict):
    """``body`` parsed and validated as the server reads a request."""
    req = parse_object(cls, body)
    req.validate()
    return req


def schema_error(cls, body: dict) -> tuple[str | None, str]:
    with pytest.raises(SchemaError) as err:
        parsed(cls, body)
    return err.value.param, err.value.message


def test_a_nested_object_of_the_wrong_type_is_named_with_its_type():
    assert schema_error(CompletionRequest, {"prompt": "x", "stream_options": 5}) == (
        "stream_options",
        "stream_options=5: must be an object",
    )
    assert schema_error(ChatCompletionRequest, {"messages": ["hi"]}) == (
        "messages",
        "messages: must be an array of objects",
    )


def test_n_and_logit_bias_bounds():
    assert parsed(CompletionRequest, {"prompt": "x", "n": 128, "best_of": 128}).n == 128
    assert schema_error(CompletionRequest, {"prompt": "x", "n": 129}) == (
        "n",
        "n=129: must be in [1, 128]",
    )
    # Only ASCII digits are token ids ("٣" is a Unicode digit that int() would read as 3).
    assert parsed(CompletionRequest, {"prompt": "x", "logit_bias": {"50256": 1}}).logit_bias
    param, message = schema_error(CompletionRequest, {"prompt": "x", "logit_bias": {"٣": 1}})
    assert (param, message) == (
        "logit_bias",
        "logit_bias: key '٣' is not a token id (digits, as '50256')",
    )


def test_request_rules_of_suffix_tokenize_and_assistant_messages():
    assert schema_error(CompletionRequest, {"prompt": "x", "suffix": "y"}) == (
        "suffix",
        "suffix: not supported",
    )
    assert parsed(CompletionRequest, {"prompt": "x", "suffix": ""}).suffix == ""
    # /tokenize takes a prompt or messages, not both; the rule of continue_final_message is
    # about messages only
    assert schema_error(TokenizeRequest, {"prompt": "x", "messages": [{"role": "user"}]}) == (
        "prompt",
        "prompt, messages: give exactly one",
    )
    tokenize = parsed(TokenizeRequest, {"prompt": "x", "continue_final_message": True})
    assert tokenize.prompt == "x"
    # An assistant turn without content (OpenAI allows it) renders as an empty text, not None
    chat = parsed(
        ChatCompletionRequest,
        {"messages": [{"role": "user", "content": "x"}, {"role": "assistant"}]},
    )
    assert chat.template_messages() == [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": ""},
    ]


def test_prompt_logprobs_take_the_larger_of_echo_logprobs_and_prompt_logprobs():
    def prompt_logprobs(body: dict) -> int | None:
        req = parsed(CompletionRequest, {"prompt": "x", **body})
        return sampling_params(
            req, max_tokens=1, logprobs=req.logprobs, sample_index=0
        ).prompt_logprobs

    assert prompt_logprobs({"echo": True, "logprobs": 3, "prompt_logprobs": 1}) == 3
    assert prompt_logprobs({"echo": True, "logprobs": 1, "prompt_logprobs": 2}) == 2
    assert prompt_logprobs({"logprobs": 3, "prompt_logprobs": 1}) == 1  # (no echo: no prompt)
    assert prompt_logprobs({"echo": True, "logprobs": 0}) == 0
    assert prompt_logprobs({"logprobs": 3}) is None


def test_min_tokens_beyond_a_chat_limit_names_the_limit_as_asked():
    """``max_completion_tokens`` is a limit the client asked for, as ``max_tokens`` is."""
    for field in ("max_completion_tokens", "max_tokens"):
        req = parsed(ChatCompletionRequest, {**CHAT, field: 2, "min_tokens": 5})
        with pytest.raises(SchemaError) as err:
            sampling_params(req, max_tokens=req.token_limit, logprobs=None, sample_index=0)
        assert (err.value.param, err.value.message) == (
            "min_tokens",
            "min_tokens=5: must be <= max_tokens (2)",
        )
    req = parsed(ChatCompletionRequest, {**CHAT, "min_tokens": 5})
    with pytest.raises(SchemaError, match=r"must be <= the default max_tokens \(3\)"):
        sampling_params(req, max_tokens=3, logprobs=None, sample_index=0)


def test_a_chat_template_that_is_no_file_nor_compiles_is_refused():
    from rltserve.http.config import ServerConfig

    with pytest.raises(ValueError, match="chat_template='/no/t.jinja': no such file"):
        ServerConfig(chat_template="/no/t.jinja")
    with pytest.raises(ValueError, match="chat_template: the template does not compile"):
        ServerConfig(chat_template="{% for m in messages %}")


@dataclasses.dataclass(frozen=True)
class _Listed:
    name: str
    tags: list[str] = dataclasses.field(default_factory=list)
    limit: int = 3


def test_openapi_paths_parameters_and_defaults():
    from rltserve.http.handlers import ROUTES

    document = openapi_document(ROUTES, "test")
    model = document["paths"]["/v1/models/{model}"]["get"]  # (aiohttp's {model:.+})
    assert model["parameters"] == [
        {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}
    ]
    assert "404" in model["responses"] and "404" not in document["paths"]["/v1/models"]["get"]
    completion = document["components"]["schemas"]["CompletionRequest"]["properties"]
    assert completion["n"] == {"anyOf": [{"type": "integer"}, {"type": "null"}], "default": 1}
    assert completion["echo"]["default"] is False and completion["model"]["default"] is None
    # a field with a default_factory is optional (null for its default), with no default shown
    assert object_schema(_Listed) == {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "tags": {"anyOf": [{"type": "array", "items": {"type": "string"}}, {"type": "null"}]},
            "limit": {"anyOf": [{"type": "integer"}, {"type": "null"}], "default": 3},
        },
        "required": ["name"],
        "additionalProperties": True,
    }


def test_inter_token_latency_runs_from_the_previous_update():
    metrics = ServingMetrics("m")
    metrics.configure(4, lambda: (None, 0, 0), max_model_len=64)
    timeline = RequestTimeline(arrival=10.0, admitted=10.0)
    for now in (11.0, 11.25, 11.75):  # gaps of 0.25 and 0.5
        metrics.on_tokens(timeline, now, [1])
    text = metrics.render()[0].decode()
    assert metric(text, "rltserve:inter_token_latency_seconds_sum") == 0.75
    assert metric(text, "rltserve:inter_token_latency_seconds_count") == 2


def test_error_types_by_status():
    types = {s: error_body(s, "x")["error"]["type"] for s in (400, 401, 404, 409, 500, 503, 502)}
    assert types == {
        400: "invalid_request_error",
        401: "authentication_error",
        404: "not_found_error",
        409: "conflict_error",
        500: "internal_server_error",
        503: "unavailable_error",
        502: "api_error",  # (a status without its own type)
    }


def test_a_body_that_is_not_an_object_names_no_field():
    """A body that is no JSON object has no field to name: ``param`` is null."""
    for body in ([1], "x", None):
        assert schema_error(CompletionRequest, body) == (None, "body: must be a JSON object")


def test_an_update_without_tokens_is_no_token_to_the_latencies():
    """Updates with no tokens (an abort, a finish of its own) are left out of TTFT and of the
    gaps between tokens."""
    metrics = ServingMetrics("m")
    metrics.configure(4, lambda: (None, 0, 0), max_model_len=64)
    timeline = RequestTimeline(arrival=10.0, admitted=10.0)
    for now, depths in ((10.5, []), (11.0, [2]), (11.5, []), (12.0, [3]), (12.5, [])):
        metrics.on_tokens(timeline, now, depths)
    text = metrics.render()[0].decode()
    assert metric(text, "rltserve:time_to_first_token_seconds_sum") == 1.0
    assert metric(text, "rltserve:time_to_first_token_seconds_count") == 1
    assert metric(text, "rltserve:inter_token_latency_seconds_sum") == 1.0
    assert metric(text, "rltserve:inter_token_latency_seconds_count") == 1
    assert (timeline.first_token, timeline.last_token, timeline.num_tokens) == (11.0, 12.0, 2)


def test_temperature_range_and_best_of():
    """``temperature`` is in [0, 2], both ends included; ``best_of`` must equal n, a smaller
    one as much as a larger one."""
    for value in (0, 2):
        assert parsed(CompletionRequest, {"prompt": "x", "temperature": value}).temperature == value
    assert schema_error(CompletionRequest, {"prompt": "x", "temperature": 2.5}) == (
        "temperature",
        "temperature=2.5: must be in [0, 2]",
    )
    assert parsed(CompletionRequest, {"prompt": "x", "n": 2, "best_of": 2}).best_of == 2
    for best_of in (1, 3):
        assert schema_error(CompletionRequest, {"prompt": "x", "n": 2, "best_of": best_of}) == (
            "best_of",
            "best_of: only best_of == n is supported",
        )


def test_logprobs_counts_may_be_the_maximum():
    """``logprobs``, ``prompt_logprobs`` and chat's ``top_logprobs`` are in [0, 20]."""
    for name in ("logprobs", "prompt_logprobs"):
        assert getattr(parsed(CompletionRequest, {"prompt": "x", name: 20}), name) == 20
        assert schema_error(CompletionRequest, {"prompt": "x", name: 21}) == (
            name,
            f"{name}=21: must be in [0, 20]",
        )
    chat = parsed(ChatCompletionRequest, {**CHAT, "logprobs": True, "top_logprobs": 20})
    assert chat.top_logprobs == 20
    assert schema_error(ChatCompletionRequest, {**CHAT, "logprobs": True, "top_logprobs": 21}) == (
        "top_logprobs",
        "top_logprobs: must be in [0, 20]",
    )


def test_a_message_name_reaches_the_template():
    chat = parsed(
        ChatCompletionRequest, {"messages": [{"role": "user", "content": "x", "name": "ann"}]}
    )
    assert chat.template_messages() == [{"role": "user", "content": "x", "name": "ann"}]


def test_reasoning_effort_is_a_template_variable_of_openais_values():
    """OpenAI's efforts (its SDK's and vLLM's list) reach the template as ``reasoning_effort``,
    over the same key in ``chat_template_kwargs``; others are a 400 naming the field."""
    for effort in ("none", "minimal", "low", "medium", "high", "xhigh", "max"):
        req = parsed(ChatCompletionRequest, {**CHAT, "reasoning_effort": effort})
        assert req.template_kwargs == {"reasoning_effort": effort}
    kwargs = {"reasoning_effort": "low", "enable_thinking": True}
    req = parsed(ChatCompletionRequest, {**CHAT, "chat_template_kwargs": kwargs})
    assert req.template_kwargs == kwargs
    req = parsed(ChatCompletionRequest, {**CHAT, "chat_template_kwargs": kwargs,
                                         "reasoning_effort": "high"})  # fmt: skip
    assert req.template_kwargs == {"reasoning_effort": "high", "enable_thinking": True}
    assert req.chat_template_kwargs == kwargs  # (the request's own, untouched)
    for cls in (ChatCompletionRequest, TokenizeRequest):  # (/tokenize renders the same prompt)
        assert schema_error(cls, {**CHAT, "reasoning_effort": "Low"}) == (
            "reasoning_effort",
            "reasoning_effort='Low': must be one of none, minimal, low, medium, high, xhigh, max",
        )
    assert parsed(TokenizeRequest, {**CHAT, "reasoning_effort": "low"}).template_kwargs == {
        "reasoning_effort": "low"
    }
    assert parsed(ChatCompletionRequest, CHAT).include_reasoning is True


def test_an_earlier_answers_reasoning_reaches_the_template_by_either_name():
    for key in ("reasoning", "reasoning_content"):
        message = {"role": "assistant", "content": "yo", key: "hmm"}
        req = parsed(ChatCompletionRequest, {"messages": [message]})
        assert req.template_messages() == [
            {"role": "assistant", "content": "yo", "reasoning": "hmm", "reasoning_content": "hmm"}
        ]
    both = {"role": "assistant", "content": "yo", "reasoning": "a", "reasoning_content": "b"}
    with pytest.raises(SchemaError) as err:
        parsed(ChatCompletionRequest, {"messages": [both]}).template_messages()
    assert (err.value.param, err.value.message) == (
        "messages[0].reasoning_content",
        "messages[0].reasoning_content: an alias of reasoning; they disagree",
    )


def test_thinking_token_budget_is_vllms_name_for_max_thinking_tokens():
    def params(**fields):
        req = parsed(ChatCompletionRequest, {**CHAT, **fields})
        return sampling_params(req, max_tokens=8, logprobs=None, sample_index=0)

    assert params(thinking_token_budget=5).max_thinking_tokens == 5
    assert params(thinking_token_budget=5, max_thinking_tokens=5).max_thinking_tokens == 5
    assert schema_error(
        ChatCompletionRequest, {**CHAT, "thinking_token_budget": 5, "max_thinking_tokens": 4}
    ) == (
        "thinking_token_budget",
        "thinking_token_budget: an alias of max_thinking_tokens; they disagree",
    )
    # vLLM's 0: no thinking (the end of the span is forced first: ``core/thinking.py``)
    assert params(thinking_token_budget=0).max_thinking_tokens == 0
    assert params(max_thinking_tokens=0).thinking_token_budget == 0
    with pytest.raises(SchemaError) as err:
        params(thinking_token_budget=-2)
    assert (err.value.param, err.value.message) == (
        "thinking_token_budget",
        "thinking_token_budget=-2: must be >= 0 (-1: no bound)",
    )
    with pytest.raises(SchemaError) as err:
        params(max_thinking_tokens=-2)
    assert err.value.param == "max_thinking_tokens"
    # vLLM's -1: "unlimited", a client's default for no budget
    assert params(thinking_token_budget=-1).max_thinking_tokens is None
    assert params(max_thinking_tokens=-1).max_thinking_tokens is None


def test_thinking_interruption_is_text_or_token_ids():
    def params(value):
        req = parsed(CompletionRequest, {"prompt": "x", "thinking_interruption": value})
        return sampling_params(req, max_tokens=8, logprobs=None, sample_index=0)

    assert params([10, 11]).thinking_interruption == (10, 11)
    assert params("Enough.").thinking_interruption == "Enough."
    with pytest.raises(SchemaError) as err:
        params([-1])
    assert (err.value.param, err.value.message) == (
        "thinking_interruption",
        "thinking_interruption=(-1,): must be non-negative token ids",
    )
    assert schema_error(CompletionRequest, {"prompt": "x", "thinking_interruption": [1.5]}) == (
        "thinking_interruption",
        "thinking_interruption: must be a string or an array of integers",
    )


def test_sampling_fields_reach_the_sampling_params_as_sent():
    body = {
        "prompt": "x",
        "presence_penalty": 0.5,
        "frequency_penalty": -0.25,
        "ignore_eos": True,
        "min_loops": 2,
        "max_loops": 3,
        "max_thinking_tokens": 4,
        "thinking_interruption": "Enough.",
    }
    params = sampling_params(
        parsed(CompletionRequest, body), max_tokens=8, logprobs=None, sample_index=0
    )
    assert (params.presence_penalty, params.frequency_penalty) == (0.5, -0.25)
    assert params.ignore_eos is True and (params.min_loops, params.max_loops) == (2, 3)
    assert params.thinking_interruption == "Enough."
    default = sampling_params(
        parsed(CompletionRequest, {"prompt": "x"}), max_tokens=8, logprobs=None, sample_index=0
    )
    assert default.ignore_eos is False and default.skip_special_tokens is True


def test_openapi_operations_of_routes_with_a_body():
    from rltserve.http.handlers import ROUTES

    document = openapi_document(ROUTES, "test")
    post = document["paths"]["/v1/completions"]["post"]
    assert post["operationId"] == "completions"
    assert post["requestBody"] == {
        "required": True,
        "content": {
            "application/json": {"schema": {"$ref": "#/components/schemas/CompletionRequest"}}
        },
    }
    assert sorted(post["responses"]) == ["200", "400", "401", "413", "503"]
    assert post["responses"]["413"]["description"] == "request body too large"
    assert sorted(document["paths"]["/v1/models"]["get"]["responses"]) == ["200", "401", "503"]
