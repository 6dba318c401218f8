"""``rltserve serve`` and ``rltserve bench serve``: their parsers and commands.

Flags come from the config dataclasses (``--max-concurrent`` from ``ServerConfig``; the engine
flags through ``rltserve.engine_args``). This module imports nothing heavy at import time, so
the main CLI can import it unconditionally; it never imports ``rltserve.cli``.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from typing import TYPE_CHECKING

from rltserve.engine_args import add_dataclass_args, dataclass_kwargs

if TYPE_CHECKING:
    from rltserve.config import EngineConfig
    from rltserve.http.config import ServerConfig
    from rltserve.ray.config import ReplicaConfig

# Hosts only this machine reaches: serving there without an API key is not worth a warning.
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
# uvicorn's levels, as vLLM's --uvicorn-log-level takes them (trace: debug here, aiohttp has none
# below it)
HTTP_LOG_LEVELS = ("trace", *LOG_LEVELS)
# Flags whose values the startup line hides (vLLM's redact_sensitive_args)
SECRET_FLAGS = frozenset({"api_key"})
BENCH_SERVE_HELP = "serving benchmark against a running server (random token-id prompts)"


# ---------------------------------------------------------------------- serve


def add_serve_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from rltserve.engine_args import add_engine_args
    from rltserve.http.config import ServerConfig
    from rltserve.ray.config import ReplicaConfig

    parser = subparsers.add_parser(
        "serve",
        help="serve the OpenAI-compatible HTTP API",
        description="Serves /v1/completions, /v1/chat/completions and friends. Without --model "
        "it serves the built-in demo model.",
    )
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
    add_engine_args(parser)  # (after serve's own: vLLM's engine flags leave those to it)
    parser.add_argument(
        "--log-level",
        default="info",
        type=str.lower,
        choices=LOG_LEVELS,
        help="server log level, in any case (default: info)",
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
        "vLLM's) that replaces the one --log-level sets up",
    )
    parser.set_defaults(func=cmd_serve)
    return parser


def configure_logging(args: argparse.Namespace) -> None:
    """The process's logging: ``--log-config-file``'s configuration, else ``--log-level``'s
    lines on stderr; ``--uvicorn-log-level`` sets aiohttp's loggers apart (ValueError naming a
    configuration file that does not load)."""
    import json
    import logging.config

    from rltserve.core.stage_worker import LOG_FORMAT

    if args.log_config_file is None:
        logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT)
    else:
        try:
            with open(args.log_config_file) as file:
                config = json.load(file)
            if isinstance(config, dict):  # (the server's loggers exist by now: keep them on)
                config.setdefault("disable_existing_loggers", False)
            logging.config.dictConfig(config)
        except (OSError, ValueError, TypeError, AttributeError, ImportError) as exc:
            raise ValueError(f"--log-config-file {args.log_config_file}: {exc}") from exc
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


def serve_configs(args: argparse.Namespace) -> tuple[ServerConfig, EngineConfig]:
    """The server and engine configs of ``serve``'s flags (ValueError naming a bad one)."""
    from rltserve.config import EngineConfig
    from rltserve.engine_args import checked_engine_kwargs
    from rltserve.http.config import API_KEY_ENV, ServerConfig

    server_config = ServerConfig(**dataclass_kwargs(args, ServerConfig)).with_env()
    if server_config.metrics_auth and server_config.api_key is None:
        # (a missing key Secret must not leave an operator believing /metrics is guarded)
        raise ValueError(f"--metrics-auth: needs an API key (--api-key or {API_KEY_ENV})")
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
    from rltserve.http.server import run_server
    from rltserve.preflight import check_listen_address, check_tls_files
    from rltserve.ray.config import ReplicaConfig

    server_config, engine_config = serve_configs(args)
    check_tls_files(server_config.ssl_certfile, server_config.ssl_keyfile)
    check_listen_address(server_config.host, server_config.port)  # before the model loads
    replica_config = ReplicaConfig(**dataclass_kwargs(args, ReplicaConfig))
    check_replica_server_flags(server_config, replica_config)
    configure_logging(args)
    from rltserve import __version__

    log = logging.getLogger("rltserve.http")
    log.info("rltserve API server version %s", __version__)
    log.info("non-default args: %s", non_default_args(args))
    if args.disable_log_requests:
        log.warning(
            "--disable-log-requests is deprecated: request logs are off by default "
            "(--enable-log-requests turns them on)"
        )
    if server_config.enable_log_outputs and not server_config.enable_log_requests:
        log.warning("--enable-log-outputs: logs nothing without --enable-log-requests")
    if server_config.api_key is None and server_config.host not in LOOPBACK_HOSTS:
        log.warning(
            "serving on %s without an API key: anyone who reaches the port may generate, and "
            "load weights or put the model to sleep (POST /v1/update_weights, /sleep); set "
            "--api-key or RLTSERVE_API_KEY",
            server_config.host,
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
    factory = ReplicaSetClient.factory(replica_config, server_config.max_concurrent, owned)
    return run_server(server_config, engine_config, factory)


# ---------------------------------------------------------------------- bench serve


# vLLM's --endpoint paths of the endpoints bench serve streams
_ENDPOINT_PATHS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}


def _endpoint_kind(value: str) -> str:
    """``--endpoint``'s kind: vLLM's path form names one too."""
    return _ENDPOINT_PATHS.get(value.rstrip("/") if value.startswith("/") else value, value)


class _EndpointAction(argparse.Action):
    """Stores ``--endpoint`` and that it was given (``--backend`` must then agree with it)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        namespace.endpoint, namespace.endpoint_given = values, True


def add_bench_serve_parser(bench_subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = bench_subparsers.add_parser(
        "serve",
        help=BENCH_SERVE_HELP,
        description="Takes the flags of `vllm bench serve` that apply to random prompts "
        "(--backend, --base-url, --host, --port, --dataset-name random, --random-*-len, "
        "--goodput, --percentile-metrics, --save-result, ...) as vLLM does.",
    )
    parser.add_argument(
        "--url",
        "--base-url",
        dest="url",
        default="http://127.0.0.1:8000",  # (bench.serve_flags.DEFAULT_URL, not imported here)
        help="server base URL (a trailing /v1, as OpenAI clients take it, is dropped)",
    )
    parser.add_argument("--host", default=None, help="vLLM's: the URL http://HOST:PORT")
    parser.add_argument("--port", type=int, default=None, help="vLLM's: see --host")
    parser.add_argument("--api-key", default=None, help="or env RLTSERVE_API_KEY")
    parser.add_argument("--model", default=None, help="model name to send (default: none)")
    parser.add_argument("--num-prompts", type=int, default=100, help="requests (default: 100)")
    parser.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests per second, Poisson arrivals (default: inf = all at once)",
    )
    parser.add_argument(
        "--burstiness", type=float, default=1.0, help="gamma shape of arrivals (1 = Poisson)"
    )
    parser.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="requests in flight at most (default: no bound)",
    )
    parser.add_argument(
        "--dataset-name",
        default="random",
        help="only vLLM's 'random' (random token-id prompts) is supported",
    )
    parser.add_argument("--dataset-path", default=None, help=argparse.SUPPRESS)
    parser.add_argument(
        "--input-len",
        "--random-input-len",
        dest="input_len",
        type=int,
        default=128,
        help="prompt tokens per request (after --random-prefix-len's)",
    )
    parser.add_argument(
        "--random-prefix-len",
        type=int,
        default=0,
        help="vLLM's: every prompt starts with the same this many random tokens (a shared "
        "system prompt) before its --input-len own ones (default: 0)",
    )
    parser.add_argument(
        "--output-len",
        "--max-tokens",
        "--random-output-len",
        dest="output_len",
        type=int,
        default=128,
        help="output tokens per request",
    )
    parser.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="vLLM's: each conversation's prompt and output lengths drawn uniformly from "
        "[len*(1-R), len*(1+R)], 0 <= R < 1 (default: 0, the lengths given)",
    )
    parser.add_argument(
        "--ignore-eos",
        action="store_true",
        help="accepted for vLLM's command lines: requests always send ignore_eos",
    )
    parser.add_argument(
        "--num-turns",
        type=int,
        default=1,
        help="multi-turn chat: turns per conversation, each prompt the previous prompt + "
        "answer + --input-len new tokens; a conversation stops before a turn the server's "
        "max_model_len would not hold (counted as skipped); reports the prefix cache hit rate "
        "(default: 1)",
    )
    parser.add_argument(
        "--endpoint",
        type=_endpoint_kind,
        action=_EndpointAction,
        choices=("completions", "chat"),  # (bench.serve.ENDPOINTS, not imported here)
        default="completions",
        help="stream /v1/completions (token-id prompts) or /v1/chat/completions (the prompts "
        "as text, a conversation as messages); vLLM's paths name them too",
    )
    parser.add_argument(
        "--backend",
        choices=("openai", "openai-chat", "vllm"),  # (bench.serve_config.BACKENDS' keys)
        default=None,
        help="vLLM's: openai and vllm stream completions, openai-chat chat",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the random prompts (default: 0; the same seed sends the same prompts, "
        "which a server's prefix cache then holds: vary it between runs on one server)",
    )
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature (default: 0.0)"
    )
    parser.add_argument(
        "--exit-threshold",
        type=float,
        default=None,
        help="each request's exit_threshold (default: none sent, the server's)",
    )
    parser.add_argument(
        "--wait-timeout",
        type=float,
        default=600.0,
        help="seconds to wait for the server to be ready, e.g. while it loads (default: 600)",
    )
    parser.add_argument(
        "--goodput",
        nargs="+",
        metavar="KEY:VALUE",
        default=None,
        help="vLLM's SLOs, e.g. ttft:500 tpot:50 e2el:2000 (ms): request_goodput counts the "
        "requests within every bound given",
    )
    parser.add_argument(
        "--percentile-metrics",
        default="ttft,tpot,itl,e2el",
        help="metrics reported (comma-separated; default: all four, where vLLM's leaves out e2el)",
    )
    parser.add_argument(
        "--metric-percentiles",
        default="99",
        help="percentiles reported, e.g. 50,90,99.9 (p50_ttft_ms, ...; default: 99)",
    )
    parser.add_argument(
        "--save-result", action="store_true", help="write the JSON report to a file"
    )
    parser.add_argument(
        "--save-detailed",
        action="store_true",
        help="the report adds vLLM's per-request arrays (input_lens, ttfts, itls, errors, ...)",
    )
    parser.add_argument("--result-dir", default=None, help="the file's directory (default: .)")
    parser.add_argument(
        "--result-filename",
        default=None,
        help="the file's name (default vLLM's: LABEL-RATEqps[-concurrencyN]-MODEL-DATE.json)",
    )
    parser.add_argument(
        "--label", default=None, help="the file name's prefix (default: the backend's name)"
    )
    parser.add_argument(
        "--metadata",
        nargs="*",
        metavar="KEY=VALUE",
        default=None,
        help="keys added to the report, e.g. version=0.3.3 tp=1",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--quiet",
        "--no-progress",
        "--disable-tqdm",
        action="store_true",
        help="no progress bar on stderr",
    )
    parser.set_defaults(func=cmd_bench_serve, endpoint_given=False)
    return parser


def _check_bench_serve_flags(args: argparse.Namespace) -> None:
    """What ``BenchConfig`` refuses, named by the flags (its errors name its fields)."""
    for name in ("num_prompts", "input_len", "output_len", "num_turns", "max_concurrency"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} {value}: must be >= 1")
    if not args.request_rate > 0:
        raise ValueError(f"--request-rate {args.request_rate:g}: must be > 0 (or inf)")
    if not 0 < args.burstiness < float("inf"):
        raise ValueError(f"--burstiness {args.burstiness:g}: must be a finite number > 0")
    if not args.wait_timeout > 0:
        raise ValueError(f"--wait-timeout {args.wait_timeout:g}: must be > 0")


def cmd_bench_serve(args: argparse.Namespace) -> int:
    import asyncio
    import os
    import sys

    import orjson

    from rltserve.bench import serve_flags
    from rltserve.bench.serve import BenchConfig, run_bench
    from rltserve.bench.serve_report import format_report, summarize
    from rltserve.client import APIError
    from rltserve.progress import progress_enabled

    _check_bench_serve_flags(args)
    config = BenchConfig(
        **serve_flags.config_kwargs(args),
        api_key=args.api_key or os.environ.get("RLTSERVE_API_KEY"),
        model=args.model,
        num_prompts=args.num_prompts,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        input_len=args.input_len,
        output_len=args.output_len,
        seed=args.seed,
        temperature=args.temperature,
        exit_threshold=args.exit_threshold,
        num_turns=args.num_turns,
        progress=progress_enabled(args.quiet),
        ready_timeout_s=args.wait_timeout,
    )
    # (checked before the run, not after it)
    metadata = serve_flags.parse_metadata(args.metadata or [], set(summarize(config, [], 1.0)))
    if serve_flags.saving(args):
        serve_flags.prepare_result_dir(args)
    try:
        report = asyncio.run(run_bench(config))
    except APIError as exc:  # e.g. 401 without the right key: one line, exit 1
        raise RuntimeError(f"{config.url}: {exc}") from exc
    report.update(metadata)
    text = orjson.dumps(report, option=orjson.OPT_INDENT_2).decode()
    print(text if args.json else format_report(report), flush=True)
    if serve_flags.saving(args):  # (after the print: a file not written must not lose it)
        path = serve_flags.result_path(args, report)
        path.write_text(text + "\n")
        print(f"saved the report to {path}", file=sys.stderr)
    return 0 if report["completed"] > 0 else 1
