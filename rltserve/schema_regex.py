"""A JSON schema as one regex: outlines-core's translation, with the subschemas it gets wrong
given regexes of our own.

outlines-core's translation (``build_regex_from_schema``) drops the bounds of integers and numbers
(``minimum``, ``maximum``, ``exclusiveMinimum``, ``exclusiveMaximum``: pydantic's ``Field(ge=...,
le=...)``; ours are number_pattern's), writes a schema of any value (``{}``, pydantic's ``Any``) as
an ungrouped alternation that breaks the object around it (``{"a": {}}`` allows ``{ }}``) and takes
minutes to compile (as does its any array, ``{"type": "array"}``), gets the formats ``date``,
``time``, ``date-time``, ``email`` and ``uri`` wrong (years of any length, 02-30, no time zone,
characters a JSON string must escape: no JSON at all), writes ``allOf``'s schemas one after another,
and leaves ``\\d`` and ``\\w`` to Rust's Unicode classes (``format: date`` could spell its year in
other scripts' digits; JSON Schema's regexes are ECMA-262's, whose ``\\d`` and ``\\w`` are ASCII).
Such a subschema is swapped for a ``const`` slot before the translation and its own regex put in the
slot's place after it; an ``allOf`` of several schemas is refused. Torch-free.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from rltserve.caller_values import is_int
from rltserve.number_pattern import BOUNDS, bounded_pattern

# json_object's strings and numbers: JSON's own (RFC 8259). outlines-core's leave out ``\uXXXX``
# escapes (Python's json.dumps writes every non-ASCII character so), U+007F-U+009F and an
# exponent without a sign ("1e5").
JSON_STRING = r'"([^"\\\x00-\x1F]|\\(["\\/bfnrt]|u[0-9a-fA-F]{4}))*"'
JSON_NUMBER = r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?"
JSON_OBJECT_DEPTH = 2  # json_object: an object's values may be objects or arrays of scalars
# Keywords that describe a schema without constraining its values.
ANNOTATIONS = {
    "title",
    "description",
    "default",
    "examples",
    "$comment",
    "$schema",
    "$id",
    "deprecated",
    "readOnly",
    "writeOnly",
}
# The keywords of a number's subschema of our own (bounds, a whole multipleOf).
_BOUNDED = {"type", "multipleOf", *BOUNDS}
# RFC 3339's full-date, full-time and date-time (JSON Schema's formats ``date``, ``time`` and
# ``date-time``). outlines-core's allow years of any length, days a month lacks (02-30), no
# time zone, and a time's fraction after a backslash (an invalid JSON escape).
_YEAR = "([1-9][0-9]{3}|0[1-9][0-9]{2}|00[1-9][0-9]|000[1-9])"  # (0000: no validator's year)
_LEAP_YEAR = "([0-9]{2}(0[48]|[2468][048]|[13579][26])|(0[48]|[2468][048]|[13579][26])00)"
_DATE = (
    f"({_YEAR}-((0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])|(0[469]|11)-(0[1-9]|[12][0-9]|30)"
    f"|02-(0[1-9]|1[0-9]|2[0-8]))|{_LEAP_YEAR}-02-29)"
)
_TIME = r"([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\.[0-9]+)?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
# outlines-core's ``email`` and ``uri`` put characters JSON must escape in the string (an email's
# quoted local part, any character of a URI's path but white space): these keep to the ones it
# need not, an email's dot-atom local part and a URI's characters but '"', '\\' and controls.
_ATOM = "[a-z0-9!#$%&'*+/=?^_`{|}~-]+"
_LABEL = "[a-z0-9]([a-z0-9-]*[a-z0-9])?"
_EMAIL = rf"{_ATOM}(\.{_ATOM})*@({_LABEL}\.)+{_LABEL}"
_URI_CHAR = r'[^\s"\\\x00-\x1F'
_URI = (
    rf"((https?|ftp)://({_URI_CHAR}:@]+(:{_URI_CHAR}:@]*)?@)?([a-zA-Z0-9.-]+\.[a-zA-Z]{{2,}}"
    rf"|localhost)(:[0-9]+)?(/{_URI_CHAR}?#]*)?(\?{_URI_CHAR}#]*)?(#{_URI_CHAR}]*)?"
    rf"|urn:[a-zA-Z0-9][a-zA-Z0-9-]{{0,31}}:{_URI_CHAR}]+)"
)
FORMATS = {
    "date": f'"{_DATE}"',
    "time": f'"{_TIME}"',
    "date-time": f'"{_DATE}T{_TIME}"',
    "email": f'"{_EMAIL}"',
    "uri": f'"{_URI}"',
}
# Where a schema's subschemas are: keyword -> whether it holds one, a list or a name -> schema.
_ONE, _LIST, _MAP = "one", "list", "map"
_SUBSCHEMAS = {
    "items": _ONE,
    "additionalProperties": _ONE,
    "prefixItems": _LIST,
    "anyOf": _LIST,
    "oneOf": _LIST,
    "allOf": _LIST,
    "properties": _MAP,
    "$defs": _MAP,
    "definitions": _MAP,
}


def outlines_json_schema() -> Any:
    from rltserve.structured import outlines_core

    return outlines_core().json_schema


def schema_regex(schema: str | dict, space: str | None = None) -> str:
    """The regex of ``schema`` (a dict or a JSON string); ``space`` the whitespace between
    tokens (None: outlines-core's). Raises what outlines-core raises for a schema it cannot
    translate (a ValueError)."""
    js = outlines_json_schema()
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            return _build(js, schema, space)  # (outlines-core's error names what is wrong)
    if not isinstance(schema, dict):
        return _build(js, json.dumps(schema), space)
    slots: dict[str, str] = {}
    marked = _mark(schema, slots, space, json.dumps(schema))
    root = marked.get("const") if isinstance(marked, dict) and set(marked) == {"const"} else None
    if isinstance(root, str) and root in slots:  # (a const of the schema's own: any JSON)
        return ascii_classes(slots[root])
    pattern = ascii_classes(_build(js, json.dumps(marked), space))
    for name, regex in slots.items():
        pattern = pattern.replace(f'"{name}"', f"({regex})")
    return pattern


def _build(js: Any, schema: str, space: str | None) -> str:
    build = js.build_regex_from_schema
    return build(schema) if space is None else build(schema, space)


def json_value_pattern(space: str | None = None, depth: int = JSON_OBJECT_DEPTH) -> str:
    """Any JSON value: a scalar, or an object or array whose values nest ``depth - 1`` levels
    deeper (a regex cannot nest without bound)."""
    return _json_patterns(space, depth)[0]


def json_object_pattern(space: str | None = None, depth: int = JSON_OBJECT_DEPTH) -> str:
    """``json_object``'s regex: a JSON object whose values are scalars, or objects and arrays
    nested ``depth - 1`` levels deeper. A regex cannot nest without bound, and the DFA grows
    fast with depth: outlines-core's own ``{"type": "object"}`` takes seconds to compile
    against a 512-token vocabulary, this one a fraction of a second."""
    return _json_patterns(space, depth)[1]


def json_array_pattern(
    space: str | None = None, min_items: int = 0, max_items: int | None = None
) -> str:
    """Any JSON array (``{"type": "array"}``, pydantic's ``list[Any]``) of ``min_items`` to
    ``max_items`` values, which nest as ``json_object``'s: outlines-core's own translation
    takes seconds to compile against a 512-token vocabulary."""
    js = outlines_json_schema()
    ws = js.WHITESPACE if space is None else space
    item = _json_patterns(space, JSON_OBJECT_DEPTH - 1)[0]
    if max_items == 0:
        return rf"\[{ws}\]"
    more = f"{{{max(min_items - 1, 0)},{'' if max_items is None else max_items - 1}}}"
    items = f"{item}({ws},{ws}{item}){more}"
    return rf"\[{ws}({items}){'' if min_items else '?'}{ws}\]"


def _json_patterns(space: str | None, depth: int) -> tuple[str, str]:
    js = outlines_json_schema()
    ws = js.WHITESPACE if space is None else space
    scalar = value = f"({JSON_STRING}|{JSON_NUMBER}|{js.BOOLEAN}|{js.NULL})"
    obj = ""
    for _ in range(depth):
        member = f"{JSON_STRING}{ws}:{ws}{value}"
        obj = rf"\{{{ws}({member}({ws},{ws}{member})*)?{ws}\}}"
        array = rf"\[{ws}({value}({ws},{ws}{value})*)?{ws}\]"
        value = f"({scalar}|{obj}|{array})"
    return value, obj


def any_object(schema: Any) -> bool:
    """Whether ``schema`` allows any JSON object (``{"type": "object"}``, as MCP tools declare
    their parameters; pydantic's ``dict[str, Any]``): outlines-core's translation of that takes
    seconds to compile against a 512-token vocabulary (minutes against a real one)."""
    return (
        isinstance(schema, dict)
        and schema.get("type") == "object"
        and schema.get("additionalProperties", True) in (True, {})
        and set(schema) <= ANNOTATIONS | {"type", "additionalProperties"}
    )


def any_array(schema: Any) -> bool:
    """Whether ``schema`` allows any JSON array of its length (``{"type": "array"}``, items
    left out or any value; ``minItems``, ``maxItems``)."""
    if not (isinstance(schema, dict) and schema.get("type") == "array"):
        return False
    items = schema.get("items", True)
    counts = [schema.get(k, 0) for k in ("minItems", "maxItems")]
    return (
        (items is True or (isinstance(items, dict) and set(items) <= ANNOTATIONS))
        and all(is_int(n) and n >= 0 for n in counts)
        and schema.get("minItems", 0) <= schema.get("maxItems", math.inf)
        and set(schema) <= ANNOTATIONS | {"type", "items", "minItems", "maxItems"}
    )


def _all_of(schema: dict) -> dict:
    """``schema`` with an ``allOf`` outlines-core can translate. It writes the values of its
    schemas one after another (``{"allOf": [A, B]}`` as an A followed by a B: no JSON), so
    those that allow anything are dropped and more than one left is refused."""
    members = schema.get("allOf")
    if not isinstance(members, list):
        return schema
    kept = [
        m for m in members if not (m is True or (isinstance(m, dict) and not set(m) - ANNOTATIONS))
    ]
    if len(kept) > 1:
        raise ValueError(
            "allOf of more than one schema is not supported (merge them into one schema)"
        )
    rest = {k: v for k, v in schema.items() if k != "allOf"}
    return {**rest, "allOf": kept} if kept else rest


def _of_each_type(schema: dict) -> dict:
    """A bounded number of several types (``{"type": ["number", "null"], "minimum": 0}``) as an
    ``anyOf`` of one schema per type, so the number's bounds are ours (each keyword applies to
    its own type alone: the same values)."""
    kinds = schema.get("type")
    keys = set(schema) - ANNOTATIONS
    if not (isinstance(kinds, list) and all(isinstance(kind, str) for kind in kinds)):
        return schema
    if not (keys & set(BOUNDS) and keys <= _BOUNDED):
        return schema
    rest = {k: v for k, v in schema.items() if k in _BOUNDED - {"type"}}
    each = [{"type": kind, **rest} if kind in ("integer", "number") else {"type": kind}
            for kind in kinds]  # fmt: skip
    return {k: v for k, v in schema.items() if k in ANNOTATIONS} | {"anyOf": each}


def _mark(schema: Any, slots: dict[str, str], space: str | None, text: str) -> Any:
    """A copy of ``schema`` whose subschemas outlines-core would get wrong are ``const`` slots
    (``slots``: each slot's name -> its regex); ``text`` the schema's JSON, which no slot name
    may occur in."""
    if schema is True:
        schema = {}
    if not isinstance(schema, dict):
        return schema
    schema = _of_each_type(_all_of(schema))
    regex = _own_regex(schema, space)
    if regex is not None:
        name = f"rltserveslot{len(slots)}"
        while name in text:
            name += "x"
        slots[name] = regex
        return {"const": name}
    marked = dict(schema)
    for key, shape in _SUBSCHEMAS.items():
        value = schema.get(key)
        if shape == _ONE and isinstance(value, dict):
            marked[key] = _mark(value, slots, space, text)
        elif shape == _LIST and isinstance(value, list):
            marked[key] = [_mark(v, slots, space, text) for v in value]
        elif shape == _MAP and isinstance(value, dict):
            marked[key] = {k: _mark(v, slots, space, text) for k, v in value.items()}
    return marked


def _own_regex(schema: dict, space: str | None) -> str | None:
    """The regex of a subschema outlines-core gets wrong, or None (its translation is used)."""
    keys = set(schema) - ANNOTATIONS
    if not keys:
        return json_value_pattern(space)
    if any_object(schema):
        return json_object_pattern(space)
    kind = schema.get("type")
    if kind in ("integer", "number") and keys & set(BOUNDS) and keys <= _BOUNDED:
        return bounded_pattern(schema)
    if kind == "string" and schema.get("format") in FORMATS and keys == {"type", "format"}:
        return FORMATS[schema["format"]]
    if any_array(schema):
        return json_array_pattern(space, schema.get("minItems", 0), schema.get("maxItems"))
    return None


# ``\d`` and ``\w`` (and their complements outside a class) as ECMA-262 reads them: ASCII.
_ASCII = {"d": ("[0-9]", "0-9"), "w": ("[0-9A-Za-z_]", "0-9A-Za-z_")}
_ASCII_NOT = {"D": "[^0-9]", "W": "[^0-9A-Za-z_]"}
_ESCAPE = re.compile(r"\\(.)|(\[)|(\])", re.DOTALL)


def ascii_classes(pattern: str) -> str:
    """``pattern`` with ``\\d``, ``\\w``, ``\\D`` and ``\\W`` spelled as ASCII classes."""
    out = []
    depth = 0  # inside a class (``[...]``; Rust's may nest)
    position = 0
    for match in _ESCAPE.finditer(pattern):
        out.append(pattern[position : match.start()])
        position = match.end()
        escaped, opening, closing = match.groups()
        if escaped in _ASCII:
            out.append(_ASCII[escaped][1 if depth else 0])
        elif escaped in _ASCII_NOT and not depth:
            out.append(_ASCII_NOT[escaped])
        else:
            out.append(match.group(0))
            depth += bool(opening) - bool(closing and depth)
    out.append(pattern[position:])
    return "".join(out)
