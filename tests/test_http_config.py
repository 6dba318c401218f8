"""``ServerConfig`` (``rltserve.http.config``): every bound is checked where the config is built,
a bad value is a ValueError naming the field and the value, the edge of every range is
accepted, and the API key comes from the environment only when no flag gives one."""

from __future__ import annotations

import pytest

from rltserve.http.config import API_KEY_ENV, ServerConfig


@pytest.mark.parametrize(
    ("kwargs", "prefix"),
    [
        ({"port": 65536}, r"port=65536: must be an int in \[0, 65535\]"),
        ({"port": -1}, r"port=-1:"),
        ({"port": "80"}, r"port='80':"),
        ({"served_model_name": "  "}, r"served_model_name='': must not be empty"),
        ({"served_model_name": ("a", "")}, r"served_model_name='': must not be empty"),
        ({"served_model_name": []}, r"served_model_name=\(\): must name at least one model"),
        ({"max_log_len": -1}, r"max_log_len=-1: must be an int >= 0"),
        ({"enable_log_requests": 1}, r"enable_log_requests=1: must be a bool"),
        (
            {"disable_access_log_for_endpoints": "/health,metrics"},
            r"disable_access_log_for_endpoints: 'metrics' is not a path \(starts with /\)$",
        ),
        ({"api_key": ""}, r"api_key='': must not be empty"),
        ({"max_concurrent": 0}, r"max_concurrent=0: must be an int >= 1"),
        ({"max_concurrent": True}, r"max_concurrent=True:"),
        ({"max_queued": -1}, r"max_queued=-1: must be an int >= 0"),
        ({"max_body_bytes": 1023}, r"max_body_bytes=1023: must be an int >= 1024"),
        ({"retry_after_s": -1}, r"retry_after_s=-1: must be an int >= 0"),
        ({"startup_timeout_s": 0}, r"startup_timeout_s=0: must be > 0"),
        ({"drain_timeout_s": -0.5}, r"drain_timeout_s=-0.5: must be >= 0"),
        ({"generation_config": "nowhere"}, r".*nowhere"),
        ({"max_n": True}, r"max_n=True: must be an int in \[1, 128\]"),
        ({"max_stop": -1}, r"max_stop=-1: must be an int >= 0"),
        ({"max_stop_chars": 0}, r"max_stop_chars=0: must be an int >= 1"),
        ({"max_logprobs": -1}, r"max_logprobs=-1: must be an int in \[0, 20\]"),
        ({"max_header_bytes": 255}, r"max_header_bytes=255: must be an int >= 256"),
        ({"max_tokens_limit": True}, r"max_tokens_limit=True: must be an int >= 1"),
        ({"body_timeout_s": 0.0}, r"body_timeout_s=0.0: must be a number > 0"),
        ({"stage_restart_backoff_s": -1}, r"stage_restart_backoff_s=-1: must be a number >= 0"),
        ({"expose_model_path": 1}, r"expose_model_path=1: must be a bool"),
        ({"disable_log_stats": 1}, r"disable_log_stats=1: must be a bool"),
        (
            {"metrics_prefix": "sglang"},
            r"metrics_prefix='sglang': must be one of 'rltserve', 'vllm'$",
        ),
        ({"default_chat_template_kwargs": "{"}, r"default_chat_template_kwargs: not JSON \("),
        (
            {"default_chat_template_kwargs": "[1]"},
            r"default_chat_template_kwargs='\[1\]': must be a JSON object$",
        ),
        (
            {"default_chat_template_kwargs": '{"messages": []}'},
            r"default_chat_template_kwargs: 'messages' is not a template variable "
            r"\(requests set it\)$",
        ),
    ],
)
def test_a_bad_setting_is_named_with_its_value(kwargs, prefix):
    with pytest.raises(ValueError, match="^" + prefix):
        ServerConfig(**kwargs)


def test_settings_at_the_edges_of_their_ranges_are_taken():
    edges = {
        "port": 65535,
        "max_concurrent": 1,
        "max_queued": 0,
        "max_body_bytes": 1024,
        "retry_after_s": 0,
        "drain_timeout_s": 0,
        "max_n": 128,
        "max_stop": 0,
        "max_stop_chars": 1,
        "max_logprobs": 20,
        "max_header_bytes": 256,
        "max_tokens_limit": 1,
        "stage_watchdog_s": 0,  # (no watchdog)
        "stage_restarts": 0,
        "stage_restart_backoff_s": 0,
        "stage_stable_s": 0,  # (every stage that started counts as stable)
    }
    config = ServerConfig(**edges)
    assert {name: getattr(config, name) for name in edges} == edges
    assert ServerConfig(port=0).port == 0  # (a free one)


def test_the_server_listens_on_loopback_only_by_default():
    config = ServerConfig()
    assert (config.host, config.port, config.api_key, config.uses_tls) == (
        "127.0.0.1",
        8000,
        None,
        False,
    )


def test_the_api_key_comes_from_the_environment_only_when_none_is_given(monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert ServerConfig().with_env().api_key == "from-env"
    assert ServerConfig(api_key="flag").with_env().api_key == "flag"
    monkeypatch.setenv(API_KEY_ENV, "")  # (set but empty: no auth, not an empty key)
    assert ServerConfig().with_env().api_key is None


def test_default_template_variables_are_a_json_object():
    """``--default-chat-template-kwargs`` (vLLM's flag) is a JSON object; unset, none."""
    config = ServerConfig(default_chat_template_kwargs='{"enable_thinking": true, "x": [1]}')
    assert config.template_defaults == {"enable_thinking": True, "x": [1]}
    assert ServerConfig().template_defaults == {}
