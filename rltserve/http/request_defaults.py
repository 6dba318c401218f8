"""The server-wide request defaults that ``rltserve serve`` takes as JSON objects:
``--override-generation-config`` (sampling defaults, vLLM's flag) and
``--default-chat-template-kwargs`` (chat template variables), parsed and checked as
``ServerConfig`` reads them, so a bad key or value is a usage error before the model loads."""

from __future__ import annotations

import json

from rltserve.generation_config import GENERATION_CONFIG_KEYS
from rltserve.sampling import SamplingParams

# ``override_generation_config``'s keys beyond GENERATION_CONFIG_KEYS, as SamplingParams names
# them: vLLM's max_new_tokens, and the loop fields a request leaves unset by sending nothing
# (None), so that a server-wide value can stand in for them. (min_loops has a request default,
# 1, that a default from here could not tell from a sent value.)
OVERRIDE_KEYS = {
    **{key: key for key in GENERATION_CONFIG_KEYS},
    "max_new_tokens": "max_tokens",
    "max_loops": "max_loops",
    "num_steps": "max_loops",
    "exit_criterion": "exit_criterion",
    "exit_threshold": "exit_threshold",
    "init_state": "init_state",
}


def template_defaults(text: str | None) -> dict:
    """``default_chat_template_kwargs`` parsed (empty when not set); ValueError when it is not
    a JSON object of template variables."""
    name = "default_chat_template_kwargs"
    value = json_object(name, text)
    from rltserve.http.chat_messages import TEMPLATE_CALL_ARGUMENTS

    for key in value:
        if key in TEMPLATE_CALL_ARGUMENTS:
            raise ValueError(f"{name}: {key!r} is not a template variable (requests set it)")
    return value


def generation_overrides(text: str | None) -> dict[str, object]:
    """``override_generation_config`` parsed as ``SamplingParams`` keywords (empty when not
    set); ValueError naming a key it does not take or a value SamplingParams refuses."""
    name = "override_generation_config"
    value = json_object(name, text)
    overrides: dict[str, object] = {}
    for key, item in value.items():
        if key == "min_loops":
            raise ValueError(
                f"{name}: {key!r} cannot be a server default (a request that omits it "
                "sends its default; send it per request)"
            )
        if key not in OVERRIDE_KEYS:
            known = ", ".join(OVERRIDE_KEYS)
            raise ValueError(f"{name}: {key!r} is not a default it sets (one of: {known})")
        if OVERRIDE_KEYS[key] in overrides:
            raise ValueError(f"{name}: {key!r} repeats another key's field")
        if item is not None:  # (null: no default, as generation_config_defaults reads it)
            overrides[OVERRIDE_KEYS[key]] = item
    try:
        SamplingParams(**overrides)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{name}: {exc}") from None
    return overrides


def json_object(name: str, text: object) -> dict:
    """The JSON object a flag's ``text`` holds ({} for None); a ValueError naming ``name``
    otherwise."""
    if text is None:
        return {}
    try:
        value = json.loads(text) if isinstance(text, str) else None
    except ValueError as exc:
        raise ValueError(f"{name}: not JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise ValueError(f"{name}={text!r}: must be a JSON object")
    return value
