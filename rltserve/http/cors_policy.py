"""What cross-origin web pages may do (CORS): ``--allowed-origins``, ``--allowed-methods``,
``--allowed-headers`` and ``--allow-credentials``, as vLLM's flags (Starlette's
``CORSMiddleware``) take them.

Each list is comma-separated or vLLM's JSON list (``'["*"]'``, its manifests' spelling), ``*``
for any (the defaults, as vLLM's), empty for none. Methods compare as sent (``POST``); header
names in any case. The headers every browser may send without asking (the CORS-safelisted
``Accept``, ``Accept-Language``, ``Content-Language``, ``Content-Type``) are always allowed,
as Starlette's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

ANY = "*"
SAFELISTED_HEADERS = frozenset({"accept", "accept-language", "content-language", "content-type"})


def name_list(name: str, text: str) -> frozenset[str]:
    """``text`` as a set of names: comma-separated, or a JSON list of strings. A JSON list
    taken as one comma-separated name would turn the setting off without a word, so a text
    that opens one and is not one is a ValueError naming the field."""
    text = text.strip()
    if not text.startswith("["):
        return frozenset(o.strip() for o in text.split(",") if o.strip())
    try:
        names = json.loads(text)
    except ValueError:
        names = None
    if not isinstance(names, list) or not all(isinstance(o, str) for o in names):
        raise ValueError(
            f"{name}={text!r}: not a JSON list of strings (as '[\"https://a.example\"]') nor "
            "comma-separated ones"
        )
    return frozenset(o.strip() for o in names if o.strip())


@dataclass(frozen=True)
class CorsPolicy:
    origins: frozenset[str]
    methods: frozenset[str]
    headers: frozenset[str]  # (lower case)
    credentials: bool = False

    @classmethod
    def parse(cls, origins: str, methods: str, headers: str, credentials: bool) -> CorsPolicy:
        """The policy of the flags' texts (ValueError naming a malformed one)."""
        for name, value in (
            ("allowed_origins", origins),
            ("allowed_methods", methods),
            ("allowed_headers", headers),
        ):
            if not isinstance(value, str):
                raise ValueError(f"{name}={value!r}: must be a string")
        return cls(
            name_list("allowed_origins", origins),
            name_list("allowed_methods", methods),
            frozenset(h.lower() for h in name_list("allowed_headers", headers)),
            credentials,
        )

    def allow_origin(self, origin: str) -> str | None:
        """The ``Access-Control-Allow-Origin`` value for ``origin``; None: not allowed. With
        credentials a page's own origin, never ``*`` (browsers refuse ``*`` with them)."""
        if ANY in self.origins:
            return origin if self.credentials else ANY
        return origin if origin in self.origins else None

    def refused(self, origin: str, method: str, headers: str | None) -> list[str]:
        """What a preflight asks for that the policy refuses (Starlette's words: ``origin``,
        ``method``, ``headers``); empty: all of it is allowed."""
        failures = []
        if self.allow_origin(origin) is None:
            failures.append("origin")
        if ANY not in self.methods and method not in self.methods:
            failures.append("method")
        if headers is not None and ANY not in self.headers:
            allowed = self.headers | SAFELISTED_HEADERS
            if any(h.strip().lower() not in allowed for h in headers.split(",") if h.strip()):
                failures.append("headers")
        return failures
