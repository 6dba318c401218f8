"""What ``AsyncClient`` sends: the server URL it is given, checked, and what a call's keyword
arguments become: the JSON body, and the OpenAI SDK's per-request keywords (``extra_body``,
``extra_headers``, ``extra_query``, ``timeout``) as ``RequestOptions``."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit


@dataclass(frozen=True)
class RequestOptions:
    """What one call asks of the transport besides its body.

    ``timeout`` is the longest wait in seconds for the server to connect or send anything
    (None: no limit); ``headers`` go over the client's own (a None value leaves that header
    out); ``query`` is added to the URL as its query string."""

    timeout: float | None
    headers: Mapping[str, str | None] = field(default_factory=dict)
    query: Mapping[str, str | int | float] = field(default_factory=dict)


def server_root(url: str) -> str:
    """The server's base URL for ``AsyncClient``: a URL ending in ``/v1``, as OpenAI clients
    take it, names the same server."""
    return url.rstrip("/").removesuffix("/v1")


def check_url(url: str, name: str = "url") -> None:
    """ValueError naming ``name`` unless ``url`` is an http(s) URL with a host (and a port, if
    any, that is a number in range)."""
    why = "must be an http(s) URL with a host, e.g. http://127.0.0.1:8000"
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError on a port that is not a number in range
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{name}={url!r}: {why} ({exc})") from exc
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{name}={url!r}: {why}")


def check_timeout(timeout: object, name: str = "timeout") -> float | None:
    """``timeout`` when it is a positive number of seconds or None, else ValueError."""
    if timeout is not None and (
        not isinstance(timeout, numbers.Real) or isinstance(timeout, bool) or not timeout > 0
    ):
        raise ValueError(f"{name}={timeout!r}: must be a positive number of seconds or None")
    return timeout


def request_of(params: dict, timeout: float | None, **fields: Any) -> tuple[dict, RequestOptions]:
    """The JSON body and the options of a call: ``fields`` (the method's own arguments) and
    ``params`` (its other keywords) make the body, ``extra_body``'s fields over them, as the
    OpenAI SDK merges it; ``timeout`` is the client's, unless the call gives its own."""
    params = dict(params)
    extra_body = params.pop("extra_body", None)
    headers = params.pop("extra_headers", None)
    query = params.pop("extra_query", None)
    options = RequestOptions(
        check_timeout(params.pop("timeout", timeout)),
        _strings(headers, "extra_headers", (str, type(None))),
        _strings(query, "extra_query", (str, int, float)),
    )
    return _body({**fields, **params, **_mapping(extra_body, "extra_body")}), options


def _mapping(value: object, name: str) -> Mapping:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(f"{name}={value!r}: must be a dict")
    return value


def _strings(value: object, name: str, kinds: tuple[type, ...]) -> dict:
    """``value`` as a dict of string keys to ``kinds``, else ValueError naming ``name``."""
    mapping = _mapping(value, name)
    for key, item in mapping.items():
        if not isinstance(key, str) or not isinstance(item, kinds) or isinstance(item, bool):
            allowed = " or ".join("None" if k is type(None) else k.__name__ for k in kinds)
            raise ValueError(f"{name}[{key!r}]={item!r}: must be a {allowed} under a str key")
    return dict(mapping)


def check_stream(body: dict, streams: bool, method: str, other: str) -> None:
    """Takes ``stream`` out of ``body``: ValueError when it asks for what ``method`` does not
    do (``other`` does)."""
    if "stream" in body and bool(body["stream"]) is not streams:
        raise ValueError(f"stream={body['stream']!r}: {method}() does not; use {other}()")
    body.pop("stream", None)


def non_finite(value: object, where: str = "") -> str | None:
    """Where in a request body a NaN or infinite number is (JSON has none), or None."""
    if isinstance(value, dict):
        paths = ((f"{where}.{k}" if where else str(k), v) for k, v in value.items())
        return next((w for path, v in paths if (w := non_finite(v, path))), None)
    if type(value).__name__ == "ndarray":  # (NumPy's, sent as lists: OPT_SERIALIZE_NUMPY)
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        return next((w for i, v in enumerate(value) if (w := non_finite(v, f"{where}[{i}]"))), None)
    if isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral):
        return None if math.isfinite(value) else f"{where}={value!r}"
    return None


def _body(fields: dict) -> dict:
    body = {k: list(v) if isinstance(v, tuple) else v for k, v in fields.items() if v is not None}
    bias = body.get("logit_bias")
    if isinstance(bias, dict):  # token ids as keys, as Python holds them: OpenAI's strings
        body["logit_bias"] = {
            str(int(k)) if isinstance(k, numbers.Integral) else k: v for k, v in bias.items()
        }
    return body
