"""Chat messages as a request carries them and as chat templates take them: the message and
content-part schemas, the rules of the template-related request fields (template variables,
the generation prompt) and the roles and text a template renders, an earlier answer's tool calls
and the tools' results among them (the tool fields' rules are ``tool_choice``'s). Shared by the
chat endpoint, /tokenize and ``LLM.chat`` (``prompt_inputs``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from rltserve.http.validation import SchemaError

# The rendering call's own arguments (``Tokenizer.apply_chat_template``): set by the request's
# fields, never by template variables; a client's ``chat_template`` would run its own Jinja
# on the server.
TEMPLATE_CALL_ARGUMENTS = (
    "self",
    "special_tokens",
    "messages",
    "add_generation_prompt",
    "tokenize",
    "chat_template",
    "continue_final_message",
)


def check_template_kwargs(kwargs: dict[str, Any] | None, chat_template: str | None) -> None:
    """A request's ``chat_template`` is refused (vLLM's default too): it is not ignored, as the
    prompt would not be the one the client rendered."""
    if chat_template is not None:
        raise SchemaError("chat_template", "chat_template: not accepted from requests")
    for key in kwargs or ():
        if key in TEMPLATE_CALL_ARGUMENTS:
            name = f"chat_template_kwargs.{key}"
            raise SchemaError(name, f"{name}: not a template variable a request may set")


# OpenAI's reasoning efforts (its SDK's ``ReasoningEffort``; vLLM's ``ReasoningEffortValue``).
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


def check_reasoning_effort(effort: str | None) -> None:
    if effort is not None and effort not in REASONING_EFFORTS:
        raise SchemaError(
            "reasoning_effort",
            f"reasoning_effort={effort!r}: must be one of " + ", ".join(REASONING_EFFORTS),
        )


def check_generation_prompt(add_generation_prompt: bool, continue_final_message: bool) -> None:
    """vLLM's rule: the conversation either gets a new assistant header or leaves its final
    message open, not both (``add_generation_prompt`` is true unless the request says false)."""
    if continue_final_message and add_generation_prompt:
        raise SchemaError(
            "continue_final_message",
            "continue_final_message: not with add_generation_prompt=true (the default); "
            "send add_generation_prompt=false",
        )


def template_role(role: object) -> object:
    """The role a chat template renders a message under: OpenAI's ``developer`` (what its newer
    SDKs send for system instructions) is a ``system`` message to templates that predate it."""
    return "system" if role == "developer" else role


def joined_text_parts(parts: list[tuple[object, object]], path: str) -> str:
    """OpenAI-style content parts, as ``(type, text)``, as the one text chat templates take:
    the text parts joined by newlines (the server's chat endpoint and ``LLM.chat`` alike); a
    SchemaError naming the first part that is not text."""
    texts = []
    for i, (kind, text) in enumerate(parts):
        if kind == "text" and not isinstance(text, str):
            where = f"{path}.content[{i}].text"
            raise SchemaError(where, f"{where}: a text part's text is required (a string)")
        if kind != "text":
            where = f"{path}.content[{i}]"
            raise SchemaError(where, f"{where}: only text parts are supported")
        texts.append(text)
    return "\n".join(texts)


def template_variables(
    kwargs: dict[str, Any] | None,
    tools: list[dict[str, Any]] | None,
    reasoning_effort: str | None = None,
) -> dict[str, Any]:
    """A request's template variables: its ``chat_template_kwargs`` and, where given, its
    ``tools`` and ``reasoning_effort`` fields (over the same keys there)."""
    out = dict(kwargs or {})
    if tools:
        out["tools"] = tools
    if reasoning_effort is not None:
        out["reasoning_effort"] = reasoning_effort
    return out


def template_tool_calls(calls: list[Any], path: str) -> list[dict[str, Any]]:
    """An answer's tool calls as chat templates take them (transformers' convention, vLLM's
    too): ``{"id", "type", "function": {"name", "arguments"}}`` with the arguments a dict,
    parsed from the JSON text OpenAI's API carries (templates render ``arguments | tojson``)."""
    out = []
    for i, call in enumerate(calls):
        where = f"{path}[{i}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            message = f'{where}: must be {{"id": ..., "type": "function", "function": {{"name": '
            raise SchemaError(where, message + '..., "arguments": "<JSON text>"}}')
        arguments = function.get("arguments")
        if arguments is None or arguments == "":  # (vLLM's: a call of no arguments)
            arguments = {}
        elif isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as exc:
                where = f"{where}.function.arguments"
                raise SchemaError(where, f"{where}: not valid JSON ({exc})") from None
        entry = {"type": call.get("type", "function"), "function": {**function}}
        entry["function"]["arguments"] = arguments
        if call.get("id") is not None:
            entry = {"id": call["id"], **entry}
        out.append(entry)
    return out


# The role of a chat answer the template opens (vLLM's default ``response_role``; the
# server's ``--response-role``).
RESPONSE_ROLE = "assistant"


def answer_role(add_generation_prompt: bool, last_role: str, response_role: str) -> str:
    """The role of a chat answer, as vLLM's ``get_chat_request_role``: the server's response
    role where the template opened the answer (``add_generation_prompt``), else that of the
    last message, which the answer continues."""
    return response_role if add_generation_prompt else last_role


def echoed_text(messages: list[dict[str, Any]], role: str = RESPONSE_ROLE) -> str:
    """vLLM's chat ``echo``: the text of the last message (as its template got it: content
    parts joined) where its role is the answer's (``answer_role``), as an assistant prefill
    the answer continues; "" otherwise (nothing echoed)."""
    last = messages[-1] if messages else {}
    return (last.get("content") or "") if last.get("role") == role else ""


@dataclass(frozen=True, kw_only=True)
class ContentPart:
    type: str
    text: str | None = None
    refusal: str | None = None  # (an assistant's refusal part: its text, for the template)


@dataclass(frozen=True, kw_only=True)
class ChatMessage:
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    # An earlier answer's tool calls (OpenAI's form) and a tool's result (``role: "tool"``
    # with the ``tool_call_id`` it answers) go to the template; the legacy ``function_call``
    # is refused rather than rendered without its call.
    tool_calls: list[Any] | None = None
    function_call: Any = None
    tool_call_id: str | None = None
    # An earlier answer's thinking, for templates that render it: vLLM's ``reasoning`` and its
    # older name ``reasoning_content`` (templates get both keys, as they read either).
    reasoning: str | None = None
    reasoning_content: str | None = None
    # The rest of an OpenAI answer's message, as its SDK's ``model_dump()`` sends it back in a
    # history (mostly nulls). A ``refusal`` is not rendered (vLLM's templates never see it),
    # nor are ``annotations`` (citations of the text); an ``audio`` answer (its id) is refused:
    # its words are not in the history, and this server has no audio.
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: dict[str, Any] | None = None

    def _part(self, part: ContentPart) -> tuple[object, object]:
        """A content part as ``(type, text)``: an assistant's refusal (OpenAI's part, in a
        history replayed from an OpenAI model) is the text it said."""
        if part.type == "refusal" and self.role == "assistant":
            return "text", part.refusal
        return part.type, part.text

    def as_template_input(self, path: str) -> dict[str, Any]:
        """The message as chat templates expect it: text content only. A role other than
        OpenAI's (system, developer, user, assistant, tool) goes to the template as given, as
        vLLM's custom roles do (Huginn's history may name its answers' role ``Huginn``)."""
        if not self.role.strip():
            raise SchemaError(f"{path}.role", f"{path}.role: must not be empty")
        if self.function_call is not None:
            where = f"{path}.function_call"
            message = f"{where}: legacy function calls are not supported (send tool_calls)"
            raise SchemaError(where, message)
        if self.audio is not None:
            where = f"{path}.audio"
            raise SchemaError(where, f"{where}: audio is not supported (text messages only)")
        if self.role != "assistant":  # (OpenAI's: an answer's fields)
            for name in ("refusal", "annotations"):
                if getattr(self, name):
                    where = f"{path}.{name}"
                    raise SchemaError(where, f"{where}: only an assistant message has one")
        content = self.content
        if content is None and self.role != "assistant":  # (OpenAI's: only an assistant's)
            where = f"{path}.content"
            raise SchemaError(where, f"{where}: required for a {self.role} message")
        if content == []:  # (OpenAI's 400: an empty turn is not a message)
            where = f"{path}.content"
            raise SchemaError(where, f"{where}: must not be an empty array")
        if isinstance(content, list):
            content = joined_text_parts([self._part(part) for part in content], path)
        message: dict[str, Any] = {"role": template_role(self.role), "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            if self.role != "assistant":  # (OpenAI's: only an answer calls tools)
                where = f"{path}.tool_calls"
                raise SchemaError(where, f"{where}: only an assistant message has tool calls")
            message["tool_calls"] = template_tool_calls(self.tool_calls, f"{path}.tool_calls")
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        reasoning = self.reasoning if self.reasoning is not None else self.reasoning_content
        if self.reasoning_content not in (None, reasoning):
            where = f"{path}.reasoning_content"
            raise SchemaError(where, f"{where}: an alias of reasoning; they disagree")
        if reasoning is not None:
            message["reasoning"] = message["reasoning_content"] = reasoning
        return message
