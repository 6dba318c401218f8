"""The server survives its stage: ``kill -9`` of the stage worker mid-stream, an exception that
ends the engine loop, and a hung stage (SIGSTOP, caught by the watchdog) each fail the stage's
open requests with a 5xx (an error event then ``[DONE]`` in a stream), answer 503 + Retry-After
while the stage restarts, then serve the same tokens again; restarts are counted in /metrics. A
control a stopped stage leaves unanswered gets the watchdog's reason (a disaggregated engine's
prefill stage is killed alone).
When restarts run out, /health stays 503 and ``rltserve serve`` exits with code 1."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import aiohttp
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

from rltserve.core.restart import RestartPolicy
from rltserve.core.stage import InProcessStageClient, StageClient
from rltserve.http.config import ServerConfig

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


@pytest.mark.parametrize("disaggregate", [False, True])
async def test_a_control_a_stopped_stage_leaves_unanswered(ckpt, disaggregate):
    """SIGSTOP of an idle stage worker, then ``POST /reset_prefix_cache``: the watchdog kills
    it. One stage: the caller's 503 says why (not "stage closed"), and the stage restarts.
    A disaggregated engine's prefill stage: killed alone, the reset done on the decode stage
    (200), the engine not restarted; the prefill stage comes back on its own."""
    from rltserve.core.pd import PDClient

    factory, engine = StageClient, {}
    if disaggregate:
        factory, engine = (lambda config: PDClient(config, StageClient)), {"disaggregate": True}
    async with running(ckpt, client_factory=factory, engine=engine, **FAST) as live:
        baseline = (await live.post(COMPLETIONS, BODY))[2]
        stage = live.state.client
        # (short from here: a loaded machine's first steps may take longer)
        stage.policy = replace(stage.policy, watchdog_s=1.0)
        worker = stage.inner.prefill if disaggregate else stage.inner
        os.kill(worker.pid, signal.SIGSTOP)
        status, _, raw = await asyncio.wait_for(live.post("/reset_prefix_cache", None), 30)
        stage.policy = replace(stage.policy, watchdog_s=300.0)
        if not disaggregate:
            assert status == 503, raw
            assert error_of(raw)["message"] == (
                "stage died: no answer to reset_prefix_cache within 1 s (stage watchdog); killed it"
            )
            await recovers(live, baseline)
            return
        assert status == 200, raw
        decode = stage.inner.decode
        assert stage.restarts == 0 and stage.alive and decode.alive
        status, _, raw = await live.post(COMPLETIONS, BODY)
        assert status == 200, raw
        assert orjson.loads(raw)["choices"] == orjson.loads(baseline)["choices"]
        await wait_for(lambda: stage.inner.prefill.pid != worker.pid, 60)
        await wait_for(lambda: stage.inner.prefill_down is None, 60)
        assert stage.inner.decode is decode and _gone(worker.pid)
        assert restarts_metric((await live.get("/metrics"))[2]) == 0


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


async def test_replicas_refuse_the_engine_controls_naming_the_route(ckpt, caplog):
    """A 400 naming the route, and no log line saying the engine does it."""
    caplog.set_level(logging.INFO, logger="rltserve.http")
    stage = _ReplicaSetStage(scripted_info(ckpt), Script([44]))
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        calls = (
            ("/v1/update_weights", {"model_path": str(ckpt)}),
            ("/reset_prefix_cache", None),
            ("/sleep", None),
            ("/wake_up", None),
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
        ("wake_up: not with engine replicas", None),
    ]
    said = [r.getMessage() for r in caplog.records if r.name == "rltserve.http"]
    assert not [m for m in said if m.startswith(("sleep the", "wake up the", "Resetting"))]


async def test_a_restarted_stage_serves_the_updated_weights_again(ckpt, tmp_path):
    """A weight update survives a stage restart: the new stage loads --model, then the update."""
    import json

    from builders import random_tensors, write_checkpoint

    cfg = json.loads((ckpt / "config.json").read_text())
    new = write_checkpoint(tmp_path / "new", cfg, random_tensors(cfg, seed=7))
    async with running(ckpt, client_factory=StageClient, **FAST) as live:
        old_tokens = (await live.post(COMPLETIONS, BODY))[2]
        status, _, raw = await live.post("/v1/update_weights", {"model_path": str(new)})
        assert status == 200 and orjson.loads(raw) == {"weight_version": "1"}, raw
        updated = (await live.post(COMPLETIONS, BODY))[2]
        assert orjson.loads(updated)["choices"] != orjson.loads(old_tokens)["choices"]
        stage = live.state.client
        os.kill(stage.pid, signal.SIGKILL)
        await wait_for(lambda: stage.restarts == 1, 120)
        await recovers(live, updated)
        _, _, models = await live.get("/v1/models")
        assert orjson.loads(models)["data"][0]["weight_version"] == "1"


# ---------------------------------------------------------------- SupervisedStage, unit level


@pytest.mark.parametrize("disaggregate", [False, True])
async def test_a_stage_killed_while_asleep_restarts_asleep(ckpt, disaggregate):
    """kill -9 of a stage worker while the engine sleeps: the restarted stage is put back to
    sleep (a trainer that freed the memory keeps it free), completions stay a 503 until
    /wake_up, then serve the same tokens."""
    from rltserve.core.pd import PDClient

    factory, engine = StageClient, {}
    if disaggregate:
        factory, engine = (lambda config: PDClient(config, StageClient)), {"disaggregate": True}
    async with running(ckpt, client_factory=factory, engine=engine, **FAST) as live:
        baseline = (await live.post(COMPLETIONS, BODY))[2]
        assert (await live.post("/sleep?level=1", None))[0] == 200
        stage = live.state.client
        worker = stage.inner.decode if disaggregate else stage.inner
        os.kill(worker.pid, signal.SIGKILL)
        await wait_for(lambda: stage.restarts == 1 and stage.alive, 120)
        assert orjson.loads((await live.get("/is_sleeping"))[2]) == {"is_sleeping": True}
        assert stage.sleeping == {"weights", "kv_cache"}
        status, _, raw = await live.post(COMPLETIONS, BODY)
        assert status == 503 and b"sleeping" in raw, raw
        _, _, metrics = await live.get("/metrics")
        assert b'sleep_state="weights_offloaded"} 1.0' in metrics
        assert (await live.post("/wake_up", None))[0] == 200
        await recovers(live, baseline)
