"""What a soak watches on the server side: the process tree's RSS, open fds and threads (from
/proc) and the engine's series in ``/metrics``; the server it starts (``wait_healthy``,
``stop_server``); plus the small statistics helpers the soak reports with. Used by
``scripts/soak_chat.py`` and ``scripts/soak.py``."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import time
from pathlib import Path

import aiohttp

# /metrics series a soak samples (without the prefix); counters end in _total
SERIES = (
    "num_requests_running",
    "num_requests_waiting",
    "kv_cache_usage_perc",
    "prefix_cache_blocks",
    "prefix_cache_queries_total",
    "prefix_cache_hits_total",
    "prompt_tokens_total",
    "prompt_tokens_cached_total",
    "generation_tokens_total",
    "num_preemptions_total",
    "stage_restarts_total",
)
GAUGES_AT_IDLE = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")


def tree_pids(pid: int) -> list[int]:
    """``pid`` and its descendants (the server and its stage worker)."""
    pids, i = [pid], 0
    while i < len(pids):
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{pids[i]}/task").iterdir():
                pids += [int(c) for c in (task / "children").read_text().split()]
        i += 1
    return list(dict.fromkeys(pids))


def process_tree(pid: int) -> dict:
    """RSS (MB), open fds and threads of the server's process tree, summed; and the RSS of
    the server process alone (the front end; the rest is its stage worker)."""
    rss_kb = fds = threads = front_kb = 0
    pids = tree_pids(pid)
    for p in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    rss_kb += int(line.split()[1])
                    front_kb += int(line.split()[1]) if p == pid else 0
                elif line.startswith("Threads:"):
                    threads += int(line.split()[1])
            fds += len(list(Path(f"/proc/{p}/fd").iterdir()))
    return {
        "rss_mb": round(rss_kb / 1024, 1),
        "frontend_rss_mb": round(front_kb / 1024, 1),
        "fds": fds,
        "threads": threads,
        "pids": len(pids),
    }


def parse_metrics(text: str, prefix: str = "rltserve") -> dict:
    """The engine series of SERIES, and ``request_success_total`` by ``finished_reason``."""
    values: dict = {"request_success": {}}
    for line in text.splitlines():
        if not line.startswith(prefix + ":"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels[len(prefix) + 1 :].split("{", 1)[0]
        if name in SERIES:
            values[name] = float(value)
        elif name == "request_success_total":
            reason = name_labels.split('finished_reason="', 1)[1].split('"', 1)[0]
            values["request_success"][reason] = float(value)
    return values


def delta(after: dict, before: dict) -> dict:
    """Counter increments between two ``parse_metrics`` results."""
    out = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in SERIES if k.endswith("_total")}
    reasons = set(after["request_success"]) | set(before["request_success"])
    out["request_success"] = {
        r: after["request_success"].get(r, 0.0) - before["request_success"].get(r, 0.0)
        for r in sorted(reasons)
    }
    return out


async def wait_healthy(url: str, process: subprocess.Popen | None, timeout: float) -> None:
    """Until ``url``'s /health answers 200 (RuntimeError if ``process``, the server started
    for the soak, exits first or ``timeout`` seconds pass)."""
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if process is not None and process.poll() is not None:
                raise RuntimeError(f"rltserve serve exited with {process.returncode}")
            with contextlib.suppress(aiohttp.ClientError):
                async with session.get(url + "/health") as response:
                    if response.status == 200:
                        return
            await asyncio.sleep(0.2)
    raise RuntimeError(f"the server was not healthy within {timeout} s")


def stop_server(process: subprocess.Popen) -> int:
    """SIGTERM (a graceful stop), SIGKILL after 60 s; the exit code."""
    process.terminate()
    try:
        return process.wait(60)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def ms_percentiles(values: list[float]) -> dict:
    def ms(x: float | None) -> float | None:
        return None if x is None else round(x * 1000, 1)

    return {f"p{int(q * 100)}": ms(percentile(values, q)) for q in (0.5, 0.9, 0.99)}


def slope_per_min(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (minute, value) points: the drift of a sampled quantity."""
    if len(points) < 3:
        return None
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    var = sum((x - mx) ** 2 for x, _ in points)
    return None if not var else sum((x - mx) * (y - my) for x, y in points) / var
