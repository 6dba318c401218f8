"""Numbers within bounds (``number_pattern``, ``number_bounds``): a ``number``'s ``minimum``,
``maximum`` and exclusive bounds, which outlines-core's translation dropped (``Field(ge=0,
le=1)`` finished with ``{"confidence": 2.36}``). The regex's full matches are compared with a
direct check of the decimal over many bounds and candidate texts, and random walks through the
index compiled for a vocabulary are checked with ``jsonschema``."""

from __future__ import annotations

import json
import random
import re
from decimal import Decimal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rltserve.number_pattern import number_bounds, number_pattern
from rltserve.structured import StructuredOutputsParams

pytest.importorskip("outlines_core")

DECIMAL = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?")  # (JSON's number, no exponent)


def inside(text: str, low, high) -> bool:
    """Whether ``text`` is a decimal the pattern should take: JSON's, no exponent, no negative
    zero, within the bounds (each a value and whether it is exclusive, or None)."""
    if not DECIMAL.fullmatch(text):
        return False
    value = Decimal(text)
    if text.startswith("-") and value == 0:
        return False
    above = low is None or (value > low[0] if low[1] else value >= low[0])
    below = high is None or (value < high[0] if high[1] else value <= high[0])
    return above and below


def texts_near(value: Decimal) -> set[str]:
    """Decimals around ``value`` in each form a writer may give them, and forms JSON refuses."""
    out = set()
    for places in range(6):
        step = Decimal(1).scaleb(-places)
        for k in range(-12, 13):
            near = value + k * step
            plain = format(near, "f")
            out |= {plain, plain + "0" if "." in plain else plain + ".0", json.dumps(float(near))}
            if near == near.to_integral_value():
                out.add(str(int(near)))
    for text in list(out):
        magnitude = text.lstrip("-")
        sign = text[: len(text) - len(magnitude)]
        out |= {sign + "0" + magnitude, text + ".", sign + magnitude.removeprefix("0")}
        out |= {"+" + magnitude, text + "e0", text.replace(".", "")}
    return out | {"-0", "-0.0", "-0.00", "0", "0.0", ".5", "-.5", "1.", "00", "1e-05"}


def random_bound(rng: random.Random) -> Decimal:
    return Decimal(rng.randint(-3000, 3000)).scaleb(-rng.randint(0, 4))


@pytest.mark.parametrize(
    ("low", "high"),
    [((0, False), (1, False)), ((0, True), None), (("-50.5", False), (60, False)),
     (("0.25", True), ("0.75", True)), (None, ("-0.5", False)), (None, (0, True)),
     (("-1", True), (0, False)), ((2, False), (2, False)), (None, None), (("0.001", False), None),
     (("-0.0125", False), ("-0.0025", True)), (("9.99", False), ("10.01", False))],
)  # fmt: skip
def test_the_pattern_is_exactly_the_range(low, high):
    low = None if low is None else (Decimal(low[0]), low[1])
    high = None if high is None else (Decimal(high[0]), high[1])
    pattern = re.compile(number_pattern(low, high))
    for bound in {Decimal(0), Decimal(1), *(b[0] for b in (low, high) if b)}:
        for text in texts_near(bound):
            assert bool(pattern.fullmatch(text)) == inside(text, low, high), (low, high, text)


def test_the_pattern_at_random_bounds():
    """Bounds with 0-4 fraction digits, negative, zero, equal, one-sided, exclusive or not."""
    rng = random.Random(0)
    for _ in range(300):
        values = sorted([random_bound(rng), random_bound(rng)])
        if rng.random() < 0.15:
            values[1] = values[0]
        low, high = ((v, rng.random() < 0.5) for v in values)
        if values[0] == values[1]:
            low, high = (values[0], False), (values[0], False)
        low, high = (None if rng.random() < 0.15 else b for b in (low, high))
        pattern = re.compile(number_pattern(low, high))
        for bound in {Decimal(0), *(b[0] for b in (low, high) if b)}:
            for text in texts_near(bound):
                assert bool(pattern.fullmatch(text)) == inside(text, low, high), (low, high, text)


@settings(max_examples=300, deadline=None)
@given(
    bounds=st.tuples(
        *[st.one_of(st.none(), st.tuples(st.decimals(-1000, 1000, places=4), st.booleans()))] * 2
    ),
    texts=st.lists(
        st.one_of(
            st.from_regex(r"-?[0-9]{1,5}(\.[0-9]{1,6})?", fullmatch=True),
            st.floats(-2000, 2000).map(json.dumps),
            st.integers(-2000, 2000).map(str),
        ),
        min_size=20,
        max_size=20,
    ),
)
def test_the_pattern_against_any_text(bounds, texts):
    low, high = bounds
    if low and high and (low[0] > high[0] or (low[0] == high[0] and (low[1] or high[1]))):
        return  # (no number lies within them: refused, below)
    pattern = re.compile(number_pattern(low, high))
    for text in texts:
        assert bool(pattern.fullmatch(text)) == inside(text, low, high), (low, high, text)


def test_what_json_dumps_writes_in_range_is_taken():
    """Floats and ints as ``json.dumps`` writes them (``1.0``, ``-0.25``, ``60``), where they
    have no exponent; ``0.00001`` stands for ``1e-05``."""
    pattern = re.compile(number_pattern((Decimal("-50.5"), False), (Decimal(60), False)))
    for value in (0.5, 1, 1.0, -0.25, 60, 60.0, -50.5, 0, 0.0, 12.345678901234567, 0.00001):
        text = json.dumps(value)
        assert bool(pattern.fullmatch(text)) == ("e" not in text), text
    assert pattern.fullmatch("0.00001") and not pattern.fullmatch("-0.0")


def test_bounds_as_schemas_write_them():
    """pydantic's ``ge``/``le``/``gt``/``lt`` (draft 2020's numeric exclusive bounds) and draft
    4's boolean flags, fractional bounds read as the decimals written (0.1, not the double
    nearest it); the tightest of several bounds holds."""
    assert number_bounds({"minimum": 0, "maximum": 1}) == ((0, False), (1, False))
    assert number_bounds({"exclusiveMinimum": 0.1}) == ((Decimal("0.1"), True), None)
    draft_4 = {"minimum": -2.5, "exclusiveMinimum": True, "maximum": 6, "exclusiveMaximum": True}
    assert number_bounds(draft_4) == ((Decimal("-2.5"), True), (6, True))
    both = {"minimum": 1, "exclusiveMinimum": 1, "maximum": 3, "exclusiveMaximum": 3.5}
    assert number_bounds(both) == ((1, True), (3, False))
    tied = {"maximum": 3, "exclusiveMaximum": 3, "minimum": -1, "exclusiveMinimum": -2}
    assert number_bounds(tied) == ((-1, False), (3, True))  # (a tie: the exclusive one holds)
    assert number_bounds({"minimum": float("-inf"), "maximum": True}) == (None, None)


@pytest.mark.parametrize(
    "bounds",
    [{"minimum": 1, "exclusiveMaximum": 1}, {"exclusiveMinimum": 2.5, "maximum": 2.5},
     {"minimum": 3, "maximum": 2.75}, {"minimum": 1, "maximum": 1, "exclusiveMaximum": True}],
)  # fmt: skip
def test_bounds_no_number_meets_are_refused_naming_the_field(bounds):
    impossible = StructuredOutputsParams(json={"type": "number", **bounds})
    with pytest.raises(ValueError, match="response_format: cannot use this schema: no number"):
        impossible.pattern("response_format")


def test_equal_inclusive_bounds_are_that_number():
    pattern = StructuredOutputsParams(json={"type": "number", "minimum": 2.5, "maximum": 2.5})
    texts = ["2.5", "2.50", "2.5000", "2.49", "2.51", "2", "-2.5", "25"]
    assert [t for t in texts if re.fullmatch(pattern.pattern(), t)] == ["2.5", "2.50", "2.5000"]


def walk(compiled, rng: random.Random, steps: int = 300) -> list[int] | None:
    """Tokens a random walk under the guide spells until it ends (None: it ran out of steps);
    the end is taken half the time it is allowed, so values are of all lengths."""
    from rltserve.core.guide import Guide

    guide = Guide(compiled)
    tokens = []
    for _ in range(steps):
        allowed = guide.allowed()
        if compiled.eos in allowed and (len(allowed) == 1 or rng.random() < 0.5):
            return tokens
        token = rng.choice([t for t in allowed if t != compiled.eos])
        guide.advance(token)
        tokens.append(token)
    return None


def test_random_walks_through_the_index_are_valid(tiny):
    """Each output the compiled index allows, at bounded floats as pydantic writes them
    (``Field(ge=0, le=1)``, ``Field(gt=0)``, ``confloat(ge=-50.5, le=60)``, an ``Optional``),
    a number of two types and a whole ``multipleOf``, parses as JSON and is valid under
    ``jsonschema`` (bounds read as decimals)."""
    jsonschema = pytest.importorskip("jsonschema")
    from rltserve.guide_index import GuideCompiler
    from rltserve.models.tokenizer import load_tokenizer

    schema = {
        "type": "object",
        "properties": {
            "confidence": {"type": "number", "minimum": 0, "maximum": 1, "title": "Confidence"},
            "price": {"type": "number", "exclusiveMinimum": 0},
            "temperature": {"type": "number", "minimum": -50.5, "maximum": 60},
            "ratio": {"anyOf": [{"type": "number", "exclusiveMaximum": -0.125}, {"type": "null"}]},
            "share": {"type": ["number", "null"], "minimum": 0.05, "exclusiveMaximum": 0.5},
            "step": {"type": "number", "minimum": -20, "maximum": 100, "multipleOf": 5},
        },
        "required": ["confidence", "price", "temperature", "ratio", "share", "step"],
    }
    tok = load_tokenizer(tiny)
    compiled = GuideCompiler(tok).compile(StructuredOutputsParams(json=schema).pattern())
    validator = jsonschema.Draft202012Validator(json.loads(json.dumps(schema), parse_float=Decimal))
    rng = random.Random(0)
    finished = 0
    for _ in range(300):
        tokens = walk(compiled, rng)
        if tokens is None:
            continue
        finished += 1
        text = tok.decode(tokens)
        value = json.loads(text, parse_float=Decimal)
        assert not list(validator.iter_errors(value)), text
    assert finished >= 100
