"""Numbers within bounds as regexes: an ``integer``'s and a ``number``'s ``minimum``, ``maximum``,
``exclusiveMinimum`` and ``exclusiveMaximum`` (pydantic's ``ge``, ``le``, ``gt``, ``lt``), which
outlines-core's schema translation drops.

A bounded number is written as JSON writes a decimal: an optional minus, ``0`` or a digit string
without leading zeros, and an optional fraction of one or more digits (``0.5``, ``1``, ``1.0``,
``-0.25``); never an exponent (``0.00001``, not ``1e-05``: every value in range has such a form,
and a regex of the numbers within bounds in exponent form would not stay small), and never a
negative zero (``-0``, ``-0.0``: ``0`` is that value). The bounds are compared as the decimals
they are written as (``0.1`` is one tenth, not the double nearest it). Torch-free.
"""

from __future__ import annotations

import math
from decimal import Decimal
from typing import Any

BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
# A bound: its value and whether it is exclusive; None where a side is unbounded.
Bound = tuple[Decimal, bool]


MULTIPLES_LISTED = 1000  # the most multiples of a whole multipleOf written out one by one


def bounded_pattern(schema: dict) -> str:
    """The regex of an ``integer`` or ``number`` schema with bounds: its ``multipleOf`` too
    where that is a whole number and the bounds leave at most ``MULTIPLES_LISTED`` multiples
    (each is written out), else the bounds alone."""
    multiples = _multiples(schema)
    if multiples is not None:
        return multiples
    if schema.get("type") == "integer":
        return integer_pattern(*integer_bounds(schema))
    return number_pattern(*number_bounds(schema))


def _multiples(schema: dict) -> str | None:
    step = _decimal(schema.get("multipleOf"))
    if step is None or step <= 0 or step != step.to_integral_value():
        return None  # (a fraction's multiples: not enforced)
    least, greatest = integer_bounds(schema)  # (a whole number's multiples are integers)
    if least is None or greatest is None:
        return None
    step = int(step)
    first, last = -(-least // step) * step, greatest // step * step
    if first > last:
        raise ValueError(f"no multiple of {step} lies within the bounds {schema}")
    if (last - first) // step >= MULTIPLES_LISTED:
        return None
    values = "|".join(str(value) for value in range(first, last + 1, step))
    # (a number may be written with a zero fraction: 5.0)
    return values if schema.get("type") == "integer" else rf"({values})(\.0+)?"


def integer_bounds(schema: dict) -> tuple[int | None, int | None]:
    """The least and greatest integer ``schema``'s bounds allow (None: unbounded)."""
    low, high = number_bounds(schema, "integer")
    least = greatest = None
    if low is not None:
        least = math.floor(low[0]) + 1 if low[1] else math.ceil(low[0])
    if high is not None:
        greatest = math.ceil(high[0]) - 1 if high[1] else math.floor(high[0])
    if least is not None and greatest is not None and least > greatest:
        raise ValueError(f"no integer lies within the bounds {schema}")
    return least, greatest


def number_bounds(schema: dict, kind: str = "number") -> tuple[Bound | None, Bound | None]:
    """``schema``'s tightest lower and upper bound. Draft 4's boolean ``exclusiveMinimum`` and
    ``exclusiveMaximum`` make ``minimum`` and ``maximum`` exclusive; later drafts' are bounds
    of their own. Raises ValueError where no ``kind`` lies within them."""
    low = high = None
    for key in BOUNDS:
        value = _decimal(schema.get(key))
        if value is None:
            continue
        lower = key.endswith("inimum")
        flag = "exclusiveMinimum" if lower else "exclusiveMaximum"
        exclusive = key.startswith("exclusive") or schema.get(flag) is True
        if lower and (low is None or (value, exclusive) > low):
            low = (value, exclusive)
        elif not lower and (high is None or (-value, exclusive) > (-high[0], high[1])):
            high = (value, exclusive)
    if low and high and (low[0] > high[0] or (low[0] == high[0] and (low[1] or high[1]))):
        raise ValueError(f"no {kind} lies within the bounds {schema}")
    return low, high


def _decimal(value: Any) -> Decimal | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None  # (draft 4's boolean exclusiveMinimum / exclusiveMaximum: a flag)
    if isinstance(value, float) and not math.isfinite(value):
        return None
    # (a float as the shortest decimal that reads back as it: 0.1, the bound the schema wrote)
    return Decimal(value) if isinstance(value, int) else Decimal(repr(value))


def number_pattern(low: Bound | None, high: Bound | None) -> str:
    """The decimals from ``low`` to ``high`` (each a value and whether it is exclusive; None:
    unbounded), in the notation the module's docstring describes. The bounds must allow some
    number (``number_bounds`` checks)."""
    zero = (Decimal(0), False)
    parts = []
    if high is None or high[0] > 0 or high == zero:
        parts += _magnitudes(low if low is not None and low[0] >= 0 else zero, high)
    if low is None or low[0] < 0:
        # (the magnitudes of the negative ones, written after a minus; never a negative zero)
        least = (-high[0], high[1]) if high is not None and high[0] < 0 else (Decimal(0), True)
        most = None if low is None else (-low[0], low[1])
        parts.append("-(" + "|".join(_magnitudes(least, most)) + ")")
    return "|".join(parts)


def _magnitudes(low: Bound, high: Bound | None) -> list[str]:
    """Alternatives matching the decimals from ``low`` (>= 0) to ``high``, unsigned."""
    whole, low_digits = _split(low[0])
    low_fraction = (low_digits, low[1])
    if high is not None and _split(high[0])[0] == whole:
        return _with_fraction(whole, low_fraction, (_split(high[0])[1], high[1]))
    parts = _with_fraction(whole, low_fraction, None)
    last = None if high is None else _split(high[0])[0] - 1
    middle = _naturals(whole + 1, last)
    if middle:  # (any fraction after a whole part strictly between the bounds')
        parts.append("(" + "|".join(middle) + r")(\.[0-9]+)?")
    if high is not None:
        parts += _with_fraction(_split(high[0])[0], None, (_split(high[0])[1], high[1]))
    return parts


def _split(value: Decimal) -> tuple[int, str]:
    """A non-negative decimal's whole part and its fraction's digits, trailing zeros dropped."""
    whole, _, fraction = format(value, "f").partition(".")
    return int(whole), fraction.rstrip("0")


def _with_fraction(whole: int, low: tuple[str, bool] | None, high: tuple[str, bool] | None):
    """``whole`` and the fractions (none, or a point and digits) that keep it within ``low`` and
    ``high`` (each a fraction's digits and whether it is exclusive; None: unbounded)."""
    empty, digits = _fractions(*(low or (None, False)), *(high or (None, False)))
    if digits is None:
        return [str(whole)] if empty else []
    return [rf"{whole}(\.({digits}))" + ("?" if empty else "")]


def _fractions(low: str | None, low_open: bool, high: str | None, high_open: bool):
    """Whether no digits, and the regex of the non-empty digit strings D (None: no such D), keep
    0.D from ``low`` to ``high`` (digit strings without trailing zeros: "" is 0; None: that
    side is unbounded). Digit by digit: once a digit differs from a bound's, that bound holds
    or fails for every digit after it."""
    if low == "" and not low_open:
        low = None  # (0 <= 0.D always)
    empty = low is None and (high is None or high != "" or not high_open)
    if low in (None, "") and high in (None, ""):
        if high == "" and high_open:
            return empty, None
        if low == "":  # (some digit not 0: 0.D > 0)
            return empty, (None if high == "" else "[0-9]*[1-9][0-9]*")
        return empty, ("[0-9]+" if high is None else "0+")
    groups: dict[tuple, list[int]] = {}
    for digit in range(10):
        after_low = _after(low, low_open, digit, above=True)
        after_high = _after(high, high_open, digit, above=False)
        if after_low is not False and after_high is not False:
            groups.setdefault((after_low, after_high), []).append(digit)
    alternatives = []
    for (after_low, after_high), digits in groups.items():
        rest_empty, rest = _fractions(*after_low, *after_high)
        if rest is None and not rest_empty:
            continue
        tail = "" if rest is None else f"({rest})" + ("?" if rest_empty else "")
        alternatives.append(_digit_class(digits) + tail)
    return empty, ("|".join(alternatives) or None)


def _after(bound: str | None, exclusive: bool, digit: int, above: bool):
    """The bound left on the digits after ``digit`` (a digit string and whether it is exclusive;
    (None, False): none left), or False where ``digit`` already breaks it (``above``: a lower
    bound)."""
    if bound is None:
        return (None, False)
    first = int(bound[0]) if bound else 0
    if digit == first:
        return (bound[1:], exclusive)
    return (None, False) if (digit > first) == above else False


def _digit_class(digits: list[int]) -> str:
    """One digit, or a range: the digits ``_fractions`` groups always run without a gap (those
    strictly between the bounds' digits, or a bound's digit alone)."""
    return str(digits[0]) if len(digits) == 1 else f"[{digits[0]}-{digits[-1]}]"


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
