"""What the ``vllm bench serve`` flags that ``rltserve bench serve`` takes mean here: their
strings parsed into ``BenchConfig`` fields (a ValueError naming the flag, exit 2), the URL of
``--host``/``--port``, the endpoint of ``--backend``, and where ``--save-result`` writes.

The result file holds the ``--json`` report (with ``--metadata``'s keys) as one line of
compact JSON, as vLLM's ``json.dump``; ``--append-result`` adds it as one more line, so a file
saved then appended to has one report per line. Its name is vLLM's (``serve_report``'s
``result_filename``; ``label``: ``--label``, else the report's backend: ``openai`` for
completions, ``openai-chat`` for chat), or ``--result-filename``, under ``--result-dir`` (made if
missing) or the working directory. ``--save-result`` or ``--append-result`` saves the report (as
vLLM's), and so does naming ``--result-dir`` or ``--result-filename`` here.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

from rltserve.bench.serve_config import BACKENDS, DATASETS, GOODPUT_METRICS, PERCENTILE_METRICS

DEFAULT_URL = "http://127.0.0.1:8000"  # (where `rltserve serve` listens by default)


def config_kwargs(args: argparse.Namespace) -> dict:
    """The ``BenchConfig`` fields of the vLLM-style flags."""
    dataset = args.dataset_name
    if dataset not in DATASETS:
        raise ValueError(
            f"--dataset-name {dataset}: not supported; bench serve sends vLLM's random, "
            "sharegpt or custom datasets"
        )
    if (dataset == "random") != (args.dataset_path is None):
        raise ValueError(
            f"--dataset-path {args.dataset_path}: the 'random' dataset reads no file"
            if dataset == "random"
            else f"--dataset-name {dataset}: needs --dataset-path FILE"
        )
    if dataset != "random":
        _check_text_dataset(args)
    if args.random_prefix_len < 0:
        raise ValueError(f"--random-prefix-len {args.random_prefix_len}: must be >= 0")
    ratio = args.random_range_ratio
    if not 0 <= ratio < 1:
        raise ValueError(f"--random-range-ratio {ratio:g}: must be in [0, 1)")
    if math.floor(args.input_len * (1 - ratio)) < 1:
        flag = args.spelled.get("input_len") or "--input-len"
        raise ValueError(
            f"--random-range-ratio {ratio:g}: the shortest prompt of {flag} "
            f"{args.input_len} would have no tokens"
        )
    return {
        "url": target_url(args),
        "endpoint": endpoint(args),
        "range_ratio": ratio,
        "prefix_len": args.random_prefix_len,
        "goodput": parse_goodput(args.goodput or []),
        "percentile_metrics": parse_percentile_metrics(args.percentile_metrics),
        "metric_percentiles": parse_metric_percentiles(args.metric_percentiles),
        "detailed": args.save_detailed,
        "dataset": dataset,
        "dataset_path": args.dataset_path,
        "sharegpt_output_len": args.sharegpt_output_len,
        "custom_output_len": args.custom_output_len,
        "skip_chat_template": args.skip_chat_template,
        "extra_body": parse_extra_body(args.extra_body),
        "headers": parse_headers(args.header or []),
        "request_id_prefix": args.request_id_prefix,
        **ramp_up(args),
    }


def _check_text_dataset(args: argparse.Namespace) -> None:
    """A sharegpt or custom file that can be read, and no flag of the random dataset (its
    lengths too) or of multi-turn runs (they would be ignored)."""
    path = Path(args.dataset_path)
    if not path.is_file():
        raise ValueError(f"--dataset-path {args.dataset_path}: no such file")
    for flag, value in (
        ("--random-prefix-len", args.random_prefix_len),
        ("--random-range-ratio", args.random_range_ratio),
    ):
        if value:
            raise ValueError(f"{flag} {value:g}: random prompts only, not --dataset-name "
                             f"{args.dataset_name}")  # fmt: skip
    if args.num_turns > 1:
        raise ValueError(f"--num-turns {args.num_turns}: random prompts only, not "
                         f"--dataset-name {args.dataset_name}")  # fmt: skip
    # (the file gives each prompt, and its reply or --*-output-len each output length)
    name = args.dataset_name
    for dest, instead in (
        ("input_len", "sends the file's prompts as they are"),
        ("output_len", f"takes --{name}-output-len for output lengths"),
    ):
        if flag := args.spelled.get(dest):
            raise ValueError(f"{flag} {getattr(args, dest)}: random prompts only; --dataset-name "
                             f"{name} {instead}")  # fmt: skip
    for flag, value in (
        ("--sharegpt-output-len", args.sharegpt_output_len),
        ("--custom-output-len", args.custom_output_len),
    ):
        if value is not None and value < 1:
            raise ValueError(f"{flag} {value}: must be >= 1")


def parse_extra_body(text: str | None) -> dict:
    """``--extra-body '{"max_loops": 4}'``: a JSON object merged into every request body."""
    if text is None:
        return {}
    try:
        body = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"--extra-body {text}: not JSON ({exc})") from None
    if not isinstance(body, dict):
        raise ValueError(f"--extra-body {text}: must be a JSON object, e.g. '{{\"seed\": 1}}'")
    if taken := sorted({"prompt", "messages", "stream"} & set(body)):
        raise ValueError(f"--extra-body {text}: {', '.join(taken)} is the benchmark's to send")
    if body.get("n", 1) != 1:
        # (its choices' chunks would be timed as one answer: halved TPOT, doubled tokens)
        raise ValueError(
            f"--extra-body {text}: n {body['n']}: bench serve times one choice per request; "
            "send more requests (--num-prompts) instead"
        )
    return body


def parse_headers(items: list[str]) -> tuple[tuple[str, str], ...]:
    """``--header X-A=1 X-B=2`` (vLLM's; or ``--header X-A=1 --header X-B=2``) ->
    (("X-A", "1"), ("X-B", "2"))."""
    headers = []
    for item in items:
        key, equals, value = item.partition("=")
        if not equals or not key.strip():
            raise ValueError(f"--header {item}: give KEY=VALUE, e.g. --header X-Tenant=a")
        headers.append((key.strip(), value.strip()))
    return tuple(headers)


def ramp_up(args: argparse.Namespace) -> dict:
    """vLLM's ``--ramp-up-strategy`` and its bounds (both needed, > 0, not with
    ``--request-rate``)."""
    bounds = {"--ramp-up-start-rps": args.ramp_up_start_rps,
              "--ramp-up-end-rps": args.ramp_up_end_rps}  # fmt: skip
    if args.ramp_up_strategy is None:
        given = [f"{flag} {value:g}" for flag, value in bounds.items() if value is not None]
        if given:
            raise ValueError(f"{' '.join(given)}: needs --ramp-up-strategy linear|exponential")
        return {}
    for flag, value in bounds.items():
        if value is None:
            raise ValueError(f"--ramp-up-strategy {args.ramp_up_strategy}: needs {flag}")
        if not 0 < value < math.inf:
            raise ValueError(f"{flag} {value:g}: must be a finite rate > 0")
    if not math.isinf(args.request_rate):
        raise ValueError(
            f"--request-rate {args.request_rate:g}: not with --ramp-up-strategy (the ramp-up "
            "sets the rate)"
        )
    return {
        "ramp_up_strategy": args.ramp_up_strategy,
        "ramp_up_start_rps": args.ramp_up_start_rps,
        "ramp_up_end_rps": args.ramp_up_end_rps,
    }


def target_url(args: argparse.Namespace) -> str:
    """``--url``/``--base-url``, or vLLM's ``--host`` and ``--port`` in its stead."""
    if args.host is None and args.port is None:
        return args.url
    given = (("--host", args.host), ("--port", args.port))
    flags = " ".join(f"{flag} {value}" for flag, value in given if value is not None)
    if args.url != DEFAULT_URL:
        raise ValueError(f"{flags}: not with --url/--base-url {args.url}; give one or the other")
    if args.port is not None and not 0 < args.port < 65536:
        raise ValueError(f"--port {args.port}: must be in 1..65535")
    host = args.host or "127.0.0.1"
    if ":" in host and not host.startswith("["):  # an IPv6 address
        host = f"[{host}]"
    return f"http://{host}:{args.port or 8000}"


def endpoint(args: argparse.Namespace) -> str:
    """``--endpoint``, or the one vLLM's ``--backend`` streams (they must agree if both are
    given)."""
    if args.backend is None:
        return args.endpoint
    wanted = BACKENDS[args.backend]
    if args.endpoint_given and args.endpoint != wanted:
        raise ValueError(
            f"--backend {args.backend}: streams the {wanted} endpoint, not --endpoint "
            f"{args.endpoint}"
        )
    return wanted


def parse_goodput(items: list[str]) -> tuple[tuple[str, float], ...]:
    """``ttft:500 tpot:50`` -> (("ttft", 500.0), ("tpot", 50.0))."""
    pairs = []
    for item in items:
        name, _, value = item.partition(":")
        try:
            bound = float(value)
        except ValueError:
            bound = None
        if bound is None or name not in GOODPUT_METRICS:
            raise ValueError(
                f"--goodput {item}: give KEY:VALUE pairs, a metric of "
                f"{', '.join(GOODPUT_METRICS)} and its bound in ms, e.g. --goodput ttft:500 "
                "tpot:50"
            )
        if not bound >= 0:
            raise ValueError(f"--goodput {item}: the bound must be >= 0 ms")
        if name in dict(pairs):
            raise ValueError(f"--goodput {' '.join(items)}: {name} is bounded twice")
        pairs.append((name, bound))
    return tuple(pairs)


def parse_percentile_metrics(text: str) -> tuple[str, ...]:
    metrics = tuple(m.strip() for m in text.split(","))
    if any(m not in PERCENTILE_METRICS for m in metrics) or len(set(metrics)) < len(metrics):
        raise ValueError(
            f"--percentile-metrics {text}: a comma-separated list of distinct metrics of "
            f"{', '.join(PERCENTILE_METRICS)}"
        )
    return metrics


def parse_metric_percentiles(text: str) -> tuple[float, ...]:
    why = "a comma-separated list of distinct percentiles in [0, 100], e.g. 50,90,99"
    try:
        percentiles = tuple(float(p) for p in text.split(","))
    except ValueError:
        raise ValueError(f"--metric-percentiles {text}: {why}") from None
    if not all(0 <= p <= 100 for p in percentiles) or len(set(percentiles)) < len(percentiles):
        raise ValueError(f"--metric-percentiles {text}: {why}")
    return percentiles


def parse_metadata(items: list[str], report_keys: set[str]) -> dict[str, str]:
    """``--metadata version=0.3.3 tp=1``: keys of the report's top level, as vLLM's (those the
    report has already are refused: they would be lost)."""
    metadata = {}
    for item in items:
        key, equals, value = item.partition("=")
        key = key.strip()
        if not equals or not key:
            raise ValueError(f"--metadata {item}: give KEY=VALUE pairs, e.g. --metadata tp=1")
        if key in report_keys:
            raise ValueError(f"--metadata {item}: {key!r} is a key of the report itself")
        metadata[key] = value.strip()
    return metadata


def saving(args: argparse.Namespace) -> bool:
    return bool(args.save_result or args.append_result or args.result_dir or args.result_filename)


def prepare_result_dir(args: argparse.Namespace) -> None:
    """Makes ``--result-dir`` and refuses a result file that could not be written, before the
    run (not after it)."""
    if args.result_dir:
        if Path(args.result_dir).exists() and not Path(args.result_dir).is_dir():
            raise ValueError(f"--result-dir {args.result_dir}: is not a directory")
        try:
            os.makedirs(args.result_dir, exist_ok=True)
        except OSError as exc:
            raise ValueError(
                f"--result-dir {args.result_dir}: cannot be made ({exc.strerror})"
            ) from None
        if not os.access(args.result_dir, os.W_OK | os.X_OK):
            raise ValueError(f"--result-dir {args.result_dir}: cannot be written")
    if args.result_filename:
        path = Path(args.result_dir or ".") / args.result_filename
        if path.is_dir():
            raise ValueError(f"--result-filename {args.result_filename}: {path} is a directory")
        if not path.parent.is_dir():
            raise ValueError(
                f"--result-filename {args.result_filename}: {path.parent} does not exist"
            )


def result_path(args: argparse.Namespace, report: dict) -> Path:
    from rltserve.bench.serve_report import result_filename

    label = args.label or report["backend"]  # (--backend, else the endpoint's)
    name = args.result_filename or result_filename(report, label)
    return Path(args.result_dir or ".") / name


def write_result(path: Path, report: dict, append: bool) -> None:
    """The report as one line of compact JSON (vLLM's ``json.dump``): the file's only line, or
    (vLLM's ``--append-result``) one more line after what the file holds."""
    if not append:
        path.write_text(json.dumps(report) + "\n", encoding="utf-8")
        return
    with path.open("a+", encoding="utf-8") as out:
        out.seek(0)
        held = out.read()
        if held and not held.endswith("\n"):
            out.write("\n")
        out.write(json.dumps(report) + "\n")
