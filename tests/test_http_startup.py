"""The server while its engine loads, and when loading fails: /health and requests are 503s
saying why (loading, a checkpoint the engine cannot build, a startup timeout), and a shutdown
during loading ends promptly, closing the stage."""

from __future__ import annotations

import asyncio
import shutil
import threading
import time

import orjson
import pytest
from test_http_harness import (
    Script,
    ScriptedStage,
    error_of,
    running,
    scripted_factory,
    scripted_info,
    stage_for,
    tiny_checkpoint,
)

from rltserve.core.stage import StageError


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory)


async def test_health_while_loading_then_ready(ckpt):
    release = threading.Event()
    stage = stage_for(ckpt)

    def slow_factory(config):
        release.wait(10)
        return stage

    async with running(ckpt, client_factory=slow_factory, wait=False) as live:
        status, _, raw = await live.get("/health")
        assert status == 503
        assert error_of(raw) == {
            "message": "Loading model",
            "type": "unavailable_error",
            "param": None,
            "code": 503,
        }
        status, headers, _ = await live.post("/v1/completions", {"prompt": "x"})
        assert status == 503 and "Retry-After" in headers
        release.set()
        await live.state.ready.wait()
        assert (await live.get("/health"))[0] == 200


def _write_bad_checkpoint(ckpt, path):
    """ouro-tiny with a config.json the engine cannot build (an unknown model_type)."""
    shutil.copytree(ckpt, path)
    cfg = orjson.loads((path / "config.json").read_bytes())
    (path / "config.json").write_bytes(orjson.dumps({**cfg, "model_type": "nope"}))
    return path


async def test_stage_build_error_is_reported_by_health(ckpt, tmp_path):
    bad = _write_bad_checkpoint(ckpt, tmp_path / "bad")
    async with running(bad, wait=False) as live:
        await asyncio.wait_for(live.state.ready.wait(), 60)
        assert "nope" in live.state.load_error
        status, _, raw = await live.get("/health")
        assert status == 503
        message = error_of(raw)["message"]
        assert message.startswith("the engine failed to start: ") and "nope" in message
        status, _, raw = await live.post("/v1/completions", {"prompt": [1]})
        assert status == 503 and "failed to start" in error_of(raw)["message"]


class NeverReady(ScriptedStage):
    """A stage that stays alive but never finishes loading."""

    def wait_ready(self, timeout=None):
        time.sleep(min(timeout or 0.05, 0.05))
        raise StageError("stage did not become ready in time")


async def test_startup_timeout_is_reported_by_health(ckpt):
    stage = NeverReady(scripted_info(ckpt), Script([44]))
    factory = scripted_factory(stage)
    async with running(ckpt, client_factory=factory, wait=False, startup_timeout_s=0.5) as live:
        await asyncio.wait_for(live.state.ready.wait(), 30)
        assert live.state.load_error == (
            "StageError: stage did not become ready in time (the engine did not load within "
            "--startup-timeout-s 0.5)"
        )
        status, _, raw = await live.get("/health")
        assert status == 503 and "did not become ready" in error_of(raw)["message"]


async def test_shutdown_while_loading_ends_promptly(ckpt):
    stage = NeverReady(scripted_info(ckpt), Script([44]))
    factory = scripted_factory(stage)

    async def serve_then_stop():
        async with running(ckpt, client_factory=factory, wait=False) as live:
            status, _, raw = await live.get("/health")
            assert status == 503 and error_of(raw)["message"] == "Loading model"
            return live.state

    state = await asyncio.wait_for(serve_then_stop(), 30)  # not startup_timeout_s (600 s)
    assert state.ready.is_set()
    assert state.load_error == "StageError: shutdown while the engine was loading"
    assert not stage.alive  # the stage was closed
