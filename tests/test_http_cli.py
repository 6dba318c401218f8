"""The parsers and commands of ``rltserve serve`` and ``rltserve bench serve``
(``rltserve/http/cli.py``): flags derived from ServerConfig, the API key from the environment,
vLLM's flag spellings (its auto tool choice flags among them), the warning of a reachable server
without a key, and bench serve's flags reaching the benchmark, bad values named before
connecting, and its exit codes."""

from __future__ import annotations

import argparse
import json
import logging
import math
import re

import pytest

from rltserve.client import APIError
from rltserve.http.cli import (
    add_bench_serve_parser,
    add_serve_parser,
    cmd_bench_serve,
    dataclass_kwargs,
    serve_configs,
)
from rltserve.http.config import ServerConfig


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rltserve")
    sub = parser.add_subparsers(dest="command")
    add_serve_parser(sub)
    bench = sub.add_parser("bench").add_subparsers(dest="bench_command")
    add_bench_serve_parser(bench)
    return parser


def test_serve_flags_come_from_server_config(monkeypatch):
    args = _parser().parse_args(
        ["serve", "--port", "0", "--max-concurrent", "8", "--served-model-name", "m",
         "--max-num-seqs", "4"]
    )  # fmt: skip
    config = ServerConfig(**dataclass_kwargs(args, ServerConfig))
    assert (config.port, config.max_concurrent, config.served_model_names) == (0, 8, ("m",))
    assert config.max_queued == ServerConfig().max_queued  # unset flags keep the defaults
    assert args.max_num_seqs == 4  # engine flags ride along
    monkeypatch.setenv("RLTSERVE_API_KEY", "from-env")
    assert config.with_env().api_key == "from-env"
    with pytest.raises(ValueError, match="ssl_certfile"):
        ServerConfig(ssl_certfile="cert.pem")
    with pytest.raises(ValueError, match="max_concurrent"):
        ServerConfig(max_concurrent=0)


def test_bench_serve_flags():
    args = _parser().parse_args(
        ["bench", "serve", "--num-prompts", "5", "--request-rate", "inf", "--json"]
    )
    assert args.num_prompts == 5 and math.isinf(args.request_rate) and args.json
    assert args.endpoint == "completions"
    from rltserve.bench.serve import ENDPOINTS

    for endpoint in ENDPOINTS:  # (the flag spells out the config's choices)
        assert _parser().parse_args(["bench", "serve", "--endpoint", endpoint]).endpoint == endpoint
    with pytest.raises(SystemExit):
        _parser().parse_args(["bench", "serve", "--endpoint", "rest"])


def test_serve_takes_the_api_key_from_the_environment_unless_a_flag_gives_one(monkeypatch):
    monkeypatch.setenv("RLTSERVE_API_KEY", "from-env")
    server, engine = serve_configs(_parser().parse_args(["serve", "--max-num-seqs", "4"]))
    assert server.api_key == "from-env" and engine.scheduler.max_num_seqs == 4
    server, _ = serve_configs(_parser().parse_args(["serve", "--api-key", "flag"]))
    assert server.api_keys == ("flag",)


def test_serve_takes_several_api_keys_as_vllm_does(monkeypatch):
    """``--api-key K1 K2`` (vLLM's api_key is a list): the second key was taken for MODEL, so
    the server tried to load a checkpoint named after the secret and printed it in the error."""
    monkeypatch.setenv("RLTSERVE_API_KEY", "from-env")
    args = _parser().parse_args(["serve", "--api-key", "sk-one", "sk-two", "--max-num-seqs", "4"])
    assert args.model_tag is None
    server, _ = serve_configs(args)
    assert server.api_keys == ("sk-one", "sk-two")  # (the flag's: the variable's is unused)
    assert ServerConfig(api_key="k").api_keys == ("k",) and ServerConfig().api_keys == ()
    for bad in ((), ("k", ""), [""]):
        with pytest.raises(ValueError, match="^api_key='': must not be empty"):
            ServerConfig(api_key=bad)


def test_serve_refuses_a_model_read_as_a_second_api_key(tiny):
    """``serve --api-key KEY MODEL`` took MODEL when the flag took one key; with several keys
    MODEL became a key: the demo model was served and the checkpoint's path passed as a key."""
    model = tiny
    args = _parser().parse_args(["serve", "--api-key", "sk-one", str(model)])
    with pytest.raises(ValueError, match="names a checkpoint, not a key") as caught:
        serve_configs(args)
    assert "sk-one" not in str(caught.value)  # (a key is never printed)
    args = _parser().parse_args(["serve", str(model), "--api-key", "sk-one", "sk-two/x"])
    server, _ = serve_configs(args)
    assert server.api_keys == ("sk-one", "sk-two/x") and args.model == str(model)


def test_serve_stage_stable_s_is_the_restart_policys():
    from types import SimpleNamespace

    from rltserve.http.state import ServingState

    server, _ = serve_configs(_parser().parse_args(["serve", "--stage-stable-s", "5"]))
    policy = ServingState.restart_policy(SimpleNamespace(config=server))
    assert (server.stage_stable_s, policy.stable_s, policy.max_restarts) == (5.0, 5.0, 3)
    with pytest.raises(ValueError, match=r"^stage_stable_s=-1\.0: must be a number >= 0$"):
        serve_configs(_parser().parse_args(["serve", "--stage-stable-s", "-1"]))


def test_serve_takes_default_template_variables_as_vllm_spells_the_flag():
    flags = ["serve", "--default-chat-template-kwargs", '{"enable_thinking": true}']
    server, _ = serve_configs(_parser().parse_args(flags))
    assert server.template_defaults == {"enable_thinking": True}
    with pytest.raises(ValueError, match="^default_chat_template_kwargs: not JSON"):
        serve_configs(_parser().parse_args(["serve", "--default-chat-template-kwargs", "x"]))


def test_serve_takes_vllms_chat_template_content_format():
    """A vLLM command line's ``--chat-template-content-format string``: taken (text parts are
    joined whichever it names, as ``LLM.chat`` does), an unknown one refused naming it."""
    flags = ["serve", "--chat-template-content-format", "string"]
    assert serve_configs(_parser().parse_args(flags))[0].chat_template_content_format == "string"
    with pytest.raises(ValueError, match="^chat_template_content_format='html': must be one of"):
        serve_configs(_parser().parse_args(["serve", "--chat-template-content-format", "html"]))


def test_serve_on_a_reachable_host_without_a_key_warns(monkeypatch, caplog):
    """Anyone who reaches such a server may load weights or put it to sleep: say so once."""
    import rltserve.http.server
    from rltserve.http.cli import cmd_serve

    monkeypatch.delenv("RLTSERVE_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    monkeypatch.setattr(rltserve.http.server, "run_server", lambda *a: 0)
    monkeypatch.setattr("rltserve.preflight.check_listen_address", lambda *a: None)
    for flags, warned in (
        (["--host", "0.0.0.0"], "'0.0.0.0'"),
        (["--host", "::"], "'::'"),
        (["--host", ""], "''"),  # (every interface)
        (["--host", "example.internal"], "'example.internal'"),
        (["--host", "0.0.0.0", "--api-key", "k"], None),
        ([], None),  # (127.0.0.1: this machine only)
        (["--host", "127.0.0.2"], None),
        (["--host", "::1"], None),
        (["--host", "localhost"], None),
    ):
        caplog.clear()
        assert cmd_serve(_parser().parse_args(["serve", "--port", "0", *flags])) == 0
        said = [r for r in caplog.records if "without an API key" in r.getMessage()]
        expected = [] if warned is None else [
            (
                logging.WARNING,
                f"serving on {warned} without an API key: anyone who reaches the port may "
                "generate and call the admin routes (POST /v1/update_weights, /sleep, /wake_up, "
                "/reset_prefix_cache: load weights, put the model to sleep); set --api-key, "
                "RLTSERVE_API_KEY or VLLM_API_KEY",
            )
        ]  # fmt: skip
        assert [(r.levelno, r.getMessage()) for r in said] == expected, flags


def test_bench_serve_targets_where_serve_listens_by_default():
    args = _parser().parse_args(["bench", "serve"])
    server = ServerConfig()
    assert args.url == f"http://{server.host}:{server.port}"
    assert math.isinf(args.request_rate) and args.num_turns == 1
    assert _parser().parse_args(["serve"]).log_level == "info"


def _bench_args(*flags: str) -> argparse.Namespace:
    return _parser().parse_args(["bench", "serve", "--json", "--quiet", *flags])


def test_bench_serve_flags_reach_the_benchmark(monkeypatch, capsys):
    seen = []

    async def fake_run_bench(config):
        seen.append(config)
        return {"completed": 3}

    monkeypatch.setattr("rltserve.bench.serve.run_bench", fake_run_bench)
    monkeypatch.setenv("RLTSERVE_API_KEY", "from-env")
    flags = ["--input-len", "3", "--output-len", "5", "--num-turns", "2", "--wait-timeout", "7",
             "--seed", "9", "--max-concurrency", "2"]  # fmt: skip
    assert cmd_bench_serve(_bench_args(*flags)) == 0
    [config] = seen
    assert (config.input_len, config.output_len, config.num_turns) == (3, 5, 2)
    assert (config.ready_timeout_s, config.seed, config.max_concurrency) == (7.0, 9, 2)
    assert config.api_key == "from-env" and math.isinf(config.request_rate)
    assert config.progress is False
    assert capsys.readouterr().out.strip() == '{\n  "completed": 3\n}'
    assert cmd_bench_serve(_bench_args("--api-key", "flag")) == 0
    assert seen[-1].api_key == "flag"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--num-prompts", "0"], "--num-prompts 0: must be >= 1"),
        (["--output-len", "0"], "--output-len 0: must be >= 1"),
        (["--max-concurrency", "0"], "--max-concurrency 0: must be >= 1"),
        (["--request-rate", "0"], "--request-rate 0: must be > 0 (or inf)"),
        (["--burstiness", "inf"], "--burstiness inf: must be a finite number > 0"),
        (["--wait-timeout", "0"], "--wait-timeout 0: must be > 0"),
    ],
)
def test_bench_serve_names_the_flag_of_a_bad_value_before_connecting(monkeypatch, flags, message):
    async def connects(config):
        raise AssertionError("the benchmark started")

    monkeypatch.setattr("rltserve.bench.serve.run_bench", connects)
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        cmd_bench_serve(_bench_args(*flags))


def test_bench_serve_fails_when_nothing_completed_or_the_server_refuses(monkeypatch):
    async def nothing_completed(config):
        return {"completed": 0}

    monkeypatch.setattr("rltserve.bench.serve.run_bench", nothing_completed)
    assert cmd_bench_serve(_bench_args()) == 1

    async def refused(config):
        raise APIError(401, "invalid API key")

    monkeypatch.setattr("rltserve.bench.serve.run_bench", refused)
    with pytest.raises(RuntimeError, match=r"^http://127.0.0.1:8000: .*invalid API key"):
        cmd_bench_serve(_bench_args())


def test_serve_takes_vllms_logging_flags():
    args = _parser().parse_args(
        ["serve", "--log-level", "INFO", "--uvicorn-log-level", "WARNING", "--disable-log-requests",
         "--enable-log-requests", "--enable-log-outputs", "--max-log-len", "100",
         "--enable-request-id-headers", "--disable-uvicorn-access-log",
         "--disable-access-log-for-endpoints", "/health,/metrics,/ping",
         "--served-model-name", "a", "org/b"]
    )  # fmt: skip
    assert (args.log_level, args.uvicorn_log_level, args.disable_log_requests) == (
        "info", "warning", True,
    )  # fmt: skip
    server, _ = serve_configs(args)
    assert server.enable_log_requests and server.enable_log_outputs and server.max_log_len == 100
    assert server.enable_request_id_headers and server.disable_uvicorn_access_log
    assert server.quiet_paths == {"/health", "/metrics", "/ping"}
    assert server.served_model_names == ("a", "org/b")
    server, _ = serve_configs(_parser().parse_args(["serve", "--disable-fastapi-docs"]))
    assert server.disable_fastapi_docs
    for level in ("critical", "CRITICAL", "Debug"):
        assert _parser().parse_args(["serve", "--log-level", level]).log_level == level.lower()
    with pytest.raises(SystemExit):
        _parser().parse_args(["serve", "--log-level", "verbose"])
    with pytest.raises(ValueError, match="^disable_access_log_for_endpoints: 'health' is not"):
        serve_configs(
            _parser().parse_args(["serve", "--disable-access-log-for-endpoints", "health"])
        )


def test_serve_takes_vllms_auto_tool_choice_flags():
    flags = ["serve", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    server, _ = serve_configs(_parser().parse_args(flags))
    assert server.enable_auto_tool_choice and server.tool_call_parser == "hermes"
    # (a parser alone, as vLLM manifests may carry it: taken, "auto" still refused)
    server, _ = serve_configs(_parser().parse_args(["serve", "--tool-call-parser", "hermes"]))
    assert not server.enable_auto_tool_choice and server.tool_call_parser == "hermes"
    for flags, message in [
        (["--enable-auto-tool-choice"], "--enable-auto-tool-choice: needs --tool-call-parser"),
        (["--enable-auto-tool-choice", "--tool-call-parser", "llama3_json"],
         "--tool-call-parser 'llama3_json': unknown (choices: hermes)"),
    ]:  # fmt: skip
        with pytest.raises(ValueError, match="^" + re.escape(message)):
            serve_configs(_parser().parse_args(["serve", *flags]))


def test_serve_takes_the_model_as_vllm_serve_does(tmp_path):
    """``rltserve serve MODEL`` (``vllm serve MODEL``'s spelling) is ``--model MODEL``; it was
    "unrecognized arguments"."""
    from rltserve.models.presets import make_model

    ckpt = make_model("ouro-tiny", tmp_path / "ouro", tokenizer=False)
    for argv in (["serve", str(ckpt), "--port", "0"], ["serve", "--port", "0", str(ckpt)]):
        args = _parser().parse_args(argv)
        _, engine = serve_configs(args)
        assert engine.model.model == args.model == str(ckpt)
    _, engine = serve_configs(_parser().parse_args(["serve", str(ckpt), "--model", str(ckpt)]))
    assert engine.model.model == str(ckpt)
    args = _parser().parse_args(["serve", str(ckpt), "--model", str(tmp_path)])
    with pytest.raises(ValueError, match=r"^MODEL '.*/ouro' and --model '.*': name the model once"):
        serve_configs(args)
    _, engine = serve_configs(_parser().parse_args(["serve"]))
    assert engine.model.model is None  # (the demo model, as before)


def test_uvicorn_log_level_sets_aiohttps_loggers_apart(monkeypatch):
    import logging

    from rltserve.http.cli import configure_logging

    aiohttp_logger = logging.getLogger("aiohttp")
    monkeypatch.setattr(aiohttp_logger, "level", aiohttp_logger.level)  # (restored after)
    configure_logging(_parser().parse_args(["serve", "--uvicorn-log-level", "warning"]))
    assert logging.getLogger("aiohttp.access").getEffectiveLevel() == logging.WARNING
    configure_logging(_parser().parse_args(["serve", "--uvicorn-log-level", "trace"]))
    assert logging.getLogger("aiohttp.access").getEffectiveLevel() == logging.DEBUG
    with pytest.raises(ValueError, match="^--log-config-file /nowhere.json: "):
        configure_logging(_parser().parse_args(["serve", "--log-config-file", "/nowhere.json"]))


def test_serve_takes_its_log_level_from_vllms_variable_under_the_flag(monkeypatch):
    """``VLLM_LOGGING_LEVEL`` (vLLM's, which deployments set) is the default of --log-level; it
    was ignored, leaving the server at info."""
    from rltserve.http.cli import configure_logging

    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "WARNING")
    assert _parser().parse_args(["serve"]).log_level == "warning"
    assert _parser().parse_args(["serve", "--log-level", "debug"]).log_level == "debug"
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "TRACE")
    with pytest.raises(ValueError, match="^VLLM_LOGGING_LEVEL='TRACE': must be one of DEBUG, "):
        configure_logging(_parser().parse_args(["serve"]))


def test_a_log_config_file_leaves_the_servers_loggers_on(tmp_path, monkeypatch):
    """The server's modules (and their loggers) are imported before the file is read:
    dictConfig's default would disable them all; a file may still ask for that itself."""
    import logging

    from rltserve.http.cli import configure_logging

    root, server = logging.getLogger(), logging.getLogger("rltserve.http")
    monkeypatch.setattr(root, "handlers", list(root.handlers))  # (restored after)
    monkeypatch.setattr(root, "level", root.level)
    for logger in logging.root.manager.loggerDict.values():  # (dictConfig may disable any)
        if isinstance(logger, logging.Logger):
            monkeypatch.setattr(logger, "disabled", logger.disabled)
    from rltserve.core import worker_process

    monkeypatch.setenv(worker_process.LOG_CONFIG_ENV, "")
    path = tmp_path / "logging.json"
    for extra, disabled in [({}, False), ({"disable_existing_loggers": True}, True)]:
        path.write_text(json.dumps({"version": 1, "root": {"level": "WARNING"}, **extra}))
        configure_logging(_parser().parse_args(["serve", "--log-config-file", str(path)]))
        assert (server.disabled, root.level) == (disabled, logging.WARNING)
        # (the stage workers it starts load the same file: test_stage_lifecycle.py)
        assert worker_process._log_args() == ["--log-config-file", str(path)]


def test_serve_logs_its_version_and_non_default_args_without_secrets(monkeypatch, caplog):
    import rltserve.http.server
    from rltserve import __version__
    from rltserve.http.cli import cmd_serve, non_default_args

    flags = ["serve", "--port", "0", "--api-key", "sk-secret", "--served-model-name", "a", "b",
             "--disable-log-requests"]  # fmt: skip
    args = _parser().parse_args(flags)
    assert non_default_args(args) == {
        "port": 0,
        "served_model_name": ["a", "b"],
        "api_key": "***",
        "disable_log_requests": True,
    }
    monkeypatch.setattr(rltserve.http.server, "run_server", lambda *a: 0)
    monkeypatch.setattr("rltserve.preflight.check_listen_address", lambda *a: None)
    caplog.set_level("INFO", logger="rltserve.http")
    assert cmd_serve(args) == 0
    said = [r.getMessage() for r in caplog.records if r.name == "rltserve.http"]
    assert said[:3] == [
        f"rltserve API server version {__version__}",
        f"non-default args: {non_default_args(args)}",
        "--disable-log-requests is deprecated: request logs are off by default "
        "(--enable-log-requests turns them on)",
    ]
    assert "sk-secret" not in caplog.text


def test_serve_takes_vllms_api_key_variable_and_logs_only_where_it_came_from(monkeypatch, caplog):
    import rltserve.http.server
    from rltserve.http.cli import cmd_serve

    served = []
    monkeypatch.delenv("RLTSERVE_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "sk-vllm-secret")
    monkeypatch.setattr(rltserve.http.server, "run_server", lambda *a: served.append(a[0]) or 0)
    monkeypatch.setattr("rltserve.preflight.check_listen_address", lambda *a: None)
    caplog.set_level("INFO", logger="rltserve.http")
    assert cmd_serve(_parser().parse_args(["serve", "--port", "0", "--host", "0.0.0.0"])) == 0
    assert served[0].api_key == "sk-vllm-secret"
    assert "API key: from the environment (VLLM_API_KEY)" in caplog.messages
    assert "without an API key" not in caplog.text and "sk-vllm-secret" not in caplog.text
    server, _ = serve_configs(_parser().parse_args(["serve", "--metrics-auth"]))
    assert server.metrics_auth and server.api_key == "sk-vllm-secret"


VLLM_SERVE_LINE = [
    "serve", "--max-model-len", "512", "--enable-chunked-prefill", "--max-num-batched-tokens",
    "512", "--trust-remote-code", "--tensor-parallel-size", "1", "--enable-prompt-tokens-details",
    "--disable-log-requests", "--prefix-caching-hash-algo", "sha256", "-tp", "1",
    "--enforce-eager", "--kv-cache-dtype", "auto", "--load-format", "safetensors",
    "--disable-log-stats", "--gpu-memory-utilization", "0.9", "--reasoning-parser", "deepseek_r1",
    "--enable-force-include-usage", "--enable-server-load-tracking",
    "--enable-tokenizer-info-endpoint",
]  # fmt: skip


def test_serve_takes_vllms_engine_flags_at_values_it_can_honour():
    """A ``vllm serve`` line ports unchanged: vLLM's engine flags (``vllm_args.FLAGS``, which
    ``LLM(...)`` takes as keywords) are accepted where their values ask for nothing rltserve
    lacks, as ``LLM`` accepts them."""
    args = _parser().parse_args(VLLM_SERVE_LINE)
    server, engine = serve_configs(args)
    assert (engine.model.max_model_len, engine.scheduler.max_num_batched_tokens) == (512, 512)
    assert (args.tensor_parallel_size, args.enable_chunked_prefill) == (1, True)
    assert args.trust_remote_code and args.enforce_eager and server.disable_log_stats
    assert server.enable_force_include_usage and server.enable_server_load_tracking
    assert server.enable_tokenizer_info_endpoint
    assert args.reasoning_parser == "deepseek_r1"  # (rltserve splits <think>...</think> itself)
    assert not engine.execution.cuda_graphs


@pytest.mark.parametrize(
    "flags,message",
    [
        (["-tp", "2"], "--tensor-parallel-size 2: not supported (rltserve runs an engine on one "
         "device; for more devices run replicas (rltserve.ray.generate, serve --replicas))"),
        (["--enable-lora"], "--enable-lora: not supported (LoRA adapters are not supported; "
         "serve a checkpoint with the adapter merged in)"),
        # (no scheduler setting of rltserve's runs a prompt whole, as vLLM's False asks)
        (["--no-enable-chunked-prefill"], "--no-enable-chunked-prefill: not supported (rltserve "
         "always prefills prompts in chunks of at most prefill_chunk_size tokens; raise it, up "
         "to max_num_batched_tokens, for fewer chunks)"),
        (["--kv-cache-dtype", "fp8"],
         "--kv-cache-dtype fp8: not supported (the KV cache has the model's dtype)"),
        (["--pipeline-parallel-size", "2"],
         "--pipeline-parallel-size 2: not supported (an engine runs on one device)"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("command", [["serve"], ["generate", "Hi"], ["bench", "offline"]])
def test_vllms_flags_asking_for_what_rltserve_lacks_are_usage_errors(
    capsys, command, flags, message
):
    """Refused before any model loads, with LLM's reason (generate and bench offline build
    their engines from the same flags)."""
    from rltserve.cli import main

    assert main([*command, *flags]) == 2
    assert capsys.readouterr().err == f"rltserve: error: {message}\n"


@pytest.mark.parametrize(
    "value,length",
    [("1k", 1000), ("1K", 1024), ("25.6k", 25600), ("1.001k", 1001), ("2048", 2048),
     ("-1", None), ("auto", None), ("AUTO", None)],
)  # fmt: skip
def test_token_counts_take_vllms_human_readable_values(value, length):
    """vLLM's parsers: k/m/g/t decimal, K/M/G/T binary; --max-model-len also -1 or auto (the
    model's context, within the KV pool)."""
    _, engine = serve_configs(_parser().parse_args(["serve", "--max-model-len", value]))
    assert engine.model.max_model_len == length
    if length is not None:
        args = _parser().parse_args(["serve", "--max-num-batched-tokens", value])
        assert args.max_num_batched_tokens == length


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--max-model-len", "1.5K"],
         "argument --max-model-len: '1.5K': a binary suffix takes a whole number (did you mean "
         "1.5k?)"),
        (["--max-model-len", "1.0005k"],
         "argument --max-model-len: '1.0005k': not a whole number of tokens"),
        (["--max-model-len", "lots"],
         "argument --max-model-len: invalid int value: 'lots' (e.g. 2048, 2k, 25.6k or 2K)"),
        (["--max-num-batched-tokens", "auto"],
         "argument --max-num-batched-tokens: invalid int value: 'auto' (e.g. 2048, 2k, 25.6k or "
         "2K)"),
    ],
)  # fmt: skip
def test_a_token_count_that_does_not_parse_names_the_flag(capsys, flags, message):
    with pytest.raises(SystemExit) as exit_info:
        _parser().parse_args(["serve", *flags])
    assert exit_info.value.code == 2 and capsys.readouterr().err.endswith(f"error: {message}\n")


def test_serve_refuses_vllms_asgi_middleware_saying_why():
    """``--middleware`` (vLLM's: an ASGI middleware's import path) cannot run on aiohttp: a
    usage error saying so, not argparse's bare "unrecognized arguments"."""
    args = _parser().parse_args(["serve", "--middleware", "my.mod.Auth", "--middleware", "b.C"])
    with pytest.raises(
        ValueError, match=r"^--middleware my\.mod\.Auth: not supported: .* aiohttp, not an ASGI app"
    ):
        serve_configs(args)
