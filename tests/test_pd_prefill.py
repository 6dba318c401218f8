"""The prefill stage's restarts (``core/pd_prefill.py``) over fake stage clients: what the
client reports while the stage is down (not asleep), what a restart gives the new stage (the
decode stage's version, transfers back on), closing during a restart, counters that never go
back, and one keeper per client. Real stages: ``test_pd_failures.py``."""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import replace

import pytest

from rltserve.config import EngineConfig
from rltserve.core import pd_prefill
from rltserve.core.engine_info import EngineStats
from rltserve.core.pd import PDClient
from rltserve.core.pd_prefill import PrefillStage
from rltserve.core.update_log import AppliedUpdate

HANG_S = 30.0  # (hang guard)


class _Stage:
    """A stage client with what ``PDClient`` and ``PrefillStage`` use of one."""

    def __init__(self, config=None, role=None) -> None:
        self.alive = True
        self.error = None
        self.stats = None
        self.weight_version = 0
        self.sleeping: set[str] = set()
        self.closed = False

    def wait_ready(self, timeout=None):
        return None

    def update_weights(self, paths, abort, timeout_s) -> int:
        self.weight_version += 1
        return self.weight_version

    def set_weight_version(self, version) -> int:
        self.weight_version = version
        return version

    def sleep(self, level, timeout_s) -> None:
        self.sleeping = {"weights", "kv_cache"}

    def wake_up(self, tags) -> None:
        self.sleeping -= set(tags)

    def die(self) -> None:
        self.alive, self.error = False, "killed"

    def close(self, timeout=None) -> None:
        self.closed, self.alive = True, False


def _stats(steps: int) -> EngineStats:
    return EngineStats(0, 0, 0.0, steps, 0, 0, 0.0)


@pytest.fixture
def fast(monkeypatch):
    monkeypatch.setattr(pd_prefill, "RESTARTS", replace(pd_prefill.RESTARTS, backoff_s=0.0))
    monkeypatch.setattr(pd_prefill, "POLL_S", 0.01)


def _client(starts: list | None = None) -> PDClient:
    """A client whose prefill stage restarts from ``starts`` (factories, in turn)."""
    client = PDClient(EngineConfig.from_flat(disaggregate=True), _Stage)
    if starts is not None:
        client._prefill._start = lambda: starts.pop(0)()
    return client


def _until(condition, what: str = "") -> None:
    deadline = time.monotonic() + HANG_S
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def _replaying(client: PDClient, version: int) -> None:
    """The log of ``client`` compacted to its last update (one that rewrote every tensor)."""
    last = AppliedUpdate(version, ("ckpt",), (), frozenset({"w"}))
    client._updates.replay = lambda: ([last], version)


def test_a_dead_prefill_stage_that_slept_does_not_keep_the_client_asleep(fast):
    """Asleep, then the prefill stage dies: once the decode stage wakes the client is awake
    (the dead stage's last reply said asleep), during the restart and after it gave up."""
    release = threading.Event()

    def cannot_start():
        assert release.wait(HANG_S)
        raise RuntimeError("no device left")

    client = _client([cannot_start] * pd_prefill.RESTARTS.max_restarts)
    try:
        client._prefill.watch(client)
        client.sleep(1, 1.0)
        assert client.sleeping == {"weights", "kv_cache"}
        client.prefill.die()
        _until(lambda: client.prefill_down is not None)
        client.wake_up(["weights", "kv_cache"])
        assert client.sleeping == set()  # (the restart waits on its start)
        release.set()
        _until(lambda: client.prefill_down.startswith("not restarted"), client.prefill_down)
        assert client.sleeping == set()
    finally:
        release.set()
        client.close()


def _restarted(client: PDClient, new: _Stage) -> None:
    client._prefill.watch(client)
    client.prefill.die()
    _until(lambda: client.prefill is new and client.prefill_down is None, client.prefill_down)


def test_a_restart_serves_the_decode_stages_version(fast):
    """The replay skipped a superseded update: the new stage applied one update, yet takes the
    decode stage's version (its block hashes carry it: test_pd_failures.py)."""
    new = _Stage()
    client = _client([lambda: new])
    try:
        client.decode.weight_version = 2
        _replaying(client, 2)
        _restarted(client, new)
        assert new.weight_version == client.decode.weight_version == 2
    finally:
        client.close()


def test_a_restart_resumes_transfers_an_update_the_old_stage_failed_stopped(fast):
    new = _Stage()
    client = _client([lambda: new])
    try:
        client.decode.weight_version = 1
        client._in_sync = False  # (the old stage failed to load update 1)
        _replaying(client, 1)
        _restarted(client, new)
        assert new.weight_version == 1 and client._in_sync
    finally:
        client.close()


def test_closing_during_a_restarts_replay_stops_the_new_stage(fast):
    """At once (a replay may take long), and the restart then publishes nothing."""
    entered, release = threading.Event(), threading.Event()
    new = _Stage()
    applied = new.update_weights

    def slow(*args):
        entered.set()
        assert release.wait(HANG_S)
        return applied(*args)

    new.update_weights = slow
    client = _client([lambda: new])
    client._prefill.watch(client)
    _replaying(client, 1)
    client.prefill.die()
    assert entered.wait(HANG_S)
    client.close(timeout=0.01)  # (its join gives up: the replay is still running)
    assert new.closed
    release.set()
    client._prefill._thread.join(HANG_S)
    assert not client._prefill._thread.is_alive()
    assert client.prefill is not new


def test_prefill_counters_never_go_back_over_a_restart(fast):
    """Each state the stage passes through (every attribute it sets, on the keeper thread)
    reads counters at least those of the one before: a dead stage's are never counted twice
    or dropped."""
    seen: list[int] = []

    class Watched(PrefillStage):
        def __setattr__(self, name, value):
            super().__setattr__(name, value)
            with contextlib.suppress(AttributeError):  # (until __init__ set what stats reads)
                stats = self.stats
                seen.append(stats.num_steps if stats is not None else 0)

    old, new = _Stage(), _Stage()
    old.stats, new.stats = _stats(5), _stats(2)
    client = _client()
    client._prefill.close(1.0)
    client._prefill = Watched(iter([old, new]).__next__)
    try:
        client._prefill.watch(client)
        old.die()
        _until(lambda: client._prefill.restarts == 1)
        assert seen and seen == sorted(seen), seen
        assert client.prefill_stats.num_steps == 5 + 2
    finally:
        client.close()


def _keepers() -> int:
    return sum(t.name == "rltserve-prefill-keeper" for t in threading.enumerate())


def test_waiting_ready_again_starts_no_second_keeper(fast):
    client = _client()
    before = _keepers()
    try:
        client._prefill.watch(client)
        thread = client._prefill._thread
        client._prefill.watch(client)  # (what a second wait_ready does)
        assert client._prefill._thread is thread and _keepers() == before + 1
    finally:
        client.close()
