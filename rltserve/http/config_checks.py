"""``ServerConfig``'s checks on construction: each a ValueError naming the field and what it
takes, before anything starts (the number fields' in ``config_numbers``); lists given for the
names and keys are kept as tuples, which a frozen config can hash."""

from __future__ import annotations

from dataclasses import fields
from typing import TYPE_CHECKING

from rltserve.http.config_numbers import check_numbers
from rltserve.http.hidden_metrics import shown_hidden_metrics
from rltserve.http.listener import check_listener
from rltserve.http.root_path import normal_root_path
from rltserve.http.tool_choice import check_tool_call_parser
from rltserve.vllm_args import CONTENT_FORMATS, generation_config_folder

if TYPE_CHECKING:
    from rltserve.http.config import ServerConfig

# What /metrics names its series with (``metrics_prefix``): rltserve's own, or vLLM's.
METRICS_PREFIXES = ("rltserve", "vllm")


def check_server_config(config: ServerConfig, max_n: int) -> None:
    """``config``'s fields in their ranges (``max_n``: the largest ``max_n`` a server takes);
    ``root_path``, ``served_model_name`` and ``api_key`` made normal."""
    check_listener(config)  # (port, socket, TLS: ValueError naming the field)
    if config.root_path is not None:
        object.__setattr__(config, "root_path", normal_root_path(config.root_path))
    names = config.served_model_name
    if names is not None and not isinstance(names, str):
        # (a list from argparse's nargs: kept as a tuple, which a frozen config can hash)
        object.__setattr__(config, "served_model_name", names := tuple(names))
        if not names:
            raise ValueError("served_model_name=(): must name at least one model")
    for name in config.served_model_names:
        if not isinstance(name, str) or not name.strip():
            raise ValueError("served_model_name='': must not be empty")
    keys = config.api_key
    if keys is not None and not isinstance(keys, str):
        object.__setattr__(config, "api_key", keys := tuple(keys))  # (as served_model_name)
    if keys is not None and (not keys or not all(isinstance(k, str) and k for k in keys)):
        raise ValueError("api_key='': must not be empty (omit it to disable auth)")
    if not isinstance(config.response_role, str) or not config.response_role.strip():
        raise ValueError(f"response_role={config.response_role!r}: must be a role's name")
    check_numbers(config, max_n)  # (ValueError naming the field)
    if config.chat_template_content_format not in CONTENT_FORMATS:
        raise ValueError(
            f"chat_template_content_format={config.chat_template_content_format!r}: must be "
            f"one of {', '.join(CONTENT_FORMATS)}"
        )
    generation_config_folder(config.generation_config, "")  # (ValueError naming it)
    if config.chat_template is not None:
        from rltserve.models.chat_template import read_chat_template

        read_chat_template(config.chat_template)  # (before the model loads: a usage error)
    config.template_defaults  # noqa: B018 - ValueError naming the field
    loops = config.max_loops_limit
    overrides = config.generation_overrides  # (ValueError naming the key)
    if loops is not None and overrides.get("max_loops", 0) > loops:
        raise ValueError(
            f"override_generation_config: max_loops={overrides['max_loops']} is above "
            f"max_loops_limit ({loops})"
        )
    config.cors  # noqa: B018 - ValueError naming a malformed list
    if config.metrics_prefix not in METRICS_PREFIXES:
        choices = ", ".join(repr(p) for p in METRICS_PREFIXES)
        raise ValueError(f"metrics_prefix={config.metrics_prefix!r}: must be one of {choices}")
    shown_hidden_metrics(config.show_hidden_metrics_for_version)  # (ValueError if malformed)
    for name in (f.name for f in fields(config) if f.type == "bool"):  # (the switches)
        if not isinstance(getattr(config, name), bool):
            raise ValueError(f"{name}={getattr(config, name)!r}: must be a bool")
    check_tool_call_parser(config.enable_auto_tool_choice, config.tool_call_parser)
    for path in config.quiet_paths:
        if not path.startswith("/"):
            raise ValueError(
                f"disable_access_log_for_endpoints: {path!r} is not a path (starts with /)"
            )
