"""``/openapi.json``: the API description, generated from the route table and the request
dataclasses that ``validation`` parses with, so the two cannot drift apart.

``json_schema`` walks a type hint exactly as ``validation._try`` does: bool is never an integer,
an integer is a number, numbers are finite (JSON has no NaN), a dataclass is an object whose
required keys are its fields without defaults, ``null`` is accepted wherever a field has a
default, and integer ``range`` metadata becomes minimum/maximum. Unknown keys are allowed
(``additionalProperties``) because the server ignores them unless it runs with strict fields.
Cross-field and value rules (``validate()`` methods, ``SamplingParams``) are not expressible
here; they are the 400s the server documents in its error messages.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple

_SCALARS = {bool: "boolean", int: "integer", float: "number", str: "string"}


class Route(NamedTuple):
    method: str
    path: str
    handler: Callable[..., Awaitable[Any]]
    body: type | None = None  # the request dataclass of a POST route


def json_schema(hint: Any, int_range: tuple[int, int] | None = None) -> dict[str, Any]:
    """The JSON Schema of the values ``validation.convert`` accepts for ``hint``."""
    origin = typing.get_origin(hint)
    if hint is Any:
        return {}
    if origin in (typing.Union, types.UnionType):
        options = [json_schema(a, int_range) for a in typing.get_args(hint) if a is not type(None)]
        return options[0] if len(options) == 1 else {"anyOf": options}
    if dataclasses.is_dataclass(hint):
        return object_schema(hint)
    if origin is list:
        (item,) = typing.get_args(hint) or (Any,)
        return {"type": "array", "items": json_schema(item)}
    if origin is dict:
        _, item = typing.get_args(hint) or (str, Any)
        return {"type": "object", "additionalProperties": json_schema(item)}
    if hint in _SCALARS:
        schema: dict[str, Any] = {"type": _SCALARS[hint]}
        if hint is int and int_range is not None:
            schema["minimum"], schema["maximum"] = int_range
        return schema
    raise TypeError(f"unsupported schema type {hint!r}")


def object_schema(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    properties: dict[str, Any] = {}
    required: list[str] = []
    for f in dataclasses.fields(cls):
        if not f.init or "null_of" in f.metadata:  # (no key of the body: ``parse_object``)
            continue
        schema = json_schema(hints[f.name], f.metadata.get("range"))
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            required.append(f.name)
        else:
            schema = {"anyOf": [schema, {"type": "null"}]}  # null stands for the default
            if f.default is not dataclasses.MISSING and _plain(f.default):
                schema["default"] = f.default
        properties[f.name] = schema
    out: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        out["required"] = required
    out["additionalProperties"] = True
    return out


def _plain(value: object) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def _error_response(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": ERROR_SCHEMA}}}


ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                "code": {"type": "integer"},
            },
        }
    },
}


# aiohttp's ``{name}`` or ``{name:regex}``; OpenAPI's is ``{name}``.
PATH_PARAMETER = re.compile(r"\{(\w+)(?::[^}]*)?\}")


def openapi_path(path: str) -> str:
    return PATH_PARAMETER.sub(r"{\1}", path)


def openapi_document(
    routes: typing.Iterable[Route], version: str, root_path: str | None = None
) -> dict[str, Any]:
    """An OpenAPI 3.1 document of ``routes`` (request bodies from their dataclasses); with a
    ``root_path``, its ``servers`` name it, as FastAPI's (vLLM's) document does, so that tools
    reading the document through the proxy call the paths under the prefix."""
    paths: dict[str, Any] = {}
    schemas: dict[str, Any] = {"Error": ERROR_SCHEMA}
    for route in routes:
        operation: dict[str, Any] = {
            "operationId": route.handler.__name__,
            "responses": {
                "200": {"description": "success"},
                "401": _error_response("missing or wrong API key (when the server has one)"),
                "503": _error_response("loading, overloaded or shutting down"),
            },
        }
        if route.body is not None:
            name = route.body.__name__
            schemas[name] = object_schema(route.body)
            ref = {"$ref": f"#/components/schemas/{name}"}
            operation["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": ref}},
            }
            responses = operation["responses"]
            responses["400"] = _error_response("invalid request; param names the field")
            responses["413"] = _error_response("request body too large")
        path = openapi_path(route.path)
        if path != route.path:
            operation["parameters"] = [
                {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
                for name in PATH_PARAMETER.findall(route.path)
            ]
            operation["responses"]["404"] = _error_response("no such item")
        paths.setdefault(path, {})[route.method.lower()] = operation
    document: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "rltserve", "version": version},
        "paths": paths,
        "components": {"schemas": schemas},
    }
    if root_path:
        document["servers"] = [{"url": root_path}]
    return document
