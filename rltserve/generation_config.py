"""A checkpoint's ``generation_config.json`` as sampling defaults, as vLLM reads it
(``--generation-config auto``): the keys of ``GENERATION_CONFIG_KEYS`` and ``max_new_tokens``
become ``SamplingParams`` keywords that a request's own values override."""

from __future__ import annotations

import json
from pathlib import Path

from rltserve.sampling import SamplingParams

# generation_config.json keys vLLM reads as sampling defaults (``max_new_tokens``: max_tokens).
GENERATION_CONFIG_KEYS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p")


def generation_config_defaults(folder: str | Path | None) -> dict[str, object]:
    """The sampling defaults a checkpoint's ``generation_config.json`` in ``folder`` sets, as
    ``SamplingParams`` keywords (vLLM's ``get_diff_sampling_param``): the keys it names of
    ``GENERATION_CONFIG_KEYS`` and ``max_new_tokens`` as ``max_tokens``; {} without the file
    (or ``folder`` None). A file that is not a JSON object, or a value ``SamplingParams``
    refuses, is a ValueError naming the file."""
    path = None if folder is None else Path(folder) / "generation_config.json"
    if path is None or not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not readable JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: must hold a JSON object")
    found = {k: raw[k] for k in (*GENERATION_CONFIG_KEYS, "max_new_tokens") if k in raw}
    found = {k: v for k, v in found.items() if v is not None}
    if "max_new_tokens" in found:
        found["max_tokens"] = found.pop("max_new_tokens")
    try:
        SamplingParams(**found)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    return found
