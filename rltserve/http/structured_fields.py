"""Structured outputs as the HTTP API asks for them: OpenAI's ``response_format`` (``json_object``,
``json_schema``), vLLM's ``guided_json`` / ``guided_regex`` / ``guided_choice`` (with
``guided_whitespace_pattern``) and its newer ``structured_outputs`` object, and chat's named or
required ``tool_choice`` (its calls' schema, ``tool_choice``). A request gives at most one; each
refusal (two at once, a bad shape, a schema or regex that cannot be compiled) is a 400 naming the
field as the client sent it. Compiling runs off the event loop
(``compile_structured``, on the frontend's executor).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from rltserve.guide_index import GuideCompiler, with_index
from rltserve.http.errors import bad_request
from rltserve.http.validation import SchemaError
from rltserve.structured import StructuredOutputsParams

if TYPE_CHECKING:
    from rltserve.http.schemas import GenerationFields

RESPONSE_FORMATS = ("text", "json_object", "json_schema")
FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "structured_outputs")


def requested(req: GenerationFields) -> tuple[StructuredOutputsParams, str] | None:
    """The request's constraint and the field that gave it, or None; a SchemaError (400) for
    a bad one. Cheap (nothing compiled): ``validate`` calls it."""
    given = [name for name in FIELDS if _asks(name, getattr(req, name))]
    if len(given) > 1:
        raise SchemaError(given[1], f"{given[1]}: give one of {', '.join(given)}, not both")
    forced = req.forced_tools  # (chat's named or required tool_choice: the calls' schema)
    if forced is not None:
        if given:
            message = f"{given[0]}: not with a named or required tool_choice (it sets the output)"
            raise SchemaError(given[0], message)
        return forced.constraint(), forced.field
    space = req.guided_whitespace_pattern
    if space is not None and not isinstance(space, str):
        raise SchemaError("guided_whitespace_pattern", "guided_whitespace_pattern: a string")
    if not given:
        return None
    name = given[0]
    value = getattr(req, name)
    try:
        if name == "response_format":
            return _response_format(value), name
        if name == "structured_outputs":
            if not isinstance(value, dict):
                raise ValueError("an object (vLLM's StructuredOutputsParams fields)")
            return StructuredOutputsParams(**value), name
        if name == "guided_json":
            value = _schema(value)
            return StructuredOutputsParams(json=value, whitespace_pattern=space), name
        key = name.removeprefix("guided_")
        return StructuredOutputsParams(**{key: value}, whitespace_pattern=space), name
    except (TypeError, ValueError) as exc:
        text = str(exc)
        raise SchemaError(name, text if text.startswith(name) else f"{name}: {text}") from None


def _asks(name: str, value: Any) -> bool:
    if name == "response_format":
        return isinstance(value, dict) and value.get("type") != "text"
    return value is not None


def _response_format(value: Any) -> StructuredOutputsParams:
    if not isinstance(value, dict):
        raise ValueError('an object, as {"type": "json_object"}')
    kind = value.get("type")
    if kind not in RESPONSE_FORMATS:
        raise ValueError(f"type {kind!r}: must be one of {', '.join(RESPONSE_FORMATS)}")
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise ValueError('json_schema: must be an object, as {"name": ..., "schema": {...}}')
    schema = spec.get("schema", spec.get("json_schema"))  # (vLLM also reads the latter)
    if schema is None:
        return StructuredOutputsParams(json_object=True)  # (OpenAI's: no schema, any object)
    return StructuredOutputsParams(json=_schema(schema))


def _schema(value: Any) -> dict:
    """A JSON schema sent as an object or as a JSON string."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError("must be a JSON schema (an object)")
    return value


def compile_structured(
    req: GenerationFields, compiler: GuideCompiler
) -> StructuredOutputsParams | None:
    """The request's constraint compiled by ``compiler`` (slow on a large vocabulary the
    first time: run it off the event loop); an HTTPError 400 naming the field if it cannot."""
    asked = requested(req)
    if asked is None:
        return None
    structured, name = asked
    try:
        guide = compiler.compile(structured.pattern(name), name)
    except ValueError as exc:  # (no tokenizer, outlines-core missing: the message says so)
        raise bad_request(str(exc), name) from None
    return with_index(structured, guide)
