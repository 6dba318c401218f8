"""``rltserve serve``: its parser and command (``rltserve bench serve``'s are in
``rltserve.bench.serve_cli``).

Flags come from the config dataclasses (``--max-concurrent`` from ``ServerConfig``; the engine
flags through ``rltserve.engine_args``). This module imports nothing heavy at import time, so
the main CLI can import it unconditionally; it never imports ``rltserve.cli``.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import logging
import os
from typing import TYPE_CHECKING

from rltserve.engine_args import add_dataclass_args, dataclass_kwargs
from rltserve.http.config_file import CONFIG_SET, add_config_flag, named_file

if TYPE_CHECKING:
    from rltserve.config import EngineConfig
    from rltserve.http.config import ServerConfig
    from rltserve.ray.config import ReplicaConfig

# The routes that change the server for everyone, open to anyone without an API key (vLLM
# registers sleep and wake only in its dev mode; RL trainers call them here).
ADMIN_ROUTES = ("/v1/update_weights", "/sleep", "/wake_up", "/reset_prefix_cache")


def is_loopback(host: str) -> bool:
    """Whether ``host`` is an address only this machine reaches (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name (or "" for every interface): it may be reachable
        return False


LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
# uvicorn's levels, as vLLM's --uvicorn-log-level takes them (trace: debug here, aiohttp has none
# below it)
HTTP_LOG_LEVELS = ("trace", *LOG_LEVELS)
# vLLM's variable of its log level, which deployments set for the server (--log-level wins)
LOG_LEVEL_ENV = "VLLM_LOGGING_LEVEL"
# Flags whose values the startup line hides (vLLM's redact_sensitive_args)
SECRET_FLAGS = frozenset({"api_key", "hf_token"})


# ---------------------------------------------------------------------- serve


def add_serve_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from rltserve.engine_args import add_engine_args
    from rltserve.http.config import ServerConfig
    from rltserve.http.vllm_frontend import add_vllm_frontend_args
    from rltserve.ray.config import ReplicaConfig

    parser = subparsers.add_parser(
        "serve",
        help="serve the OpenAI-compatible HTTP API",
        description="Serves /v1/completions, /v1/chat/completions and friends. Without --model "
        "it serves the built-in demo model.",
    )
    parser.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="the checkpoint, as vLLM's `vllm serve MODEL` takes it: the same as --model",
    )
    add_config_flag(parser)
    add_dataclass_args(parser, ServerConfig, "server")
    add_dataclass_args(parser, ReplicaConfig, "replicas (Ray Serve; the 'ray' extra)")
    parser.add_argument(
        "--disable-log-requests",
        action="store_true",
        help="deprecated, as vLLM's: request logs are off unless --enable-log-requests",
    )
    parser.add_argument(
        "--enable-prompt-tokens-details",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="vLLM's; accepted: usage.prompt_tokens_details (cached_tokens) is always there when "
        "some prompt tokens were cached, as vLLM's with this flag",
    )
    parser.add_argument(
        "--middleware",
        action="append",
        default=None,
        metavar="IMPORT_PATH",
        help="vLLM's ASGI middleware (an import path); refused: this server is aiohttp, not an "
        "ASGI app, so it cannot run one (put the logic in a proxy in front of it)",
    )
    add_vllm_frontend_args(parser)
    add_engine_args(parser)  # (after serve's own: vLLM's engine flags leave those to it)
    parser.add_argument(
        "--log-level",
        default=os.environ.get(LOG_LEVEL_ENV) or "info",  # (a bad one: configure_logging's)
        type=str.lower,
        choices=LOG_LEVELS,
        help=f"server log level, in any case (default: info, or env {LOG_LEVEL_ENV}, vLLM's)",
    )
    parser.add_argument(
        "--uvicorn-log-level",
        default=None,
        type=str.lower,
        choices=HTTP_LOG_LEVELS,
        help="vLLM's: the level of the HTTP server's own logs (aiohttp's), the access lines "
        "(INFO) among them: 'warning' drops those; 'trace' is 'debug' (default: --log-level's)",
    )
    parser.add_argument(
        "--log-config-file",
        default=None,
        help="a JSON logging configuration (Python's logging.config.dictConfig schema, as "
        "vLLM's) that replaces the one --log-level sets up, in the stage workers and Ray "
        "replicas too",
    )
    parser.set_defaults(func=cmd_serve)
    return parser


def configure_logging(args: argparse.Namespace) -> None:
    """The process's logging: ``--log-config-file``'s configuration (which the stage workers
    it starts then load too), else ``--log-level``'s lines on stderr; ``--uvicorn-log-level``
    sets aiohttp's loggers apart (ValueError naming a configuration file that does not load,
    or a ``VLLM_LOGGING_LEVEL`` that names no level)."""
    from rltserve.core import worker_process
    from rltserve.core.stage_worker import LOG_FORMAT, load_log_config

    if args.log_level not in LOG_LEVELS:  # (the environment's: argparse checks the flag's)
        levels = ", ".join(level.upper() for level in LOG_LEVELS)
        raise ValueError(
            f"{LOG_LEVEL_ENV}={os.environ.get(LOG_LEVEL_ENV)!r}: must be one of {levels}"
        )
    if args.log_config_file is None:
        logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT)
    else:
        try:
            load_log_config(args.log_config_file)
        except ValueError as exc:
            raise ValueError(f"--log-config-file {args.log_config_file}: {exc}") from exc
        worker_process.set_log_config_file(args.log_config_file)
    if args.uvicorn_log_level is not None:
        level = "debug" if args.uvicorn_log_level == "trace" else args.uvicorn_log_level
        logging.getLogger("aiohttp").setLevel(level.upper())


def non_default_args(args: argparse.Namespace) -> dict[str, object]:
    """``serve``'s flags given values other than their defaults, secrets hidden: what vLLM
    logs at start as ``non-default args``."""
    defaults = vars(add_serve_parser(argparse.ArgumentParser().add_subparsers()).parse_args([]))
    changed = {
        name: value
        for name, value in vars(args).items()
        if name in defaults and name != "func" and value != defaults[name]
    }
    return {name: "***" if name in SECRET_FLAGS else v for name, v in changed.items()}


def take_model_tag(args: argparse.Namespace) -> None:
    """``serve MODEL`` (vLLM's spelling) is ``serve --model MODEL``: ``args.model`` takes the
    positional argument; both, naming different models, are a ValueError. MODEL replaces the
    ``model`` of a ``--config`` file, as vLLM's."""
    tag = getattr(args, "model_tag", None)
    if tag is None:
        return
    from_file = getattr(args, CONFIG_SET, {}).get("model", (None, None))[1]
    from_file = args.model is not None and args.model == from_file
    if args.model is not None and args.model != tag and not from_file:
        raise ValueError(f"MODEL {tag!r} and --model {args.model!r}: name the model once")
    args.model = tag


def check_model_not_key(keys: list[str] | None) -> None:
    """``--api-key`` takes several keys (vLLM's), so a MODEL written after it (``serve
    --api-key KEY MODEL``, which took MODEL when the flag took one key) is read as a second
    key: the demo model would be served, and the checkpoint's path would pass as a key. A last
    key that names a checkpoint (a path here, or a repo id in the local Hugging Face cache) is
    a ValueError saying so; the keys themselves are never printed."""
    if not keys or len(keys) < 2:
        return
    from rltserve.preflight import names_checkpoint

    if names_checkpoint(keys[-1]):
        raise ValueError(
            f"--api-key: its last value {keys[-1]!r} names a checkpoint, not a key (--api-key "
            "takes several keys, as vLLM's, so MODEL after it is read as one); give the model "
            "first, 'rltserve serve MODEL --api-key KEY', or as --model"
        )


def serve_configs(args: argparse.Namespace) -> tuple[ServerConfig, EngineConfig]:
    """The server and engine configs of ``serve``'s flags (ValueError naming a bad one)."""
    from rltserve.config import EngineConfig
    from rltserve.engine_args import checked_engine_kwargs
    from rltserve.http.api_keys import API_KEY_ENVS
    from rltserve.http.config import ServerConfig
    from rltserve.http.vllm_frontend import check_vllm_frontend_args

    check_vllm_frontend_args(args)
    if getattr(args, "middleware", None):  # (before the model loads: a usage error)
        raise ValueError(
            f"--middleware {args.middleware[0]}: not supported: rltserve's server is aiohttp, "
            "not an ASGI app (FastAPI, Starlette), so it cannot run an ASGI middleware; run "
            "that logic in a proxy in front of the server"
        )
    take_model_tag(args)
    check_model_not_key(getattr(args, "api_key", None))
    server_config = ServerConfig(**dataclass_kwargs(args, ServerConfig)).with_env()
    if server_config.metrics_auth and server_config.api_key is None:
        # (a missing key Secret must not leave an operator believing /metrics is guarded)
        envs = " or ".join(API_KEY_ENVS)
        raise ValueError(f"--metrics-auth: needs an API key (--api-key, {envs})")
    engine_config = EngineConfig.from_flat(**checked_engine_kwargs(args))
    if server_config.served_model_name is None and engine_config.model.model != args.model:
        # A Hugging Face repo id served from its cached snapshot goes by the id (as vLLM),
        # not by the snapshot directory's commit hash.
        server_config = dataclasses.replace(server_config, served_model_name=args.model)
    return server_config, engine_config


def check_replica_server_flags(server_config: ServerConfig, replica_config: ReplicaConfig) -> None:
    """Refuses server flags that would do nothing with ``--replicas`` (as ``ReplicaConfig``
    refuses its flags without it): the stage watchdog leaves a replica set alone, whose hung
    replicas Ray Serve's health checks replace (``ray.client.deployment_options``)."""
    from rltserve.http.config import ServerConfig

    default = {f.name: f.default for f in dataclasses.fields(ServerConfig)}["stage_watchdog_s"]
    if replica_config.enabled and server_config.stage_watchdog_s != default:
        raise ValueError(
            f"--stage-watchdog-s {server_config.stage_watchdog_s:g}: not with --replicas N "
            "(Ray Serve's health checks replace a replica that stops answering)"
        )


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        return _serve(args)
    except ValueError as exc:  # (its kind kept: a checkpoint that does not load exits 1)
        if (message := named_file(str(exc), args)) != str(exc):
            exc.args = (message,)
        raise


def _serve(args: argparse.Namespace) -> int:
    from rltserve.http.listener import check_listener_files
    from rltserve.http.server import run_server
    from rltserve.http.vllm_frontend import ignored_vllm_frontend_args
    from rltserve.preflight import check_listen_address
    from rltserve.ray.config import ReplicaConfig

    server_config, engine_config = serve_configs(args)
    check_listener_files(server_config)  # (before the model loads)
    if server_config.uds is None:
        check_listen_address(server_config.host, server_config.port)
    replica_config = ReplicaConfig(**dataclass_kwargs(args, ReplicaConfig))
    check_replica_server_flags(server_config, replica_config)
    configure_logging(args)
    from rltserve import __version__
    from rltserve.http.api_keys import api_key_env

    log = logging.getLogger("rltserve.http")
    log.info("rltserve API server version %s", __version__)
    log.info("non-default args: %s", non_default_args(args))
    if args.api_key is None and server_config.api_key is not None:
        # (the key itself never: only where it came from, as non-default args show ***)
        log.info("API key: from the environment (%s)", api_key_env())
    if args.disable_log_requests:
        log.warning(
            "--disable-log-requests is deprecated: request logs are off by default "
            "(--enable-log-requests turns them on)"
        )
    for line in ignored_vllm_frontend_args(args):
        log.info("%s", line)
    if server_config.ssl_ca_certs is not None and not server_config.ssl_cert_reqs:
        log.warning("--ssl-ca-certs: clients are not asked for certificates without "
                    "--ssl-cert-reqs 1 (verified when sent) or 2 (required)")  # fmt: skip
    backend = (getattr(args, "structured_outputs_config", None) or {}).get("backend", "auto")
    if backend not in ("auto", "outlines"):
        log.info("--structured-outputs-config: backend %r: structured outputs run on "
                 "outlines-core (the same constraints)", backend)  # fmt: skip
    if server_config.enable_log_outputs and not server_config.enable_log_requests:
        log.warning("--enable-log-outputs: logs nothing without --enable-log-requests")
    reachable = server_config.uds is None and not is_loopback(server_config.host)
    if server_config.api_key is None and reachable:
        log.warning(
            "serving on %r without an API key: anyone who reaches the port may generate and "
            "call the admin routes (POST %s: load weights, put the model to sleep); set "
            "--api-key, RLTSERVE_API_KEY or VLLM_API_KEY",
            server_config.host,
            ", ".join(ADMIN_ROUTES),
        )
    if not replica_config.enabled:
        return run_server(server_config, engine_config)
    from rltserve.ray.client import ReplicaSetClient
    from rltserve.ray.cluster import connect, ray_address

    address, flag = ray_address(replica_config)
    if address is not None and address.startswith("ray://"):
        raise ValueError(
            f"{flag} {address}: a Ray Client address cannot stream from Serve "
            "deployments; pass the cluster's GCS address (host:port, the head's --port)"
        )
    owned = connect(replica_config)  # before the model loads: a bad address is a usage error
    # (Replicas Serve stops, e.g. on `ray drain-node`, give their streams what the server gives)
    factory = ReplicaSetClient.factory(
        replica_config, server_config.max_concurrent, owned, server_config.drain_timeout_s
    )
    return run_server(server_config, engine_config, factory)


# (bench serve's parser and command live with the benchmark: rltserve.bench.serve_cli)
from rltserve.bench.serve_cli import add_bench_serve_parser as add_bench_serve_parser  # noqa: E402
from rltserve.bench.serve_cli import cmd_bench_serve as cmd_bench_serve  # noqa: E402
