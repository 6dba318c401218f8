"""``--allowed-origins`` read (``ServerConfig.origins``; ``cors`` answers with it): a
comma-separated list of origins, or vLLM's JSON list (``'["*"]'``, its manifests' spelling),
which taken as one comma-separated origin would turn CORS off without a word."""

from __future__ import annotations

import json


def allowed_origins(text: str) -> frozenset[str]:
    """The origins the flag's ``text`` names (empty: no cross-origin page may call the API);
    ValueError for a malformed JSON list."""
    if not text.strip().startswith("["):
        return frozenset(o.strip() for o in text.split(",") if o.strip())
    try:
        origins = json.loads(text)
    except ValueError:
        origins = None
    if not isinstance(origins, list) or not all(isinstance(o, str) for o in origins):
        raise ValueError(
            f"allowed_origins={text!r}: not a JSON list of origins "
            "(as '[\"https://a.example\"]') nor comma-separated ones"
        )
    return frozenset(o.strip() for o in origins if o.strip())
