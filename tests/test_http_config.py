"""``ServerConfig`` (``rltserve.http.config``): every bound is checked where the config is built,
a bad value is a ValueError naming the field and the value, the edge of every range is
accepted, and the API key comes from the environment only when no flag gives one."""

from __future__ import annotations

import dataclasses

import pytest
from test_http_harness import Script, ScriptedStage, running, scripted_factory, scripted_info

from rltserve.http.api_keys import API_KEY_ENV, API_KEY_ENVS, api_key_env
from rltserve.http.config import ServerConfig


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from test_http_harness import tiny_checkpoint

    return tiny_checkpoint(tmp_path_factory)


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
        ({"response_role": "  "}, r"response_role='  ': must be a role's name$"),
        ({"max_concurrent": 0}, r"max_concurrent=0: must be an int >= 1"),
        ({"max_concurrent": True}, r"max_concurrent=True:"),
        ({"max_queued": -1}, r"max_queued=-1: must be an int >= 0"),
        ({"max_body_bytes": 1023}, r"max_body_bytes=1023: must be an int >= 1024"),
        ({"retry_after_s": -1}, r"retry_after_s=-1: must be an int >= 0"),
        ({"startup_timeout_s": 0}, r"startup_timeout_s=0: must be a number > 0"),
        ({"drain_timeout_s": -0.5}, r"drain_timeout_s=-0.5: must be a number >= 0"),
        # (from Python, a str or None is a ValueError naming the field, not a TypeError)
        ({"startup_timeout_s": "30"}, r"startup_timeout_s='30': must be a number > 0$"),
        ({"startup_timeout_s": None}, r"startup_timeout_s=None: must be a number > 0$"),
        ({"drain_timeout_s": "5"}, r"drain_timeout_s='5': must be a number >= 0$"),
        ({"stage_stable_s": float("nan")}, r"stage_stable_s=nan: must be a number >= 0$"),
        ({"idle_timeout_s": True}, r"idle_timeout_s=True: must be a number > 0$"),
        ({"port": True}, r"port=True: must be an int in \[0, 65535\]$"),
        ({"retry_after_s": True}, r"retry_after_s=True: must be an int >= 0$"),
        ({"stage_restarts": "3"}, r"stage_restarts='3': must be an int >= 0$"),
        ({"max_header_count": 0}, r"max_header_count=0: must be an int >= 1$"),
        ({"uds": ""}, r"uds='': must be a socket's path$"),
        ({"uds": "/tmp/" + "s" * 200}, r"uds='/tmp/s+': longer than a Unix socket's path"),
        ({"api_server_count": 2}, r"api_server_count=2: rltserve serves the API from one process"),
        ({"api_server_count": "1"}, r"api_server_count='1': rltserve serves the API"),
        ({"ssl_cert_reqs": 3}, r"ssl_cert_reqs=3: must be one of 0 \(none\), 1 \(optional\), 2"),
        ({"ssl_cert_reqs": 2}, r"ssl_cert_reqs=2: only with TLS \(ssl_certfile\)$"),
        ({"ssl_ca_certs": "ca.pem"}, r"ssl_ca_certs='ca.pem': only with TLS \(ssl_certfile\)$"),
        (
            {"ssl_certfile": "c.pem", "ssl_keyfile": "k.pem", "ssl_cert_reqs": 2},
            r"ssl_cert_reqs=2: needs ssl_ca_certs, the CA certificates \(PEM\) that client",
        ),
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
        ({"max_loops_limit": 0}, r"max_loops_limit=0: must be an int >= 1$"),
        ({"max_loops_limit": True}, r"max_loops_limit=True: must be an int >= 1$"),
        ({"override_generation_config": "{"}, r"override_generation_config: not JSON \("),
        (
            {"override_generation_config": "[1]"},
            r"override_generation_config='\[1\]': must be a JSON object$",
        ),
        (
            {"override_generation_config": '{"temprature": 0.5}'},
            r"override_generation_config: 'temprature' is not a default it sets \(one of: "
            r"repetition_penalty, temperature, top_k, top_p, min_p, max_new_tokens, max_loops, "
            r"num_steps, exit_criterion, exit_threshold, init_state\)$",
        ),
        (
            {"override_generation_config": '{"min_loops": 2}'},
            r"override_generation_config: 'min_loops' cannot be a server default \(a "
            r"request that omits it sends its default; send it per request\)$",
        ),
        (
            {"override_generation_config": '{"max_loops": 4, "num_steps": 8}'},
            r"override_generation_config: 'num_steps' repeats another key's field$",
        ),
        (
            {"override_generation_config": '{"top_p": 0}'},
            r"override_generation_config: top_p=0: must be in \(0, 1\]$",
        ),
        (
            {"override_generation_config": '{"init_state": "noise"}'},
            r"override_generation_config: init_state='noise': must be one of",
        ),
        (
            {"override_generation_config": '{"num_steps": 9}', "max_loops_limit": 8},
            r"override_generation_config: max_loops=9 is above max_loops_limit \(8\)$",
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
        "max_loops_limit": 1,
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


def test_vllms_api_key_variable_counts_after_rltserves_own(monkeypatch):
    """A deployment configured for vLLM (VLLM_API_KEY) must not come up unauthenticated:
    --api-key, then RLTSERVE_API_KEY, then VLLM_API_KEY (an empty one is unset)."""
    assert API_KEY_ENVS == (API_KEY_ENV, "VLLM_API_KEY")
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "vllm-key")
    assert (ServerConfig().with_env().api_key, api_key_env()) == ("vllm-key", "VLLM_API_KEY")
    assert ServerConfig(api_key="flag").with_env().api_key == "flag"
    monkeypatch.setenv(API_KEY_ENV, "ours")
    assert (ServerConfig().with_env().api_key, api_key_env()) == ("ours", API_KEY_ENV)
    monkeypatch.setenv(API_KEY_ENV, "")
    assert ServerConfig().with_env().api_key == "vllm-key"
    monkeypatch.setenv("VLLM_API_KEY", "")
    assert (ServerConfig().with_env().api_key, api_key_env()) == (None, None)


def test_default_template_variables_are_a_json_object():
    """``--default-chat-template-kwargs`` (vLLM's flag) is a JSON object; unset, none."""
    config = ServerConfig(default_chat_template_kwargs='{"enable_thinking": true, "x": [1]}')
    assert config.template_defaults == {"enable_thinking": True, "x": [1]}
    assert ServerConfig().template_defaults == {}


def test_generation_overrides_are_sampling_params_keywords():
    """``--override-generation-config`` (vLLM's flag) in ``SamplingParams``' names: vLLM's
    max_new_tokens is max_tokens, Huginn's num_steps max_loops; a null sets nothing."""
    config = ServerConfig(
        override_generation_config='{"temperature": 0.5, "max_new_tokens": 7, "num_steps": 8, '
        '"init_state": "zero", "exit_criterion": "kl", "top_k": null}',
        max_loops_limit=8,
    )
    assert config.generation_overrides == {
        "temperature": 0.5,
        "max_tokens": 7,
        "max_loops": 8,
        "init_state": "zero",
        "exit_criterion": "kl",
    }
    assert ServerConfig().generation_overrides == {}


async def test_generation_overrides_are_the_defaults_of_requests_that_leave_fields_out(ckpt):
    """The overrides replace the generation config's defaults (the loop fields too); a
    request's own values win; a default depth beyond the model's stops the server from
    starting (health says why)."""
    overrides = (
        '{"temperature": 0.5, "top_p": 0.9, "max_new_tokens": 3, "max_loops": 3, '
        '"init_state": "zero", "exit_criterion": "kl", "exit_threshold": 0.25}'
    )
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    huginn_like = dataclasses.replace(scripted_info(ckpt), needs_noise=True)  # (an initial state)
    stage = ScriptedStage(huginn_like, Script([44, 77]))
    factory = scripted_factory(stage)
    async with running(ckpt, client_factory=factory, override_generation_config=overrides) as live:
        assert (await live.post("/v1/chat/completions", chat))[0] == 200
        given = {"prompt": [5], "temperature": 0.0, "num_steps": 2, "init_state": "random",
                 "exit_criterion": "none", "exit_threshold": 1.0, "max_tokens": 2}  # fmt: skip
        assert (await live.post("/v1/completions", given))[0] == 200
    fields = ("temperature", "top_p", "max_tokens", "max_loops", "init_state", "exit_criterion",
              "exit_threshold")  # fmt: skip
    assert [tuple(getattr(p, f) for f in fields) for p in stage.added_params] == [
        (0.5, 0.9, 3, 3, "zero", "kl", 0.25),
        (0.0, 0.9, 2, 2, "random", "none", 1.0),  # (an explicit 1.0 is kept, not the default)
    ]
    stage = ScriptedStage(scripted_info(ckpt), Script([44, 77]))  # (8 loops at most)
    factory, too_deep = scripted_factory(stage), '{"max_loops": 9}'
    async with running(
        ckpt, client_factory=factory, override_generation_config=too_deep, wait=False
    ) as live:
        await live.state.ready.wait()
        assert live.state.load_error == (
            "ValueError: --override-generation-config: max_loops=9: this model allows at most 8"
        )
    # Defaults the model cannot take stop it at start too, not every request later.
    for info, bad, why in [
        (scripted_info(ckpt), '{"init_state": "zero"}', "init_state='zero': this model has no"),
        (
            dataclasses.replace(scripted_info(ckpt), has_gate=True),
            '{"exit_criterion": "kl"}',
            "exit_criterion='kl': this model's tokens exit by its learned gate",
        ),
    ]:
        factory = scripted_factory(ScriptedStage(info, Script([44])))
        async with running(
            ckpt, client_factory=factory, override_generation_config=bad, wait=False
        ) as live:
            await live.state.ready.wait()
            assert live.state.load_error.startswith(
                f"ValueError: --override-generation-config: {why}"
            )


async def test_a_default_threshold_stays_with_its_criterion(ckpt):
    """A server's default ``exit_threshold`` is on its default criterion's scale: a request
    naming another criterion without a threshold takes that criterion's own default (it was a
    400 for argmax-stability, "exit_threshold=0.5: ... must be a whole number", a threshold the
    request never sent, and latent-diff ran at kl's 0.5); the same criterion, or a threshold
    alone, keeps the server's pairing. A default threshold below 1 alone is kl's."""
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    sent = [
        {"exit_criterion": "argmax-stability"},
        {"exit_criterion": "latent-diff"},
        {"exit_criterion": "kl"},
        {"exit_threshold": 0.2},
        {"exit_criterion": "latent-diff", "exit_threshold": 0.4},
    ]
    for overrides, want in [
        (
            '{"exit_criterion": "kl", "exit_threshold": 0.5}',
            [("argmax-stability", 5), ("latent-diff", 0.03), ("kl", 0.5), ("kl", 0.2)],
        ),
        (
            '{"exit_threshold": 0.5}',
            [("argmax-stability", 5), ("latent-diff", 0.03), ("kl", 0.5), (None, 0.2)],
        ),
    ]:
        stage = ScriptedStage(scripted_info(ckpt), Script([44, 77]))
        factory = scripted_factory(stage)
        async with running(
            ckpt, client_factory=factory, override_generation_config=overrides
        ) as live:
            for body in sent:
                status, _, raw = await live.post("/v1/chat/completions", {**chat, **body})
                assert status == 200, raw
        got = [(p.exit_criterion, p.exit_threshold) for p in stage.added_params]
        assert got == [*want, ("latent-diff", 0.4)], overrides


def test_lists_of_names_and_keys_are_kept_as_tuples_a_frozen_config_hashes():
    """argparse's nargs gives lists: a config holding them hashes and compares as one given
    tuples (a frozen dataclass hashes its fields: a list there would be a TypeError)."""
    listed = ServerConfig(served_model_name=["a", "b"], api_key=["k1", "k2"])
    given = ServerConfig(served_model_name=("a", "b"), api_key=("k1", "k2"))
    assert (listed.served_model_name, listed.api_key) == (("a", "b"), ("k1", "k2"))
    assert hash(listed) == hash(given) and listed == given
