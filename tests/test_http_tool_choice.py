"""A chat request's ``tools`` and ``tool_choice`` (``http.tool_choice``), and the tool calls of
a history (``chat_messages``), parsed and validated as the server reads them: which choices are
served (vLLM's named function and "required", as structured outputs; "auto" where the server
enables it) and which refused, each refusal a 400 naming the field; /tokenize has chat's
rules."""

from __future__ import annotations

import re

import pytest
from test_http_request_rules import parsed, schema_error

from rltserve.http.schemas import ChatCompletionRequest, CompletionRequest, TokenizeRequest
from rltserve.http.structured_fields import requested
from rltserve.http.tool_choice import NO_PARAMETERS, check_auto_choice, check_tool_call_parser
from rltserve.http.validation import SchemaError

CHAT = {"messages": [{"role": "user", "content": "x"}]}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "ping"}},  # (no parameters: none taken)
]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize("cls", [ChatCompletionRequest, TokenizeRequest])
def test_text_answers_keep_the_tools_for_the_template(cls):
    """tool_choice "none" (and "auto" without tools, and "required" of no tools, vLLM's)
    asks for no call: the tools still reach the template."""
    req = parsed(cls, {**CHAT, "tools": TOOLS, "tool_choice": "none"})
    assert req.template_kwargs == {"tools": TOOLS}
    for body in ({"tool_choice": "auto"}, {"tools": [], "tool_choice": "required"}):
        req = parsed(cls, {**CHAT, **body})
        assert getattr(req, "forced_tools", None) is None
    # /tokenize renders the prompt a forcing request gets
    req = parsed(cls, {**CHAT, "tools": TOOLS, "tool_choice": NAMED})
    assert req.template_kwargs == {"tools": TOOLS}


def auto_error(body: dict, enabled: bool = False) -> tuple[str | None, str] | None:
    """The refusal of a parsed request's "auto" on a server with or without auto tool choice
    (None: served)."""
    req = parsed(ChatCompletionRequest, {**CHAT, **body})
    try:
        check_auto_choice(req.tools, req.tool_choice, enabled)
    except SchemaError as exc:
        return exc.param, str(exc)
    return None


def test_auto_is_refused_unless_the_server_enables_it_in_vllms_words():
    param, message = auto_error({"tools": TOOLS})
    assert param == "tools" and message.startswith('tools: tool_choice "auto" (the default')
    vllms = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
    assert vllms in message and 'send tool_choice "required"' in message
    param, message = auto_error({"tools": TOOLS, "tool_choice": "auto"})
    assert param == "tool_choice" and message.startswith(f"tool_choice: {vllms}")
    for body in ({"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "auto"}):
        assert auto_error(body, enabled=True) is None
        assert parsed(ChatCompletionRequest, {**CHAT, **body}).forced_tools is None
    for body in ({"tool_choice": "auto"}, {"tools": [], "tool_choice": "auto"}, {"tools": TOOLS,
                 "tool_choice": "none"}, {"tools": TOOLS, "tool_choice": "required"}):  # fmt: skip
        assert auto_error(body) is None  # (nothing for the model to choose)


def test_the_servers_auto_tool_flags_are_vllms():
    check_tool_call_parser(False, None)
    check_tool_call_parser(True, "hermes")
    check_tool_call_parser(False, "hermes")  # (vLLM takes it: "auto" stays refused)
    for enable, parser, message in [
        (True, None, "--enable-auto-tool-choice: needs --tool-call-parser (hermes)"),
        (True, "mistral", "--tool-call-parser 'mistral': unknown (choices: hermes)"),
    ]:
        with pytest.raises(ValueError, match="^" + re.escape(message)):
            check_tool_call_parser(enable, parser)


@pytest.mark.parametrize("cls", [ChatCompletionRequest, TokenizeRequest])
def test_bad_choices_are_refused_naming_the_field(cls):
    assert schema_error(cls, {**CHAT, "tools": TOOLS, "tool_choice": "any"}) == (
        "tool_choice",
        'tool_choice=\'any\': must be "none", "auto", "required" or '
        '{"type": "function", "function": {"name": ...}}',
    )
    other = {"type": "function", "function": {"name": "get_time"}}
    assert schema_error(cls, {**CHAT, "tools": TOOLS, "tool_choice": other}) == (
        "tool_choice",
        "tool_choice: function 'get_time' is not among tools (they name 'get_weather', 'ping')",
    )
    for choice in ("required", NAMED):
        assert schema_error(cls, {**CHAT, "tool_choice": choice}) == (
            "tool_choice",
            "tool_choice: give the tools it chooses from (tools)",
        )
    for choice, param in [
        ({"type": "function"}, "tool_choice.function"),
        ({"type": "function", "function": {"name": ""}}, "tool_choice.function"),
        ({"type": "custom", "function": {"name": "ping"}}, "tool_choice.type"),
    ]:
        assert schema_error(cls, {**CHAT, "tools": TOOLS, "tool_choice": choice})[0] == param


@pytest.mark.parametrize(
    ("tool", "param"),
    [
        ({"type": "function"}, "tools[1].function"),
        ({"type": "function", "function": {"description": "d"}}, "tools[1].function.name"),
        ({"type": "function", "function": {"name": "f", "parameters": "{}"}},
         "tools[1].function.parameters"),
        ({"type": "custom", "custom": {"name": "f"}}, "tools[1].type"),
    ],
)  # fmt: skip
def test_a_bad_tool_is_refused_where_the_output_calls_it(tool, param):
    for choice in ("required", NAMED):
        body = {**CHAT, "tools": [TOOLS[0], tool], "tool_choice": choice}
        assert schema_error(ChatCompletionRequest, body)[0] == param


def test_the_legacy_function_fields_stay_refused():
    functions = [{"name": "f", "parameters": {}}]
    assert schema_error(ChatCompletionRequest, {**CHAT, "functions": functions}) == (
        "functions",
        "functions: not supported (use tools and tool_choice)",
    )
    assert schema_error(ChatCompletionRequest, {**CHAT, "function_call": {"name": "f"}}) == (
        "function_call",
        "function_call: not supported (use tools and tool_choice)",
    )
    for call in ("none", "auto"):
        parsed(ChatCompletionRequest, {**CHAT, "function_call": call})


def constraint(body: dict) -> tuple[dict, str]:
    structured, field = requested(parsed(ChatCompletionRequest, {**CHAT, **body}))
    return structured.json, field


def test_a_named_function_constrains_the_output_to_its_parameters():
    assert constraint({"tools": TOOLS, "tool_choice": NAMED}) == (
        WEATHER,
        "tools[0].function.parameters",
    )
    ping = {"type": "function", "function": {"name": "ping"}}
    assert constraint({"tools": TOOLS, "tool_choice": ping}) == (
        NO_PARAMETERS,
        "tools[1].function.parameters",
    )


def test_required_constrains_the_output_to_vllms_array_of_calls():
    """vLLM's schema: at least one ``{"name", "parameters"}`` object per call, the name one of
    the tools'; ``parallel_tool_calls`` false allows one; each tool's ``$defs`` go to the top,
    where its ``$ref``s point (the request's own schema left as sent)."""
    schema, field = constraint({"tools": TOOLS, "tool_choice": "required"})
    assert field == "tools"
    assert schema == {
        "type": "array",
        "minItems": 1,
        "items": {
            "type": "object",
            "anyOf": [
                {
                    "properties": {
                        "name": {"type": "string", "enum": [name]},
                        "parameters": parameters,
                    },
                    "required": ["name", "parameters"],
                }
                for name, parameters in (("get_weather", WEATHER), ("ping", NO_PARAMETERS))
            ],
        },
    }
    one, _ = constraint({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False})
    assert one == {**schema, "maxItems": 1}
    unit = {"enum": ["C", "F"]}
    with_defs = {**WEATHER, "$defs": {"unit": unit}, "properties": {"u": {"$ref": "#/$defs/unit"}}}
    tools = [{"type": "function", "function": {"name": "w", "parameters": with_defs}}]
    schema, _ = constraint({"tools": tools, "tool_choice": "required"})
    assert schema["$defs"] == {"unit": unit} and "$defs" in with_defs
    assert "$defs" not in schema["items"]["anyOf"][0]["properties"]["parameters"]
    other = {**with_defs, "$defs": {"unit": {"enum": ["K"]}}}
    tools.append({"type": "function", "function": {"name": "v", "parameters": other}})
    body = {**CHAT, "tools": tools, "tool_choice": "required"}
    assert schema_error(ChatCompletionRequest, body) == (
        "tools[1].function.parameters",
        "tools[1].function.parameters: $defs 'unit' differs from another tool's",
    )


def test_a_forcing_tool_choice_is_the_one_structured_output():
    for extra, param in [
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"guided_regex": "a+"}, "guided_regex"),
    ]:
        body = {**CHAT, "tools": TOOLS, "tool_choice": "required", **extra}
        param_, message = schema_error(ChatCompletionRequest, body)
        assert (param_, message) == (
            param,
            f"{param}: not with a named or required tool_choice (it sets the output)",
        )
    # (completions have no tools: their structured outputs are their own)
    assert requested(parsed(CompletionRequest, {"prompt": "x", "guided_regex": "a+"}))


def test_a_history_of_tool_calls_and_results_reaches_the_template():
    """An answer's ``tool_calls`` (as the OpenAI SDK dumps them) go to the template with their
    arguments parsed from JSON text (vLLM's and transformers' convention: templates render
    ``arguments | tojson``); a tool's result keeps its ``tool_call_id``."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    messages = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": None, "tool_calls": [call], "refusal": None},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]
    req = parsed(ChatCompletionRequest, {"messages": messages})
    assert req.template_messages()[1:] == [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}
            ],
        },
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]
    as_dict = {**call, "function": {"name": "f", "arguments": {"a": 2}}}
    messages[1]["tool_calls"] = [as_dict]
    req = parsed(ChatCompletionRequest, {"messages": messages})
    assert req.template_messages()[1]["tool_calls"][0]["function"]["arguments"] == {"a": 2}
    for none in ("", None):  # (vLLM's: no arguments)
        messages[1]["tool_calls"] = [{**call, "function": {"name": "f", "arguments": none}}]
        req = parsed(ChatCompletionRequest, {"messages": messages})
        assert req.template_messages()[1]["tool_calls"][0]["function"]["arguments"] == {}


@pytest.mark.parametrize(
    ("message", "param", "fragment"),
    [
        ({"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
          "function": {"name": "f", "arguments": "{a"}}]},
         "messages[1].tool_calls[0].function.arguments", "not valid JSON"),
        ({"role": "assistant", "tool_calls": [{"id": "c1", "type": "function"}]},
         "messages[1].tool_calls[0]", 'must be {"id": ..., "type": "function"'),
        ({"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]},
         "messages[1].tool_calls", "only an assistant message has tool calls"),
        ({"role": "assistant", "function_call": {"name": "f", "arguments": "{}"}},
         "messages[1].function_call", "legacy function calls are not supported"),
    ],
)  # fmt: skip
def test_a_bad_tool_call_in_a_history_is_named(message, param, fragment):
    req = parsed(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}, message]})
    with pytest.raises(SchemaError) as err:
        req.template_messages()
    assert err.value.param == param and fragment in err.value.message, err.value.message
