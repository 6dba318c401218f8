"""Soak test: a mixed, hostile load against a loopback ``rltserve serve`` for a fixed time.

    python scripts/soak.py --minutes 10 --concurrency 64 [--model DIR] [--json]

starts ``rltserve serve`` on a free loopback port (the built-in demo model unless ``--model``)
with an admission limit below the concurrency, so bursts meet 503s, then runs ``concurrency``
clients for ``minutes``. Each client loops over a mix of streaming and non-streaming completions
and chats with n > 1, stop strings, logprobs and adaptive exit thresholds; 30% of streams are
cut at a random point (before the first token, after a few chunks, mid decode). Every few
seconds a burst of extra requests goes beyond the admission limit.

Prints a JSON report: requests served, errors by kind, 503s, p50/p99 TTFT and ITL (streams),
server RSS (server and stage processes together) after warm-up and at the end, and whether the
run passed: zero 5xx other than 503, zero lost or stuck requests (every request ended within its
timeout), the KV pool empty and nothing running once the load stops, and RSS growth after
warm-up below 10%. Exit code 0 when passed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from soak_probe import percentile, stop_server, wait_healthy  # noqa: E402

REQUEST_TIMEOUT_S = 120.0  # a request not ended by then is "stuck"
CUT_FRACTION = 0.3
BURST_EVERY_S = 5.0
RSS_GROWTH_LIMIT = 0.10


@dataclass
class Tally:
    served: int = 0
    cut: int = 0
    unavailable: int = 0  # 503 (admission queue full): expected under bursts
    errors: Counter = field(default_factory=Counter)  # kind -> count
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def tree_rss_bytes(pid: int) -> int:
    """RSS of ``pid`` and its children (the stage process), from /proc."""
    total = 0
    pids = [pid]
    with contextlib.suppress(OSError):
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        pids += [int(c) for c in children]
    for p in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
    return total


def _body(rng: random.Random, chat: bool, stream: bool) -> dict:
    body: dict = {
        "max_tokens": rng.choice([4, 8, 16, 24]),
        "temperature": rng.choice([0.0, 0.7, 1.0]),
        "n": rng.choice([1, 1, 1, 2, 3]),
        "stream": stream,
    }
    if rng.random() < 0.3:
        body["stop"] = rng.choice(["\n", ".", ["a", "the"]])
    if rng.random() < 0.3:
        body["exit_threshold"] = rng.choice([0.5, 0.8, 0.95])
    if rng.random() < 0.3:
        if chat:
            body.update(logprobs=True, top_logprobs=rng.choice([0, 2]))
        else:
            body["logprobs"] = rng.choice([0, 2])
    if stream and rng.random() < 0.3:
        body["stream_options"] = {"include_usage": True}
    words = " ".join(rng.choice(["loop", "depth", "model", "token", "tree"]) for _ in range(8))
    if chat:
        body["messages"] = [{"role": "user", "content": words}]
    else:
        body["prompt"] = words if rng.random() < 0.7 else [rng.randrange(5, 400) for _ in range(12)]
    return body


async def one_request(session: aiohttp.ClientSession, url: str, rng: random.Random, tally: Tally):
    chat = rng.random() < 0.5
    stream = rng.random() < 0.6
    cut_after = rng.choice([0, 1, 3, 8]) if stream and rng.random() < CUT_FRACTION else None
    if cut_after == 0:  # gone before the first token: while queued, in prefill or just after
        try:
            await asyncio.wait_for(
                _request(session, url, rng, tally, chat, stream, None), rng.uniform(0.0, 0.3)
            )
        except asyncio.TimeoutError:
            tally.cut += 1
        return
    try:
        await asyncio.wait_for(
            _request(session, url, rng, tally, chat, stream, cut_after), REQUEST_TIMEOUT_S
        )
    except asyncio.TimeoutError:
        tally.errors["stuck (timeout)"] += 1
    except aiohttp.ClientError as exc:
        tally.errors[f"client {type(exc).__name__}"] += 1


async def _request(
    session: aiohttp.ClientSession,
    url: str,
    rng: random.Random,
    tally: Tally,
    chat: bool,
    stream: bool,
    cut_after: int | None,
) -> None:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = _body(rng, chat, stream)
    started = time.monotonic()
    async with session.post(url + path, json=body) as response:
        if response.status == 503:
            tally.unavailable += 1
            await response.read()
            await asyncio.sleep(rng.uniform(0.1, 0.5))  # a client backing off, not spinning
            return
        if response.status != 200:
            tally.errors[f"http {response.status}"] += 1
            await response.read()
            return
        if not stream:
            data = await response.json()
            if "choices" not in data:
                tally.errors["bad body"] += 1
            else:
                tally.served += 1
            return
        chunks, last = 0, None
        done = False
        async for line in response.content:
            if not line.startswith(b"data: "):
                continue
            if line.strip() == b"data: [DONE]":
                done = True
                break
            if b'"error"' in line:
                tally.errors["stream error event"] += 1
            now = time.monotonic()
            if last is None:
                tally.ttft.append(now - started)
            else:
                tally.itl.append(now - last)
            last, chunks = now, chunks + 1
            if cut_after is not None and chunks >= cut_after:
                tally.cut += 1
                response.close()
                return
        if done:
            tally.served += 1
        else:
            tally.errors["stream ended without [DONE]"] += 1


async def client_loop(session, url: str, seed: int, tally: Tally, until: float) -> None:
    rng = random.Random(seed)
    while time.monotonic() < until:
        await one_request(session, url, rng, tally)


async def bursts(session, url: str, size: int, tally: Tally, until: float) -> None:
    rng = random.Random(-1)
    while time.monotonic() + BURST_EVERY_S < until:
        await asyncio.sleep(BURST_EVERY_S)
        await asyncio.gather(*(one_request(session, url, rng, tally) for _ in range(size)))


async def engine_idle(session, url: str, timeout: float) -> dict:
    """The running/waiting/KV gauges once they reach zero (or their last values)."""
    deadline = time.monotonic() + timeout
    values: dict = {}
    while True:
        async with session.get(url + "/metrics") as response:
            text = await response.text()
        for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
            for line in text.splitlines():
                if line.startswith(f"rltserve:{name}{{"):
                    values[name] = float(line.rsplit(" ", 1)[1])
        if values and not any(values.values()):
            return values
        if time.monotonic() > deadline:
            return values
        await asyncio.sleep(0.2)


async def soak(url: str, pid: int, minutes: float, concurrency: int, burst: int) -> dict:
    tally = Tally()
    timeout = aiohttp.ClientTimeout(total=None)
    connector = aiohttp.TCPConnector(limit=0)
    started = time.monotonic()
    until = started + minutes * 60
    warmup = started + min(30.0, minutes * 60 * 0.2)
    rss: dict = {}

    async def sample_rss() -> None:
        await asyncio.sleep(max(0.0, warmup - time.monotonic()))
        rss["after_warmup"] = tree_rss_bytes(pid)

    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        sampler = asyncio.create_task(sample_rss())
        await asyncio.gather(
            *(client_loop(session, url, i, tally, until) for i in range(concurrency)),
            bursts(session, url, burst, tally, until),
        )
        await sampler
        idle = await engine_idle(session, url, timeout=30)
    rss["end"] = tree_rss_bytes(pid)
    growth = (rss["end"] - rss["after_warmup"]) / rss["after_warmup"] if rss["after_warmup"] else 0
    five_xx = sum(n for kind, n in tally.errors.items() if kind.startswith("http 5"))
    stuck = tally.errors.get("stuck (timeout)", 0) + tally.errors.get(
        "stream ended without [DONE]", 0
    )
    idle_ok = bool(idle) and not any(idle.values())

    def ms(x: float | None) -> float | None:
        return None if x is None else round(x * 1000, 1)

    report = {
        "minutes": minutes,
        "concurrency": concurrency,
        "elapsed_s": round(time.monotonic() - started, 1),
        "requests_served": tally.served,
        "streams_cut": tally.cut,
        "rejected_503": tally.unavailable,
        "errors": dict(tally.errors),
        "ttft_ms": {
            "p50": ms(percentile(tally.ttft, 0.5)),
            "p99": ms(percentile(tally.ttft, 0.99)),
        },
        "itl_ms": {"p50": ms(percentile(tally.itl, 0.5)), "p99": ms(percentile(tally.itl, 0.99))},
        "mean_itl_ms": ms(statistics.fmean(tally.itl)) if tally.itl else None,
        "rss_mb": {k: round(v / 2**20, 1) for k, v in rss.items()},
        "rss_growth": round(growth, 4),
        "engine_at_end": idle,
    }
    report["passed"] = (
        five_xx == 0
        and stuck == 0
        and not tally.errors
        and idle_ok
        and growth < RSS_GROWTH_LIMIT
        and tally.served > 0
    )
    return report


def serve_command(args: argparse.Namespace, port: int) -> list[str]:
    cmd = [sys.executable, "-m", "rltserve.cli", "serve", "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--max-concurrent", str(args.max_concurrent)]
    cmd += ["--max-queued", str(args.max_queued), "--log-level", "warning"]
    if args.model:
        cmd += ["--model", args.model]
    return cmd + list(args.serve_arg)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=1.0)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--model", default=None, help="checkpoint (default: the demo model)")
    parser.add_argument("--max-concurrent", type=int, default=32, help="server admission limit")
    parser.add_argument("--max-queued", type=int, default=32, help="server queue limit")
    parser.add_argument("--burst", type=int, default=None, help="burst size (default: 2 x C)")
    parser.add_argument(
        "--serve-arg", action="append", default=[], help="extra flag for 'rltserve serve'"
    )
    args = parser.parse_args(argv)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = subprocess.Popen(serve_command(args, port), env=os.environ.copy())
    try:
        asyncio.run(wait_healthy(url, process, timeout=300))
        burst = args.burst if args.burst is not None else 2 * args.concurrency
        report = asyncio.run(soak(url, process.pid, args.minutes, args.concurrency, burst))
    finally:
        code = stop_server(process)
    report["server_exit_code"] = code
    report["passed"] = report["passed"] and code == 0
    print(json.dumps(report, indent=2))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
