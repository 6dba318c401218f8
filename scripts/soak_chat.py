"""Chat-app soak: a realistic chat load against ``rltserve serve`` for a fixed time, sampled
every minute.

    python scripts/soak_chat.py --minutes 25 --concurrency 12 --model /tmp/ouro-small \\
        --port 19360 [--out soak.json]

starts ``rltserve serve`` (prefix caching on, ``--scheduling-policy priority``, a
``--max-tokens-limit`` so answers without ``max_tokens`` stay a few hundred tokens; ``--url URL
--server-pid PID`` attaches to a running one instead) and runs ``concurrency`` users. Each holds
a multi-turn conversation under one long system prompt that every user shares, through the
official ``openai`` SDK (``AsyncOpenAI``) and raw aiohttp: streamed and plain turns without
``max_tokens``, streams cut mid-answer, ``n`` > 1 with logprobs, stop strings, structured outputs
(``response_format`` json_schema), forced tools (a named function, ``"required"``), text
completions, bad requests (which must be 400/404), random ``priority`` values, and
``/health``, ``/v1/models`` and ``/metrics`` scrapes. Every ``--idle-every`` minutes the users
pause until the server is idle, which must bring the running/waiting gauges and KV usage to 0.

Every minute it samples the server's process tree (RSS, fds, threads), its gauges, the
prefix-cache hit rate of that minute and the clients' TTFT/ITL/E2E percentiles. At the end an
audit replays a fixed set of uncut requests and compares the counters' increments with what the
clients were told (``request_success_total`` by reason, prompt and generation tokens). Prints
one JSON report; exit code 0 when it passed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from soak_probe import (  # noqa: E402
    delta,
    ms_percentiles,
    process_tree,
    slope_per_min,
    stop_server,
    wait_healthy,
)
from soak_users import REQUEST_TIMEOUT_S, WEIGHTS, Soak, system_prompt  # noqa: E402

RSS_GROWTH_LIMIT = 0.10  # idle RSS, first quiet window to the end
IDLE_SETTLE_S = 3.0  # the stage gives its heap back after a second idle
FD_GROWTH_LIMIT = 8
MIN_HIT_RATE = 0.3  # every prompt starts with the same long system prompt
AUDIT_KINDS = [k for k in WEIGHTS if k != "cut"]
IDLE_KEYS = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "inflight")


async def sample_minutes(soak: Soak, started: float, until: float, samples: list) -> None:
    """Every minute: the process tree, the gauges, this minute's counters and latencies."""
    previous = await soak.metrics()
    while time.monotonic() < until - 1:
        await asyncio.sleep(min(60.0, max(0.0, until - time.monotonic())))
        current = await soak.metrics()
        minute, soak.minute = soak.minute, soak.new_minute()
        step = delta(current, previous)
        previous = current
        queries = step["prefix_cache_queries_total"]
        samples.append(
            {
                "minute": round((time.monotonic() - started) / 60, 2),
                **process_tree(soak.pid),
                **{k: current.get(k) for k in ("num_requests_running", "num_requests_waiting")},
                "kv_cache_usage_perc": current.get("kv_cache_usage_perc"),
                "prefix_cache_blocks": current.get("prefix_cache_blocks"),
                "prefix_hit_rate": round(step["prefix_cache_hits_total"] / queries, 3)
                if queries
                else None,
                "preemptions": step["num_preemptions_total"],
                "generation_tokens": step["generation_tokens_total"],
                "requests_done": minute["done"],
                "errors": minute["errors"],
                "ttft_ms": ms_percentiles(minute["ttft"]),
                "itl_ms": ms_percentiles(minute["itl"]),
                "e2e_ms": ms_percentiles(minute["e2e"]),
            }
        )
        print(json.dumps(samples[-1]), file=sys.stderr, flush=True)


async def idle_sample(soak: Soak, timeout: float) -> dict:
    """The gauges once the server is idle, and its process tree after the heap was trimmed:
    under load RSS follows the largest recent step, so idle samples are the ones to compare."""
    gauges = await soak.until_idle(timeout)
    await asyncio.sleep(IDLE_SETTLE_S)
    return {**gauges, **process_tree(soak.pid)}


async def quiet_windows(soak: Soak, every_min: float, until: float, checks: list) -> None:
    """Pauses the users every ``every_min`` minutes until the server is idle."""
    while time.monotonic() + every_min * 60 < until:
        await asyncio.sleep(every_min * 60)
        soak.gate.clear()
        try:
            checks.append(await idle_sample(soak, REQUEST_TIMEOUT_S))
        finally:
            soak.gate.set()


async def audit(soak: Soak, requests: int) -> dict:
    """Uncut requests of every kind, then the counters' increments against the answers."""
    before_counts = (soak.finished.copy(), soak.usage.copy(), len(soak.errors))
    before = await soak.metrics()
    rng = random.Random(12345)
    for i in range(0, requests, 4):
        batch = []
        for j in range(i, min(requests, i + 4)):
            conversation = [
                {"role": "system", "content": soak.system},
                {"role": "user", "content": f"audit question {j}"},
            ]
            batch.append(soak.guarded(AUDIT_KINDS[j % len(AUDIT_KINDS)], rng, conversation))
        await asyncio.gather(*batch)
    idle = await soak.until_idle()
    step = delta(await soak.metrics(), before)
    finished = soak.finished - before_counts[0]
    usage = {k: soak.usage[k] - before_counts[1][k] for k in soak.usage}
    server = {r: int(v) for r, v in step["request_success"].items() if v}
    checks = {
        "request_success_by_reason": server == dict(finished),
        "prompt_tokens_total": step["prompt_tokens_total"] == usage.get("prompt_tokens_x_n", 0),
        "generation_tokens_total": step["generation_tokens_total"]
        == usage.get("completion_tokens", 0),
        "no_errors": len(soak.errors) == before_counts[2],
        "idle_after": not any(idle[k] for k in idle),
    }
    return {
        "requests": requests,
        "client_finished": dict(finished),
        "server_request_success": server,
        "client_usage": usage,
        "server_tokens": {k: step[k] for k in ("prompt_tokens_total", "generation_tokens_total")},
        "server_prompt_tokens_cached": step["prompt_tokens_cached_total"],
        "checks": checks,
    }


def whole_run(soak: Soak, first: dict, last: dict) -> dict:
    """The load's counters against the clients' view: an answer the client cut may have ended
    on the server either way, so each reason lies between what clients saw end and that plus
    the cut choices."""
    step = delta(last, first)
    server = step["request_success"]
    cut = soak.cut_choices
    ok = all(
        soak.finished[r] <= server.get(r, 0) <= soak.finished[r] + cut for r in ("stop", "length")
    )
    ok = ok and server.get("abort", 0) <= cut and server.get("error", 0) == 0
    queries = step["prefix_cache_queries_total"]
    return {
        "client_finished": dict(soak.finished),
        "cut_choices": cut,
        "server_request_success": {r: int(v) for r, v in server.items()},
        "client_usage": dict(soak.usage),
        "server_prompt_tokens": step["prompt_tokens_total"],
        "server_generation_tokens": step["generation_tokens_total"],
        "server_prompt_tokens_cached": step["prompt_tokens_cached_total"],
        "preemptions": step["num_preemptions_total"],
        "stage_restarts": step["stage_restarts_total"],
        "prefix_hit_rate": round(step["prefix_cache_hits_total"] / queries, 3) if queries else None,
        "consistent": ok
        and step["generation_tokens_total"] >= soak.usage["completion_tokens"]
        and step["prompt_tokens_total"] >= soak.usage["prompt_tokens_x_n"],
    }


async def run(url: str, pid: int, args: argparse.Namespace) -> dict:
    soak = Soak(url, pid, args.metrics_prefix, system_prompt(args.system_rules))
    samples: list = []
    quiet: list = []
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        soak.session = session
        soak.model = (await soak.sdk.models.list()).data[0].id
        first = await soak.metrics()
        started = time.monotonic()
        until = started + args.minutes * 60
        await asyncio.gather(
            *(soak.user(i, until) for i in range(args.concurrency)),
            soak.scrapes(until),
            sample_minutes(soak, started, until, samples),
            quiet_windows(soak, args.idle_every, until, quiet),
        )
        end_idle = await idle_sample(soak, REQUEST_TIMEOUT_S + 30)
        last = await soak.metrics()
        run_view = whole_run(soak, first, last)
        audited = await audit(soak, args.audit_requests)
        await soak.sdk.close()
    return report(args, soak, samples, quiet, end_idle, run_view, audited, started)


def report(args, soak, samples, quiet, end_idle, run_view, audited, started) -> dict:
    warm = [s for s in samples if s["minute"] >= 2] or samples
    rss = [(s["minute"], s["rss_mb"]) for s in warm]
    idle_rss = [c["rss_mb"] for c in quiet + [end_idle]]
    growth = (idle_rss[-1] - idle_rss[0]) / idle_rss[0] if len(idle_rss) > 1 else 0.0
    fds = [s["fds"] for s in warm]
    idle_ok = all(not any(c[k] for k in IDLE_KEYS) for c in quiet + [end_idle])
    hit = run_view["prefix_hit_rate"]
    failures = {
        "errors (5xx, stuck, wrong status, bad output)": bool(soak.errors),
        "gauges or KV not 0 when idle": not idle_ok,
        f"idle RSS growth >= {RSS_GROWTH_LIMIT:.0%}": growth >= RSS_GROWTH_LIMIT,
        "fds growing": bool(fds) and fds[-1] - fds[0] > FD_GROWTH_LIMIT,
        "counters inconsistent with the clients (whole run)": not run_view["consistent"],
        "counters inconsistent with the clients (audit)": not all(audited["checks"].values()),
        f"prefix-cache hit rate below {MIN_HIT_RATE}": hit is None or hit < MIN_HIT_RATE,
    }
    return {
        "minutes": args.minutes,
        "concurrency": args.concurrency,
        "elapsed_s": round(time.monotonic() - started, 1),
        "requests": dict(soak.counts),
        "errors": dict(soak.errors),
        "per_minute": samples,
        "drift": {
            "rss_mb_under_load_first_last": [rss[0][1], rss[-1][1]] if rss else None,
            "rss_mb_under_load_per_min": _round(slope_per_min(rss)),
            "rss_mb_idle": idle_rss,
            "rss_idle_growth": round(growth, 4),
            "fds_first_last": [fds[0], fds[-1]] if fds else None,
            "threads_first_last": [warm[0]["threads"], warm[-1]["threads"]] if warm else None,
            "ttft_p50_ms_per_min": trend(warm, "ttft_ms"),
            "itl_p50_ms_per_min": trend(warm, "itl_ms"),
        },
        "quiet_windows": quiet,
        "at_end": end_idle,
        "whole_run": run_view,
        "audit": audited,
        "failures": [k for k, v in failures.items() if v],
        "passed": not any(failures.values()),
    }


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def trend(samples: list, key: str) -> float | None:
    """ms per minute: the drift of a latency's per-minute median."""
    return _round(slope_per_min([(s["minute"], s[key]["p50"]) for s in samples if s[key]["p50"]]))


def serve_command(args: argparse.Namespace) -> list[str]:
    cmd = [sys.executable, "-m", "rltserve.cli", "serve", "--host", "127.0.0.1"]
    cmd += ["--port", str(args.port), "--enable-prefix-caching"]
    cmd += ["--scheduling-policy", "priority", "--max-tokens-limit", str(args.max_tokens_limit)]
    cmd += ["--log-level", "warning", "--metrics-prefix", args.metrics_prefix]
    if args.model:
        cmd += ["--model", args.model]
    return cmd + list(args.serve_arg)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--concurrency", type=int, default=12, help="users at once")
    parser.add_argument("--model", default=None, help="checkpoint (default: the demo model)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--url", default=None, help="a running server (with --server-pid)")
    parser.add_argument("--server-pid", type=int, default=None)
    parser.add_argument("--max-tokens-limit", type=int, default=256)
    parser.add_argument("--idle-every", type=float, default=5.0, help="minutes between pauses")
    parser.add_argument("--audit-requests", type=int, default=36)
    parser.add_argument("--metrics-prefix", default="rltserve")
    parser.add_argument(
        "--system-rules", type=int, default=12, help="length of the shared system prompt"
    )
    parser.add_argument("--serve-arg", action="append", default=[], help="extra serve flag")
    parser.add_argument("--out", default=None, help="also write the JSON report here")
    args = parser.parse_args(argv)
    process = None
    if args.url:
        if args.server_pid is None:
            parser.error("--url needs --server-pid (the process whose RSS and fds to sample)")
        url, pid = args.url.rstrip("/"), args.server_pid
    else:
        url = f"http://127.0.0.1:{args.port}"
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        process = subprocess.Popen(serve_command(args), env=env)
        pid = process.pid
    try:
        asyncio.run(wait_healthy(url, process, timeout=300))
        result = asyncio.run(run(url, pid, args))
    finally:
        if process is not None:
            code = stop_server(process)
    if process is not None:
        result["server_exit_code"] = code
        result["passed"] = result["passed"] and code == 0
    text = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
