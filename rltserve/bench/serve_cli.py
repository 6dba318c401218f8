"""``rltserve bench serve``: its parser (the flags of ``vllm bench serve`` it takes, with vLLM's
names; ``serve_flags`` says what their strings mean) and its command. Imports nothing heavy at
import time: the main CLI imports it unconditionally."""

from __future__ import annotations

import argparse

BENCH_SERVE_HELP = "serving benchmark against a running server (vLLM's bench serve flags)"
# vLLM's --endpoint paths of the endpoints bench serve streams
_ENDPOINT_PATHS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}


def _endpoint_kind(value: str) -> str:
    """``--endpoint``'s kind: vLLM's path form names one too."""
    return _ENDPOINT_PATHS.get(value.rstrip("/") if value.startswith("/") else value, value)


class _EndpointAction(argparse.Action):
    """Stores ``--endpoint`` and that it was given (``--backend`` must then agree with it)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        namespace.endpoint, namespace.endpoint_given = values, True


class _SpelledAction(argparse.Action):
    """Stores the value and the spelling typed (``--random-output-len``, ``--max-tokens``,
    ...): an error names the flag as the user wrote it."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, values)
        spelled = dict(getattr(namespace, "spelled", None) or {})
        namespace.spelled = {**spelled, self.dest: option_string}


def add_bench_serve_parser(bench_subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = bench_subparsers.add_parser(
        "serve",
        help=BENCH_SERVE_HELP,
        description="Takes the flags of `vllm bench serve` that apply to random prompts "
        "(--backend, --base-url, --host, --port, --dataset-name random, --random-*-len, "
        "--dataset-name random|sharegpt|custom, --goodput, --percentile-metrics, "
        "--save-result, ...) as vLLM does.",
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
    parser.add_argument(
        "--api-key", default=None, help="or env RLTSERVE_API_KEY, else OPENAI_API_KEY (vLLM's)"
    )
    parser.add_argument(
        "--model",
        default=None,
        help="the model: the name sent (unless --served-model-name) and the report's model_id "
        "(default: none sent, the server's first)",
    )
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="vLLM's: the model name sent in requests (default: --model)",
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="vLLM's: a local tokenizer directory; counts the tokens of --dataset-path prompts "
        "(default: the server's /tokenize) and keeps its special tokens out of random prompts",
    )
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
        help="vLLM's: random (random token-id prompts), sharegpt (a ShareGPT JSON file) or "
        "custom (JSONL, a 'prompt' per line); the last two need --dataset-path",
    )
    parser.add_argument("--dataset-path", default=None, help="the sharegpt or custom file")
    parser.add_argument(
        "--sharegpt-output-len",
        type=int,
        default=None,
        help="vLLM's: every sharegpt request's output tokens (default: its reply's tokens)",
    )
    parser.add_argument(
        "--custom-output-len",
        type=int,
        default=256,
        help="vLLM's: every custom request's output tokens (default: 256)",
    )
    parser.add_argument(
        "--skip-chat-template",
        action="store_true",
        help="vLLM's: custom prompts to /v1/completions go as written, not in the chat template",
    )
    parser.add_argument(
        "--input-len",
        "--random-input-len",
        dest="input_len",
        action=_SpelledAction,
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
        action=_SpelledAction,
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
        help="send ignore_eos: every request produces its whole output length (default, as "
        "vLLM's: not sent, a request may stop at its end token)",
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
    for flag, kind in (("--top-p", float), ("--top-k", int), ("--min-p", float)):
        parser.add_argument(flag, type=kind, default=None, help="vLLM's (default: none sent)")
    parser.add_argument(
        "--extra-body",
        default=None,
        metavar="JSON",
        help="vLLM's: a JSON object merged into every request body, e.g. "
        '\'{"max_loops": 6, "exit_criterion": "kl", "exit_threshold": 0.5}\' (the report '
        "records it, and the exit_threshold and temperature it sends)",
    )
    parser.add_argument(
        "--header",
        nargs="*",
        action="extend",  # (vLLM's nargs="*", and a repeated --header adds to the first)
        metavar="KEY=VALUE",
        default=None,
        help="vLLM's: HTTP headers sent with every request, e.g. --header X-A=1 X-B=2",
    )
    parser.add_argument(
        "--num-warmups",
        type=int,
        default=0,
        help="vLLM's: unmeasured requests of the first prompt before the run (up to "
        "--max-concurrency at once; default: 0)",
    )
    parser.add_argument(
        "--request-id-prefix",
        default=None,
        help="vLLM's: request i sends the header X-Request-Id PREFIXi (a chat turn t of "
        "--num-turns: PREFIXi-t), which the server names it by (default: the server's ids)",
    )
    parser.add_argument(
        "--ramp-up-strategy",
        choices=("linear", "exponential"),
        default=None,
        help="vLLM's: the request rate ramps from --ramp-up-start-rps to --ramp-up-end-rps "
        "over the run (instead of --request-rate)",
    )
    parser.add_argument("--ramp-up-start-rps", type=float, default=None, help="vLLM's")
    parser.add_argument("--ramp-up-end-rps", type=float, default=None, help="vLLM's")
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
        "--save-result", action="store_true", help="write the JSON report to a file (one line)"
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
        help="the file's name (default vLLM's: LABEL-RATEqps[-concurrencyN]-MODEL-DATE.json, "
        "a ramp-up's LABEL-ramp-up-STRATEGY-STARTqps-ENDqps[-concurrencyN]-MODEL-DATE.json; "
        "MODEL: --model's last part)",
    )
    parser.add_argument(
        "--label", default=None, help="the file name's prefix (default: the backend's name)"
    )
    parser.add_argument(
        "--append-result",
        action="store_true",
        help="vLLM's: save the report as one more line of the result file (made if missing)",
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
    parser.set_defaults(func=cmd_bench_serve, endpoint_given=False, spelled={})
    return parser


def _check_bench_serve_flags(args: argparse.Namespace) -> None:
    """What ``BenchConfig`` refuses, named by the flags as typed (its errors name its fields)."""
    for name in ("num_prompts", "input_len", "output_len", "num_turns", "max_concurrency"):
        value = getattr(args, name)
        if value is not None and value < 1:
            flag = args.spelled.get(name) or f"--{name.replace('_', '-')}"
            raise ValueError(f"{flag} {value}: must be >= 1")
    if not args.request_rate > 0:
        raise ValueError(f"--request-rate {args.request_rate:g}: must be > 0 (or inf)")
    if not 0 < args.burstiness < float("inf"):
        raise ValueError(f"--burstiness {args.burstiness:g}: must be a finite number > 0")
    if not args.wait_timeout > 0:
        raise ValueError(f"--wait-timeout {args.wait_timeout:g}: must be > 0")
    if args.num_warmups < 0:
        raise ValueError(f"--num-warmups {args.num_warmups}: must be >= 0")


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
        # (vLLM's bench reads OPENAI_API_KEY: the last fallback)
        api_key=args.api_key
        or os.environ.get("RLTSERVE_API_KEY")
        or os.environ.get("OPENAI_API_KEY"),
        model=args.served_model_name or args.model,
        model_id=args.model,
        tokenizer=args.tokenizer,
        label=args.label,
        backend=args.backend,
        num_prompts=args.num_prompts,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        input_len=args.input_len,
        output_len=args.output_len,
        seed=args.seed,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        ignore_eos=args.ignore_eos,
        exit_threshold=args.exit_threshold,
        num_turns=args.num_turns,
        num_warmups=args.num_warmups,
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
        serve_flags.write_result(path, report, args.append_result)
        print(f"saved the report to {path}", file=sys.stderr)
    return 0 if report["completed"] > 0 else 1
