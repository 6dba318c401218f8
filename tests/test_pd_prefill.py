"""The prefill stage's restarts (``core/pd_prefill.py``) over fake stage clients: what the
client reports while the stage is down (not asleep), what a restart gives the new stage (the
decode stage's version, transfers back on), closing during a restart, counters that never go
back, and one keeper per client; when attempts count, and none while the decode stage sleeps;
the prefill stage's request. Real stages: ``test_pd_failures.py``."""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import replace

import pytest

from rltserve.config import EngineConfig
from rltserve.core import pd_prefill
from rltserve.core.engine_info import EngineInfo, EngineStats
from rltserve.core.pd import PDClient
from rltserve.core.pd_prefill import PrefillStage, prefill_params
from rltserve.core.stage import StageError
from rltserve.core.update_log import AppliedUpdate, UpdateLost
from rltserve.sampling import SamplingParams

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


def test_a_stage_dead_but_not_yet_noticed_is_not_served_and_a_live_ones_refusal_is_raised():
    """Between a prefill stage's death and its keeper noticing, the client reads nothing of it
    (a dead stage's sleep would stick) and sends it nothing; a live stage refusing a command
    is the caller's error."""
    client = _client()
    try:
        prefill = client.prefill
        prefill.sleeping = {"weights"}
        prefill.alive = False  # (no keeper runs here: nobody noticed)
        assert client._prefill.serving is None and client.sleeping == set()
        client.wake_up(["weights"])  # (not sent to the dead stage)
        assert prefill.sleeping == {"weights"}
        prefill.alive = True

        def refusing(tags) -> None:
            raise StageError("refused")

        prefill.wake_up = refusing
        with pytest.raises(StageError, match="refused"):
            client.wake_up(["weights"])
    finally:
        client.close()


def test_a_stage_that_served_a_while_gets_its_restarts_back(fast):
    """Attempts spent on earlier deaths count only within ``stable_s`` of the last restart."""
    new = _Stage()
    client = _client([lambda: new])
    try:
        client._prefill._attempts = pd_prefill.RESTARTS.max_restarts
        client._prefill._since -= pd_prefill.RESTARTS.stable_s
        _restarted(client, new)
    finally:
        client.close()


def test_no_stage_is_started_while_the_decode_stage_sleeps(fast):
    """A stage started then could not take the weights: it waits for the wake-up."""
    new, starts = _Stage(), []
    client = _client()
    client._prefill._start = lambda: starts.append(new) or new
    try:
        client._prefill.watch(client)
        client.sleep(1, 1.0)
        client.prefill.die()
        _until(lambda: client.prefill_down is not None)
        time.sleep(20 * pd_prefill.POLL_S)
        assert starts == []
        client.wake_up(["weights", "kv_cache"])
        _until(lambda: client.prefill is new and client.prefill_down is None, client.prefill_down)
        assert starts == [new]
    finally:
        client.close()


def test_weights_that_cannot_be_restored_end_the_restarts_at_once(fast):
    """No other attempt would get them back: one start, then the decode stage serves alone."""
    starts = []
    client = _client()
    client._prefill._start = lambda: starts.append(_Stage()) or starts[-1]

    def lost():
        raise UpdateLost("update 3: its files are gone")

    client._updates.replay = lost
    try:
        client._prefill.watch(client)
        client.prefill.die()
        _until(lambda: (client.prefill_down or "").startswith("not restarted: cannot restore"))
        assert len(starts) == 1 and starts[0].closed
    finally:
        client.close()


def test_the_restarts_count_again_from_the_last_restart(fast):
    """A stage that served ``stable_s`` gets all its attempts back; the one it restarted into,
    dying soon after, only those left."""
    starts = []

    def start():
        starts.append(_Stage())
        if len(starts) > 1:
            raise RuntimeError("no device left")
        return starts[0]

    client = _client()
    client._prefill._start = start
    client._prefill._since -= pd_prefill.RESTARTS.stable_s
    try:
        client._prefill.watch(client)
        client.prefill.die()
        _until(lambda: starts and client.prefill is starts[0] and client.prefill_down is None)
        starts[0].die()
        _until(lambda: (client.prefill_down or "").startswith("not restarted after"))
        assert len(starts) == pd_prefill.RESTARTS.max_restarts, client.prefill_down
    finally:
        client.close()


def test_the_prefill_request_keeps_what_its_kv_and_its_place_depend_on():
    """One greedy token at the request's full depth (a gated model's at least its own loop
    count), under the request's seed, KV policy, priority and cache salt."""
    info = EngineInfo("m", "ouro", 4, 8, 64, 512, (0,), 64, 16, "full", has_gate=True)
    asked = SamplingParams(
        temperature=0.7, max_tokens=9, seed=5, max_loops=2, kv_policy="last_exited",
        priority=3, cache_salt="tenant",
    )  # fmt: skip
    got = prefill_params(asked, info)
    want = (1, 0.0, 5, 4, "last_exited", 3, "tenant")
    assert (got.max_tokens, got.temperature, got.seed, got.max_loops) + (
        got.kv_policy,
        got.priority,
        got.cache_salt,
    ) == want
    ungated = prefill_params(asked, replace(info, has_gate=False))
    assert ungated.max_loops == 2


def test_a_stage_started_as_the_decode_stage_fell_asleep_is_dropped_uncounted(fast):
    """It could not take the weights: stopped, and the attempt given back; the next start,
    once the decode stage is awake, serves."""
    first, second = _Stage(), _Stage()
    client = _client()

    def start():
        if first.closed:
            return second
        client.decode.sleeping = {"weights"}  # (a sleep that came meanwhile)
        return first

    client._prefill._start = start
    try:
        client._prefill.watch(client)
        client.prefill.die()
        _until(lambda: first.closed)
        client.decode.sleeping = set()
        _until(lambda: client.prefill is second and client.prefill_down is None)
        assert client._prefill._attempts == 1 and client._prefill.restarts == 1
    finally:
        client.close()


class _Hung(_Stage):
    """A prefill stage that stopped answering (SIGSTOP): its weight updates wait until it is
    killed, then fail as a dead stage client's do."""

    def __init__(self, config=None, role=None) -> None:
        super().__init__(config, role)
        self.entered, self.killed = threading.Event(), threading.Event()

    def update_weights(self, paths, abort, timeout_s) -> int:
        self.entered.set()
        assert self.killed.wait(HANG_S), "never killed"
        raise StageError("stage died: prefill stage: worker process killed by signal 9")

    def kill(self) -> None:
        self.die()
        self.killed.set()


def test_a_command_or_replay_that_a_prefill_stage_holds_up_names_it_and_a_kill_ends_it(fast):
    """The server's watchdog kills only the prefill stage when a command waits for it
    (``control_stage``): the command goes on without it, the decode stage serving on; a
    restart's replay that hangs the same way is killed (the stage being started), and the
    next attempt serves."""
    hung, starting, new = _Hung(), _Hung(), _Stage()
    client = PDClient(
        EngineConfig.from_flat(disaggregate=True),
        lambda config, role: hung if role == "prefill" else _Stage(),
    )
    client._prefill._start = iter([starting, new]).__next__
    try:
        _replaying(client, 1)
        client._prefill.watch(client)
        assert client.control_stage() == "decode"
        update = threading.Thread(target=client.update_weights, args=(["w"], False, 1.0))
        update.start()
        assert hung.entered.wait(HANG_S)
        assert client.control_stage() == "prefill"
        client.kill_prefill()
        update.join(HANG_S)
        assert not update.is_alive() and client.decode.weight_version == 1
        assert client.control_stage() == "decode" and client.decode.alive
        assert starting.entered.wait(HANG_S)  # (its replay, under the command lock)
        assert client.control_stage() == "prefill"
        client.kill_prefill()
        _until(lambda: client.prefill is new and client.prefill_down is None, client.prefill_down)
        assert new.weight_version == 1 and client._prefill._attempts == 2
    finally:
        client.close()
