"""The server survives its stage: ``kill -9`` of the stage worker mid-stream, an exception that
ends the engine loop, and a hung stage (SIGSTOP, caught by the watchdog) each fail the stage's
open requests with a 5xx (an error event then ``[DONE]`` in a stream), answer 503 + Retry-After
while the stage restarts, then serve the same tokens again; restarts are counted in /metrics.
When restarts run out, /health stays 503 and ``rltserve serve`` exits with code 1."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import aiohttp
import numpy as np
import orjson
import pytest
from test_http_harness import (
    Script,
    ScriptedStage,
    error_of,
    running,
    scripted_factory,
    scripted_info,
    sse_payloads,
    tiny_checkpoint,
    wait_for,
)

from rltserve.core.stage import InProcessStageClient, StageClient, StageError
from rltserve.http.config import ServerConfig
from rltserve.http.supervisor import RestartPolicy
from rltserve.updates import FinishReason, RequestUpdate

ROOT = Path(__file__).resolve().parents[1]
COMPLETIONS = "/v1/completions"
BODY = {"prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
LONG_STREAM = {**BODY, "max_tokens": 1500, "stream": True}
FAST = {"stage_restart_backoff_s": 0.1}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory)


def restarts_metric(raw: bytes) -> float:
    for line in raw.decode().splitlines():
        if line.startswith("rltserve:stage_restarts_total{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no rltserve:stage_restarts_total in /metrics")


async def stream_until_failure(live, fail) -> list:
    """Opens a long stream, calls ``fail()`` after its first event, returns all its events."""
    async with live.stream(COMPLETIONS, LONG_STREAM) as r:
        assert r.status == 200
        first = await r.content.readuntil(b"\n\n")
        fail()
        rest = await asyncio.wait_for(r.content.read(), 60)
    return sse_payloads(first + rest)


async def recovers(live, baseline: bytes, restarts: int = 1) -> None:
    """503 + Retry-After while restarting, then 200 and the baseline's tokens."""
    status, headers, raw = await live.get("/health")
    if status == 503:
        assert headers["Retry-After"] == "1"
        assert b"restarting" in raw
        status, headers, _ = await live.post(COMPLETIONS, BODY)
        assert status in (200, 503)

    async def healthy() -> None:
        while (await live.get("/health"))[0] != 200:
            await asyncio.sleep(0.1)

    await asyncio.wait_for(healthy(), 120)
    status, _, raw = await live.post(COMPLETIONS, BODY)
    assert status == 200, raw
    assert orjson.loads(raw)["choices"][0]["text"] == orjson.loads(baseline)["choices"][0]["text"]
    assert restarts_metric((await live.get("/metrics"))[2]) == restarts


def assert_stage_error(events: list, *needles: str) -> None:
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert error["code"] == 503, error
    assert error["message"].startswith("stage died: "), error
    for needle in needles:
        assert needle in error["message"], error


async def test_kill_9_of_the_stage_mid_stream_restarts_it(ckpt):
    async with running(ckpt, client_factory=StageClient, **FAST) as live:
        stage = live.state.client
        baseline = (await live.post(COMPLETIONS, BODY))[2]
        assert restarts_metric((await live.get("/metrics"))[2]) == 0
        old_pid = stage.pid
        events = await stream_until_failure(live, lambda: os.kill(old_pid, signal.SIGKILL))
        assert_stage_error(events, "killed by signal 9")
        await recovers(live, baseline)
        assert stage.pid != old_pid


async def test_an_exception_that_ends_the_engine_loop_restarts_the_stage(ckpt, monkeypatch):
    from rltserve.core.engine import EngineCore

    apply, tokens, gate, fired = EngineCore.apply, [], threading.Event(), threading.Event()

    def apply_broken_after_two_tokens(self, plan, result):
        if len(tokens) >= 2 and not fired.is_set():  # once, after the test read a token
            gate.wait(30)
            fired.set()
            raise RuntimeError("injected loop failure")
        updates = apply(self, plan, result)
        tokens.extend(t for u in updates for t in u.new_token_ids)
        return updates

    async with running(ckpt, client_factory=InProcessStageClient, **FAST) as live:
        baseline = (await live.post(COMPLETIONS, BODY))[2]
        monkeypatch.setattr(EngineCore, "apply", apply_broken_after_two_tokens)
        events = await stream_until_failure(live, gate.set)
        assert_stage_error(events, "RuntimeError: injected loop failure")
        await recovers(live, baseline)


async def test_a_hung_stage_is_killed_by_the_watchdog_and_restarted(ckpt):
    async with running(ckpt, client_factory=StageClient, stage_watchdog_s=1.0, **FAST) as live:
        stage = live.state.client
        baseline = (await live.post(COMPLETIONS, BODY))[2]
        old_pid = stage.pid
        started = time.monotonic()
        events = await stream_until_failure(live, lambda: os.kill(old_pid, signal.SIGSTOP))
        assert time.monotonic() - started < 60  # ended by the watchdog, not by a test timeout
        assert_stage_error(events, "watchdog")
        await recovers(live, baseline)
        await wait_for(lambda: _gone(old_pid), timeout=10)  # killed and reaped


def _child_of(pid: int) -> int | None:
    """A child process of ``pid`` (any of its threads may have started it), if there is one."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        children = (task / "children").read_text().split()
        if children:
            return int(children[0])
    return None


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


async def test_restarts_that_keep_failing_give_up(ckpt):
    stage = ScriptedStage(scripted_info(ckpt), Script([44], interval_s=0.01))
    async with running(
        ckpt, client_factory=scripted_factory(stage), stage_restarts=2, **FAST
    ) as live:
        supervisor = live.state.client
        stage.kill()  # the factory hands back the same dead stage: every restart fails
        await asyncio.wait_for(supervisor.given_up.wait(), 10)
        status, headers, raw = await live.get("/health")
        assert status == 503 and "Retry-After" not in headers
        assert b"no restarts left" in raw
        assert restarts_metric((await live.get("/metrics"))[2]) == 0


async def test_a_stage_dead_for_good_makes_serve_exit_1(ckpt):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "rltserve.cli", "serve", "--model", str(ckpt)]
    cmd += ["--port", str(port), "--stage-restarts", "0", "--log-level", "warning"]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    process = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    try:
        async with aiohttp.ClientSession() as session:
            deadline = time.monotonic() + 180
            while True:
                assert process.poll() is None and time.monotonic() < deadline
                with contextlib.suppress(aiohttp.ClientError):
                    async with session.get(f"http://127.0.0.1:{port}/health") as r:
                        if r.status == 200:
                            break
                await asyncio.sleep(0.2)
        worker = _child_of(process.pid)  # the stage worker is the server's only child
        os.kill(worker, signal.SIGKILL)
        code = await asyncio.to_thread(process.wait, 120)
        stderr = process.stderr.read()
        assert code == 1, stderr
        assert "could not be restarted" in stderr
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("stage_watchdog_s", -1),
        ("stage_restarts", -1),
        ("stage_restarts", 1.5),
        ("stage_restart_backoff_s", "x"),
        ("stage_stable_s", -1),
        ("stage_stable_s", True),
    ],  # fmt: skip
)
def test_bad_supervision_settings_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field}="):
        ServerConfig(**{field: value})


def test_backoff_doubles_up_to_its_cap():
    policy = RestartPolicy(backoff_s=0.5, backoff_max_s=3.0)
    assert [policy.backoff(a) for a in range(1, 6)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    with pytest.raises(ValueError, match="^max_restarts=-1"):
        RestartPolicy(max_restarts=-1)


async def test_health_is_200_while_the_stage_is_idle_beyond_the_watchdog(ckpt):
    # The watchdog measures only while requests are open: an idle stage is not hung.
    async with running(
        ckpt, client_factory=InProcessStageClient, stage_watchdog_s=0.2, **FAST
    ) as live:
        await asyncio.sleep(0.6)
        assert (await live.get("/health"))[0] == 200
        assert live.state.client.restarts == 0
        async with aiohttp.ClientSession():
            status, _, _ = await live.post(COMPLETIONS, BODY)
        assert status == 200


class _NoReplicaStage(ScriptedStage):
    """A running replica set with no replica alive."""

    unavailable_reason = "no engine replica is alive (0 of 2); retry later"


async def test_no_live_replica_is_a_503_with_retry_after_not_a_hang(ckpt):
    stage = _NoReplicaStage(scripted_info(ckpt), Script([44]))
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        for path, body in (("/health", None), (COMPLETIONS, BODY)):
            request = live.get(path) if body is None else live.post(path, body)
            status, headers, raw = await asyncio.wait_for(request, 10)
            assert status == 503 and headers["Retry-After"] == "1", raw
            assert orjson.loads(raw)["error"]["message"] == stage.unavailable_reason
        assert stage.added == []


class _ReplicaSetStage(ScriptedStage):
    """A replica set: no weight update, sleep mode or cache reset (a Serve call reaches one
    replica)."""

    update_weights = sleep = wake_up = reset_prefix_cache = None


async def test_replicas_refuse_the_engine_controls_naming_the_route(ckpt):
    stage = _ReplicaSetStage(scripted_info(ckpt), Script([44]))
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        calls = (
            ("/v1/update_weights", {"model_path": str(ckpt)}),
            ("/reset_prefix_cache", None),
            ("/sleep", None),
        )
        errors = []
        for path, body in calls:
            status, _, raw = await live.post(path, body)
            assert status == 400, raw
            errors.append(error_of(raw))
    assert [(e["message"], e["param"]) for e in errors] == [
        ("update_weights: not with engine replicas: restart them with the new checkpoint", None),
        ("reset_prefix_cache: not with engine replicas", None),
        ("sleep: not with engine replicas", None),
    ]


async def test_a_restarted_stage_serves_the_updated_weights_again(ckpt, tmp_path):
    """A weight update survives a stage restart: the new stage loads --model, then the update."""
    import json

    from builders import random_tensors, write_checkpoint

    cfg = json.loads((ckpt / "config.json").read_text())
    new = write_checkpoint(tmp_path / "new", cfg, random_tensors(cfg, seed=7))
    async with running(ckpt, client_factory=StageClient, **FAST) as live:
        old_tokens = (await live.post(COMPLETIONS, BODY))[2]
        status, _, raw = await live.post("/v1/update_weights", {"model_path": str(new)})
        assert status == 200 and orjson.loads(raw) == {"weight_version": 1}, raw
        updated = (await live.post(COMPLETIONS, BODY))[2]
        assert orjson.loads(updated)["choices"] != orjson.loads(old_tokens)["choices"]
        stage = live.state.client
        os.kill(stage.pid, signal.SIGKILL)
        await wait_for(lambda: stage.restarts == 1, 120)
        await recovers(live, updated)
        _, _, models = await live.get("/v1/models")
        assert orjson.loads(models)["data"][0]["weight_version"] == 1


# ---------------------------------------------------------------- SupervisedStage, unit level


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


async def test_supervised_stage_sleep_controls_are_the_current_stages():
    class Sleepy(_FakeStage):
        sleeping: set[str] = set()

        def sleep(self, level, timeout_s) -> None:
            self.sleeping = {"weights", "kv_cache"}

        def wake_up(self, tags) -> None:
            self.sleeping = self.sleeping - set(tags)

    a, b = Sleepy("a"), _FakeStage("replicas")  # (b: a stage without sleep mode)
    sup, _, _ = _supervised(a, b)
    sup.sleep(1, 5.0)
    assert sup.sleeping == {"weights", "kv_cache"}
    sup.wake_up(["weights"])
    assert sup.sleeping == {"kv_cache"}
    await sup._replace("boom")
    assert sup.sleeping == set()  # (a restarted stage starts awake)
    with pytest.raises(ValueError, match="sleep: not with engine replicas"):
        sup.sleep(1, 5.0)
    with pytest.raises(ValueError, match="reset_prefix_cache: not with engine replicas"):
        sup.reset_prefix_cache()


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


def test_supervised_stage_watchdog_measures_only_open_requests_without_progress():
    clock = _Clock()
    a = _FakeStage("a")
    sup, _, _ = _supervised(a, clock=clock, watchdog_s=10.0)
    clock.now += 100  # idle for long: not hung, and the first request starts the measure
    assert sup.check() is None
    sup.add_request("r1", [1], None, lambda u: None)
    assert sup.check() is None
    clock.now += 8
    a.sinks["r1"](_token("r1"))  # progress
    clock.now += 7
    assert sup.check() is None
    clock.now += 4  # 11 s without progress
    assert "stage watchdog" in sup.check()
    # watchdog 0: off
    sup, _, _ = _supervised(_FakeStage("b"), clock=clock, watchdog_s=0.0)
    sup.add_request("r1", [1], None, lambda u: None)
    clock.now += 1000
    assert sup.check() is None
    # a self-supervised client (Ray Serve replicas) replaces its own parts
    c = _FakeStage("c")
    c.self_supervised = True
    sup, _, _ = _supervised(c, clock=clock, watchdog_s=10.0)
    sup.add_request("r1", [1], None, lambda u: None)
    clock.now += 1000
    assert sup.check() is None
