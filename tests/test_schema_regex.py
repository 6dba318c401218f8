"""A JSON schema's regex (``schema_regex``): the subschemas outlines-core's translation gets wrong
(integer and number bounds, a schema of any value, date-time's year and zone, Unicode ``\\d``)
are ours, checked with Python's ``re`` against values a validator takes or refuses."""

from __future__ import annotations

import datetime
import json
import random
import re

import pytest

from rltserve.number_pattern import integer_pattern
from rltserve.schema_regex import json_object_pattern, schema_regex
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


def test_draft_4_exclusive_flags_tighten_fractional_bounds():
    """Draft 4's ``exclusiveMinimum: true`` beside ``minimum: 2.5``: 3 is the least integer
    above 2.5 (it was 4), and 6 the greatest below ``maximum: 6.5`` (it was 5)."""
    schema = {
        "type": "integer",
        "minimum": 2.5,
        "exclusiveMinimum": True,
        "maximum": 6.5,
        "exclusiveMaximum": True,
    }
    assert [v for v in range(10) if matches(schema, str(v))] == [3, 4, 5, 6]
    whole = {"type": "integer", "minimum": 2, "exclusiveMinimum": True, "maximum": 6}
    assert [v for v in range(10) if matches(whole, str(v))] == [3, 4, 5, 6]


def test_a_constant_object_or_array_is_the_whole_schema():
    """A root ``const`` that is no string was looked up among the slots (TypeError:
    unhashable type), so the schema was refused."""
    assert matches({"const": {"x": 1}}, '{"x": 1}') and not matches({"const": {"x": 1}}, "{}")
    assert matches({"const": [1, 2]}, "[1, 2]") and not matches({"const": [1, 2]}, "[2, 1]")


def test_any_array_is_our_json_array():
    """``{"type": "array"}`` and ``list[Any]``: outlines-core's translation took 5.5 s (7.8 s
    for ``items: {}``) to compile against a 512-token vocabulary; ours nests as json_object."""
    for schema in ({"type": "array"}, {"type": "array", "items": {"title": "Any"}}):
        for text in ("[]", '[1, "x", {"a": null}, [2]]', "[[true], []]"):
            assert matches(schema, text), (schema, text)
        for text in ("[1,]", "[", '{"a": 1}'):
            assert not matches(schema, text), (schema, text)
    bounded = {"type": "array", "minItems": 1, "maxItems": 2}
    assert [n for n in range(5) if matches(bounded, json.dumps([0] * n))] == [1, 2]
    assert matches({"type": "array", "maxItems": 0}, "[]")
    assert not matches({"type": "array", "maxItems": 0}, "[1]")


def test_all_of_several_schemas_is_refused():
    """outlines-core wrote ``allOf``'s values one after another (``{"allOf": [integer,
    null]}`` as ``3null``, no JSON); schemas that allow anything constrain nothing."""
    two = StructuredOutputsParams(json={"allOf": [{"type": "integer"}, {"minimum": 0}]})
    with pytest.raises(ValueError, match="response_format: .*allOf of more than one schema"):
        two.pattern("response_format")
    one = {"allOf": [{}, {"type": "integer", "minimum": 0}, True], "title": "N"}
    assert matches(one, "5") and not matches(one, "-1") and not matches(one, "5null")


def test_dates_are_the_days_of_the_calendar():
    """``date`` and ``date-time`` allowed 02-30 and 04-31 (a validator refuses them)."""
    date = re.compile(schema_regex({"type": "string", "format": "date"}))
    for year in (1900, 2000, 2023, 2024):
        for month in range(1, 13):
            for day in range(1, 33):
                text = f"{year:04d}-{month:02d}-{day:02d}"
                try:
                    valid = datetime.date.fromisoformat(text) is not None
                except ValueError:
                    valid = False
                assert bool(date.fullmatch(json.dumps(text))) == valid, text
    assert not date.fullmatch('"0000-01-01"') and date.fullmatch('"0001-01-01"')
    assert not matches({"type": "string", "format": "date-time"}, '"2023-02-29T10:00:00Z"')


def test_formats_are_json_strings():
    """outlines-core's ``time`` put a backslash before its fraction (``"20:55:38\\}5158Z"``
    was allowed: no JSON), and had no zone; its ``email`` a quoted local part, its ``uri`` any
    character but white space (a '"' in the string)."""
    cases = {
        "time": (['"13:45:00Z"', '"13:45:00.25+02:00"'], ['"20:55:38\\}5158Z"', '"13:45:00"']),
        "email": (['"a.b+c@mail.example.org"'], ['""a"@x.org"', '"a@x"']),
        "uri": (
            ['"https://example.com/p/q?x=1#f"', '"urn:isbn:0451450523"'],
            ['"urn:a:b"c"', '"https://example.com/a\\"', '"ftp://x.org/\\u0001"'],
        ),
    }
    for name, (good, bad) in cases.items():
        schema = {"type": "string", "format": name}
        for text in good:
            assert matches(schema, text), (name, text)
        for text in bad:
            assert not matches(schema, text), (name, text)


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


def test_number_bounds_hold_as_pydantic_writes_them():
    """``Field(ge=0, le=1)``, ``Field(gt=0)``, ``confloat(ge=-50.5, le=60)`` and an
    ``Optional`` one: outlines-core's translation dropped a number's bounds (a finished answer
    of confidence 2.36 or 289006, which the model's ``parse`` refused)."""
    pydantic = pytest.importorskip("pydantic")

    class Reading(pydantic.BaseModel):
        confidence: float = pydantic.Field(ge=0, le=1)
        price: float = pydantic.Field(gt=0)
        temperature: pydantic.confloat(ge=-50.5, le=60)
        drift: float | None = pydantic.Field(lt=0)

    schema = Reading.model_json_schema()
    good = {"confidence": 0.5, "price": 0.01, "temperature": -50.5, "drift": -0.25}
    for text in (json.dumps(good), json.dumps(good | {"confidence": 1.0, "drift": None})):
        assert matches(schema, text), text
        Reading.model_validate_json(text)
    bad = [
        {"confidence": 2.36},
        {"confidence": -0.0},
        {"price": 0},
        {"price": 0.0},
        {"temperature": 60.01},
        {"temperature": -50.51},
        {"drift": 0},
        {"drift": 1.5},
    ]
    for change in bad:
        assert not matches(schema, json.dumps(good | change)), change


def test_a_whole_multiple_of_holds_within_bounds():
    """``Field(ge=0, le=100, multiple_of=5)``: outlines-core's translation dropped the bounds
    with the ``multipleOf`` (any integer). Whole multiples within bounds are written out; where
    they cannot be (a fraction's, or no bound on a side) the bounds still hold."""
    percent = {"type": "integer", "minimum": 0, "maximum": 100, "multipleOf": 5}
    assert [v for v in range(-10, 120) if matches(percent, str(v))] == list(range(0, 101, 5))
    number = {"type": "number", "exclusiveMinimum": -10, "maximum": 10, "multipleOf": 5}
    taken = ["-5", "0", "5.0", "10", "10.00"]
    assert [t for t in [*taken, "-10", "5.5", "15", "-0", "7"] if matches(number, t)] == taken
    one_sided = {"type": "integer", "minimum": 0, "multipleOf": 5}
    assert matches(one_sided, "7") and not matches(one_sided, "-5")
    halves = {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.5}
    assert matches(halves, "0.25") and not matches(halves, "1.5")
    none = StructuredOutputsParams(
        json={"type": "integer", "minimum": 1, "maximum": 4, "multipleOf": 5}
    )
    with pytest.raises(ValueError, match="json: cannot use this schema: no multiple of 5"):
        none.pattern("json")


def test_a_bounded_number_of_several_types_keeps_its_bounds():
    """``{"type": ["number", "null"], "minimum": 0, "maximum": 1}``: the bounds were dropped."""
    schema = {"type": ["number", "null"], "minimum": 0, "maximum": 1, "title": "Share"}
    assert [t for t in ("0.5", "null", "1", "2", "-1", '"x"') if matches(schema, t)] == [
        "0.5",
        "null",
        "1",
    ]
    assert matches({"type": ["integer", "string"], "maximum": 3}, '"9"')
    assert not matches({"type": ["integer", "string"], "maximum": 3}, "9")


def test_whole_multiples_at_the_edges():
    """An integer's multiples are written as integers (never ``5.0``), equal bounds are that one
    number, the most multiples written out is ``MULTIPLES_LISTED`` (beyond it the bounds alone
    hold), and a ``multipleOf`` that is no positive number constrains nothing more."""
    from rltserve.number_pattern import MULTIPLES_LISTED

    five = {"type": "integer", "minimum": -10, "maximum": 10, "multipleOf": 5}
    assert [t for t in ("5", "5.0", "-10", "10.00", "7") if matches(five, t)] == ["5", "-10"]
    seven = {"type": "integer", "minimum": 7, "maximum": 7}
    assert [v for v in range(-10, 20) if matches(seven, str(v))] == [7]
    last = 5 * (MULTIPLES_LISTED - 1)  # (0, 5, ..., last: MULTIPLES_LISTED of them)
    listed = {"type": "integer", "minimum": 0, "maximum": last, "multipleOf": 5}
    assert not matches(listed, "3") and matches(listed, str(last))
    assert matches(listed | {"maximum": last + 5}, "3")  # (one more: the bounds alone)
    for step in (0, -5):
        bounded = {"type": "integer", "minimum": 0, "maximum": 10, "multipleOf": step}
        assert [v for v in range(-2, 13) if matches(bounded, str(v))] == list(range(11))


def compiles(pattern: str) -> bool:
    """Whether outlines-core builds an index of ``pattern`` (Python's ``re`` reads some regexes
    it refuses, e.g. ``{0,-1}`` as literal text)."""
    import outlines_core

    table = {chr(c): [c] for c in range(32, 127)}
    try:
        outlines_core.Index(pattern, outlines_core.Vocabulary(0, table))
    except Exception:  # noqa: BLE001 - its errors are of no one class
        return False
    return True


def test_any_array_is_ours_only_where_it_allows_any_item():
    """Items of a schema, other array keywords, or counts no array has leave the array to
    outlines-core's translation, which enforces them; an empty array's regex compiles; items
    nest as json_object's values do."""
    from rltserve.schema_regex import JSON_OBJECT_DEPTH, any_array

    assert compiles(schema_regex({"type": "array", "maxItems": 0}))
    ints = {"type": "array", "items": {"type": "integer"}}
    assert matches(ints, "[1, 2]") and not matches(ints, '["x"]')
    first = {"type": "array", "prefixItems": [{"type": "integer"}]}
    assert matches(first, "[1]") and not matches(first, '["x"]')
    for counts in ({"minItems": -1}, {"maxItems": True}, {"minItems": 1.5}):
        assert not any_array({"type": "array", **counts}), counts
    deepest = "[" * JSON_OBJECT_DEPTH + "1" + "]" * JSON_OBJECT_DEPTH
    assert matches({"type": "array"}, deepest)
    assert re.fullmatch(json_object_pattern(), '{"a": ' + deepest[1:-1] + "}")
    assert not matches({"type": "array"}, f"[{deepest}]")


def test_subschemas_of_our_own_keep_their_other_keywords():
    """A number's bounds, a format or an ``allOf`` with keywords of their own besides (an
    ``enum``, a string's ``maxLength``, the rest of the schema): those keywords still hold."""
    enum = {"type": "integer", "minimum": 0, "enum": [1, 2]}
    assert matches(enum, "1") and not matches(enum, "3")
    dated = {"type": "string", "format": "date", "enum": ["2020-01-01"]}
    assert matches(dated, '"2020-01-01"') and not matches(dated, '"2021-01-01"')
    short = {"type": ["string", "integer"], "minimum": 0, "maxLength": 2}
    assert matches(short, '"ab"') and not matches(short, '"abc"')
    anything = {"allOf": [{}, True], "type": "integer"}
    assert matches(anything, "5") and not matches(anything, '"x"')


def test_an_email_keeps_to_its_dot_atom():
    email = {"type": "string", "format": "email"}
    assert matches(email, '"a.b_c-d@x.io"')
    for text in ('"a b@x.io"', '"a\\\\b@x.io"', '"a\\"b@x.io"', '"a..b@x.io"', '"a@x..io"'):
        assert not matches(email, text), text
