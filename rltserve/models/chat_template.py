"""Chat templates rendered with jinja2, as ``transformers``' ``apply_chat_template`` renders them.

Same environment (sandboxed, immutable, ``trim_blocks`` and ``lstrip_blocks``, the
``loopcontrols`` extension, a ``{% generation %}`` block that renders its body), the same
globals (``raise_exception``, ``strftime_now``, ``dict``, ``namespace`` rejecting ``_`` names),
the same ``tojson`` filter (no HTML escaping, ``ensure_ascii=False``), and the same variables:
``messages``, ``tools``, ``documents``, ``add_generation_prompt``, the named special tokens
(``bos_token``, ``eos_token``, ...) and the caller's keyword arguments, which win over the rest.
Messages are normalised the same way: keys whose value is None are dropped and a reasoning field
(``reasoning_content``, ``thinking`` or ``reasoning``) is exposed under the first two names.

Templates are compiled once per ``ChatTemplate`` (a template is a fixed string of a checkpoint).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: renders its body (transformers uses the block to
    locate assistant tokens for training masks, which serving never asks for)."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """``dict(...)`` for templates without exposing the ``dict`` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """``namespace(...)`` that refuses underscore-prefixed attribute names."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - jinja's own signature trick
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes ({name!r})"
            )


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _Namespace
    return env


def _plain(value: Any) -> Any:
    """Template data rebuilt from plain JSON-like types (what the sandbox may safely see)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages as templates see them: plain dicts without None values, reasoning aliased."""
    out = []
    for message in messages:
        if callable(getattr(message, "model_dump", None)):
            message = message.model_dump()  # type: ignore[union-attr]
        if not isinstance(message, Mapping):
            raise TypeError(f"chat messages must be dicts, got {message!r}")
        msg = {k: v for k, v in _plain(message).items() if v is not None}
        reasoning = next((msg[k] for k in _REASONING_FIELDS if msg.get(k) is not None), None)
        if reasoning is not None:
            msg = {"thinking": reasoning, **msg, "reasoning_content": reasoning}
        out.append(msg)
    return out


class ChatTemplate:
    """One compiled template (or a named set: ``default`` and optionally ``tool_use``)."""

    def __init__(self, source: str | Mapping[str, str]) -> None:
        env = _environment()
        named = {"default": source} if isinstance(source, str) else dict(source)
        self.sources: dict[str, str] = named
        self._compiled = {name: env.from_string(text) for name, text in named.items()}

    def _pick(self, tools: object) -> jinja2.Template:
        if tools is not None and "tool_use" in self._compiled:
            return self._compiled["tool_use"]
        if "default" in self._compiled:
            return self._compiled["default"]
        raise ValueError(
            "the tokenizer has several chat templates and none is named 'default': "
            + ", ".join(sorted(self._compiled))
        )

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool,
        special_tokens: Mapping[str, str],
        **kwargs: Any,
    ) -> str:
        """The rendered text. ``kwargs`` (template variables such as ``enable_thinking``,
        ``tools``, ``documents``) override the special tokens of the same name."""
        variables: dict[str, Any] = {"tools": None, "documents": None, **special_tokens}
        variables.update(_plain(kwargs))
        template = self._pick(variables["tools"])
        variables["messages"] = normalize_messages(messages)
        variables["add_generation_prompt"] = add_generation_prompt
        return template.render(**variables)


def read_chat_template(value: str, name: str = "chat_template") -> str:
    """A template given as vLLM's ``--chat-template`` takes it: a file's path (its text) or the
    Jinja source itself (text with braces or a newline); ValueError naming ``name`` for a path
    that is no file or a template that does not compile."""
    try:
        with open(value, encoding="utf-8") as f:
            source = f.read()
    except OSError:
        if not any(c in value for c in "{}\n"):
            raise ValueError(f"{name}={value!r}: no such file (nor a Jinja template)") from None
        source = value
    try:
        ChatTemplate(source)
    except jinja2.TemplateError as exc:
        raise ValueError(f"{name}: the template does not compile: {exc}") from exc
    return source
