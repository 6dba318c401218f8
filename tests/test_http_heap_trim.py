"""The server's idle heap trim: once HTTP traffic stops, the freed heap goes back to the kernel
(``heap_trim``), once per quiet spell and never while a request (a stream) is in flight."""

from __future__ import annotations

import asyncio
import platform
import sys

import pytest
from test_http_harness import running, scripted_factory, stage_for, tiny_checkpoint, wait_for

from rltserve.http.heap_trim import IdleTrim, heap_trimmer


class Counting:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1


@pytest.mark.skipif(
    sys.platform != "linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc_trim"
)
def test_glibc_has_a_trimmer():
    trim = heap_trimmer()
    assert trim is not None
    trim()  # (returns whether memory was released: either is fine)


async def test_trims_once_per_quiet_spell():
    trim = Counting()
    idle = IdleTrim(trim, idle_s=0.05)
    idle.begin()
    idle.begin()
    idle.end()
    await asyncio.sleep(0.15)
    assert trim.calls == 0  # one request still in flight
    idle.end()
    await wait_for(lambda: trim.calls == 1)
    await asyncio.sleep(0.15)
    assert trim.calls == 1 and idle.trims == 1  # once per quiet spell, not every idle_s
    idle.begin()  # a request within idle_s of the last one's end puts the trim off
    idle.end()
    await asyncio.sleep(0.02)
    idle.begin()
    await asyncio.sleep(0.15)
    assert trim.calls == 1
    idle.end()
    idle.close()  # (shutdown)
    await asyncio.sleep(0.15)
    assert trim.calls == 1


async def test_without_a_trimmer_nothing_is_scheduled():
    idle = IdleTrim(None, idle_s=0.01)
    idle.begin()
    idle.end()
    await asyncio.sleep(0.05)
    assert idle.trims == 0 and idle.active == 0


async def test_the_server_trims_its_heap_once_requests_stop(tmp_path_factory):
    ckpt = tiny_checkpoint(tmp_path_factory)
    stage = stage_for(ckpt, interval_s=0.1)  # (a token every 0.1 s)
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        idle = live.state.idle_trim
        trim = idle.trim = Counting()
        idle.idle_s = 0.1
        body = {"prompt": "Hello", "max_tokens": 2}
        streamed = {"prompt": "Hello", "max_tokens": 8, "stream": True}
        async with live.stream("/v1/completions", streamed) as response:
            assert response.status == 200
            await asyncio.sleep(0.4)  # (a stream open past idle_s: still in flight)
            assert idle.active == 1 and trim.calls == 0
            await response.read()
        results = await asyncio.gather(*(live.post("/v1/completions", body) for _ in range(4)))
        assert [status for status, _, _ in results] == [200] * 4
        await wait_for(lambda: trim.calls == 1)
        assert idle.active == 0
        status, _, _ = await live.get("/v1/models")  # a scrape after the trim: one more
        assert status == 200
        await wait_for(lambda: trim.calls == 2)
