"""Structured outputs (vLLM's ``StructuredOutputsParams``, formerly ``GuidedDecodingParams``):
what a request's output must match, as one regular expression.

A JSON schema, a generic JSON object, a regex or a choice of strings each become a regex here
(``pattern``); ``guide_index`` compiles it against the tokenizer and the runner masks what each
step may sample (``core/guide.py``). The regex dialect and the JSON schema translation are
outlines-core's (the latter mended where it falls short: ``schema_regex``), imported lazily:
only a structured request needs it (``pip install 'rltserve[structured]'``). Torch-free;
imports nothing from the engine or the front ends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rltserve.schema_regex import ascii_classes, json_object_pattern, schema_regex

INSTALL_HINT = "pip install 'rltserve[structured]'"
# The constraints a request picks one of (vLLM's fields); ``grammar`` (a context-free grammar)
# is known so that asking for it is refused rather than ignored.
KINDS = ("json", "regex", "choice", "grammar", "json_object")
# Characters that mean something in outlines-core's regex dialect (Rust's ``regex``): a choice
# escapes these and nothing else (Python's ``re.escape`` escapes more than that dialect reads).
_META = set("\\.+*?()|[]{}^$#&-~")


class StructuredOutputsUnavailable(ValueError):
    """outlines-core is not installed: structured outputs cannot be compiled here."""


def outlines_core() -> Any:
    """The outlines-core module, imported on first use."""
    try:
        import outlines_core
    except ImportError:
        raise StructuredOutputsUnavailable(
            f"structured outputs need the outlines-core package: {INSTALL_HINT}"
        ) from None
    return outlines_core


@dataclass
class StructuredOutputsParams:
    """vLLM's structured-output constraint of a request: exactly one of ``json`` (a JSON
    schema, as a dict or a JSON string), ``regex``, ``choice`` (a non-empty list of strings;
    the output is one of them), ``json_object=True`` (any JSON object). ``grammar`` is refused
    (no context-free grammars). ``whitespace_pattern`` (a regex) replaces the JSON translation's
    whitespace between tokens; ``disable_any_whitespace`` allows none. vLLM's backend switches
    (``disable_fallback``, ``disable_additional_properties``, ``structural_tag``) are accepted
    at their defaults only. Validated on construction (a ValueError naming the field)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        if self.choice is not None and not isinstance(self.choice, str):
            try:
                self.choice = list(self.choice)
            except TypeError:
                raise ValueError(f"choice={self.choice!r}: must be a list of strings") from None
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                f"structured_outputs: give exactly one of {', '.join(KINDS)} (got "
                f"{', '.join(given) or 'none'})"
            )
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"json={self.json!r}: must be a JSON schema (a dict or a string)")
        if self.regex is not None and not (isinstance(self.regex, str) and self.regex):
            raise ValueError(f"regex={self.regex!r}: must be a non-empty string")
        if self.choice is not None and (
            isinstance(self.choice, str)
            or not self.choice
            or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError(f"choice={self.choice!r}: must be a non-empty list of strings")
        if self.json_object not in (None, True, False):
            raise ValueError(f"json_object={self.json_object!r}: must be a bool")
        if self.grammar is not None:
            raise ValueError("grammar: context-free grammars are not supported (use json or regex)")
        for name in ("disable_fallback", "disable_additional_properties"):
            if getattr(self, name) is not False:
                raise ValueError(f"{name}: not supported (one backend, outlines-core)")
        if self.structural_tag is not None:
            raise ValueError("structural_tag: not supported")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError("disable_any_whitespace: must be a bool")
        pattern = self.whitespace_pattern
        if pattern is not None and not isinstance(pattern, str):
            raise ValueError(f"whitespace_pattern={pattern!r}: must be a string")

    @property
    def kind(self) -> str:
        """The constraint given: one of ``KINDS``."""
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def pattern(self, field: str = "json") -> str:
        """The regex the output must match in full. A schema outlines-core cannot translate
        is a ValueError naming ``field`` (the schema's field as the caller sent it)."""
        if self.regex is not None:
            # (``\d`` as users mean it, and vLLM's default backend reads it: outlines-core's
            # Unicode one lets a model spell digits in other scripts)
            return ascii_classes(self.regex)
        if self.choice is not None:
            return "(" + "|".join(map(_escape, self.choice)) + ")"
        space = "" if self.disable_any_whitespace else self.whitespace_pattern
        if self.json is None:
            return json_object_pattern(space)
        try:
            return schema_regex(self.json, space)
        except StructuredOutputsUnavailable:
            raise
        except Exception as exc:  # (outlines-core raises ValueError, a bad JSON string too)
            raise ValueError(f"{field}: cannot use this schema: {exc}") from None


# vLLM's older name (``vllm.sampling_params.GuidedDecodingParams``), the same class.
GuidedDecodingParams = StructuredOutputsParams


def _escape(text: str) -> str:
    return "".join("\\" + c if c in _META else c for c in text)


def resolve(guided: object, structured: object) -> StructuredOutputsParams | None:
    """``SamplingParams``' constraint from its two fields (``guided_decoding``, vLLM's older
    name, and ``structured_outputs``): either, or both when they agree; a dict is taken as the
    params' keyword arguments."""
    values = []
    for name, value in (("guided_decoding", guided), ("structured_outputs", structured)):
        if isinstance(value, dict):
            try:
                value = StructuredOutputsParams(**value)
            except TypeError as exc:
                raise ValueError(f"{name}: {exc}") from None
        elif value is not None and not isinstance(value, StructuredOutputsParams):
            raise ValueError(f"{name}={value!r}: must be a StructuredOutputsParams (or None)")
        values.append(value)
    old, new = values
    if old is not None and new is not None and old != new:
        raise ValueError("guided_decoding: differs from structured_outputs (give one)")
    return new if new is not None else old
