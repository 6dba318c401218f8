"""A JSON schema's regex (``schema_regex``): the subschemas outlines-core's translation gets wrong
(integer bounds, a schema of any value, date-time's year and zone, Unicode ``\\d``) are ours,
checked with Python's ``re`` against values a validator takes or refuses."""

from __future__ import annotations

import json
import random
import re

import pytest

from rltserve.schema_regex import integer_pattern, schema_regex
from rltserve.structured import StructuredOutputsParams

pytest.importorskip("outlines_core")


def matches(schema: dict, text: str) -> bool:
    return bool(re.fullmatch(schema_regex(schema), text))


@pytest.mark.parametrize(
    ("low", "high"),
    [(0, 120), (1, 5), (-5, 5), (-120, -3), (None, 0), (57, None), (None, -7), (-13, None),
     (None, None), (7, 7), (-1000, 999)],
)  # fmt: skip
def test_integer_pattern_is_exactly_the_range(low, high):
    pattern = re.compile(integer_pattern(low, high))
    for value in range(-1500, 1500):
        inside = (low is None or value >= low) and (high is None or value <= high)
        assert bool(pattern.fullmatch(str(value))) == inside, value
    assert not pattern.fullmatch("-0") and not pattern.fullmatch("007")


def test_integer_pattern_at_random_ranges():
    rng = random.Random(0)
    for _ in range(200):
        low = rng.randint(-(10**6), 10**6)
        high = rng.randint(low, low + rng.choice([10, 1000, 10**6]))
        pattern = re.compile(integer_pattern(low, high))
        edges = [*range(low - 30, low + 30), *range(high - 30, high + 30)]
        for value in edges + [rng.randint(low - 10**7, high + 10**7) for _ in range(100)]:
            assert bool(pattern.fullmatch(str(value))) == (low <= value <= high), (low, high)


def test_integer_bounds_hold_as_pydantic_writes_them():
    """``Field(ge=0, le=120)``, ``gt``/``lt`` and an ``Optional`` one: outlines-core's
    translation dropped the bounds (a finished answer of age 2800)."""
    schema = {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 0, "maximum": 120, "title": "Age"},
            "rank": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10},
            "floor": {"anyOf": [{"type": "integer", "minimum": -2.5}, {"type": "null"}]},
        },
        "required": ["age", "rank", "floor"],
        "additionalProperties": False,
    }
    good = {"age": 120, "rank": 9, "floor": -2}
    assert matches(schema, json.dumps(good)) and matches(schema, json.dumps(good | {"floor": None}))
    for bad in ({"age": 2800}, {"age": -1}, {"rank": 0}, {"rank": 10}, {"floor": -3}):
        assert not matches(schema, json.dumps(good | bad)), bad


def test_bounds_no_integer_meets_are_refused_naming_the_field():
    impossible = StructuredOutputsParams(json={"type": "integer", "minimum": 3, "maximum": 2.5})
    with pytest.raises(ValueError, match="response_format: cannot use this schema: no integer"):
        impossible.pattern("response_format")


def test_a_schema_of_any_value_keeps_its_object_whole():
    """``{}`` (pydantic's ``Any``): outlines-core's alternation was not grouped, so the object
    around it could end early or close twice (a finished answer of ``{  }}``)."""
    schema = {"type": "object", "properties": {"meta": {"title": "Meta"}}, "required": ["meta"]}
    for text in ('{"meta": null}', '{"meta": {"a": [1, "x"]}}', '{"meta": [true, {}]}'):
        assert matches(schema, text), text
    for text in ("{ }}", '{"meta": true', "null", '{"meta": 1}}'):
        assert not matches(schema, text), text
    for text in ("1", '"x"', '{"a": [null]}'):
        assert matches({}, text)
    nested_any_object = {"type": "object", "properties": {"d": {"type": "object"}}}
    assert matches(nested_any_object, '{"d": {"k": [1, 2]}}')


def test_date_time_has_a_four_digit_year_and_a_zone():
    schema = {"type": "string", "format": "date-time"}
    assert matches(schema, '"2024-05-01T13:45:00Z"')
    assert matches(schema, '"2024-05-01T13:45:00.250+02:00"')
    assert not matches(schema, '"86580043624588-04-27T14:14:14Z"')
    assert not matches(schema, '"2024-05-01T13:45:00"')


def test_digits_and_word_characters_are_ascii():
    """JSON Schema's regexes are ECMA-262's (``\\d`` is 0-9); Rust's ``\\d`` took any script's
    digits, so a ``format: date`` could begin with four Arabic-Indic ones."""
    assert matches({"type": "string", "format": "date"}, '"2024-05-01"')
    assert not matches({"type": "string", "format": "date"}, '"\u0661\u0662\u0663\u0664-05-01"')
    word = {"type": "string", "pattern": r"^\w+[\d]$"}
    assert matches(word, '"ab_1"') and not matches(word, '"\u00e9\u00e9\u0661"')
    assert schema_regex({"type": "string", "pattern": r"a\\d"}) == r'("a\\d")'
