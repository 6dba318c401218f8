"""``ReplicaSetClient``'s relay of a replica's stream and ``EngineReplica.generate``, without Ray:
a fake streaming call stands for Serve's, a fake stage client for the replica's engine. Every
request gets exactly one final update; an abort cancels the call; a failed replica's counters
stay in the sums; a cancelled stream aborts its request in the engine."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import threading

import pytest

from rltserve.core.engine_info import EngineStats
from rltserve.ray.client import ReplicaSetClient
from rltserve.ray.config import ReplicaConfig
from rltserve.ray.guides import GuideShipper, GuideStore
from rltserve.ray.replica import EngineReplica, ReplicaBatch
from rltserve.ray.roster import Retired
from rltserve.sampling import SamplingParams
from rltserve.updates import FinishReason, RequestUpdate

PARAMS = SamplingParams(temperature=0.0, max_tokens=4)


def _stats(**values) -> EngineStats:
    zeros = {f.name: 0 for f in dataclasses.fields(EngineStats)}
    return EngineStats(**{**zeros, "step_rows_counts": (), **values})


class FakeCall:
    """A streaming call: yields ``batches``, then raises ``error`` or waits forever (``hang``)."""

    def __init__(self, batches, error: Exception | None = None, hang: bool = False) -> None:
        self.batches, self.error, self.hang = batches, error, hang
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True

    async def __aiter__(self):
        for batch in self.batches:
            yield batch
        if self.error is not None:
            raise self.error
        if self.hang:
            await asyncio.Event().wait()


class FakeStream:
    def __init__(self, call: FakeCall) -> None:
        self.call = call
        self.options_given: list[dict] = []  # (Serve's handle.options: the session's replica)

    def options(self, **kwargs) -> FakeStream:
        self.options_given.append(kwargs)
        return self

    def remote(self, *args):
        return self.call


def _client(call: FakeCall) -> ReplicaSetClient:
    client = object.__new__(ReplicaSetClient)  # no cluster: only the relay's state
    client.config = ReplicaConfig(replicas=1)
    client._lock = threading.Lock()
    client._tasks, client._replicas = {}, {}
    client._retired, client._closed, client._fatal = Retired(), False, None
    client._deployment, client._deployed, client._seen, client._lost = "d-1", True, False, None
    client._stream = FakeStream(call)
    client._guides = GuideShipper(put=lambda index: ("ref", index))
    return client


def _batch(*updates, steps: int = 3, running: int = 1) -> ReplicaBatch:
    return ReplicaBatch("rep-1", 4321, list(updates), _stats(num_steps=steps, num_running=running))


async def _run(client, rid="r"):
    got: list[RequestUpdate] = []
    client.add_request(rid, [1, 2], PARAMS, got.append)
    await asyncio.wait_for(client._tasks[rid], 10)
    return got


async def test_a_finished_request_leaves_its_replica_idle_and_its_id_free():
    final = RequestUpdate("r", [6], finish_reason=FinishReason.LENGTH)
    call = FakeCall([_batch(RequestUpdate("r", [5])), _batch(final)])
    client = _client(call)
    got = await _run(client)
    assert [u.new_token_ids for u in got] == [[5], [6]]
    assert got[-1].finish_reason is FinishReason.LENGTH
    assert client._tasks == {}  # the id can be used again
    state = client.replicas()["rep-1"]
    assert state.requests == 1 and state.in_flight == 0
    assert state.stats.num_running == 0  # a gauge: idle now
    assert state.stats.num_steps == 3  # a counter: kept
    got = await _run(client)  # same id again
    assert got[-1].finish_reason is FinishReason.LENGTH


async def test_a_stream_that_ends_without_a_final_update_fails_its_request():
    client = _client(FakeCall([_batch(RequestUpdate("r", [5]))]))
    got = await _run(client)
    assert [u.finish_reason for u in got] == [None, FinishReason.ERROR]
    assert "ended the request without finishing it" in got[-1].error


async def test_a_failed_replica_fails_its_request_and_its_counters_stay_in_the_sums():
    error = RuntimeError("actor died\nmore")
    call = FakeCall([_batch(RequestUpdate("r", [5]), steps=7)], error=error)
    client = _client(call)
    got = await _run(client)
    assert got[-1].finish_reason is FinishReason.ERROR
    assert got[-1].error == "stage died: replica rep-1 failed: RuntimeError: actor died"
    assert client.replicas() == {}  # a replacement reports anew
    assert client.stats.num_steps == 7 and client.stats.num_running == 0


async def test_abort_cancels_the_call_and_ends_the_request_once():
    call = FakeCall([_batch(RequestUpdate("r", [5]))], hang=True)
    client = _client(call)
    got: list[RequestUpdate] = []
    client.add_request("r", [1, 2], PARAMS, got.append)
    for _ in range(1000):
        if got:
            break
        await asyncio.sleep(0.001)
    client.abort("r")
    task = client._tasks.get("r")
    if task is not None:
        await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), 10)
    assert call.cancelled  # the replica's generator is cancelled: it aborts in its engine
    assert [u.finish_reason for u in got] == [None, FinishReason.ABORT]
    assert client._tasks == {}


async def test_an_abort_before_the_relay_ran_still_ends_the_request_once():
    """An abort in the same loop tick as the add (a client that went away at once): the
    request still gets its one final update, the call is cancelled and the id is free."""
    call = FakeCall([], hang=True)
    client = _client(call)
    got: list[RequestUpdate] = []
    client.add_request("r", [1, 2], PARAMS, got.append)
    client.abort("r")
    task = client._tasks["r"]
    await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), 10)
    assert call.cancelled
    assert [u.finish_reason for u in got] == [FinishReason.ABORT]
    assert client._tasks == {}
    client.add_request("r", [1, 2], PARAMS, got.append)  # (the id is free again)
    client.abort("r")
    await asyncio.wait_for(asyncio.gather(client._tasks["r"], return_exceptions=True), 10)


async def test_close_ends_the_open_requests(monkeypatch):
    from rltserve.ray import client as ray_client

    monkeypatch.setattr(ray_client, "cluster_gone", lambda watch_s: True)  # nothing to stop
    call = FakeCall([_batch(RequestUpdate("r", [5]))], hang=True)
    client = _client(call)
    client._owns_cluster = False
    got: list[RequestUpdate] = []
    client.add_request("r", [1, 2], PARAMS, got.append)
    task = client._tasks["r"]
    await asyncio.sleep(0.01)
    client.close()
    await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), 10)
    assert [u.finish_reason for u in got][-1] is FinishReason.ABORT and call.cancelled
    assert not client.alive


# ---------------------------------------------------------------- the replica's side


class FakeStage:
    """A stage client whose request emits ``updates`` at once."""

    def __init__(self, updates) -> None:
        self.updates, self.aborted, self.stats = updates, [], _stats()
        self.groups: list[str | None] = []

    def add_request(self, rid, prompt, params, sink, group=None):
        self.groups.append(group)
        for update in self.updates:
            sink(update)

    def abort(self, rid):
        self.aborted.append(rid)


def _replica(stage: FakeStage) -> EngineReplica:
    replica = object.__new__(EngineReplica)
    replica._client, replica._id = stage, "rep-1"
    replica._guides = GuideStore()
    return replica


async def test_a_cancelled_stream_aborts_its_request_in_the_engine():
    stage = FakeStage([RequestUpdate("r", [5])])
    gen = _replica(stage).generate("r", [1, 2], PARAMS)
    batch = await gen.__anext__()
    assert batch.updates[0].new_token_ids == [5] and batch.replica == "rep-1"
    await gen.aclose()  # the front end went away
    assert stage.aborted == ["r"]


async def test_a_finished_stream_ends_without_an_abort():
    stop = RequestUpdate("r", finish_reason=FinishReason.STOP)
    stage = FakeStage([RequestUpdate("r", [5]), stop])
    batches = [b async for b in _replica(stage).generate("r", [1, 2], PARAMS)]
    assert sum(len(b.updates) for b in batches) == 2
    assert batches[-1].updates[-1].finish_reason is FinishReason.STOP
    assert stage.aborted == []


def test_a_replica_whose_stage_died_fails_its_health_check():
    stage = FakeStage([])
    stage.alive, stage.error = False, "stage died: boom"
    replica = _replica(stage)
    with pytest.raises(RuntimeError, match="the replica's stage is not running: stage died: boom"):
        replica.check_health()
    stage.alive = True
    replica.check_health()  # a healthy one passes


async def test_a_request_id_in_use_is_refused():
    client = _client(FakeCall([_batch(RequestUpdate("r", [5]))], hang=True))
    got: list[RequestUpdate] = []
    client.add_request("r", [1, 2], PARAMS, got.append)
    with pytest.raises(ValueError, match="request_id='r': already in use"):
        client.add_request("r", [3], PARAMS, got.append)
    for _ in range(1000):  # (the relay runs: see the report on aborting a task not yet started)
        if got:
            break
        await asyncio.sleep(0.001)
    client.abort("r")
    await asyncio.wait_for(asyncio.gather(client._tasks["r"], return_exceptions=True), 10)
    assert got[-1].finish_reason is FinishReason.ABORT  # the first request's sink, once
    assert sum(u.finish_reason is not None for u in got) == 1


@pytest.mark.parametrize("closing", [False, True])
def test_a_cluster_that_stops_answering_ends_the_client_unless_closing(monkeypatch, closing):
    """The replica poller counts running replicas; when Serve stops answering, the client is
    dead with the reason (the server's supervisor sees it), unless it is closing anyway."""
    import rltserve.ray.client as client_module

    monkeypatch.setattr(client_module, "_POLL_S", 0.0)
    client = _client(FakeCall([]))
    answers = iter([{"RUNNING": 2, "STARTING": 1}])

    def serve_app():
        try:
            states = next(answers)
        except StopIteration:
            client._closed = closing  # (close() sets it while a poll is in flight)
            raise ConnectionError("the GCS is gone") from None
        return object(), type("Deployment", (), {"replica_states": states})()

    client._serve_app = serve_app
    client._poll()  # (returns when the cluster stops answering)
    assert client.live_replicas == 2
    if closing:
        assert client._fatal is None and client.error == "closed"
    else:
        assert not client.alive
        assert client.error == "Ray Serve is not answering: ConnectionError: the GCS is gone"


def test_a_closed_client_refuses_new_requests():
    from rltserve.core.stage import StageError

    client = _client(FakeCall([]))
    client._closed = True
    with pytest.raises(StageError, match="stage is not running: closed"):
        client.add_request("r", [1, 2], PARAMS, [].append)
    assert client._tasks == {}


@pytest.mark.parametrize("affinity", ["none", "session"])
async def test_the_session_key_picks_the_replica_only_under_session_affinity(affinity):
    final = RequestUpdate("r", [6], finish_reason=FinishReason.LENGTH)
    client = _client(FakeCall([_batch(final)]))
    client.config = ReplicaConfig(replicas=2, replica_affinity=affinity)
    got: list[RequestUpdate] = []
    client.add_request("r", [1, 2], PARAMS, got.append, session="chat-1")
    await asyncio.wait_for(client._tasks["r"], 10)
    expected = [{"session_id": "chat-1"}] if affinity == "session" else []
    assert client._stream.options_given == expected
    assert got[-1].finish_reason is FinishReason.LENGTH


async def test_counters_of_every_failed_replica_stay_in_the_sums():
    client = _client(None)
    for replica, steps in (("rep-1", 7), ("rep-2", 5)):
        batch = dataclasses.replace(_batch(RequestUpdate("r", [5]), steps=steps), replica=replica)
        client._stream = FakeStream(FakeCall([batch], error=RuntimeError("actor died")))
        got = await _run(client)
        assert got[-1].finish_reason is FinishReason.ERROR
    assert client.stats.num_steps == 12


async def test_a_failed_replicas_gauges_leave_the_sums():
    stats = _stats(num_steps=7, prefix_cache_blocks=9, prefix_cache_evictions=2)
    batch = ReplicaBatch("rep-1", 4321, [RequestUpdate("r", [5])], stats)
    client = _client(FakeCall([batch], error=RuntimeError("actor died")))
    await _run(client)
    assert client.stats.prefix_cache_blocks == 0  # blocks its cache held: gone with it
    assert client.stats.prefix_cache_evictions == 2  # a counter: kept


def test_replicas_serve_no_longer_lists_leave_the_roster_once_idle(monkeypatch):
    """A replica that died running nothing here (so no request failed on it) used to stay in
    the roster for good: its series in /metrics beside its replacement's."""
    import rltserve.ray.client as ray_client
    from rltserve.ray.roster import ReplicaState

    client = _client(None)
    client._replicas = {
        "gone": ReplicaState(1, _stats(num_steps=7, kv_usage=0.5), requests=2),
        "busy-gone": ReplicaState(2, _stats(num_steps=1), in_flight=1),  # (its relay's to drop)
        "live": ReplicaState(3, _stats(num_steps=3)),
    }
    monkeypatch.setattr(ray_client, "serve_replica_ids", lambda app, deployment: {"live"})
    client._forget_gone()
    assert set(client.replicas()) == {"busy-gone", "live"}
    assert client.stats.num_steps == 11  # its counters stay in the sums, its gauges do not
    assert client.stats.kv_usage == 0.0
    monkeypatch.setattr(ray_client, "serve_replica_ids", lambda app, deployment: None)
    client._forget_gone()  # (Serve does not say: nothing dropped)
    assert set(client.replicas()) == {"busy-gone", "live"}


def test_with_no_live_replica_the_client_says_it_is_unavailable():
    client = _client(FakeCall([]))
    client.config = ReplicaConfig(replicas=2)
    client.live_replicas = 0
    assert client.unavailable_reason == "no engine replica is alive (0 of 2); retry later"
    client.live_replicas = 1
    assert client.unavailable_reason is None


async def test_a_replicas_batches_carry_its_identity_its_stats_and_the_group():
    stop = RequestUpdate("r", [5], finish_reason=FinishReason.STOP)
    stage = FakeStage([stop])
    stage.stats = _stats(num_steps=4)
    batches = [b async for b in _replica(stage).generate("r", [1, 2], PARAMS, group="g-1")]
    assert stage.groups == ["g-1"]  # samples of one prompt share its prefill
    assert [(b.replica, b.pid, b.stats) for b in batches] == [("rep-1", os.getpid(), stage.stats)]
    assert [b.prefill_stats for b in batches] == [None]  # (one stage per replica)
    stage.prefill_stats = _stats(num_steps=2)  # a disaggregated replica's prefill stage
    batches = [b async for b in _replica(stage).generate("r", [1, 2], PARAMS)]
    assert [b.prefill_stats for b in batches] == [stage.prefill_stats]


async def test_disaggregated_replicas_prefill_stages_are_summed_as_their_stats():
    """``--replicas N --disaggregate``: the ``prefill_stage_*`` series are the sums; a failed
    replica's counters stay in them, its gauges leave; an idle replica's gauges read 0."""
    client = _client(None)
    assert client.prefill_stats is None  # (no replica reported: no such series)
    for replica, steps, error in (("rep-1", 7, RuntimeError("actor died")), ("rep-2", 5, None)):
        final = RequestUpdate("r", [5], finish_reason=None if error else FinishReason.LENGTH)
        batch = dataclasses.replace(
            _batch(final),
            replica=replica,
            prefill_stats=_stats(num_steps=steps, num_running=1, prefix_cache_blocks=3),
        )
        client._stream = FakeStream(FakeCall([batch], error=error))
        await _run(client)
    prefill = client.prefill_stats
    assert (prefill.num_steps, prefill.num_running, prefill.prefix_cache_blocks) == (12, 0, 3)
    assert client.stats.num_steps == 6  # (the decode stages': 3 each)
