"""A chat request's ``tools`` and ``tool_choice``, served as vLLM serves them: a forcing choice
by constraining the output (structured outputs), ``"auto"`` by reading calls from the answer's
text with the server's tool-call parser.

- ``"none"`` (and ``"auto"`` without tools): the model answers in text; the chat template still
  gets the tools.
- a named function, ``{"type": "function", "function": {"name": ...}}``: the output is a JSON
  object matching that function's ``parameters`` schema, returned as its one tool call.
- ``"required"``: the output is a JSON array of ``{"name": <a tool's name>, "parameters": <its
  schema>}`` objects (vLLM's schema; at most one with ``parallel_tool_calls`` false), each
  returned as a tool call.
- ``"auto"`` with tools (the default where tools are given): the model answers as it likes and
  ``auto_tools`` reads the calls it writes (``hermes_tools``). Served only where the operator
  named the model's call format (``serve --enable-auto-tool-choice --tool-call-parser hermes``,
  vLLM's flags, ``check_tool_call_parser``); elsewhere a 400 (``check_auto_choice``).

OpenAI's legacy ``functions`` and ``function_call`` are refused (ignored, the answer would look
like one that had them). The answer's side is ``tool_calls``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from rltserve.http.validation import SchemaError
from rltserve.structured import StructuredOutputsParams

# A function without parameters takes none: its arguments are "{}" (vLLM's).
NO_PARAMETERS = {"type": "object", "properties": {}}
NAMED_SHAPE = '{"type": "function", "function": {"name": ...}}'
# The tool-call formats ``--tool-call-parser`` names (vLLM's names; ``auto_tools.PARSERS``).
TOOL_CALL_PARSERS = ("hermes",)
AUTO_REFUSED = (
    '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set '
    f'(the server\'s flags); or send tool_choice "required" or a named function {NAMED_SHAPE} '
    '(the output is constrained to the call), or "none" (the model answers in text)'
)


def check_tool_call_parser(enable_auto_tool_choice: bool, tool_call_parser: str | None) -> None:
    """The server's auto tool choice flags, as vLLM's: a parser it has, named wherever auto
    tool choice is on (ValueError naming the flag). A parser alone is taken, as vLLM takes it
    (manifests carry it): "auto" stays refused without ``--enable-auto-tool-choice``."""
    choices = ", ".join(TOOL_CALL_PARSERS)
    if tool_call_parser is not None and tool_call_parser not in TOOL_CALL_PARSERS:
        raise ValueError(f"--tool-call-parser {tool_call_parser!r}: unknown (choices: {choices})")
    if enable_auto_tool_choice and tool_call_parser is None:
        raise ValueError(f"--enable-auto-tool-choice: needs --tool-call-parser ({choices})")


def asks_auto(tools: list[dict[str, Any]] | None, tool_choice: object) -> bool:
    """Whether the model chooses whether to call: tools given, ``tool_choice`` "auto" or
    left out (its default where tools are given)."""
    return bool(tools) and tool_choice in (None, "auto")


def check_auto_choice(
    tools: list[dict[str, Any]] | None, tool_choice: object, enabled: bool
) -> None:
    """Refuses "auto" with tools (a SchemaError naming the field as sent) unless ``enabled``
    (the server's ``enable_auto_tool_choice``)."""
    if enabled or not asks_auto(tools, tool_choice):
        return
    if tool_choice is None:
        raise SchemaError(
            "tools", f'tools: tool_choice "auto" (the default with tools): {AUTO_REFUSED}'
        )
    raise SchemaError("tool_choice", f"tool_choice: {AUTO_REFUSED}")


@dataclass(frozen=True)
class ForcedTools:
    """The tool calls a request's ``tool_choice`` forces: the named function's (``name``, its
    index in ``tools``), or, with ``name`` None, ``"required"``'s array of calls."""

    tools: list[dict[str, Any]]
    name: str | None = None
    position: int = 0  # (the named function's index in ``tools``)
    parallel: bool = True  # (``parallel_tool_calls``; false: one call at most)

    @property
    def field(self) -> str:
        """The field a schema that cannot be compiled is refused under."""
        if self.name is None:
            return "tools"
        return f"tools[{self.position}].function.parameters"

    def constraint(self) -> StructuredOutputsParams:
        """The structured output the calls are generated under."""
        if self.name is not None:
            return StructuredOutputsParams(json=_parameters(self.tools[self.position]))
        return StructuredOutputsParams(json=self._required_schema())

    def _required_schema(self) -> dict[str, Any]:
        """vLLM's: an array of at least one call, each a tool's name and its parameters; each
        tool's ``$defs`` gathered at the top, where its ``$ref``s point."""
        items, defs = [], {}
        for i, tool in enumerate(self.tools):
            parameters = copy.deepcopy(_parameters(tool))
            for name, schema in parameters.pop("$defs", {}).items():
                if defs.setdefault(name, schema) != schema:
                    where = f"tools[{i}].function.parameters"
                    raise SchemaError(where, f"{where}: $defs {name!r} differs from another tool's")
            items.append(
                {
                    "properties": {
                        "name": {"type": "string", "enum": [tool["function"]["name"]]},
                        "parameters": parameters,
                    },
                    "required": ["name", "parameters"],
                }
            )
        schema: dict[str, Any] = {
            "type": "array",
            "minItems": 1,
            "items": {"type": "object", "anyOf": items},
        }
        if not self.parallel:
            schema["maxItems"] = 1
        if defs:
            schema["$defs"] = defs
        return schema


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or NO_PARAMETERS


def forced_tools(
    tools: list[dict[str, Any]] | None,
    tool_choice: str | dict[str, Any] | None,
    parallel_tool_calls: bool | None = None,
) -> ForcedTools | None:
    """The calls ``tool_choice`` forces, or None where the model answers in text (with
    "auto", text that may hold calls of its own); a SchemaError (400) naming the field for a
    choice or tool list this server cannot serve. Cheap (nothing compiled)."""
    if tool_choice in (None, "none", "auto"):
        if asks_auto(tools, tool_choice):
            _check_tools(tools or [])  # (the calls read from the answer are of these)
        return None  # ("auto": no constraint; the server reads any calls, ``check_auto_choice``)
    if tools is None:
        raise SchemaError("tool_choice", "tool_choice: give the tools it chooses from (tools)")
    if tool_choice == "required":
        if not tools:
            return None  # (vLLM's, after OpenAI: required of no tools is "none")
        _check_tools(tools)
        return ForcedTools(tools, parallel=parallel_tool_calls is not False)
    name = _named(tool_choice)
    _check_tools(tools)
    names = [tool["function"]["name"] for tool in tools]
    if name not in names:
        known = ", ".join(map(repr, names)) or "none"
        message = f"tool_choice: function {name!r} is not among tools (they name {known})"
        raise SchemaError("tool_choice", message)
    return ForcedTools(tools, name, names.index(name))


def _named(tool_choice: object) -> str:
    """The function a named tool choice names."""
    if not isinstance(tool_choice, dict):
        raise SchemaError(
            "tool_choice",
            f'tool_choice={tool_choice!r}: must be "none", "auto", "required" or {NAMED_SHAPE}',
        )
    if tool_choice.get("type", "function") != "function":
        message = f'tool_choice.type={tool_choice.get("type")!r}: must be "function"'
        raise SchemaError("tool_choice.type", message)
    function = tool_choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or not name:
        raise SchemaError("tool_choice.function", f"tool_choice: must be {NAMED_SHAPE}")
    return name


def _check_tools(tools: list[dict[str, Any]]) -> None:
    """Each tool a function with a name and, if any, a parameters schema (an object)."""
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if tool.get("type", "function") != "function":
            message = f"{where}.type={tool.get('type')!r}: only function tools can be called"
            raise SchemaError(f"{where}.type", message)
        function = tool.get("function")
        if not isinstance(function, dict):
            raise SchemaError(f"{where}.function", f"{where}.function: required (an object)")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            where = f"{where}.function.name"
            raise SchemaError(where, f"{where}: required (a non-empty string)")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            where = f"{where}.function.parameters"
            raise SchemaError(where, f"{where}: must be a JSON schema (an object)")


def check_tools(
    tools: list[dict[str, Any]] | None,
    tool_choice: str | dict[str, Any] | None,
    functions: list[dict[str, Any]] | None,
    function_call: str | dict[str, Any] | None,
) -> None:
    """The tool fields' rules (``forced_tools``'), and the legacy ``functions`` and
    ``function_call`` refused."""
    forced_tools(tools, tool_choice)
    if functions:
        raise SchemaError("functions", "functions: not supported (use tools and tool_choice)")
    if function_call not in (None, "none", "auto"):
        message = "function_call: not supported (use tools and tool_choice)"
        raise SchemaError("function_call", message)
