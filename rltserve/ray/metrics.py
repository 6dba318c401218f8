"""Per-replica metrics of a replica set, with a ``replica`` label (Ray Serve's replica id).

Read at scrape time from what the front end learnt from the replicas' streamed batches: each
replica's latest ``EngineStats`` and how many requests were routed to it. The unlabelled engine
metrics of ``rltserve.http.metrics`` carry the sums over replicas.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


class ReplicaCollector(Collector):
    def __init__(
        self, model_name: str, client: Callable[[], object], prefix: str = "rltserve"
    ) -> None:
        self.model_name = model_name
        self.client = client  # the current replica-set client (a restart may replace it)
        self.prefix = prefix + ":"  # (``ServerConfig.metrics_prefix``)

    def collect(self) -> Iterator[Metric]:
        P = self.prefix
        client = self.client()
        replicas = client.replicas() if hasattr(client, "replicas") else {}
        live = GaugeMetricFamily(
            P + "replicas_live", "Engine replicas running.", labels=["model_name"]
        )
        live.add_metric([self.model_name], float(getattr(client, "live_replicas", 0)))
        yield live
        labels = ["model_name", "replica"]
        requests = CounterMetricFamily(
            P + "replica_requests", "Requests routed to each replica.", labels=labels
        )
        running = GaugeMetricFamily(
            P + "replica_num_requests_running", "Requests running in each replica.", labels=labels
        )
        kv = GaugeMetricFamily(
            P + "replica_kv_cache_usage_perc",
            "Fraction of each replica's KV blocks in use.",
            labels=labels,
        )
        steps = CounterMetricFamily(
            P + "replica_engine_steps", "Engine steps run by each replica.", labels=labels
        )
        for replica, state in sorted(replicas.items()):
            key = [self.model_name, replica]
            requests.add_metric(key, float(state.requests))
            stats = state.stats
            running.add_metric(key, float(stats.num_running if stats else 0))
            kv.add_metric(key, float(stats.kv_usage if stats else 0.0))
            steps.add_metric(key, float(stats.num_steps if stats else 0))
        yield from (requests, running, kv, steps)
