"""Routing overhead of a Ray Serve streaming call, without an engine: the front end's
``handle.options(stream=True)`` call to a replica whose generator yields one item at once, timed
to that first item (what ``ReplicaSetClient`` adds to a request's time to first token).

Usage: python scripts/bench_ray_routing.py [--replicas 2] [--calls 300]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import time

import ray
from ray import serve

from rltserve.ray.client import _SERVE_LOGGING  # the server's settings: no access log


class Echo:
    async def generate(self, request_id: str, prompt: list[int], params: object):
        yield request_id


async def measure(handle, calls: int) -> list[float]:
    stream = handle.options(method_name="generate", stream=True)
    for _ in range(20):  # warm-up: routers, connections
        async for _ in stream.remote("w", [1, 2, 3], None):
            break
    out = []
    for i in range(calls):
        t0 = time.perf_counter()
        async for _ in stream.remote(f"r{i}", list(range(64)), None):
            out.append((time.perf_counter() - t0) * 1000)
            break
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.WARNING)
    try:
        serve.start(proxy_location="Disabled", logging_config=_SERVE_LOGGING)
        app = serve.deployment(
            Echo,
            num_replicas=args.replicas,
            ray_actor_options={"num_cpus": 0},
            logging_config=_SERVE_LOGGING,
        )
        handle = serve.run(app.bind(), name="routing", route_prefix=None)
        ms = sorted(asyncio.run(measure(handle, args.calls)))
        p = lambda q: ms[min(len(ms) - 1, int(q * len(ms)))]  # noqa: E731
        print(
            f"replicas={args.replicas} calls={len(ms)} first item: mean {statistics.mean(ms):.2f} "
            f"ms, median {p(0.5):.2f}, p90 {p(0.9):.2f}, p99 {p(0.99):.2f}"
        )
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
