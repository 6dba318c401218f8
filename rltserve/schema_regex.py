"""A JSON schema as one regex: outlines-core's translation, with the subschemas it gets wrong
given regexes of our own.

outlines-core's translation (``build_regex_from_schema``) drops integer bounds (``minimum``,
``maximum``, ``exclusiveMinimum``, ``exclusiveMaximum``: pydantic's ``Field(ge=..., le=...)``),
writes a schema of any value (``{}``, pydantic's ``Any``) as an ungrouped alternation that
breaks the object around it (``{"a": {}}`` allows ``{ }}``) and takes minutes to compile, allows
years of any length in ``date-time``, and leaves ``\\d`` and ``\\w`` to Rust's Unicode classes
(``format: date`` could spell its year in other scripts' digits; JSON Schema's regexes are
ECMA-262's, whose ``\\d`` and ``\\w`` are ASCII). Such a subschema is swapped for a ``const``
slot before the translation and its own regex put in the slot's place after it. Torch-free.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

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
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
# RFC 3339's date-time (JSON Schema's format): a four-digit year and a time zone.
DATE_TIME = (
    r'"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])T([01][0-9]|2[0-3]):[0-5][0-9]:[0-5]'
    r'[0-9](\.[0-9]+)?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"'
)
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
    if isinstance(marked, dict) and set(marked) == {"const"} and marked["const"] in slots:
        return ascii_classes(slots[marked["const"]])
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


def _json_patterns(space: str | None, depth: int) -> tuple[str, str]:
    js = outlines_json_schema()
    ws = js.WHITESPACE if space is None else space
    scalar = value = f"({JSON_STRING}|{JSON_NUMBER}|{js.BOOLEAN}|{js.NULL})"
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


def _mark(schema: Any, slots: dict[str, str], space: str | None, text: str) -> Any:
    """A copy of ``schema`` whose subschemas outlines-core would get wrong are ``const`` slots
    (``slots``: each slot's name -> its regex); ``text`` the schema's JSON, which no slot name
    may occur in."""
    if schema is True:
        schema = {}
    if not isinstance(schema, dict):
        return schema
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
    if kind == "integer" and keys & set(_BOUNDS) and keys <= {"type", *_BOUNDS}:
        return integer_pattern(*_integer_bounds(schema))
    if kind == "string" and schema.get("format") == "date-time" and keys == {"type", "format"}:
        return DATE_TIME
    return None


def _integer_bounds(schema: dict) -> tuple[int | None, int | None]:
    low = high = None
    for key in _BOUNDS:
        value = schema.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isinf(value):
            # (draft 4's boolean exclusiveMinimum / exclusiveMaximum tighten their bound)
            continue
        if key == "minimum":
            bound = math.ceil(value) + (schema.get("exclusiveMinimum") is True)
        elif key == "exclusiveMinimum":
            bound = math.floor(value) + 1
        elif key == "maximum":
            bound = math.floor(value) - (schema.get("exclusiveMaximum") is True)
        else:
            bound = math.ceil(value) - 1
        if key.endswith("inimum"):
            low = bound if low is None else max(low, bound)
        else:
            high = bound if high is None else min(high, bound)
    if low is not None and high is not None and low > high:
        raise ValueError(f"no integer lies within the bounds {schema}")
    return low, high


def integer_pattern(low: int | None, high: int | None) -> str:
    """The integers from ``low`` to ``high`` (None: unbounded) as JSON writes them."""
    parts = []
    if high is None or high >= 0:
        parts += _naturals(max(low, 0) if low is not None else 0, high)
    if low is None or low < 0:
        # (the magnitudes of the negative ones, written after a minus; never "-0")
        smallest = 1 if high is None or high >= 0 else -high
        magnitudes = _naturals(smallest, None if low is None else -low)
        parts.append("-(" + "|".join(magnitudes) + ")")
    return "|".join(parts)


def _naturals(low: int, high: int | None) -> list[str]:
    """Alternatives matching the integers ``low``..``high`` (>= 0; None: unbounded)."""
    parts = []
    digits = len(str(low))
    while high is None or digits <= len(str(high)):
        first = 0 if digits == 1 else 10 ** (digits - 1)
        last = 10**digits - 1
        start = max(low, first)
        if high is None and start == first and digits > 1:
            parts.append(f"[1-9][0-9]{{{digits - 1},}}")  # (every longer number too)
            break
        end = last if high is None else min(high, last)
        if start <= end:
            parts += _same_length(str(start), str(end))
        digits += 1
    return parts


def _same_length(low: str, high: str) -> list[str]:
    """Alternatives matching the digit strings of one length from ``low`` to ``high``."""
    if low == high:
        return [low]
    if len(low) == 1:
        return [f"[{low}-{high}]"]
    if low[0] == high[0]:
        return [low[0] + rest for rest in _same_length(low[1:], high[1:])]
    rest = len(low) - 1
    parts = []
    first, last = int(low[0]), int(high[0])
    if low[1:] != "0" * rest:
        parts += [low[0] + tail for tail in _same_length(low[1:], "9" * rest)]
        first += 1
    if high[1:] != "9" * rest:
        last -= 1
    if first <= last:
        head = str(first) if first == last else f"[{first}-{last}]"
        parts.append(f"{head}[0-9]{{{rest}}}")
    if high[1:] != "9" * rest:
        parts += [high[0] + tail for tail in _same_length("0" * rest, high[1:])]
    return parts


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
