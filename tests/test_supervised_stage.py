"""``SupervisedStage`` (rltserve/http/supervisor.py) on fake stages and a hand-advanced clock:
each request ends once and stale updates are dropped, a failing sink or add, restart counting
(failed starts and quick failures, a stable stage's fresh count), weight updates re-applied in
order or given up on, sleep controls, counters across a restart, liveness while restarting, and
a dying client's ended requests (the watchdog: ``test_supervised_stage_watchdog``)."""

from __future__ import annotations

import asyncio
import logging
import os
import threading

import numpy as np
import pytest

from rltserve.core.restart import RestartPolicy
from rltserve.core.stage import StageError
from rltserve.updates import FinishReason, RequestUpdate


class _FakeStage:
    """A stage client whose life the test drives: requests are only recorded (the test calls
    their sinks), ``alive`` is settable, and update_weights / wait_ready can be made to fail."""

    def __init__(self, name: str, fail_weights: bool = False) -> None:
        self.name = name
        self.alive = True
        self.error: str | None = None
        self.info = None
        self.stats = None
        self.sinks: dict[str, object] = {}
        self.aborted: list[str] = []
        self.weights: list[list[str]] = []
        self.fail_weights = fail_weights
        self.fail_add = False
        self.killed = self.closed = False
        self.weight_version = 0

    def wait_ready(self, timeout=None):
        if not self.alive:
            raise StageError("the stage exited while starting")
        return self.info

    def add_request(self, request_id, prompt_token_ids, params, sink, group=None) -> None:
        if self.fail_add:
            raise RuntimeError("add failed")
        self.sinks[request_id] = sink

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def update_weights(self, paths, abort, timeout_s) -> int:
        if self.fail_weights:
            raise RuntimeError("no such checkpoint")
        self.weights.append(list(paths))
        self.weight_version += 1
        return self.weight_version

    def kill(self) -> None:  # (a killed stage may look alive until its channel ends)
        self.killed = True

    def close(self) -> None:
        self.closed = True


class _Factory:
    """Hands out the given stages (or raises the given exceptions) in order."""

    def __init__(self, *stages) -> None:
        self.stages = list(stages)
        self.calls = 0

    def __call__(self, config):
        self.calls += 1
        item = self.stages.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item() if callable(item) else item


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _supervised(*stages, clock=None, **policy):
    from rltserve.http.supervisor import SupervisedStage

    factory = _Factory(*stages)
    restarted: list[int] = []
    policy = RestartPolicy(**{"backoff_s": 0.0, "stable_s": 60.0, **policy})
    sup = SupervisedStage(
        factory, None, policy, on_restart=lambda: restarted.append(1), clock=clock or _Clock()
    )
    return sup, factory, restarted


def _collecting():
    got: list = []
    return got, got.append


def _token(rid: str, finish=None):
    return RequestUpdate(rid, [7], [1], [-0.5], [None], finish)


async def test_supervised_stage_ends_each_request_once_and_drops_stale_updates():
    a, b = _FakeStage("a"), _FakeStage("b")
    sup, factory, restarted = _supervised(a, b)
    done, sink_done = _collecting()
    open_, sink_open = _collecting()
    sup.add_request("r-done", [1], None, sink_done)
    sup.add_request("r-open", [1], None, sink_open)
    with pytest.raises(ValueError, match="already in use"):
        sup.add_request("r-open", [1], None, sink_open)
    a.sinks["r-done"](_token("r-done", FinishReason.LENGTH))  # ended by its stage
    a.sinks["r-open"](_token("r-open"))
    a.alive = False
    assert sup.check() == "the stage stopped"
    await sup._replace("the stage stopped")
    # the open request ends once, with an ERROR; the finished one gets nothing more
    assert [u.finish_reason for u in done] == [FinishReason.LENGTH]
    assert [(u.finish_reason, u.error) for u in open_[1:]] == [
        (FinishReason.ERROR, "stage died: the stage stopped")
    ]
    assert a.killed and a.closed  # the failed stage is stopped for good
    assert sup.inner is b and sup.alive and sup.error is None
    assert (sup.restarts, restarted, factory.calls) == (1, [1], 2)
    # the id is free again; a late update the old stage sends for it is dropped
    again, sink_again = _collecting()
    sup.add_request("r-open", [1], None, sink_again)
    a.sinks["r-open"](_token("r-open", FinishReason.STOP))
    b.sinks["r-open"](_token("r-open"))
    assert len(open_) == 2 and [u.finish_reason for u in again] == [None]
    sup.abort("r-open")
    assert b.aborted == ["r-open"] and a.aborted == []
    sup.close()  # closing ends what is still open, with an abort
    assert [u.finish_reason for u in again] == [None, FinishReason.ABORT] and b.closed


async def test_supervised_stage_one_failing_sink_does_not_keep_the_others_waiting():
    a, b = _FakeStage("a"), _FakeStage("b")
    sup, _, _ = _supervised(a, b)

    def broken(update):
        raise RuntimeError("sink failed")

    got, sink = _collecting()
    sup.add_request("r1", [1], None, broken)
    sup.add_request("r2", [1], None, sink)
    await sup._replace("boom")
    assert [u.finish_reason for u in got] == [FinishReason.ERROR]


async def test_supervised_stage_a_failed_add_leaves_no_open_request():
    a, b = _FakeStage("a"), _FakeStage("b")
    sup, _, _ = _supervised(a, b)
    a.fail_add = True
    got, sink = _collecting()
    with pytest.raises(RuntimeError, match="add failed"):
        sup.add_request("r1", [1], None, sink)
    await sup._replace("boom")
    assert got == []  # never added: no final update for it
    sup.add_request("r1", [1], None, sink)  # and its id is free
    assert "r1" in b.sinks


def _gave_up_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("giving up")]


async def test_supervised_stage_restart_counting(caplog):
    # max_restarts consecutive failed attempts give up; a failed start is one attempt.
    a = _FakeStage("a")
    sup, factory, _ = _supervised(a, RuntimeError("x"), RuntimeError("y"), max_restarts=2)
    await sup._replace("boom")
    assert sup.gave_up and factory.calls == 3 and not sup.alive
    assert sup.error == "restart failed: RuntimeError: y"
    assert _gave_up_lines(caplog) == [
        "giving up on the stage: its last 2 restart attempt(s) failed to start it "
        "(--stage-restarts 2, --stage-stable-s 60): restart failed: RuntimeError: y"
    ]
    caplog.clear()
    sup, _, _ = _supervised(_FakeStage("a"), max_restarts=0)
    await sup._replace("boom")
    assert _gave_up_lines(caplog) == [
        "giving up on the stage: no restart allowed (--stage-restarts 0): boom"
    ]
    # a start that fails once is retried
    a = _FakeStage("a")
    b = _FakeStage("b")
    sup, factory, _ = _supervised(a, RuntimeError("x"), b, max_restarts=2)
    await sup._replace("boom")
    assert not sup.gave_up and sup.inner is b and sup.alive and sup.restarts == 1
    # a stage that dies while starting is one failed attempt, not a wait for the deadline
    dead = _FakeStage("dead")
    dead.alive = False
    sup, factory, _ = _supervised(_FakeStage("a"), dead, max_restarts=1)
    await asyncio.wait_for(sup._replace("boom"), 5)
    assert sup.gave_up and dead.killed and factory.calls == 2


async def test_supervised_stage_a_stable_stage_starts_a_fresh_count(caplog):
    clock = _Clock()
    stages = [_FakeStage(str(i)) for i in range(4)]
    sup, _, _ = _supervised(*stages, clock=clock, max_restarts=1, stable_s=60.0)
    clock.now += 100  # the first stage ran 100 s: its failure starts a fresh count
    await sup._replace("boom")
    assert sup.inner is stages[1] and sup.restarts == 1
    clock.now += 100  # so did the second
    await sup._replace("boom")
    assert sup.inner is stages[2] and sup.restarts == 2
    clock.now += 10  # the third failed 10 s after its start: its attempt counts
    await sup._replace("boom")
    assert sup.gave_up and sup.restarts == 2
    # every restart succeeded: the log says what ran out, not "failed restart attempts"
    assert _gave_up_lines(caplog) == [
        "giving up on the stage: it failed within 60 s of each of its last 1 restart(s) "
        "(--stage-restarts 1, --stage-stable-s 60): boom"
    ]


async def test_supervised_stage_counts_failed_starts_and_quick_failures_together(caplog):
    clock = _Clock()
    a, b = _FakeStage("a"), _FakeStage("b")
    sup, _, _ = _supervised(a, RuntimeError("x"), b, clock=clock, max_restarts=2, stable_s=5.0)
    await sup._replace("boom")
    assert sup.inner is b and sup.restarts == 1
    clock.now += 4.5  # b failed before it ran --stage-stable-s
    await sup._replace("hung")
    assert sup.gave_up
    assert _gave_up_lines(caplog) == [
        "giving up on the stage: of its last 2 restart attempts, 1 failed to start it and 1 "
        "started a stage that failed within 5 s (--stage-restarts 2, --stage-stable-s 5): hung"
    ]


def _update_file(path, **tensors) -> str:
    from safetensors.numpy import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: np.full(2, v, dtype=np.float32) for k, v in tensors.items()}, str(path))
    return str(path)


async def test_supervised_stage_reapplies_the_updates_still_needed_in_order(tmp_path):
    a, b = _FakeStage("a"), _FakeStage("b")
    sup, _, _ = _supervised(a, b)
    w1 = _update_file(tmp_path / "w1.safetensors", x=1.0)  # (superseded by w3: then deleted)
    _update_file(tmp_path / "w2" / "model.safetensors", y=2.0)
    w3 = _update_file(tmp_path / "w3.safetensors", x=3.0)
    assert sup.update_weights([w1], False, 5.0) == 1
    assert sup.update_weights([str(tmp_path / "w2")], False, 5.0) == 2
    assert sup.update_weights([w3], False, 5.0) == 3
    os.remove(w1)
    await sup._replace("boom")
    assert sup.inner is b and b.weights == [[str(tmp_path / "w2")], [w3]]
    # The version goes on from where it was, though one update was not applied again: in
    # what the stage reports and in what its outputs carry.
    assert sup.weight_version == 3 and sup.update_weights([w3], False, 5.0) == 4
    assert b.weights[-1] == [w3]
    got, sink = _collecting()
    sup.add_request("r", [1], None, sink)
    update = _token("r", FinishReason.LENGTH)
    update.weight_version = b.weight_version
    b.sinks["r"](update)
    assert [u.weight_version for u in got] == [4]


async def test_supervised_stage_gives_up_on_weights_it_cannot_restore(tmp_path):
    """A trainer that overwrites one path: the first update's tensors are gone from the file,
    so a restarted stage would serve other weights under the same version."""
    a, b = _FakeStage("a"), _FakeStage("b")
    sup, factory, _ = _supervised(a, b)
    path = tmp_path / "update.safetensors"
    sup.update_weights([_update_file(path, x=1.0)], False, 5.0)
    sup.update_weights([_update_file(path, y=2.0)], False, 5.0)
    os.utime(path, ns=(1, 1))  # (two writes within one mtime tick would look the same)
    await sup._replace("boom")
    assert sup.gave_up and factory.calls == 1  # (no stage was started for nothing)
    assert sup.failure == (
        f"restart failed: cannot restore the weights of update 1 (['{path}']): {path} changed "
        "since it was applied"
    )


async def test_supervised_stage_a_stage_that_cannot_take_the_updates_never_serves(tmp_path):
    a, bad = _FakeStage("a"), _FakeStage("bad", fail_weights=True)
    sup, _, _ = _supervised(a, bad, max_restarts=1)
    w1 = _update_file(tmp_path / "w1.safetensors", x=1.0)
    sup.update_weights([w1], False, 5.0)
    await sup._replace("boom")
    assert sup.gave_up and sup.inner is a and bad.killed
    assert sup.error.startswith(f"restart failed: weight update ['{w1}'] again")


class _Sleepy(_FakeStage):
    """A stage with sleep mode, recording its sleep controls."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.sleeping: set[str] = set()
        self.controls: list[tuple] = []

    def sleep(self, level, timeout_s) -> None:
        self.controls.append(("sleep", level))
        self.sleeping = {"weights", "kv_cache"}

    def wake_up(self, tags) -> None:
        self.controls.append(("wake_up", list(tags)))
        self.sleeping = self.sleeping - set(tags)


async def test_supervised_stage_sleep_controls_are_the_current_stages():
    a, b, c = _Sleepy("a"), _Sleepy("b"), _FakeStage("replicas")  # (c: without sleep mode)
    sup, _, _ = _supervised(a, b, c)
    sup.sleep(1, 5.0)
    assert sup.sleeping == {"weights", "kv_cache"}
    sup.wake_up(["weights"])
    assert sup.sleeping == {"kv_cache"}
    sup.wake_up(["kv_cache"])
    await sup._replace("boom")
    assert sup.inner is b and sup.sleeping == set() and b.controls == []  # (it was awake)
    await sup._replace("boom")
    assert sup.inner is c
    with pytest.raises(ValueError, match="sleep: not with engine replicas"):
        sup.sleep(1, 5.0)
    with pytest.raises(ValueError, match="reset_prefix_cache: not with engine replicas"):
        sup.reset_prefix_cache()


@pytest.mark.parametrize(
    ("level", "woken", "controls"),
    [
        (1, [], [("sleep", 1)]),
        (2, [], [("sleep", 2)]),  # (its weights come back undefined, for the trainer to load)
        (1, ["kv_cache"], [("sleep", 1), ("wake_up", ["kv_cache"])]),
        # Weights woken after level 2 and not loaded since: the new stage drops its own too
        # (it refuses requests until the trainer's load, as the failed one did).
        (2, ["weights"], [("sleep", 2), ("wake_up", ["weights"])]),
    ],
)
async def test_supervised_stage_a_restarted_stage_sleeps_as_the_failed_one(level, woken, controls):
    """A stage restarted while the engine sleeps is put back to sleep before it serves: the
    trainer that freed the device memory gets no weights or KV allocated behind its back."""
    a, b, c = _Sleepy("a"), _Sleepy("b"), _Sleepy("c")
    sup, _, _ = _supervised(a, b, c)
    sup.sleep(level, 5.0)
    if woken:
        sup.wake_up(woken)
    await sup._replace("boom")
    assert sup.inner is b and b.controls == controls
    assert sup.sleeping == {"weights", "kv_cache"} - set(woken)
    sup.wake_up(["weights", "kv_cache"])
    await sup._replace("boom")
    # (woken: it was awake, but after level 2 without a load its weights stay dropped)
    dropped = [("sleep", 2), ("wake_up", ["weights", "kv_cache"])] if level == 2 else []
    assert sup.inner is c and c.controls == dropped and sup.sleeping == set()


async def test_supervised_stage_a_restarted_stage_keeps_dropped_weights_until_a_load(tmp_path):
    """After sleep(level=2) the engine refuses requests until a weight update, woken or not; a
    stage restarted before that load drops its weights too (a level-2 sleep and a wake-up)
    rather than serving the checkpoint's. Once the trainer loaded, level 1 keeps them."""
    a, b, c, d = _Sleepy("a"), _Sleepy("b"), _Sleepy("c"), _Sleepy("d")
    sup, _, _ = _supervised(a, b, c, d)
    sup.sleep(2, 5.0)
    sup.wake_up(["weights", "kv_cache"])
    await sup._replace("boom")
    assert sup.inner is b and sup.sleeping == set()
    assert b.controls == [("sleep", 2), ("wake_up", ["weights", "kv_cache"])]
    sup.sleep(2, 5.0)
    sup.wake_up(["weights"])
    sup.update_weights([_update_file(tmp_path / "w.safetensors", x=1.0)], False, 5.0)
    await sup._replace("boom")
    assert sup.inner is c and c.controls == [("sleep", 1), ("wake_up", ["weights"])]
    sup.wake_up(["kv_cache"])
    await sup._replace("boom")
    assert sup.inner is d and d.controls == []


async def test_supervised_stage_a_stage_that_cannot_sleep_again_never_serves():
    class Sleepless(_Sleepy):
        def sleep(self, level, timeout_s) -> None:
            raise RuntimeError("cannot free the memory")

    a, bad = _Sleepy("a"), Sleepless("bad")
    sup, _, _ = _supervised(a, bad, max_restarts=1)
    sup.sleep(1, 5.0)
    await sup._replace("boom")
    assert sup.gave_up and sup.inner is a and bad.killed
    assert sup.error == "restart failed: putting it back to sleep: cannot free the memory"


async def test_supervised_stage_counters_carry_over_a_restart_and_gauges_idle_meanwhile():
    from rltserve.core.engine_info import EngineStats

    def stats(running: int, kv: float, steps: int, rows: int) -> EngineStats:
        return EngineStats(running, 0, kv, steps, rows, 0, 0.0)

    a, b = _FakeStage("a"), _FakeStage("b")
    a.stats = stats(3, 0.5, 10, 40)
    a.prefill_stats = stats(2, 0.25, 7, 9)  # (a disaggregated engine's prefill stage: the same)
    sup, _, _ = _supervised(a, b)
    assert sup.stats is a.stats and sup.prefill_stats is a.prefill_stats
    await sup._replace("boom")
    got = sup.prefill_stats
    assert (got.num_running, got.kv_usage, got.num_steps) == (0, 0.0, 7)
    got = sup.stats  # (the new stage has sent none yet)
    assert (got.num_running, got.kv_usage, got.num_steps, got.num_rows) == (0, 0.0, 10, 40)
    b.stats = stats(1, 0.25, 2, 4)
    got = sup.stats
    assert (got.num_running, got.kv_usage, got.num_steps, got.num_rows) == (1, 0.25, 12, 44)
    await sup._replace("boom again")  # (no stage left to start: it gives up)
    got = sup.stats  # (a dead stage's gauges are not shown; its counters stay)
    assert sup.gave_up and (got.num_running, got.kv_usage, got.num_steps) == (0, 0.0, 12)


async def test_supervised_stage_is_not_alive_while_it_restarts():
    a = _FakeStage("a")
    started, release = threading.Event(), threading.Event()
    b = _FakeStage("b")

    def slow_start(config):
        started.set()
        release.wait(10)
        return b

    sup, _, _ = _supervised(a, lambda: slow_start(None))
    task = asyncio.create_task(sup._replace("boom"))
    await asyncio.to_thread(started.wait, 10)
    assert not sup.alive and sup.error == "boom"
    with pytest.raises(StageError, match="not running"):
        sup.add_request("r1", [1], None, lambda u: None)
    release.set()
    await asyncio.wait_for(task, 10)
    assert sup.alive and sup.inner is b


async def test_supervised_stage_lists_the_requests_a_dying_client_ended(caplog):
    """A client that ends its own requests as it dies (a dead decode stage): they end once,
    from here, named in the log line, with the client's error."""
    a, b = _FakeStage("a"), _FakeStage("b")
    sup, _, _ = _supervised(a, b)
    got, sink = _collecting()
    sup.add_request("r1", [1], None, sink)
    a.alive, a.error = False, "decode stage: worker process killed by signal 9"
    dying = RequestUpdate("r1", finish_reason=FinishReason.ERROR, error="stage died: x")
    a.sinks["r1"](dying)
    assert got == []  # (left for _replace)
    with caplog.at_level(logging.ERROR):
        await sup._replace(sup.check())
    assert [(u.finish_reason, u.error) for u in got] == [
        (FinishReason.ERROR, "stage died: decode stage: worker process killed by signal 9")
    ]
    assert "failing 1 request(s): r1" in caplog.text
    sup.close()
