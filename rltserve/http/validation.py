"""Parses a decoded JSON object into a frozen request dataclass, strictly.

The dataclass's type hints are the schema: missing required keys and values of the wrong JSON
type are errors naming the field (``messages[2].role``). Unknown keys go to ``on_unknown`` (the
server logs and ignores them, as clients such as LangChain send fields this server has no use
for); without it they are errors. ``null`` stands for the field's default, as OpenAI clients send
explicit nulls for unset options. Nested dataclasses are parsed recursively. An integer field
may declare ``metadata={"range": (low, high)}``, which the type message states; other value
ranges are the dataclasses' own business (``validate`` methods and ``SamplingParams``).

Type hints understood: int, float, bool, str, Any, ``list[X]``, ``dict[str, X]``, unions
(including ``X | None``) and dataclasses. JSON numbers: bool is never an int; an int is a float;
an int is at most 64 bits (signed or unsigned, as orjson reads them), a larger one is refused
quoting it as sent (``loads`` keeps it exact).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import re
import types
import typing
from collections.abc import Callable
from typing import Any

import orjson

_MISSING = dataclasses.MISSING
# The integers a JSON number may be here (orjson's: signed or unsigned 64 bits).
_INT_RANGE = (-(2**63), 2**64 - 1)
_LONG_DIGITS = re.compile(rb"\d{19}")  # (every integer outside _INT_RANGE has 19 digits or more)
UnknownField = Callable[[str], None]  # called with the field's path, e.g. "messages[0].foo"
_TYPE_NAMES = {int: "an integer", float: "a number", bool: "a boolean", str: "a string"}


class SchemaError(ValueError):
    """A request body that does not fit its schema; ``param`` is the offending field path."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


def loads(raw: bytes) -> Any:
    """A JSON body decoded (``orjson.JSONDecodeError`` if it is not JSON). orjson reads an
    integer beyond 64 bits as a float (99999999999999999999 as 1e+20); a body that may hold
    one is read again by the standard library, whose integers are exact, so that its refusal
    quotes the integer sent."""
    data = orjson.loads(raw)
    if _LONG_DIGITS.search(raw):  # (rare, and cheap to look for)
        # (orjson took it: valid JSON without NaN; json's recursive decoder may still run out
        # of stack on nesting orjson allows (1024 levels): then orjson's reading stands)
        with contextlib.suppress(RecursionError):
            data = json.loads(raw)
    return data


def param_of(message: str) -> str | None:
    """The field a validation message names: ``"max_tokens=0: must be >= 1"`` -> max_tokens.
    SamplingParams and the engine both start their messages with the field name."""
    head = message.split(":", 1)[0].split("=", 1)[0].strip()
    return head if head.replace("_", "").isalnum() and head.isascii() else None


@functools.cache
def _schema(cls: type) -> tuple[dict[str, Any], dict[str, dataclasses.Field]]:
    """A request dataclass's type hints and init fields, resolved once per class: under
    ``from __future__ import annotations`` resolving them evaluates strings, which for bodies
    of many small objects (100k chat messages) cost seconds."""
    hints = typing.get_type_hints(cls)
    return hints, {f.name: f for f in dataclasses.fields(cls) if f.init}


def parse_object(
    cls: type, data: object, path: str = "", on_unknown: UnknownField | None = None
) -> Any:
    """Builds ``cls`` from ``data`` (a decoded JSON object); raises SchemaError. Unknown keys
    are passed to ``on_unknown`` and dropped, or are errors when it is None. A field whose
    metadata has ``null_of`` is no key of the body: it is true where the body sent that field
    as an explicit null (where the two differ: completions' max_tokens)."""
    if not isinstance(data, dict):
        raise SchemaError(path or None, f"{path or 'body'}: must be a JSON object")
    hints, fields = _schema(cls)
    for key in data:
        if key not in fields or "null_of" in fields[key].metadata:
            name = _join(path, str(key))
            if on_unknown is None:
                raise SchemaError(name, f"{name}: unknown field")
            on_unknown(name)
    values: dict[str, Any] = {}
    for name, f in fields.items():
        if (of := f.metadata.get("null_of")) is not None:
            if of in data and data[of] is None:
                values[name] = True
            continue
        full = _join(path, name)
        value = data.get(name)
        required = f.default is _MISSING and f.default_factory is _MISSING
        if value is None:
            if required:
                raise SchemaError(full, f"{full}: is required")
            continue  # the default
        values[name] = convert(value, hints[name], full, on_unknown, f.metadata.get("range"))
    return cls(**values)


def convert(
    value: object,
    hint: Any,
    path: str,
    on_unknown: UnknownField | None = None,
    int_range: tuple[int, int] | None = None,
) -> Any:
    """Checks ``value`` against ``hint`` (and an integer against ``int_range``, inclusive);
    returns it (nested dataclasses built, tuples kept)."""
    ok, out = _try(value, hint, path, on_unknown)
    in_range = int_range is None or not isinstance(out, int) or int_range[0] <= out <= int_range[1]
    if not ok or not in_range:
        what = describe(hint)
        if int_range is not None:
            what += f" in [{int_range[0]}, {int_range[1]}]"
        head = f"{path}={value!r}" if ok or isinstance(value, (int, float)) else path
        if _beyond_64_bits(value):  # (the range says why, not just the type)
            head += " (beyond 64-bit integers)"
        raise SchemaError(path, f"{head}: must be {what}")
    return out


def _try(
    value: object, hint: Any, path: str, on_unknown: UnknownField | None = None
) -> tuple[bool, Any]:
    origin = typing.get_origin(hint)
    if hint is Any:
        return True, value
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(hint):
            if arg is type(None):
                continue
            ok, out = _try(value, arg, path, on_unknown)
            if ok:
                return True, out
        return False, None
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            return False, None
        return True, parse_object(hint, value, path, on_unknown)
    if origin is list:
        if not isinstance(value, list):
            return False, None
        (item,) = typing.get_args(hint) or (Any,)
        out = []
        for i, v in enumerate(value):
            ok, x = _try(v, item, f"{path}[{i}]", on_unknown)
            if not ok:
                return False, None
            out.append(x)
        return True, out
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            return False, None
        _, item = typing.get_args(hint) or (str, Any)
        out_d = {}
        for k, v in value.items():
            ok, x = _try(v, item, _join(path, k), on_unknown)
            if not ok:
                return False, None
            out_d[k] = x
        return True, out_d
    if hint is bool:
        return isinstance(value, bool), value
    if hint is int:
        is_int = isinstance(value, int) and not isinstance(value, bool)
        return is_int and not _beyond_64_bits(value), value
    if hint is float:
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if number and _beyond_64_bits(value):
            return True, float(value)  # (finite: orjson refuses the numbers a float cannot be)
        return number and math.isfinite(value), value
    if hint is str:
        return isinstance(value, str), value
    raise TypeError(f"{path}: unsupported schema type {hint!r}")  # a bug in a schema


def _beyond_64_bits(value: object) -> bool:
    return type(value) is int and not _INT_RANGE[0] <= value <= _INT_RANGE[1]


def describe(hint: Any) -> str:
    """Words for a type hint, for error messages: ``list[int]`` -> "an array of integers"."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        parts = [describe(a) for a in typing.get_args(hint) if a is not type(None)]
        return ", ".join(parts[:-1]) + " or " + parts[-1] if len(parts) > 1 else parts[0]
    if origin is list:
        (item,) = typing.get_args(hint) or (Any,)
        inner = describe(item)
        return "an array of " + _plural(inner)
    if origin is dict:
        _, item = typing.get_args(hint) or (str, Any)
        return "an object" if item is Any else "an object of " + _plural(describe(item))
    if dataclasses.is_dataclass(hint):
        return "an object"
    return _TYPE_NAMES.get(hint, "a value")


def _plural(words: str) -> str:
    if words.startswith("an array of "):
        return "arrays of " + words[len("an array of ") :]
    for article in ("an ", "a "):
        if words.startswith(article):
            return words[len(article) :] + "s"
    return words


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name
