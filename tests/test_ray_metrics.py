"""``ReplicaCollector``: one sample per replica and metric, labelled with the replica's id, read
from what the front end learnt from the replicas' batches. No Ray needed."""

from __future__ import annotations

import dataclasses
import types

from rltserve.core.engine_info import EngineStats
from rltserve.ray.client import ReplicaState
from rltserve.ray.metrics import ReplicaCollector


def _stats(**values) -> EngineStats:
    zeros = {f.name: 0 for f in dataclasses.fields(EngineStats)}
    return EngineStats(**{**zeros, "step_rows_counts": (), **values})


def _samples(collector: ReplicaCollector) -> dict[tuple[str, str], float]:
    """(sample name, replica label or '') -> value."""
    return {
        (s.name, s.labels.get("replica", "")): s.value
        for family in collector.collect()
        for s in family.samples
        if not s.name.endswith("_created")
    }


def test_each_replica_reports_its_own_requests_and_engine_gauges():
    busy = _stats(num_running=3, num_waiting=5, kv_usage=0.25, num_steps=40, num_rows=90)
    replicas = {
        "b": ReplicaState(pid=2, stats=busy, requests=7, in_flight=3),
        "a": ReplicaState(pid=1, stats=None, requests=1, in_flight=1),  # no batch yet
    }
    client = types.SimpleNamespace(replicas=lambda: replicas, live_replicas=1)  # (one died)
    samples = _samples(ReplicaCollector("tiny", lambda: client))
    assert samples[("rltserve:replicas_live", "")] == 1
    assert samples[("rltserve:replica_requests_total", "b")] == 7
    assert samples[("rltserve:replica_num_requests_running", "b")] == 3
    assert samples[("rltserve:replica_kv_cache_usage_perc", "b")] == 0.25
    assert samples[("rltserve:replica_engine_steps_total", "b")] == 40
    assert samples[("rltserve:replica_requests_total", "a")] == 1
    assert samples[("rltserve:replica_num_requests_running", "a")] == 0
    assert samples[("rltserve:replica_kv_cache_usage_perc", "a")] == 0
    assert samples[("rltserve:replica_engine_steps_total", "a")] == 0


def test_a_client_without_replicas_reports_none_live():
    samples = _samples(ReplicaCollector("tiny", lambda: object()))
    assert samples == {("rltserve:replicas_live", ""): 0}
