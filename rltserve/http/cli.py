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

# Hosts only this machine reaches: serving there without an API key is not worth a warning.
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
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
    add_engine_args(parser)
    parser.add_argument(
        "--log-level",
        default="info",
        choices=("debug", "info", "warning", "error"),
        help="server log level (default: info)",
    )
    parser.set_defaults(func=cmd_serve)
    return parser


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


def cmd_serve(args: argparse.Namespace) -> int:
    from rltserve.http.server import run_server
    from rltserve.preflight import check_listen_address, check_tls_files
    from rltserve.ray.config import ReplicaConfig

    server_config, engine_config = serve_configs(args)
    check_tls_files(server_config.ssl_certfile, server_config.ssl_keyfile)
    check_listen_address(server_config.host, server_config.port)  # before the model loads
    replica_config = ReplicaConfig(**dataclass_kwargs(args, ReplicaConfig))
    from rltserve.core.stage_worker import LOG_FORMAT

    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT)
    if server_config.api_key is None and server_config.host not in LOOPBACK_HOSTS:
        logging.getLogger("rltserve.http").warning(
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


def add_bench_serve_parser(bench_subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = bench_subparsers.add_parser("serve", help=BENCH_SERVE_HELP)
    parser.add_argument(
        "--url",
        default="http://127.0.0.1:8000",
        help="server base URL (a trailing /v1, as OpenAI clients take it, is dropped)",
    )
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
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    parser.add_argument(
        "--output-len",
        "--max-tokens",
        dest="output_len",
        type=int,
        default=128,
        help="output tokens per request",
    )
    parser.add_argument(
        "--num-turns",
        type=int,
        default=1,
        help="multi-turn chat: turns per conversation, each prompt the previous prompt + "
        "answer + --input-len new tokens; reports the prefix cache hit rate (default: 1)",
    )
    parser.add_argument(
        "--endpoint",
        choices=("completions", "chat"),  # (bench.serve.ENDPOINTS, not imported here)
        default="completions",
        help="stream /v1/completions (token-id prompts) or /v1/chat/completions (the prompts "
        "as text, a conversation as messages)",
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
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--quiet", "--no-progress", action="store_true", help="no progress bar on stderr"
    )
    parser.set_defaults(func=cmd_bench_serve)
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

    import orjson

    from rltserve.bench.serve import BenchConfig, format_report, run_bench
    from rltserve.client import APIError
    from rltserve.progress import progress_enabled

    _check_bench_serve_flags(args)
    config = BenchConfig(
        url=args.url,
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
        endpoint=args.endpoint,
        progress=progress_enabled(args.quiet),
        ready_timeout_s=args.wait_timeout,
    )
    try:
        report = asyncio.run(run_bench(config))
    except APIError as exc:  # e.g. 401 without the right key: one line, exit 1
        raise RuntimeError(f"{config.url}: {exc}") from exc
    if args.json:
        print(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode())
    else:
        print(format_report(report))
    return 0 if report["completed"] > 0 else 1
