"""What the front end keeps of each replica (``ReplicaState``), and what it keeps of the
replicas that are gone (``Retired``: their counters, so that the sums never go down).

A replica leaves the roster when a request fails on it (``ReplicaSetClient._relay``) or, for
one that died or was stopped while it ran nothing, when Serve's controller no longer lists it
(``serve_replica_ids``): else its series stayed in ``/metrics`` for good, beside its
replacement's, and its last gauges in the sums (a KV usage averaged over one replica too many).
"""

from __future__ import annotations

import dataclasses

from rltserve.core.engine_info import EngineStats, sum_stats


@dataclasses.dataclass
class ReplicaState:
    """What the front end knows of one replica (from the batches it streamed)."""

    pid: int
    stats: EngineStats | None = None
    prefill_stats: EngineStats | None = None  # its prefill stage's, under --disaggregate
    requests: int = 0  # requests routed to it
    in_flight: int = 0  # of which still streaming


@dataclasses.dataclass
class Retired:
    """The summed counters of replicas that are gone (their gauges do not count)."""

    stats: EngineStats | None = None
    prefill_stats: EngineStats | None = None  # (of their prefill stages)

    def add(self, state: ReplicaState) -> None:
        if state.stats is not None:
            self.stats = sum_stats([state.stats], self.stats)
        if state.prefill_stats is not None:
            self.prefill_stats = sum_stats([state.prefill_stats], self.prefill_stats)


def serve_replica_ids(app: str, deployment: str) -> set[str] | None:
    """The ids of the replicas Serve's controller lists for ``deployment`` of ``app`` (in any
    state: a starting or stopping one too); None when it does not say (the app is gone, or this
    Serve lacks the details call, which is not public API: then nothing is pruned)."""
    try:
        from ray.serve.context import _get_global_client

        details = _get_global_client().get_serve_details()
        listed = details["applications"][app]["deployments"][deployment]["replicas"]
        return {str(r["replica_id"]) for r in listed}
    except Exception:  # noqa: BLE001 - see the doc: no answer, no pruning
        return None
